"""Training xPress with transformers' `Trainer`: the paper's objective (§4.3, SPEC §4) against a frozen target.

Read top to bottom:

1. `XPressTrainingArguments` — the objective's knobs on top of `TrainingArguments`.
2. `XPressDataCollator` — pads sequences and samples random block anchors inside the responses (a function of the
   seed, the epoch and the row alone, so a resumed run draws exactly the anchors of an uninterrupted one).
3. The objective as plain functions: block layout (`block_attention_mask`, `block_position_ids`, `draft_blocks`),
   the frozen target's signals (`target_signals`), the per-distribution loss (`distribution_loss`) and the schedule
   (`position_weights`, `anchor_weight`); `XPressObjective` composes them into
   `L(p^r) + w_anchor · L(p^b) + w_cons · L(p̂^r)`.
4. `XPressTrainer` — holds the frozen target, freezes / LoRA-wraps the drafter, logs every term, and writes each
   checkpoint as a loadable xPress Hub folder (LoRA merged, target never saved) that `resume_from_checkpoint` reads.

Shapes: b = sequences, T = padded sequence length, m = anchors per sequence, B = block size, n = B - 1 draft
positions, N = valid blocks in the batch, H = hidden width, V = vocabulary.

This file does not travel with checkpoints (it imports peft and the Trainer); only the package uses it.
"""

import collections
import copy
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.utils import ModelOutput, logging

from .configuration_xpress import is_integer
from .modeling_xpress import XPressModel
from .refinement import previous_tokens

logger = logging.get_logger(__name__)

TRAIN_MODES = ("refiner", "full", "lora")
# Drafter modules LoRA adapts by default: every attention and MLP projection of its decoder layers (not `fc`, the
# context projection, and never the refiner, which is trained in full).
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Sub-folder of a LoRA checkpoint holding the unmerged adapter: the merged weights alone cannot be resumed from.
LORA_CHECKPOINT_DIR = "lora_adapter"
_BASE_FINGERPRINT_FILE = "xpress_base_fingerprint.json"
IGNORE_INDEX = -100


def _check_int(name: str, value, minimum: int | None = None) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an integer (not a float, not a bool) >= `minimum`."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


