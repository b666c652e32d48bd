"""The per-distribution loss of the objective (paper eq. (14)) and its weights.

`distribution_loss` is `Σ_k w_k [α_ce · CE_k + α_l1 · ‖p_k − p^t_k‖₁] / Σ_k w_k` over valid block positions,
computed by `cross_entropy_l1` with its gradient written out; `position_weights` are the w_k and `anchor_weight` the
drafter-anchor weight's schedule. `restrict_to_draft_vocabulary` / `top_k_draft_targets` put the target's
distribution (dense, or as a signal cache's top k) on the drafter's vocabulary.

Shapes: N = valid blocks in the batch, n = draft positions per block, V = vocabulary (V_d: the draft vocabulary).
"""

from dataclasses import dataclass

import torch

from .collator import IGNORE_INDEX


def position_weights(num_draft_tokens: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ) for k = 1..n: a mismatch at k voids every later draft, so early positions weigh more."""
    k = torch.arange(num_draft_tokens, device=device, dtype=dtype)
    return torch.exp(-k / gamma)


def anchor_weight(step: int, total_steps: int, start: float, floor: float) -> float:
    """Drafter-anchor weight λ at `step`: linear from `start` (step 0) to `floor` (last step); `start` if unknown."""
    if total_steps <= 0:
        return start
    return start + (floor - start) * min(step / total_steps, 1.0)


@dataclass
class DistributionLoss:
    loss: torch.Tensor  # scalar: Σ w_k valid [α_ce CE + α_l1 L1] / Σ w_k valid
    ce: torch.Tensor  # (N, n) −log p_k(x*_k), 0 where invalid or where x*_k lies outside the draft vocabulary
    l1: torch.Tensor  # (N, n) ‖p_k − p^t_k‖₁ over the whole vocabulary, 0 where invalid
    valid: torch.Tensor  # (N, n) bool
    ce_valid: torch.Tensor  # (N, n) bool: valid and x*_k inside the draft vocabulary

    @property
    def accept(self) -> torch.Tensor:
        """(N, n) acceptance probability under speculative sampling, 1 − TV = 1 − ½‖p − p^t‖₁ (0 where invalid)."""
        return (1.0 - 0.5 * self.l1.detach()) * self.valid


# Rows of a vocabulary-sized tensor processed at once by `cross_entropy_l1`: ~2 MB of fp32 per temporary, so a chunk's
# passes (exp, difference, sign, ...) run out of cache instead of streaming whole (positions × V) tensors from memory.
_CHUNK_ELEMENTS = 1 << 19


class _CrossEntropyL1(torch.autograd.Function):
    """Per-row −log p(y) and ‖p − q‖₁ for p = softmax(z), with the gradient written out.

    Autograd through log_softmax → exp → (p − q) → abs keeps about four (positions × V) fp32 tensors alive per
    distribution and makes some fifteen passes over them; with V = 49152 that, not the matmuls, dominates a CPU step.
    This keeps only the per-row log-normaliser and recomputes p in backward, chunk by chunk. The gradient:
    ∂CE/∂z = p − onehot(y) and ∂‖p − q‖₁/∂z_i = p_i (s_i − Σ_j p_j s_j) with s = sign(p − q) (sign(0) = 0, as autograd's
    abs).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_probs: torch.Tensor, labels: torch.Tensor):
        rows, vocab = logits.shape
        compute = torch.promote_types(logits.dtype, torch.float32)  # at least fp32: the softmax needs the range
        chunk = max(1, _CHUNK_ELEMENTS // vocab)
        ce = torch.empty(rows, dtype=compute, device=logits.device)
        l1, log_norm = torch.empty_like(ce), torch.empty_like(ce)
        for start in range(0, rows, chunk):
            part = slice(start, start + chunk)
            z = logits[part].to(compute, copy=True)  # a private copy: everything below is in place
            lse = torch.logsumexp(z, dim=-1)
            ce[part] = lse - z.gather(-1, labels[part, None]).squeeze(-1)
            p = z.sub_(lse[:, None]).exp_()
            l1[part] = p.sub_(target_probs[part]).abs_().sum(dim=-1)
            log_norm[part] = lse
        ctx.save_for_backward(logits, target_probs, labels, log_norm)
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_l1: torch.Tensor):
        logits, target_probs, labels, log_norm = ctx.saved_tensors
        grad = torch.empty_like(logits)
        chunk = max(1, _CHUNK_ELEMENTS // logits.shape[1])
        for start in range(0, logits.shape[0], chunk):
            part = slice(start, start + chunk)
            a, c = grad_l1[part, None], grad_ce[part, None]
            p = logits[part].to(log_norm.dtype, copy=True).sub_(log_norm[part, None]).exp_()
            g = torch.sub(p, target_probs[part]).sign_()  # s
            shift = c - a * torch.linalg.vecdot(p, g).unsqueeze(-1)  # c − a·Σ_j p_j s_j, before g is overwritten
            g.mul_(a).add_(shift).mul_(p)  # p ⊙ (a·s + c − a·Σ_j p_j s_j), in the buffer of s
            g.scatter_add_(-1, labels[part, None], -c)
            grad[part] = g
        return grad, None, None


def cross_entropy_l1(logits: torch.Tensor, target_probs: torch.Tensor, labels: torch.Tensor):
    """(..., V) logits, (..., V) target distribution, (...) labels in [0, V) → per-position (CE, ‖p − q‖₁), each (...)."""
    shape = labels.shape
    ce, l1 = _CrossEntropyL1.apply(
        logits.reshape(-1, logits.shape[-1]), target_probs.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    )
    return ce.view(shape), l1.view(shape)


def distribution_loss(
    logits: torch.Tensor,
    target_probs: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    ce_weight: float,
    l1_weight: float,
    tail: torch.Tensor | None = None,
) -> DistributionLoss:
    """Paper eq. (14) for one distribution p = softmax(logits): logits/target_probs (N, n, V), labels (N, n) with -100
    on ignored positions, weights (n,) position weights. Normalised by the weight of the valid positions.

    Over a draft vocabulary (logits and target_probs over its V_d tokens): `tail` (N, n) is the target's mass outside
    it, where p is 0, so ‖p − p^t‖₁ over the whole vocabulary is the sum over V_d plus `tail`; a label of -1 (the data
    token lies outside) adds no cross-entropy, only that L1 term."""
    valid = labels != IGNORE_INDEX
    ce_valid = labels >= 0
    ce, l1 = cross_entropy_l1(logits, target_probs, labels.clamp(min=0))
    if tail is not None:
        l1 = l1 + tail
    ce, l1 = ce * ce_valid, l1 * valid
    w = weights.view(1, -1) * valid
    # clamp: a batch without a single valid position yields 0 (still connected to the graph, so DDP sees every
    # parameter) instead of 0/0.
    loss = (w * (ce_weight * ce + l1_weight * l1)).sum() / w.sum().clamp(min=1e-12)
    return DistributionLoss(loss=loss, ce=ce, l1=l1, valid=valid, ce_valid=ce_valid)


@dataclass
class DraftTargets:
    """The target's side of the loss over the drafter's vocabulary."""

    probs: torch.Tensor  # (N, n, V_d) p^t on the draft vocabulary
    labels: torch.Tensor  # (N, n) data tokens as draft-vocabulary indices; -1 outside it, -100 ignored
    tail: torch.Tensor | None  # (N, n) p^t mass outside the draft vocabulary (None: it is the whole vocabulary)


def restrict_to_draft_vocabulary(probs: torch.Tensor, labels: torch.Tensor, token_ids: torch.Tensor | None) -> DraftTargets:
    """p^t (N, n, V) and labels (N, n) in target ids → the same over the draft vocabulary `token_ids` (V_d,)."""
    if token_ids is None:
        return DraftTargets(probs=probs, labels=labels, tail=None)
    restricted = probs.index_select(-1, token_ids)
    row = torch.full((probs.shape[-1],), -1, dtype=torch.long, device=labels.device)
    row[token_ids] = torch.arange(token_ids.shape[0], device=labels.device)
    draft_labels = torch.where(labels == IGNORE_INDEX, labels, row[labels.clamp(min=0)])
    return DraftTargets(probs=restricted, labels=draft_labels, tail=(1.0 - restricted.sum(dim=-1)).clamp(min=0.0))


def top_k_draft_targets(
    ids: torch.Tensor,
    probs: torch.Tensor,
    tail: torch.Tensor,
    labels: torch.Tensor,
    token_ids: torch.Tensor | None,
    vocab_size: int,
) -> DraftTargets:
    """p^t given as its top k (`ids` target ids and `probs`, (N, n, k)) plus `tail` (N, n), the mass outside them, as
    a signal cache stores it → the dense teacher over the draft vocabulary `token_ids` (the whole `vocab_size` one when
    None). Top-k entries outside the draft vocabulary join the tail, so `tail` is always the mass of p^t the dense
    teacher does not hold. CE never reads the teacher, so it is exact; the L1 term is exact on the held entries and, on
    the missing set M (the draft vocabulary outside the top k), counts Σ_M p_i + q_i instead of Σ_M |p_i − q_i|: it
    exceeds the live L1 by 2 Σ_M min(p_i, q_i) ∈ [0, 2 × stored tail] (docs/training.md)."""
    if token_ids is not None:
        row = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
        row[token_ids] = torch.arange(token_ids.shape[0], device=ids.device)
        ids, labels = row[ids], torch.where(labels == IGNORE_INDEX, labels, row[labels.clamp(min=0)])
        inside = ids >= 0
        tail = tail + (probs * ~inside).sum(dim=-1)
        # Entries outside add 0 at index 0: scatter_add keeps that exact whatever the order (a plain scatter of
        # duplicate indices would not say which value wins).
        ids, probs = ids.clamp(min=0), probs * inside
    width = vocab_size if token_ids is None else token_ids.shape[0]
    dense = probs.new_zeros(*probs.shape[:-1], width).scatter_add_(-1, ids, probs)
    return DraftTargets(probs=dense, labels=labels, tail=tail)
