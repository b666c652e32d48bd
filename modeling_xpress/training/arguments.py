"""`XPressTrainingArguments`: the xPress objective's knobs (paper §4.3) on top of transformers'
`TrainingArguments`, validated where they are declared."""

import math
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from ..configuration_xpress import is_integer


TRAIN_MODES = ("refiner", "full", "lora")
# The authors' recipe (their released run, `xpress-s1-b16warm-sgu-consis-k3`: the drafter warm-started from dFlash and
# co-trained with the head, its own loss weight falling 0.6 → 0.2; three free-running Jacobi consistency rounds,
# averaged, weight 0.3; 0.9 · L1 + 0.1 · CE per position with decay γ = 4; AdamW at 6e-4). These are also the
# defaults of `XPressTrainingArguments`; `XPressTrainingArguments.paper_recipe(...)` spells them out. Their head:
# r = 256, MLP hidden 512 (`XPressConfig.refiner_rank`, `refiner_mlp_hidden`).
PAPER_RECIPE = {
    "train_mode": "full",
    "anchor_weight_start": 0.6,
    "anchor_weight_floor": 0.2,
    "consistency_rounds": 3,
    "consistency_weight": 0.3,
    "l1_weight": 0.9,
    "ce_weight": 0.1,
    "loss_gamma": 4.0,
    "learning_rate": 6e-4,
}
# Drafter modules LoRA adapts by default: every attention and MLP projection of its decoder layers (not `fc`, the
# context projection, and never the refiner, which is trained in full).
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_int(name: str, value, minimum: int | None = None) -> None:
    """Raise a `ValueError` naming `name` unless `value` is an integer (not a float, not a bool) >= `minimum`."""
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class XPressTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the xPress objective (paper §4.3). Defaults are the authors' recipe (`PAPER_RECIPE`).

    The per-distribution loss is `L(p) = Σ_k w_k [ce_weight · CE_k + l1_weight · ‖p_k − p^t_k‖₁] / Σ_k w_k` over valid
    block positions, with `w_k = exp(−(k−1)/γ)`; the total is `L(p^r) + w_anchor · L(p^b) + consistency_weight ·
    mean_i L(p̂^r_i)` over `consistency_rounds` free-running rounds, where `w_anchor` falls linearly from
    `anchor_weight_start` to `anchor_weight_floor` over the run.
    """

    # Random block anchors drawn per sequence (fewer when the response is shorter). Each anchor is one block of
    # `block_size - 1` supervised positions, so a batch holds up to batch_size × anchors_per_sequence blocks.
    anchors_per_sequence: int = field(default=8, metadata={"help": "Random block anchors sampled per sequence."})
    # γ of the position weights w_k = exp(−(k−1)/γ). None → 4 · block_size / 16 (the authors' γ = 4 at B = 16, scaled
    # so the weights decay over the same fraction of any block; the paper's text says 7).
    loss_gamma: float | None = field(
        default=None, metadata={"help": "Position-weight decay γ; None → 4 · block_size / 16."}
    )
    # α_ce: weight of the teacher-forced cross-entropy against the data token.
    ce_weight: float = field(default=0.1, metadata={"help": "Weight α_ce of the cross-entropy term."})
    # α_l1: weight of ‖p − p^t‖₁ = 2 · (1 − acceptance rate) against the target's distribution.
    l1_weight: float = field(default=0.9, metadata={"help": "Weight α_l1 of the L1 (total-variation) term."})
    # β: weight of the consistency loss, the mean of L(p̂^r_i) over the rounds below.
    consistency_weight: float = field(default=0.3, metadata={"help": "Weight of the consistency term."})
    # Free-running Jacobi rounds of the consistency term: round 1 feeds the head the drafter's own argmax (Jacobi's
    # seed), round i the argmax of round i − 1 (what Jacobi's i-th iteration sees); their losses are averaged. 0: no
    # consistency term; 1: the paper's single p̂^r.
    consistency_rounds: int = field(default=3, metadata={"help": "Free-running Jacobi rounds of the consistency term."})
    # λ: weight of the drafter-anchor loss L(p^b) at the first step …
    anchor_weight_start: float = field(default=0.6, metadata={"help": "Drafter-anchor weight at the first step."})
    # … annealed linearly to this value at the last step.
    anchor_weight_floor: float = field(default=0.2, metadata={"help": "Drafter-anchor weight at the last step."})
    # The drafter's learning rate as a fraction of `learning_rate` (the head's), when both are trained (the authors'
    # --drafter-lr-scale; their released run used 1, one rate for both). Below 1 the warm-started drafter moves less
    # while a fresh head learns at the full rate.
    drafter_lr_scale: float = field(default=1.0, metadata={"help": "Drafter learning rate / head learning rate."})
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
        check_int("anchors_per_sequence", self.anchors_per_sequence, 1)
        check_int("consistency_rounds", self.consistency_rounds, 0)
        if not (self.drafter_lr_scale > 0 and math.isfinite(self.drafter_lr_scale)):
            raise ValueError(f"drafter_lr_scale must be a finite number > 0, got {self.drafter_lr_scale}")
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
        check_int("lora_r", self.lora_r, 1)
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.train_mode == "lora" and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: train_mode='lora' needs at least one drafter module")
        if self.max_seq_length is not None:
            check_int("max_seq_length", self.max_seq_length, 2)  # an anchor and its next token
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the `loss_mask` column the xPress collator needs; leave it False"
            )
        if self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing=True is not supported: the xPress drafter has no checkpointing")

    def resolved_gamma(self, block_size: int) -> float:
        """γ for a drafter with `block_size`: `loss_gamma`, or 4 · block_size / 16 when it is None."""
        return self.loss_gamma if self.loss_gamma is not None else 4.0 * block_size / 16

    @classmethod
    def paper_recipe(cls, output_dir: str, **overrides) -> "XPressTrainingArguments":
        """Arguments with the authors' recipe (`PAPER_RECIPE`) spelled out, any of it (and any other field)
        overridden by keyword."""
        return cls(output_dir=output_dir, **{**PAPER_RECIPE, **overrides})