# ---------------------------------------------------------------------------------------------------------------------
# 1. Arguments
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class XPressTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the xPress objective (paper §4.3). Defaults follow the paper.

    The per-distribution loss is `L(p) = Σ_k w_k [ce_weight · CE_k + l1_weight · ‖p_k − p^t_k‖₁] / Σ_k w_k` over valid
    block positions, with `w_k = exp(−(k−1)/γ)`; the total is `L(p^r) + w_anchor · L(p^b) + consistency_weight ·
    L(p̂^r)` where `w_anchor` falls linearly from `anchor_weight_start` to `anchor_weight_floor` over the run.
    """

    # Random block anchors drawn per sequence (fewer when the response is shorter). Each anchor is one block of
    # `block_size - 1` supervised positions, so a batch holds up to batch_size × anchors_per_sequence blocks.
    anchors_per_sequence: int = field(default=8, metadata={"help": "Random block anchors sampled per sequence."})
    # γ of the position weights w_k = exp(−(k−1)/γ). None → 7 · block_size / 16 (the paper's γ = 7 at B = 16, scaled
    # so the weights decay over the same fraction of any block).
    loss_gamma: float | None = field(
        default=None, metadata={"help": "Position-weight decay γ; None → 7 · block_size / 16."}
    )
    # α_ce: weight of the teacher-forced cross-entropy against the data token.
    ce_weight: float = field(default=1.0, metadata={"help": "Weight α_ce of the cross-entropy term."})
    # α_l1: weight of ‖p − p^t‖₁ = 2 · (1 − acceptance rate) against the target's distribution.
    l1_weight: float = field(default=1.0, metadata={"help": "Weight α_l1 of the L1 (total-variation) term."})
    # β: weight of the consistency loss L(p̂^r), the refiner fed the drafter's own argmax tokens (what Jacobi sees).
    consistency_weight: float = field(default=0.3, metadata={"help": "Weight of the consistency term L(p̂^r)."})
    # λ: weight of the drafter-anchor loss L(p^b) at the first step …
    anchor_weight_start: float = field(default=0.6, metadata={"help": "Drafter-anchor weight at the first step."})
    # … annealed linearly to this value at the last step.
    anchor_weight_floor: float = field(default=0.2, metadata={"help": "Drafter-anchor weight at the last step."})
    # What is trained: "refiner" (drafter frozen), "full" (refiner + whole drafter, the paper's co-training) or
    # "lora" (refiner + LoRA adapters on the drafter's projections, merged into every saved checkpoint).
    train_mode: str = field(default="full", metadata={"help": f"One of {TRAIN_MODES}."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (train_mode='lora')."})
    lora_alpha: float = field(default=32.0, metadata={"help": "LoRA scaling α (train_mode='lora')."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch (train_mode='lora')."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES),
        metadata={"help": "Drafter module names LoRA adapts (train_mode='lora')."},
    )
    # Sequences longer than this are cut (prompt kept, response truncated) to bound memory; None keeps them whole.
    max_seq_length: int | None = field(default=None, metadata={"help": "Truncate sequences to this many tokens."})

    # --- TrainingArguments defaults changed for xPress ---
    learning_rate: float = field(default=6e-4, metadata={"help": "AdamW learning rate (paper: 6e-4)."})
    # The collator needs `loss_mask`, which no model forward takes: columns must not be pruned.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Must stay False for xPress."})
    # The objective uses every trainable parameter in every step, so DDP need not search for unused ones.
    ddp_find_unused_parameters: bool | None = field(default=False, metadata={"help": "See TrainingArguments."})

    def __post_init__(self):
        self.validate_xpress()
        # On a machine without accelerators the CPU is the only device; transformers still wants `use_cpu` set before
        # it enables CPU bf16 autocast or joins the processes of `accelerate launch` / `torchrun` (over gloo) instead
        # of leaving each one to train alone.
        if not torch.accelerator.is_available():
            self.use_cpu = True
        super().__post_init__()

    def validate_xpress(self) -> None:
        """Raise a `ValueError` naming the first xPress field whose value cannot work."""
        _check_int("anchors_per_sequence", self.anchors_per_sequence, 1)
        if self.loss_gamma is not None and not self.loss_gamma > 0:
            raise ValueError(f"loss_gamma must be > 0 (or None for 7 · block_size / 16), got {self.loss_gamma}")
        for name in ("ce_weight", "l1_weight", "consistency_weight", "anchor_weight_start", "anchor_weight_floor"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.ce_weight == 0 and self.l1_weight == 0:
            raise ValueError("ce_weight and l1_weight are both 0: the objective would be empty")
        if self.anchor_weight_floor > self.anchor_weight_start:
            raise ValueError(
                f"anchor_weight_floor ({self.anchor_weight_floor}) must not exceed anchor_weight_start "
                f"({self.anchor_weight_start}): the drafter-anchor weight is annealed downwards"
            )
        if self.train_mode not in TRAIN_MODES:
            raise ValueError(f"train_mode must be one of {TRAIN_MODES}, got {self.train_mode!r}")
        _check_int("lora_r", self.lora_r, 1)
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.train_mode == "lora" and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: train_mode='lora' needs at least one drafter module")
        if self.max_seq_length is not None:
            _check_int("max_seq_length", self.max_seq_length, 2)  # an anchor and its next token
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the `loss_mask` column the xPress collator needs; leave it False"
            )
        if self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing=True is not supported: the xPress drafter has no checkpointing")

    def resolved_gamma(self, block_size: int) -> float:
        """γ for a drafter with `block_size`: `loss_gamma`, or 7 · block_size / 16 when it is None."""
        return self.loss_gamma if self.loss_gamma is not None else 7.0 * block_size / 16


# ---------------------------------------------------------------------------------------------------------------------
# 2. Data
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class XPressDataCollator:
    """Batches `{"input_ids", "loss_mask"}` rows and samples the blocks to train on (SPEC §4).

    An anchor is a position t with `loss_mask[t] == loss_mask[t+1] == 1` (inside a response, with at least one
    response token after it). Up to `anchors_per_sequence` distinct anchors are drawn per sequence, uniformly and
    without replacement, from a generator seeded with a hash of (`seed`, `epoch`, the row's tokens and loss mask).
    The anchors of a row are thus a function of the row and the epoch alone, not of how many batches were collated
    before: a resumed run (whose Trainer skips the batches already trained, for a map-style dataset without collating
    them), dataloader workers (each with its own copy of the collator) and other processes all draw exactly the anchors
    of an uninterrupted single-process run. `XPressTrainer` calls `set_epoch` at the start of every epoch, so a row
    seen again gets a fresh draw. (Identical rows in one epoch get identical anchors.)

    Returns right-padded `input_ids` / `attention_mask` (b, T); `anchors` (b, m) positions and `anchor_mask` (b, m)
    (False on the padding slots of sequences with fewer than m anchors); `labels` (b, m, n): block position k of the
    block anchored at t is labelled with token t+k, or -100 from the first position that runs past the sequence or
    leaves the response (a draft past a non-response token can never be accepted as a continuation of it).
    """

    block_size: int
    anchors_per_sequence: int = XPressTrainingArguments.anchors_per_sequence  # declared (and documented) once, there
    pad_token_id: int = 0
    max_length: int | None = None
    seed: int = 0
    # The Trainer's pass over the data, part of every row's anchor seed; set by `set_epoch`.
    epoch: int = 0

    def __post_init__(self):
        _check_int("block_size", self.block_size, 2)
        _check_int("anchors_per_sequence", self.anchors_per_sequence, 1)
        if self.max_length is not None:
            _check_int("max_length", self.max_length, 2)
        _check_int("seed", self.seed)
        _check_int("epoch", self.epoch, 0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the anchors of `epoch` from now on (`XPressTrainer` calls this at the start of every epoch)."""
        _check_int("epoch", epoch, 0)
        self.epoch = int(epoch)

    def row_generator(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Generator:
        """The generator a row's anchors are drawn from: seeded by (seed, epoch, the row's tokens and loss mask)."""
        digest = hashlib.blake2b(f"{self.seed}:{self.epoch}:".encode(), digest_size=8)
        digest.update(ids.cpu().numpy().tobytes())
        digest.update(mask.cpu().numpy().tobytes())
        return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little"))

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if len(features) == 0:
            raise ValueError(
                "XPressDataCollator got an empty batch (no rows): pass at least one row with input_ids and loss_mask"
            )
        rows = []
        for i, row in enumerate(features):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long).flatten()
            mask = torch.as_tensor(row["loss_mask"]).flatten().bool()
            if len(ids) != len(mask):
                raise ValueError(f"row {i}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
            if self.max_length is not None:
                ids, mask = ids[: self.max_length], mask[: self.max_length]
            rows.append((ids, mask))
        b, t_max = len(rows), max(len(ids) for ids, _ in rows)
        if t_max == 0:
            raise ValueError(
                f"every row of this batch of {b} has 0 tokens: there is nothing to train on. Drop empty rows from the "
                "dataset (e.g. dataset.filter(lambda row: len(row['input_ids']) > 1))"
            )
        m, n = self.anchors_per_sequence, self.block_size - 1

        input_ids = torch.full((b, t_max), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(b, t_max, dtype=torch.long)
        in_response = torch.zeros(b, t_max, dtype=torch.bool)
        anchors = torch.zeros(b, m, dtype=torch.long)
        anchor_mask = torch.zeros(b, m, dtype=torch.bool)
        for i, (ids, mask) in enumerate(rows):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
            in_response[i, : len(ids)] = mask
            eligible = (mask[:-1] & mask[1:]).nonzero().flatten()  # t with loss_mask[t] == loss_mask[t+1] == 1
            pick = torch.randperm(len(eligible), generator=self.row_generator(ids, mask))[:m]
            chosen = eligible[pick].sort().values
            anchors[i, : len(chosen)] = chosen
            anchor_mask[i, : len(chosen)] = True

        # Label of block position k (1..n) is the token at anchor + k while every token up to it is a response token.
        offsets = torch.arange(1, n + 1)
        positions = anchors[..., None] + offsets  # (b, m, n)
        inside = positions < t_max
        clamped = positions.clamp(max=t_max - 1)
        gathered_ok = torch.gather(in_response[:, None, :].expand(-1, m, -1), 2, clamped) & inside
        valid = gathered_ok.long().cumprod(dim=-1).bool() & anchor_mask[..., None]
        tokens = torch.gather(input_ids[:, None, :].expand(-1, m, -1), 2, clamped)
        labels = torch.where(valid, tokens, torch.full_like(tokens, IGNORE_INDEX))
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "anchors": anchors,
            "anchor_mask": anchor_mask,
            "labels": labels,
        }


# ---------------------------------------------------------------------------------------------------------------------
# 3. The objective
# ---------------------------------------------------------------------------------------------------------------------


def position_weights(num_draft_tokens: int, gamma: float, device=None, dtype=torch.float32) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ) for k = 1..n: a mismatch at k voids every later draft, so early positions weigh more."""
    k = torch.arange(num_draft_tokens, device=device, dtype=dtype)
    return torch.exp(-k / gamma)


def anchor_weight(step: int, total_steps: int, start: float, floor: float) -> float:
    """Drafter-anchor weight λ at `step`: linear from `start` (step 0) to `floor` (last step); `start` if unknown."""
    if total_steps <= 0:
        return start
    return start + (floor - start) * min(step / total_steps, 1.0)


def block_position_ids(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Positions of `[context ; blocks]`: context 0..T-1, block j at anchor_j .. anchor_j + B - 1. → (b, T + m·B)."""
    b = anchors.shape[0]
    context = torch.arange(context_len, device=anchors.device).expand(b, -1)
    blocks = (anchors[..., None] + torch.arange(block_size, device=anchors.device)).reshape(b, -1)
    return torch.cat([context, blocks], dim=1)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean (b, 1, m·B, T + m·B) mask, True = attend, reproducing inference for every block at once.

    A block anchored at t sees the context strictly before t (the anchor is the target's newest token, so its
    features are not known yet when the block is drafted), every position of itself, and no other block.
    """
    b, m = anchors.shape
    q = m * block_size
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, q) anchor of each query's block
    sees_context = torch.arange(context_len, device=device).view(1, 1, -1) < query_anchor[..., None]  # (b, q, T)
    query_block = torch.arange(q, device=device) // block_size
    sees_block = (query_block[:, None] == query_block[None, :]).expand(b, q, q)  # block-diagonal
    return torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)


def draft_blocks(
    xpress: XPressModel, embed_tokens: nn.Module, context: torch.Tensor, anchors: torch.Tensor, anchor_ids: torch.Tensor
) -> torch.Tensor:
    """One drafter forward over every block of the batch: (b, m) anchors → last hidden states (b, m, B, H).

    context: (b, T, L·H_t) target features of every token; anchors: (b, m) positions; anchor_ids: (b, m) tokens.
    """
    b, m = anchors.shape
    block = xpress.config.block_size
    dtype = xpress.fc.weight.dtype
    noise_embeds = xpress.embed_blocks(anchor_ids, embed_tokens)  # (b, m·B, H)
    out = xpress(
        noise_embeds=noise_embeds.to(dtype),
        context_hidden_states=context.to(dtype),
        position_ids=block_position_ids(anchors, context.shape[1], block),
        attention_mask=block_attention_mask(anchors, context.shape[1], block),
    )
    return out.last_hidden_state.view(b, m, block, -1)


@dataclass
class TargetSignals:
    context: torch.Tensor  # (b, T, L·H_t) features of the chosen target layers for every token
    probs: torch.Tensor  # (N, n, V) target next-token distribution p^t at every position of every valid block


@torch.no_grad()
def target_signals(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    layer_ids: list[int],
    num_draft_tokens: int,
) -> TargetSignals:
    """One frozen-target forward, teacher-forced on the data: the drafter's context and p^t for each valid block.

    Block position k of a block anchored at t predicts token t+k, so its p^t is the softmax of the target's logits at
    position t+k-1. Only the positions some block needs go through the lm_head (`logits_to_keep`).
    """
    t_len = input_ids.shape[1]
    offsets = torch.arange(num_draft_tokens, device=input_ids.device)
    positions = (anchors[..., None] + offsets).clamp(max=t_len - 1)[anchor_mask]  # (N, n)
    keep = torch.unique(positions)  # sorted
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in layer_ids],
        logits_to_keep=keep,
    )
    context = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    b, m = anchors.shape
    rows = torch.arange(b, device=input_ids.device).view(b, 1, 1).expand(b, m, num_draft_tokens)[anchor_mask]
    logits = out.logits[rows, torch.searchsorted(keep, positions)]  # (N, n, V)
    return TargetSignals(context=context, probs=logits.float().softmax(dim=-1))


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


def frequency_ranked_vocabulary(dataset, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent response tokens (`loss_mask == 1`) of a `{"input_ids", "loss_mask"}` dataset, most
    frequent first, with the ids in `always` (e.g. EOS) included: what `XPressModel.set_draft_vocabulary` stores.
    Ties break by token id, so the result is deterministic."""
    counts: collections.Counter = collections.Counter()
    for row in dataset:
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    forced = list(dict.fromkeys(int(t) for t in always))
    ranked = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if t not in forced]
    if size < len(forced) or size > len(forced) + len(ranked):
        raise ValueError(
            f"size must be between {len(forced)} (the ids always included) and {len(forced) + len(ranked)} (the "
            f"distinct response tokens), got {size}; a larger draft vocabulary than the data covers cannot be ranked"
        )
    return torch.tensor(forced + ranked[: size - len(forced)], dtype=torch.long)


