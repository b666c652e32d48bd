"""Decoding a draft block from the drafter's logits: Jacobi refinement (paper §4.2, Algorithm 1) and its references.

A token is always decoded as `argmax(transform(ℓ_k) + G_k)`: `transform` turns raw logits into the processed logits
of the sampling distribution (identity for greedy; temperature/top-k/top-p for sampling) and `G` is Gumbel noise
drawn once per block (zeros for greedy). Keeping `G` fixed across Jacobi iterations makes the iteration converge to
the sequential *sample*, and Gumbel-argmax of processed logits is an exact sample from their softmax.

For lossless speculative sampling the distribution reported for position k (`RefinementResult.logits`) is exactly
the one its token was drawn from: the processed corrected logits of the **last** iteration, conditioned on that
iteration's prefix. By causality those logits depend on the noise of positions < k only, so the token at k is a
genuine draw from them.

A drafter with a draft vocabulary can decode in that vocabulary (`token_ids`: its (V_d,) target ids): the logits,
noise and head outputs are then (..., V_d), decoded tokens are draft-vocabulary indices, mapped to target ids where
the head reads them and in the result. Outside the draft vocabulary q is exactly 0 either way, so this is the same
distribution at a fraction of the vocabulary-sized work per iteration (a twelfth for SmolLM2's 49,152 tokens and a
4,096-token draft vocabulary).

This file travels with every saved checkpoint; it imports only torch.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

LogitsTransform = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class RefinementResult:
    tokens: torch.Tensor  # (b, n) draft tokens
    logits: torch.Tensor  # (b, n, V) processed logits each token was drawn from
    iterations: torch.Tensor  # (b,) refiner passes each block needed (0 for the plain drafter)


def gumbel_noise(shape: tuple[int, ...], generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """Standard Gumbel noise in float32."""
    # G = -log(-log U), in place: the vocabulary-sized tensor is allocated once. (On CPU this beats exponential_.)
    u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
    return u.clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 1e-7).log_().neg_().log_().neg_()


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def decode(logits: torch.Tensor, transform: LogitsTransform | None, noise: torch.Tensor | None):
    """Processed logits and the token drawn from them: argmax(transform(ℓ) + G)."""
    processed = (transform or _identity)(logits.float())
    scores = processed if noise is None else processed + noise
    return processed, scores.argmax(dim=-1)


def previous_tokens(last_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The head's token inputs `[x_-1, x_0, y_1..y_{m-1}]` for a block's draft tokens y_1..y_m: the block's last two
    committed tokens (b, 2) (the token before the anchor, the anchor) and the drafts (b, m) → (b, m + 1). Entry j is
    the previous token of the block's slot j (slot 0 the anchor's, slot k ≥ 1 draft position k)."""
    return torch.cat([last_tokens.view(-1, 2), tokens[:, :-1]], dim=1)


