"""Training xPress, and the data it is trained on. None of this travels with a saved checkpoint; it imports the
runtime (`modeling_xpress.*` at the top level), never the other way round.

The trainer, in the order a reader meets it (the paper's objective, §4.3, against a frozen target):

- `arguments`: `XPressTrainingArguments`, the objective's knobs on top of `TrainingArguments`.
- `collator`: `XPressDataCollator`, padding and the random block anchors inside the responses.
- `loss`: the per-distribution loss (`distribution_loss`: CE + L1, gradient written out) and its weights.
- `objective`: block layout, the frozen target's signals and `XPressObjective`, which composes them into
  `L(p^r) + w_anchor · L(p^b) + w_cons · L(p̂^r)`.
- `trainer`: `XPressTrainer` (training modes, LoRA, logs, checkpoints that load as xPress folders), `with_fresh_head`.
- `snapshot`: `snapshot_checkpoint`, a checkpoint without its optimizer state, to commit and resume from.
- `vocabulary`: the frequency-ranked draft vocabulary and a model restricted to it.
- `signal_cache`: the target's features and teacher top-k, computed once for every training run.
- `target_init`: a drafter whose layers start as the target's own.

The data: `prompts` draws training prompts (built by `general_prompts`, `task_prompts`, `mined_prompts`);
`regeneration` has the target answer them, in resumable shards; `synthetic` builds targets with exactly known
next-token distributions (tests, demos).

The trainer's names below can be imported from this package (`from modeling_xpress.training import XPressTrainer`).
They are loaded on first use, so `import modeling_xpress.training` loads neither the Trainer nor peft nor datasets.
"""

import importlib

# name -> the module of this package that defines it
_EXPORTS = {
    "XPressTrainingArguments": "arguments",
    "PAPER_RECIPE": "arguments",
    "XPressDataCollator": "collator",
    "DistributionLoss": "loss",
    "DraftTargets": "loss",
    "anchor_weight": "loss",
    "cross_entropy_l1": "loss",
    "distribution_loss": "loss",
    "position_weights": "loss",
    "restrict_to_draft_vocabulary": "loss",
    "top_k_draft_targets": "loss",
    "TargetSignals": "objective",
    "XPressObjective": "objective",
    "XPressObjectiveOutput": "objective",
    "block_attention_mask": "objective",
    "block_position_ids": "objective",
    "draft_blocks": "objective",
    "target_signals": "objective",
    "XPressTrainer": "trainer",
    "prepare_for_training": "trainer",
    "with_fresh_head": "trainer",
    "snapshot_checkpoint": "snapshot",
    "frequency_ranked_vocabulary": "vocabulary",
    "with_draft_vocabulary": "vocabulary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