@dataclass
class XPressObjectiveOutput(ModelOutput):
    """`loss` to optimise; `metrics`: name → tensor([sum, count]) of every logged quantity (summed over batches and
    processes, then divided, so averages are exact)."""

    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None


def _mean_metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.stack([(values.detach() * mask).sum().float(), mask.sum().float()])


class XPressObjective(nn.Module):
    """The training loss of one batch, as a module so that DDP wraps (and synchronises) all of it.

    It owns the drafter being trained (an `XPressModel`, or the `PeftModel` around it) and *borrows* the frozen
    target: the target is deliberately not a submodule, so it is never saved, never handed to the optimizer and
    never wrapped or broadcast by DDP. Its embedding table and lm_head are used, frozen, by the drafter.
    """

    def __init__(
        self,
        xpress: nn.Module,
        target: PreTrainedModel,
        *,
        gamma: float,
        ce_weight: float = XPressTrainingArguments.ce_weight,  # the objective's defaults are the arguments' defaults
        l1_weight: float = XPressTrainingArguments.l1_weight,
        consistency_weight: float = XPressTrainingArguments.consistency_weight,
    ):
        super().__init__()
        self.xpress = xpress
        object.__setattr__(self, "target", target)  # borrowed, see the class docstring
        self.gamma = gamma
        self.ce_weight = ce_weight
        self.l1_weight = l1_weight
        self.consistency_weight = consistency_weight

    @property
    def core(self) -> XPressModel:
        """The `XPressModel` itself (inside the PEFT wrapper when training LoRA)."""
        return self.xpress.get_base_model() if hasattr(self.xpress, "get_base_model") else self.xpress

    def _drafter_trainable(self) -> bool:
        return any(p.requires_grad for name, p in self.core.named_parameters() if not name.startswith("refiner."))

    def _loss(self, logits, targets: DraftTargets, weights) -> DistributionLoss:
        return distribution_loss(
            logits, targets.probs, targets.labels, weights, self.ce_weight, self.l1_weight, tail=targets.tail
        )

    def forward(
        self,
        input_ids: torch.LongTensor,
        anchors: torch.LongTensor,
        anchor_mask: torch.BoolTensor,
        labels: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        anchor_weight: float = XPressTrainingArguments.anchor_weight_start,
        features: torch.Tensor | None = None,
        teacher_ids: torch.LongTensor | None = None,
        teacher_probs: torch.Tensor | None = None,
        teacher_tail: torch.Tensor | None = None,
    ) -> XPressObjectiveOutput:
        """Batch from `XPressDataCollator` → total loss and metrics. `anchor_weight` is λ of the current step.

        From a signal cache (`signal_cache.SignalCacheCollator`) the batch also carries the target's `features`
        (b, T, L·H) and p^t of every block position as top-k `teacher_ids` / `teacher_probs` (b, m, n, k) plus
        `teacher_tail` (b, m, n): then the target runs no forward, only its embedding table and lm_head are used."""
        core = self.core
        config = core.config
        embed_tokens, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        cached = features is not None
        if cached and (teacher_ids is None or teacher_probs is None or teacher_tail is None):
            raise ValueError("a batch with cached features needs teacher_ids, teacher_probs and teacher_tail too")
        if cached:
            context = features
        else:
            signals = target_signals(
                self.target, input_ids, attention_mask, anchors, anchor_mask, config.target_layer_ids,
                config.num_draft_tokens,
            )  # fmt: skip
            context = signals.context
        anchor_ids = torch.gather(input_ids, 1, anchors)  # (b, m)
        # A frozen drafter (train_mode="refiner") runs without a graph: nothing upstream of the head needs gradients.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self._drafter_trainable()):
            hidden = draft_blocks(core, embed_tokens, context, anchors, anchor_ids)[anchor_mask]  # (N, B, H)
        anchor_ids, labels = anchor_ids[anchor_mask], labels[anchor_mask]  # (N,), (N, n)
        # Every distribution lives on the draft vocabulary (the whole one by default): s and δ are (N, n, V_d).
        base = core.draft_logits(hidden.to(lm_head.weight.dtype), lm_head)
        if cached:
            targets = top_k_draft_targets(
                teacher_ids[anchor_mask], teacher_probs[anchor_mask].float(), teacher_tail[anchor_mask].float(), labels,
                core.draft_token_ids, lm_head.weight.shape[0],
            )  # fmt: skip
        else:
            targets = restrict_to_draft_vocabulary(signals.probs, labels, core.draft_token_ids)
        hidden = hidden[:, 1:]  # draft positions 1..n, (N, n, H), what the head reads
        weights = position_weights(config.num_draft_tokens, self.gamma, device=base.device)

        terms: dict[str, DistributionLoss] = {"base": self._loss(base, targets, weights)}
        if not core.refiner.corrects:  # dFlash's own objective: the drafter's distribution is the draft distribution
            loss, main = terms["base"].loss, "base"
        else:
            # p^r: teacher forcing, the head sees the gold previous tokens [anchor, x*_1..x*_{n-1}]. Ignored labels
            # only ever feed ignored positions (validity is a prefix), so their placeholder ids do not matter.
            gold = previous_tokens(anchor_ids, labels.clamp(min=0))
            terms["refined"] = self._loss(base + core.refiner(hidden, gold), targets, weights)
            # p̂^r: the head fed the drafter's own argmax (as target ids), the seed Jacobi refinement starts from.
            seed = base.detach().argmax(dim=-1)
            drafted = previous_tokens(anchor_ids, seed if core.draft_token_ids is None else core.draft_token_ids[seed])
            terms["consistency"] = self._loss(base + core.refiner(hidden, drafted), targets, weights)
            loss = (
                terms["refined"].loss
                + anchor_weight * terms["base"].loss
                + self.consistency_weight * terms["consistency"].loss
            )
            main = "refined"

        metrics: dict[str, torch.Tensor] = {}
        one = torch.ones((), device=base.device)
        for name, term in terms.items():
            metrics[f"loss_{name}"] = torch.stack([term.loss.detach().float(), one])
            metrics[f"ce_{name}"] = _mean_metric(term.ce, term.ce_valid)
            metrics[f"l1_{name}"] = _mean_metric(term.l1, term.valid)
            metrics[f"accept_{name}"] = _mean_metric(term.accept, term.valid)
        if core.refiner.corrects:
            metrics["anchor_weight"] = torch.stack([torch.tensor(float(anchor_weight), device=base.device), one])
        accept = terms[main].accept  # (N, n), of the distribution drafts are drawn from
        for k in range(config.num_draft_tokens):
            metrics[f"accept_k{k + 1}"] = _mean_metric(accept[:, k], terms[main].valid[:, k])
        # τ estimate at temperature 1: 1 + Σ_k Π_{j≤k} (1 − TV_j), over blocks whose every position is labelled.
        full = terms[main].valid.all(dim=-1)
        metrics["tau_estimate"] = _mean_metric(1.0 + accept.cumprod(dim=-1).sum(dim=-1), full)
        return XPressObjectiveOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Trainer