def target_ids(tokens: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """Decoded tokens as target ids: draft-vocabulary indices mapped through `token_ids`, or as they are (None)."""
    return tokens if token_ids is None else token_ids[tokens]


def scatter_vocabulary(values: torch.Tensor, token_ids: torch.Tensor | None, vocab_size: int,
                       fill: float = 0.0) -> torch.Tensor:  # fmt: skip
    """(..., V_d) over the draft vocabulary `token_ids` → (..., V) over the target's, `fill` elsewhere (as they are
    when `token_ids` is None)."""
    if token_ids is None:
        return values
    out = values.new_full((*values.shape[:-1], vocab_size), fill)
    return out.index_copy_(values.dim() - 1, token_ids, values)


@torch.no_grad()
def jacobi_refine(
    refiner,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    last_tokens: torch.Tensor,
    *,
    max_iters: int,
    early_exit: bool = True,
    to_vocabulary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    logits_transform: LogitsTransform | None = None,
    noise: torch.Tensor | None = None,
    init_tokens: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> RefinementResult:
    """Algorithm 1 with the folded refiner: seed from the drafter, then up to `max_iters` parallel re-decodes.

    Each block stops counting iterations at its fixed point (an iteration that changes none of its tokens); with
    `early_exit` the loop ends once every block has stopped. By Theorem 1 the fixed point is the sequential decode and
    is reached in at most n iterations, so early exit changes nothing but the iteration count. `init_tokens` (b, n)
    replaces the drafter seed (Theorem 1 holds from any seed). `to_vocabulary` maps δ from the refiner's readout
    (a draft vocabulary) onto the whole vocabulary of `base_logits`; with `token_ids`, `base_logits`, `noise` and δ
    are all over the draft vocabulary instead (module docstring), and `init_tokens` are draft-vocabulary indices.

    `max_iters=0` is the drafter's own marginals: the seed decode, no refiner pass, `iterations` 0 — exactly what
    `plain_decode` (`refiner="none"`) drafts, so switching the head off measures its contribution in the same loop.

    hidden (b, p, H): the block's drafter states, anchor slot first; base_logits (b, n, V): its first n ≤ p - 1 draft
    positions (`XPressModel.refine`); last_tokens (b, 2): the token before the anchor and the anchor.
    """
    b, n = base_logits.shape[:2]
    if max_iters < 0:
        raise ValueError(f"max_iters must be >= 0 (0 = the drafter's own marginals), got {max_iters}")
    if max_iters == 0:
        if init_tokens is not None:  # no iteration would start from them, and they were not drawn from any q
            raise ValueError("init_tokens needs max_iters >= 1: with max_iters=0 the drafter's own decode is returned")
        return plain_decode(base_logits, logits_transform=logits_transform, noise=noise, token_ids=token_ids)
    to_vocabulary = to_vocabulary or _identity
    prepared = refiner.prepare(hidden)  # token-independent part, once per block (its summary reads every slot)
    processed, tokens = decode(base_logits, logits_transform, noise)  # seed Y^0 from the drafter's marginals
    if init_tokens is not None:
        tokens = init_tokens
    iterations = torch.zeros(b, dtype=torch.long, device=tokens.device)
    settled = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    start = 0  # positions before `start` saw no prefix change in the last iteration: their logits stand
    for _ in range(max_iters):
        previous = previous_tokens(last_tokens, target_ids(tokens, token_ids))  # (b, n + 1)
        delta = to_vocabulary(refiner.delta_folded(prepared, previous, start=start))  # (b, n - start, V)
        tail_noise = None if noise is None else noise[:, start:]
        tail_logits, tail_tokens = decode(base_logits[:, start:] + delta, logits_transform, tail_noise)
        processed = torch.cat([processed[:, :start], tail_logits], dim=1) if start else tail_logits
        new_tokens = torch.cat([tokens[:, :start], tail_tokens], dim=1)
        moved = new_tokens != tokens  # (b, n)
        changed = moved.any(dim=1)
        iterations += (~settled).long()
        settled |= ~changed
        tokens = new_tokens
        if bool(settled.all()) and early_exit:
            break
        # Position k reads tokens < k: the earliest token that moved (in any block) bounds what must be recomputed.
        first_moved = torch.where(changed, moved.float().argmax(dim=1), torch.full_like(iterations, n))
        start = min(int(first_moved.min()) + 1, n - 1)
    return RefinementResult(tokens=target_ids(tokens, token_ids), logits=processed, iterations=iterations)


@torch.no_grad()
def sequential_refine(
    refiner,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    last_tokens: torch.Tensor,
    *,
    to_vocabulary: Callable[[torch.Tensor], torch.Tensor] | None = None,
    logits_transform: LogitsTransform | None = None,
    noise: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> RefinementResult:
    """Left-to-right decode: y_k from the unfolded head given the already decoded y_{<k}, n dependent head passes.

    The tests' reference for Jacobi (Theorem 1), and the Markov head's own decode (its δ reads only the previous
    token, so nothing parallel pays). As there, `base_logits` may cover only the first n of hidden's draft positions."""
    to_vocabulary = to_vocabulary or _identity
    b, n, v = base_logits.shape
    tokens = torch.zeros(b, hidden.shape[1] - 1, dtype=torch.long, device=base_logits.device)  # later ones unread
    logits = torch.empty(b, n, v, dtype=torch.float32, device=base_logits.device)
    for k in range(n):
        # Positions > k are ignored by causality; slices stay 3-D (b, 1, V) because a logits transform takes blocks.
        previous = previous_tokens(last_tokens, target_ids(tokens, token_ids))
        delta = to_vocabulary(refiner(hidden, previous)[:, k : k + 1])
        step_noise = None if noise is None else noise[:, k : k + 1]
        step_logits, step_tokens = decode(base_logits[:, k : k + 1] + delta, logits_transform, step_noise)
        logits[:, k], tokens[:, k] = step_logits[:, 0], step_tokens[:, 0]
    return RefinementResult(tokens=target_ids(tokens[:, :n], token_ids), logits=logits,
                            iterations=torch.full((b,), n, device=tokens.device))


@torch.no_grad()
def plain_decode(
    base_logits: torch.Tensor,
    *,
    logits_transform: LogitsTransform | None = None,
    noise: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> RefinementResult:
    """No head: every position decoded independently from the drafter's marginals (plain dFlash)."""
    processed, tokens = decode(base_logits, logits_transform, noise)
    zeros = torch.zeros(base_logits.shape[0], dtype=torch.long, device=tokens.device)
    return RefinementResult(tokens=target_ids(tokens, token_ids), logits=processed, iterations=zeros)


__all__ = [
    "RefinementResult",
    "gumbel_noise",
    "jacobi_refine",
    "sequential_refine",
    "plain_decode",
    "previous_tokens",
    "scatter_vocabulary",
    "target_ids",
]
