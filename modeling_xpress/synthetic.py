"""Synthetic targets with exactly known next-token distributions, for tests, demos and sanity checks.

`markov_target(log_probs)` is a real `LlamaForCausalLM` whose next-token distribution given the current token x is
exactly `softmax(log_probs[x])`; `perfect_head` sets an xPress/Markov head that predicts a permutation target
exactly, which is how a run with whole blocks accepted can be *constructed* without training.
"""

import math

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def markov_target(log_probs: torch.Tensor, seed: int = 0) -> LlamaForCausalLM:
    """A Llama whose next-token log-distribution given current token x is exactly `log_probs[x]` (V × V).

    Attention and MLP outputs are zeroed, so the residual stream is the token embedding; embeddings are one-hot
    (hidden = V), the final RMSNorm maps e_x to sqrt(V)·e_x, and lm_head column x is `log_probs[x] / sqrt(V)`.
    """
    vocab = log_probs.shape[0]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=vocab, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    target = LlamaForCausalLM(config).eval()
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


def perfect_head(model, perm: torch.Tensor, scale: float = 100.0) -> None:
    """Set the head so that δ_k = scale · onehot(perm[x_{k-1}]): it then predicts a permutation target exactly.

    Needs refiner_rank == vocab_size. Works for both the xPress refiner (hidden inputs and mixing switched off,
    token path = identity) and the Markov head.
    """
    vocab, r = perm.shape[0], model.config.refiner_rank
    if r != vocab:
        raise ValueError(f"perfect_head needs refiner_rank == vocab_size, got {r} and {vocab}")
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


def constructed_permutation_pair(vocab_size: int = 64, block_size: int = 8, refiner: str = "xpress"):
    """(target, xpress) where the head is constructed to know the target's permutation: whole blocks are accepted."""
    from .configuration_xpress import XPressConfig
    from .modeling_xpress import XPressModel

    target, perm = permutation_target(vocab_size)
    config = XPressConfig.from_target_config(
        target.config, num_hidden_layers=1, intermediate_size=64, refiner=refiner, refiner_rank=vocab_size,
        block_size=block_size, jacobi_max_iters=block_size - 1,
    )  # fmt: skip
    xpress = XPressModel(config).eval()
    perfect_head(xpress, perm)
    return target, xpress
