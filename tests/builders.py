"""Tiny models for the tests: random Llama/Qwen3 targets, xPress drafters for them, and a target whose next-token
distribution is an exact, designed function of the current token (a Markov chain)."""

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from modeling_xpress import XPressConfig, XPressModel


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


def tiny_xpress(target, refiner: str = "xpress", seed: int = 1, randomize_head: bool = True, **overrides) -> XPressModel:
    """A random xPress drafter for `target`. Heads start at δ = 0; `randomize_head` makes them non-trivial."""
    torch.manual_seed(seed)
    fields = dict(num_hidden_layers=2, intermediate_size=96, refiner=refiner, refiner_rank=16, block_size=8)
    fields.update(overrides)
    model = XPressModel(XPressConfig.from_target_config(target.config, **fields)).eval()
    if randomize_head and model.refiner is not None:
        with torch.no_grad():
            for p in model.refiner.parameters():
                p.normal_(std=0.5)
    return model


def markov_target(log_probs: torch.Tensor, seed: int = 0) -> LlamaForCausalLM:
    """A Llama whose next-token log-distribution given current token x is exactly `log_probs[x]` (V × V).

    Attention and MLP outputs are zeroed, so the residual stream is the token embedding; embeddings are one-hot
    (hidden = V), the final RMSNorm maps e_x to sqrt(V)·e_x, and lm_head column x is `log_probs[x] / sqrt(V)`.
    """
    vocab = log_probs.shape[0]
    target = tiny_llama(vocab_size=vocab, seed=seed, hidden_size=vocab, intermediate_size=32, num_attention_heads=2,
                        num_key_value_heads=1, num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        target.model.embed_tokens.weight.copy_(torch.eye(vocab))
        target.lm_head.weight.copy_(log_probs.T / math.sqrt(vocab))
    return target


def permutation_target(vocab_size: int = 32, seed: int = 0) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A deterministic target: next token = perm[current token]. Returns (target, perm)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(vocab_size, generator=g)
    log_probs = torch.full((vocab_size, vocab_size), -20.0)
    log_probs[torch.arange(vocab_size), perm] = 0.0
    return markov_target(log_probs, seed=seed), perm


def perfect_head(model: XPressModel, perm: torch.Tensor, scale: float = 100.0) -> None:
    """Set the head so that δ_k = scale · onehot(perm[x_{k-1}]): it then predicts a permutation target exactly.

    Needs refiner_rank == vocab_size. Works for both the xPress refiner (hidden inputs and mixing switched off,
    token path = identity) and the Markov head.
    """
    vocab, r = perm.shape[0], model.config.refiner_rank
    assert r == vocab, "perfect_head needs refiner_rank == vocab_size"
    readout = torch.zeros(vocab, r)
    readout[perm, torch.arange(vocab)] = scale
    head = model.refiner
    with torch.no_grad():
        head.token_embed.weight.copy_(torch.eye(vocab))
        head.readout.weight.copy_(readout)
        if model.config.refiner == "xpress":
            head.hidden_proj.weight.zero_()
            head.global_proj.weight.zero_()
            head.mix.zero_()
            head.fuse.weight.zero_()
            head.fuse.weight[:, 2 * r :] = torch.eye(r)
            head.down.weight.zero_()
            head.down.bias.zero_()


def tiny_tokenizer(vocab_size: int):
    """A word-level tokenizer over the words t0..t{V-1} (one id per word), built in code: no downloads."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
