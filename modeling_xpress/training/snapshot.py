"""Training snapshots: a checkpoint without its optimizer state, small enough to commit and resume from in another
session (`snapshot_checkpoint`; `XPressTrainer` resumes one with its learning-rate schedule and a fresh optimizer)."""

import json
import os
import shutil
from pathlib import Path

import torch
from transformers.trainer import OPTIMIZER_NAME, TRAINER_STATE_NAME


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