# ---------------------------------------------------------------------------------------------------------------------


def prepare_for_training(xpress: XPressModel, args: XPressTrainingArguments) -> nn.Module:
    """Apply `args.train_mode`: freeze the drafter, unfreeze everything, or wrap it with LoRA (peft).

    The head is always trained in full; with LoRA it is declared `modules_to_save`, so the adapter checkpoint carries
    it and `merge_and_unload` puts the trained copy back in place.
    """
    if args.train_mode == "refiner":
        if not xpress.refiner.corrects:
            raise ValueError(
                "train_mode='refiner' trains only the head, but this model has refiner='none'. Use train_mode='full' "
                "(or 'lora') to train the drafter alone."
            )
        xpress.requires_grad_(False)
        xpress.refiner.requires_grad_(True)
        return xpress
    if args.train_mode == "full":
        return xpress.requires_grad_(True)
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=list(args.lora_target_modules),
        modules_to_save=["refiner"] if xpress.refiner.corrects else None,
    )
    return get_peft_model(xpress, lora)


def with_fresh_head(model: XPressModel, refiner: str, refiner_rank: int | None = None) -> XPressModel:
    """A new `XPressModel` with `model`'s drafter weights and a fresh `refiner` head (δ = 0 until trained).

    The second stage of training from scratch: a drafter trained alone (`refiner="none"`) gets an xPress or Markov
    head; or a head is swapped for another on the same drafter.
    """
    config = copy.deepcopy(model.config)
    config.refiner = refiner
    if refiner_rank is not None:
        config.refiner_rank = refiner_rank
    config.validate_xpress()
    fresh = XPressModel(config).to(model.device, model.dtype)
    drafter = {name: tensor for name, tensor in model.state_dict().items() if not name.startswith("refiner.")}
    missing, unexpected = fresh.load_state_dict(drafter, strict=False)
    stray = [name for name in missing if not name.startswith("refiner.")] + list(unexpected)
    if stray:
        raise ValueError(f"drafter weights do not fit the new model: {stray}")
    return fresh


