"""One draft step: the drafter's block forward on the target's features, the readout, the head's refinement.

`draft_block` is the eager draft step of both ways in: the standalone loop (`decoding.EagerSteps`) and transformers'
assisted decoding (`generation.XPressCandidateGenerator`). The compiled loop runs the same computation as
fixed-shape graphs (`compiled.CompiledDecoder`).

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import contextlib

import torch
from transformers import DynamicCache

from .policy import LinearPolicy
from .refinement import RefinementResult, gumbel_noise
from .stats import SectionTimer, XPressGenerationStats


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int], count: int) -> torch.Tensor:
    """The drafter's context features for the first `count` tokens of a target forward: (1, count, L·H_t)."""
    return torch.cat([hidden_states[i + 1][:, :count] for i in layer_ids], dim=-1)


def last_tokens(sequence: torch.Tensor) -> torch.Tensor:
    """A block's last two committed tokens (1, 2) — the token before the anchor, and the anchor — of a committed
    sequence (1, t): what the xPress head reads as its first previous tokens (`XPressModel.refine`). Drafting starts
    after the target's first token, so t ≥ 2."""
    if sequence.shape[-1] < 2:
        raise ValueError("a block is drafted after at least two committed tokens (the prompt and the target's first)")
    return sequence[..., -2:].reshape(1, 2)


def run_drafter(xpress, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, anchor: torch.Tensor,
                context_features: torch.Tensor, context_start: int, cache: DynamicCache, *, draft_space: bool = False,
                positions: int | None = None, policy: LinearPolicy | None = None, stats=None, timer=None):  # fmt: skip
    """The drafter's block forward and its readout: hidden states (1, B, H) of the block (anchor slot first) and the
    base logits (1, m, V_d or V) of its first m = `positions` draft positions (all B - 1 by default). Arguments as in
    `draft_block`; the drafter cache keeps only context K/V."""
    timer = timer or SectionTimer(anchor.device)
    block = xpress.config.block_size
    t0 = timer.mark()
    noise_embeds = xpress.embed_blocks(anchor.view(1, 1), embed_tokens)  # (1, B, H)
    c = context_features.shape[1]
    position_ids = torch.arange(context_start, context_start + c + block, device=anchor.device).unsqueeze(0)
    dtype = xpress.fc.weight.dtype
    if policy is not None:
        policy.prepare("drafter", block)  # (packs for B rows where packed: a dictionary lookup once they exist)
    with policy.mode("drafter", block, 2 * block) if policy is not None else contextlib.nullcontext():
        out = xpress(
            noise_embeds=noise_embeds.to(dtype),
            context_hidden_states=context_features.to(dtype),
            position_ids=position_ids,
            cache=cache,
        )
    cache.crop(-block)
    hidden = out.last_hidden_state  # (1, B, H)
    t1 = timer.mark()
    read = xpress.draft_logits if draft_space else xpress.base_logits
    base = read(hidden.to(lm_head.weight.dtype), lm_head, positions=positions)  # (1, m, V_d) draft vocabulary, else V
    t2 = timer.mark()
    if stats is not None:
        stats.record("drafter", t0, t1)
        stats.record("lm_head", t1, t2)
    return hidden, base


def draft_block(
    xpress,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    last: torch.Tensor,
    context_features: torch.Tensor,
    context_start: int,
    cache: DynamicCache,
    *,
    logits_transform=None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
    stats: XPressGenerationStats | None = None,
    timer: SectionTimer | None = None,
    draft_space: bool = False,
    positions: int | None = None,
    policy: LinearPolicy | None = None,
) -> RefinementResult:
    """Draft one block after the committed prefix and return its tokens and their distributions.

    last: (1, 2) the last two committed tokens (`last_tokens`), the anchor (position `context_start + c`) last;
    context_features: (1, c, L·H_t) target features
    of committed tokens the drafter cache has not seen. The drafter cache keeps only context K/V: the block's K/V are
    cropped before returning. `draft_space`: decode over the draft vocabulary (allowed when `vocabulary_local` holds
    for the processors behind `logits_transform`); the result is the same either way, over the whole vocabulary.
    `positions`: read out and decode only the block's first that many drafts (the most a step can verify), which
    come out as they would in the whole block; the drafter itself always runs the whole block. `policy`: the caller's
    `LinearPolicy`, whose "drafter" group runs the drafter's products (None: `F.linear` as it is).
    """
    timer = timer or SectionTimer(last.device)
    hidden, base = run_drafter(xpress, embed_tokens, lm_head, last[0, -1:], context_features, context_start, cache,
                               draft_space=draft_space, positions=positions, policy=policy, stats=stats, timer=timer)  # fmt: skip
    t2 = timer.mark()
    noise = gumbel_noise(base.shape, generator=generator, device=base.device) if do_sample else None
    result = xpress.refine(hidden, base, last, logits_transform=logits_transform, noise=noise)
    t3 = timer.mark()
    if stats is not None:
        stats.record("refiner", t2, t3)
        stats.jacobi_iterations.append(int(result.iterations[0]))
    return result


__all__ = ["draft_block", "last_tokens", "run_drafter", "target_features"]
