"""Synthetic targets with exactly known next-token distributions, for tests, demos and sanity checks.

`markov_target(log_probs)` is a real `LlamaForCausalLM` whose next-token distribution given the current token x is
exactly `softmax(log_probs[x])`; `perfect_head` sets an xPress/Markov head that predicts a permutation target
exactly, which is how a run with whole blocks accepted can be *constructed* without training.
`oracle_drafter` makes a drafter propose the permutation target's own continuation, wrong from a seeded random
position on, so a run whose acceptance lengths take every value 1..B (and are known in advance) is constructed too.
"""

import math
from collections.abc import Callable

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
        if hasattr(head, "mix"):  # the xPress refiner: switch off every path but the token one
            head.hidden_proj.weight.zero_()
            head.global_proj.weight.zero_()
            head.mix.zero_()
            head.fuse.weight.zero_()
            head.fuse.weight[:, 2 * r :] = torch.eye(r)
            head.down.weight.zero_()
            if head.down.bias is not None:
                head.down.bias.zero_()


def constructed_permutation_pair(vocab_size: int = 64, block_size: int = 8, refiner: str = "xpress"):
    """(target, xpress) where the head is constructed to know the target's permutation: whole blocks are accepted."""
    from ..configuration_xpress import XPressConfig
    from ..modeling_xpress import XPressModel

    target, perm = permutation_target(vocab_size)
    config = XPressConfig.from_target_config(
        target.config, num_hidden_layers=1, intermediate_size=64, refiner=refiner, refiner_rank=vocab_size,
        block_size=block_size, jacobi_max_iters=block_size - 1,
    )  # fmt: skip
    xpress = XPressModel(config).eval()
    perfect_head(xpress, perm)
    return target, xpress


def oracle_drafter(xpress, target, perm: torch.Tensor, seed: int = 0) -> Callable[[int], int]:
    """Make `xpress`'s drafter right up to a random position: each block drafts the permutation target's own
    continuation, wrong from position k on. Returns `first_wrong(position) -> k`, so callers know every τ in advance.

    k is drawn in 1..B (B = block_size) by a generator seeded with `seed` and the block's position (the anchor's
    position in the sequence), so every entry point draws the same k for the same block. Drafts 1..k-1 are right,
    draft k is wrong and later ones are random; k = B means no draft is wrong. Under greedy verification of a full
    block τ = k: acceptance lengths span 1..B, whole blocks included.

    Only the drafter's forward is replaced on this instance (the real drafter still runs, so its cache advances as
    usual); its `last_hidden_state` is overwritten so that the target's lm_head has its argmax at the designed token.
    Every caller of the drafter sees it: `draft_block` (and each head's decode on top of it) as well as transformers'
    native dFlash generator. The correction head is untouched: with δ = 0 the drafts are exactly the designed ones.
    The anchor is read from `noise_embeds[:, 0]` (the nearest row of the target's embedding table) and the position
    from `position_ids`. `target, perm = permutation_target(...)`: its lm_head reads sqrt(V)·e_x as the log-probability
    row of x, whose argmax is perm[x], so the hidden state that makes it say t is sqrt(V)·e_{perm⁻¹[t]}.
    """
    vocab, block = perm.shape[0], xpress.config.block_size
    if xpress.config.hidden_size != vocab:
        raise ValueError(f"oracle_drafter needs a permutation target (hidden size = vocab size = {vocab}), got a "
                         f"drafter of hidden size {xpress.config.hidden_size}")  # fmt: skip
    table = target.get_input_embeddings().weight.detach()  # (V, V), one-hot rows
    inverse = torch.argsort(perm)
    drafter_forward = xpress.forward

    def generator(position: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 1_000_003 + position)

    def first_wrong(position: int) -> int:
        return int(torch.randint(1, block + 1, (1,), generator=generator(position)))

    def block_tokens(anchor: int, position: int) -> list[int]:
        """[anchor, d_1..d_{B-1}]: the chain perm[anchor], perm[perm[anchor]], … up to k-1, then wrong ones."""
        g = generator(position)
        k = int(torch.randint(1, block + 1, (1,), generator=g))  # the same draw as first_wrong(position)
        tokens, right = [anchor], anchor
        for i in range(1, block):
            right = int(perm[right])
            if i < k:
                tokens.append(right)
            elif i == k:
                tokens.append((right + int(torch.randint(1, vocab, (1,), generator=g))) % vocab)  # never `right`
            else:
                tokens.append(int(torch.randint(0, vocab, (1,), generator=g)))
        return tokens

    def forward(noise_embeds, context_hidden_states=None, position_ids=None, attention_mask=None, cache=None, **kwargs):
        out = drafter_forward(noise_embeds=noise_embeds, context_hidden_states=context_hidden_states,
                              position_ids=position_ids, attention_mask=attention_mask, cache=cache, **kwargs)
        b, q, _ = noise_embeds.shape
        if q != block or position_ids is None:
            raise ValueError(f"oracle_drafter drafts one block of {block} with its position_ids, got {q} positions "
                             f"and position_ids={position_ids}")  # fmt: skip
        hidden = torch.zeros_like(out.last_hidden_state)  # (b, B, V)
        for row in range(b):
            anchor = int(torch.cdist(noise_embeds[row, :1].float(), table.float()).argmin())
            position = int(position_ids[row if position_ids.shape[0] > 1 else 0, -block])
            hidden[row, torch.arange(block), inverse[block_tokens(anchor, position)]] = math.sqrt(vocab)
        out.last_hidden_state = hidden
        return out

    xpress.forward = forward
    return first_wrong