class _AnchorEpochCallback(TrainerCallback):
    """Tells the collator which epoch starts, so a row seen again gets new anchors. The epoch comes from the Trainer's
    state, which a resumed run restores, so the resumed run continues the anchors of the interrupted one."""

    def __init__(self, collator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        # `state.epoch` is `epoch + fraction done`: an exact integer at an epoch's start, mid-way after a resume.
        self.collator.set_epoch(math.floor(state.epoch))


class _TrainingClock(TrainerCallback):
    """Training wall time summed over every process run of a training (first run and each resume): the seconds of
    the interrupted runs come back with the restored state's last logged `train_seconds`."""

    def __init__(self):
        self.before = 0.0
        self.start = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs):
        logged = [entry["train_seconds"] for entry in state.log_history if "train_seconds" in entry]
        self.before = logged[-1] if logged else 0.0
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.start


def with_draft_vocabulary(model: XPressModel, token_ids) -> XPressModel:
    """A new `XPressModel` with `model`'s weights restricted to the draft vocabulary `token_ids` (target ids, e.g.
    `frequency_ranked_vocabulary(...)`): the head keeps its readout rows of those tokens, the drafter is unchanged.

    Restricting a trained model is exact on the kept rows; training with the restriction (what the heads then read
    out) is what makes the most of it."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    config = copy.deepcopy(model.config)
    config.draft_vocab_size = int(ids.shape[0])
    config.validate_xpress()
    restricted = XPressModel(config).to(model.device, model.dtype)
    state = dict(model.state_dict())
    if model.draft_token_ids is not None:
        raise ValueError("this model already has a draft vocabulary; restrict the full-vocabulary model instead")
    for name in [k for k in state if k.endswith("readout.weight")]:
        state[name] = state[name][ids.to(state[name].device)]
    missing, unexpected = restricted.load_state_dict(state, strict=False)
    if missing != ["draft_token_ids"] or unexpected:
        raise ValueError(f"weights do not fit the restricted model: missing {missing}, unexpected {unexpected}")
    restricted.set_draft_vocabulary(ids)
    return restricted


def _frozen_fingerprint(model: nn.Module) -> str:
    """sha256 of every frozen tensor of the LoRA-wrapped drafter: the base an adapter checkpoint is only valid on."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if not p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class XPressTrainer(Trainer):
    """`Trainer` for an xPress drafter + head against a frozen target, with the paper's objective.

    Example:

    ```python
    >>> args = XPressTrainingArguments(output_dir="out", max_steps=1000, per_device_train_batch_size=8, bf16=True)
    >>> trainer = XPressTrainer(model=xpress, target=target, args=args, train_dataset=responses)
    >>> trainer.train()  # checkpoints in out/checkpoint-*/ load with XPressModel.from_pretrained
    ```

    `model` is the `XPressModel` to train (fresh, converted from dFlash, or a previous xPress checkpoint); `target`
    the model it drafts for. The target is frozen, put in eval mode, moved to the training device, and never saved.
    `train_dataset` rows hold `input_ids` and `loss_mask` (1 on response tokens), e.g. from
    `modeling_xpress.data.regenerate_responses`, or a signal cache of them (`signal_cache.load_signal_cache`: the target
    then runs no forward, only its embedding table and lm_head are used). Every checkpoint (and `save_model`) is a
    self-contained xPress Hub folder — LoRA merged — plus the Trainer's state, so `train(resume_from_checkpoint=...)`
    continues the run.
    `self.model` is the `XPressObjective` (the module DDP wraps); `self.xpress` the drafter being trained.
    """

    def __init__(
        self,
        model: XPressModel,
        target: PreTrainedModel,
        args: XPressTrainingArguments,
        train_dataset=None,
        eval_dataset=None,
        data_collator=None,
        **kwargs,
    ):
        if not isinstance(args, XPressTrainingArguments):
            raise ValueError(f"args must be XPressTrainingArguments (it carries the objective), got {type(args).__name__}")
        if not (isinstance(model, PreTrainedModel) and getattr(model.config, "model_type", None) == "xpress"):
            raise ValueError(f"model must be an XPressModel, got {type(model).__name__}")
        if kwargs.get("model_init") is not None:
            raise ValueError("model_init is not supported by XPressTrainer; pass the XPressModel as model=")
        model.config.check_target(target.config)
        target.requires_grad_(False).eval()
        # Rows of a signal cache (`signal_cache.load_signal_cache`) carry the target's features and p^t, so the target
        # runs no forward: they must hold this drafter's layers of this target. (Imported here: signal_cache imports
        # this module.)
        from .signal_cache import SignalCacheCollator, check_signal_cache, signal_cache_settings

        evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        caches = [signal_cache_settings(d) for d in (train_dataset, *evals) if d is not None]
        for settings in filter(None, caches):
            check_signal_cache(settings, model.config, target)
        self.target = target
        self.xpress = prepare_for_training(model, args)
        self.is_lora = args.train_mode == "lora"
        self._base_fingerprint = _frozen_fingerprint(self.xpress) if self.is_lora else None
        objective = XPressObjective(
            self.xpress,
            target,
            gamma=args.resolved_gamma(model.config.block_size),
            ce_weight=args.ce_weight,
            l1_weight=args.l1_weight,
            consistency_weight=args.consistency_weight,
        )
        if data_collator is None:
            data_collator = (SignalCacheCollator if any(caches) else XPressDataCollator)(
                block_size=model.config.block_size,
                anchors_per_sequence=args.anchors_per_sequence,
                pad_token_id=model.config.pad_token_id or 0,
                max_length=args.max_seq_length,
                # The same for every process: anchors depend on the row, not on which process collates it.
                seed=args.seed,
            )
        if hasattr(data_collator, "set_epoch"):
            if args.dataloader_persistent_workers and args.dataloader_num_workers > 0:
                raise ValueError(
                    "dataloader_persistent_workers=True keeps the collator each worker copied at the first epoch, so "
                    "set_epoch never reaches it and every epoch would train the same anchors of a row. Set "
                    "dataloader_persistent_workers=False (workers then restart, with the new epoch, every epoch)."
                )
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), _AnchorEpochCallback(data_collator)]
        self._clock = _TrainingClock()
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self._clock]
        super().__init__(
            model=objective,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            data_collator=data_collator,
            **kwargs,
        )
        # The objective returns a per-batch mean: the Trainer must divide it for gradient accumulation itself.
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False
        if getattr(target, "hf_device_map", None) is None:  # a target dispatched over devices stays where it is
            self.target.to(self.args.device)
        self._metric_sums: dict[str, dict[str, torch.Tensor]] = {"train": {}, "eval": {}}

    # --- loss and logs -----------------------------------------------------------------------------------------------

    def current_anchor_weight(self) -> float:
        """λ for the step being trained: annealed linearly from `anchor_weight_start` to `anchor_weight_floor`."""
        return anchor_weight(
            self.state.global_step, self.state.max_steps, self.args.anchor_weight_start, self.args.anchor_weight_floor
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, anchor_weight=self.current_anchor_weight())
        sums = self._metric_sums["train" if model.training else "eval"]
        for name, value in outputs.metrics.items():
            sums[name] = sums[name] + value if name in sums else value.detach().clone()
        return (outputs.loss, outputs) if return_outputs else outputs.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Evaluation computes the objective (and its metrics); there are no logits worth gathering."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _flush_metrics(self, split: str) -> dict[str, float]:
        """Averages of the metrics recorded since the last log, over steps and processes; resets them."""
        sums = self._metric_sums[split]
        names = list(sums)
        stacked = torch.stack([sums[name] for name in names]).to(self.args.device)  # (K, 2): sum, count
        if self.accelerator.num_processes > 1:  # every process logs at the same step, so this collective is safe
            stacked = self.accelerator.reduce(stacked, reduction="sum")
        sums.clear()
        prefix = "eval_" if split == "eval" else ""
        return {prefix + name: s / c for name, (s, c) in zip(names, stacked.tolist()) if c > 0}

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the objective's terms, per-position acceptance and the training's wall time so far (`train_seconds`,
        summed over resumed runs) to the Trainer's own training / evaluation logs."""
        split = "train" if "loss" in logs else "eval" if "eval_loss" in logs else None
        if split is not None and self._metric_sums[split]:
            logs.update(self._flush_metrics(split))
        if split is not None:  # wall time of the whole training so far, resumes included (`_TrainingClock`)
            logs["train_seconds"] = round(self._clock.seconds(), 1)
        super().log(logs, start_time)

    # --- checkpoints -------------------------------------------------------------------------------------------------

    def export_model(self) -> XPressModel:
        """The trained model as a plain `XPressModel`: with LoRA, a merged copy (training continues on the adapter)."""
        if not self.is_lora:
            return self.xpress
        return copy.deepcopy(self.xpress).merge_and_unload()

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write a loadable xPress Hub folder (config, weights, code, card; LoRA merged; never the target). A LoRA run
        also keeps its unmerged adapter in `lora_adapter/`, which `resume_from_checkpoint` needs."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        logger.info(f"Saving xPress checkpoint to {output_dir}")
        self.export_model().save_pretrained(output_dir)
        if self.is_lora:
            adapter_dir = os.path.join(output_dir, LORA_CHECKPOINT_DIR)
            self.xpress.save_pretrained(adapter_dir)
            with open(os.path.join(adapter_dir, _BASE_FINGERPRINT_FILE), "w") as f:
                json.dump({"sha256": self._base_fingerprint}, f)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Restore the trained weights from a checkpoint `_save` wrote (the Trainer restores optimizer, scheduler,
        RNG and step itself)."""
        if self.is_lora:
            from peft.utils import load_peft_weights, set_peft_model_state_dict

            adapter_dir = os.path.join(resume_from_checkpoint, LORA_CHECKPOINT_DIR)
            if not os.path.isdir(adapter_dir):
                raise ValueError(
                    f"{resume_from_checkpoint} has no {LORA_CHECKPOINT_DIR}/: it was not written by a train_mode='lora' "
                    "run, so there is no adapter to resume. Start a new run with --init_from pointing at it instead."
                )
            with open(os.path.join(adapter_dir, _BASE_FINGERPRINT_FILE)) as f:
                saved = json.load(f)["sha256"]
            if saved != self._base_fingerprint:
                raise ValueError(
                    f"The LoRA adapter in {adapter_dir} was trained on a different base drafter than the one this "
                    "trainer was built with. Resume with the same initial model (e.g. the same --init_from), not with "
                    "the merged checkpoint."
                )
            set_peft_model_state_dict(self.xpress, load_peft_weights(adapter_dir, device="cpu"))
            return
        saved = XPressModel.from_pretrained(resume_from_checkpoint)
        self.xpress.load_state_dict(saved.state_dict())

    def _load_best_model(self) -> None:
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """A snapshot (`snapshot_checkpoint`: a checkpoint without its optimizer state) resumes with the learning-rate
        schedule where it was and a fresh optimizer; the Trainer itself would drop the schedule too and restart it."""
        snapshot = (
            checkpoint is not None
            and not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME))
            and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME))
            and os.path.isfile(os.path.join(checkpoint, SNAPSHOT_NOTE))
        )
        if not snapshot:
            return super()._load_optimizer_and_scheduler(checkpoint)
        logger.warning(
            f"{checkpoint} is a snapshot without optimizer state: the learning-rate schedule continues at step "
            f"{self.state.global_step}, the optimizer's moments start again from zero."
        )
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


SNAPSHOT_NOTE = "SNAPSHOT.md"


def snapshot_checkpoint(checkpoint: str | os.PathLike, destination: str | os.PathLike,
                        weights_dtype: torch.dtype | None = None) -> Path:  # fmt: skip
    """Copy a training checkpoint without its optimizer state: small enough to commit (a 2-layer SmolLM2 drafter is
    ~31 MB of fp32 weights; Adam's moments would add twice that), so a run can stop at the end of one session and
    `train(resume_from_checkpoint=<destination>)` continue it in the next, on another machine. It keeps the weights,
    the Trainer's state (step, logs, best checkpoint), the learning-rate schedule and the RNG states; the optimizer's
    moments restart from zero on resume (`XPressTrainer` then loads the schedule alone). `weights_dtype` (e.g.
    bfloat16, for a 4-layer drafter's 59 MB) stores the floating-point weights in that dtype; a resumed run casts them
    back to its own, so it continues from the rounded weights. Returns the destination."""
    source, destination = Path(checkpoint), Path(destination)
    if not (source / TRAINER_STATE_NAME).is_file() or not (source / "config.json").is_file():
        raise ValueError(f"{source} is not a training checkpoint (no {TRAINER_STATE_NAME} or config.json)")
    if destination.exists():
        shutil.rmtree(destination)
    # no optimizer state, and no copies of the package's code (a checkpoint is also a Hub folder): load and resume a
    # snapshot with the package, whose code is the current one
    ignored = shutil.ignore_patterns(OPTIMIZER_NAME, "optimizer.bin", "*.py", "custom_generate")
    shutil.copytree(source, destination, ignore=ignored)
    if weights_dtype is not None:
        from safetensors.torch import load_file, save_file

        for weights in destination.glob("*.safetensors"):
            tensors = load_file(weights)
            save_file({k: v.to(weights_dtype) if v.is_floating_point() else v for k, v in tensors.items()}, weights,
                      metadata={"format": "pt"})  # fmt: skip
    state = json.loads((source / TRAINER_STATE_NAME).read_text())
    (destination / SNAPSHOT_NOTE).write_text(
        f"# Training snapshot at step {state['global_step']}\n\n"
        f"`{source}` without `{OPTIMIZER_NAME}`. Continue it with `resume_from_checkpoint` pointing here: the weights, "
        "the step, the logs, the learning-rate schedule and the RNG states are restored; the optimizer's moments "
        "start again from zero.\n"
    )
    return destination


__all__ = [
    "XPressTrainingArguments",
    "XPressDataCollator",
    "XPressObjective",
    "XPressObjectiveOutput",
    "XPressTrainer",
    "DistributionLoss",
    "DraftTargets",
    "frequency_ranked_vocabulary",
    "restrict_to_draft_vocabulary",
    "snapshot_checkpoint",
    "top_k_draft_targets",
    "TargetSignals",
    "anchor_weight",
    "block_attention_mask",
    "block_position_ids",
    "cross_entropy_l1",
    "distribution_loss",
    "draft_blocks",
    "position_weights",
    "prepare_for_training",
    "target_signals",
    "with_draft_vocabulary",
    "with_fresh_head",
]
