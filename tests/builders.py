"""Tiny models for the tests: random Llama/Qwen3/Gemma-3 targets, xPress drafters for them, tokenizers built in code,
and a target whose next-token distribution is an exact, designed function of the current token (a Markov chain)."""

import importlib.util
import math
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.training.synthetic import (  # noqa: F401 (re-exported)
    markov_target, oracle_drafter, perfect_head, permutation_target,
)  # fmt: skip

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    """`examples/<name>.py` imported as a module (its functions, and `main` to run it in-process)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_llama(vocab_size: int = 96, seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(LlamaConfig(**(fields | overrides))).eval()


def tiny_qwen3(vocab_size: int = 96, seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    return Qwen3ForCausalLM(Qwen3Config(**(fields | overrides))).eval()


def tiny_gemma3(vocab_size: int = 96, seed: int = 0, sliding_window: int = 8, **overrides) -> Gemma3ForCausalLM:
    """A random Gemma-3 text model: six layers, five sliding-window (`sliding_window` tokens, shorter than the tests'
    prompts, so the window is exercised) to one global, one KV head, Gemma's own norms and GELU MLP."""
    torch.manual_seed(seed)
    fields = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, sliding_window=sliding_window, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return Gemma3ForCausalLM(Gemma3TextConfig(**(fields | overrides))).eval()


def tiny_xpress(target, refiner: str = "xpress", seed: int = 1, randomize_head: bool = True, **overrides) -> XPressModel:
    """A random xPress drafter for `target`. Heads start at δ = 0; `randomize_head` makes them non-trivial."""
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, intermediate_size=96, refiner=refiner, refiner_rank=16, block_size=8)
    fields.update(overrides)
    model = XPressModel(XPressConfig.from_target_config(target.config, **fields)).eval()
    if randomize_head:  # (refiner="none" has no parameters)
        with torch.no_grad():
            for p in model.refiner.parameters():
                p.normal_(std=0.5)
    return model


def randomize(model, seed: int = 0):
    """Random weights everywhere (any model), norms around 1: a drafter whose every tensor matters, e.g. to compare
    with another implementation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)
    return model


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over the words t0..t{V-1} (one id per word), built in code: no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


CHAR_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>"
    "{% endif %}"
)


def char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """One id per printable ASCII character and newline (100 ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3, then the
    characters), built in code; English prompts and code become varied ids. `chat_template=None`: a base model's
    tokenizer, without one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {token: i for i, token in enumerate(CHAR_SPECIALS)} | {c: i + len(CHAR_SPECIALS) for i, c in enumerate(characters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character alone
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        bos_token="<bos>", unk_token="<unk>")  # fmt: skip
    tokenizer.chat_template = chat_template
    return tokenizer


def branching_chain(
    vocab_size: int = 32, num_branches: int = 2, branch_length: int = 3, floor: float = -20.0
) -> torch.Tensor:
    """Log-transition table (V × V) of a chain where per-position marginals cannot get a block right.

    Token 0 is followed by the first token of one of `num_branches` branches, uniformly ("she → is / are"); each
    branch is a fixed run of `branch_length` tokens (1, 2, 3 or 4, 5, 6, …) that returns to 0. A block drafted after 0
    must commit to one branch: its later tokens are certain given the branch token, but each is a coin flip given only
    the context. Unused tokens return to 0. `floor` is the log-probability of every impossible transition (a less
    extreme floor keeps the target's lm_head better conditioned for a drafter learning it from scratch).
    """
    if 1 + num_branches * branch_length > vocab_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for {num_branches} branches of {branch_length} tokens")
    log_probs = torch.full((vocab_size, vocab_size), floor)
    log_probs[:, 0] = 0.0  # unused tokens (and branch ends, below) return to 0
    first_tokens = [1 + b * branch_length for b in range(num_branches)]
    log_probs[0] = floor
    log_probs[0, first_tokens] = -math.log(num_branches)
    for first in first_tokens:
        for token in range(first, first + branch_length - 1):
            log_probs[token] = floor
            log_probs[token, token + 1] = 0.0
    return log_probs.log_softmax(dim=-1)  # exact log-probabilities whatever the floor


def markov_responses(log_probs: torch.Tensor, num_sequences: int, length: int, prompt_length: int = 4, seed: int = 0):
    """Sequences drawn from the chain `log_probs` (exactly the distribution `markov_target(log_probs)` samples), as a
    `datasets.Dataset` with `input_ids` and a `loss_mask` that is 0 on the first `prompt_length` tokens."""
    import datasets

    g = torch.Generator().manual_seed(seed)
    probs = log_probs.softmax(dim=-1)
    rows = []
    for _ in range(num_sequences):
        tokens = [0]
        for _ in range(length - 1):
            tokens.append(int(torch.multinomial(probs[tokens[-1]], 1, generator=g)))
        rows.append({"input_ids": tokens, "loss_mask": [0] * prompt_length + [1] * (length - prompt_length)})
    return datasets.Dataset.from_list(rows)
