"""What the pipeline's stages are given, as functions of the recipe: the plan (which stages, in order), the response
sets and signal caches the training reads, each training stage's `examples/train_refiner.py` flags, where an
unfinished stage resumes (its newest checkpoint, or a snapshot of an earlier session), and the training records
(`final_logs`, `snapshot_stage`). The stages that run them are `stages.Pipeline`'s.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

from transformers import HfArgumentParser

from ..bench.assets import DTYPES
from ..training.arguments import XPressTrainingArguments
from ..training.prompts import GENERATORS
from ..training.regeneration import held_out_indices
from ..training.run import RunArguments
from ..training.snapshot import snapshot_checkpoint
from .recipe import HEAD_REFINER, PromptSet, Recipe


def stage_plan(recipe: Recipe) -> list[str]:
    """The stages a recipe runs, in order."""
    plan = ["target", "prompts", "responses"]
    if "drafter" in recipe.stages:
        if recipe.continue_from is None and recipe.draft_vocab_size is not None:
            plan.append("vocabulary")
        plan.append("drafter-init")
    if recipe.signal_cache is not False:
        plan.append("signal-cache")
    return plan + list(recipe.stages) + ["measure", "save"]


def response_sets(recipe: Recipe, out: Path) -> list[tuple[PromptSet | None, Path]]:
    """(prompt set, folder) of every response set the training reads: the recipe's `data` (given), or one folder per
    prompt set, plus, with `eval_held_out`, the first held-out prompts of each generator that no set covers yet."""
    if recipe.data:
        return [(None, Path(folder)) for folder in recipe.data]
    sets = list(recipe.prompt_sets)
    if recipe.eval_held_out:
        for kinds in dict.fromkeys(s.kinds for s in recipe.prompt_sets):
            held = held_out_indices(GENERATORS[kinds])
            wanted = range(held.start, held.start + min(recipe.eval_held_out, len(held)))
            covered = any(s.kinds == kinds and s.first <= wanted.start and wanted.stop <= s.n for s in sets)
            if not covered:
                sets.append(PromptSet(kinds, wanted.stop, wanted.start))
    return [(s, out / "responses" / s.name()) for s in sets]


def cache_folder(recipe: Recipe, out: Path, stage: str) -> str | None:
    """The signal cache a training stage reads (None: the live target). Head stages on a subset of the rows
    (`head_train_rows`) read their own cache of just those rows, beside the shared one."""
    if recipe.signal_cache is False:
        return None
    folder = str(out / "signals") if recipe.signal_cache is True else recipe.signal_cache
    if stage != "drafter" and recipe.head_train_rows:
        folder = f"{folder}-heads{recipe.head_train_rows}"
    return folder


def last_checkpoint(folder: Path) -> Path | None:
    checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return checkpoints[-1] if checkpoints else None


def stage_start(recipe: Recipe, out: Path, stage: str) -> Path:
    """The drafter a training stage starts from."""
    if stage == "drafter":
        return out / "drafter-init"
    return Path(recipe.drafter_from) if recipe.drafter_from else out / "drafter"


def resume_point(recipe: Recipe, out: Path, stage: str) -> Path | None:
    """The checkpoint an unfinished training stage resumes from: its newest local one, else a snapshot."""
    resume = last_checkpoint(out / stage)
    snapshot = Path(recipe.snapshots) / stage if recipe.snapshots else None
    if resume is None and snapshot is not None and (snapshot / "trainer_state.json").is_file():
        resume = snapshot  # a run started in an earlier session (`--write-snapshots` there)
    return resume


def training_flags(recipe: Recipe, out: Path, stage: str, target_path: str, data: list[str],
                   resume: Path | None = None) -> dict:  # fmt: skip
    """The `examples/train_refiner.py` flags of a training stage (`RunArguments` and `XPressTrainingArguments`
    fields), from the recipe; `recipe.drafter_args` / `head_args` are passed through as they are, last."""
    drafter = stage == "drafter"
    flags = {
        "target": target_path, "target_dtype": recipe.precision, "data": ",".join(data), "output_dir": str(out / stage),
        "init_from": str(stage_start(recipe, out, stage)), "seed": recipe.seed,
        "per_device_train_batch_size": recipe.batch_size, "anchors_per_sequence": recipe.anchors,
        "max_seq_length": recipe.max_seq_length, "lr_scheduler_type": "cosine", "logging_steps": 5,
        "save_steps": recipe.save_steps, "save_total_limit": 2, "report_to": "none",
    }  # fmt: skip
    if recipe.precision == "bfloat16":
        flags["bf16"] = True
    if recipe.threads is not None:
        flags["threads"] = recipe.threads
    cache = cache_folder(recipe, out, stage)
    if cache is not None:
        flags |= {"signal_cache": cache, "signal_cache_top_k": recipe.signal_cache_top_k}
    if drafter:
        flags |= {"refiner": "none", "max_steps": recipe.drafter_steps, "warmup_steps": recipe.warmup_steps,
                  "learning_rate": recipe.learning_rate}  # fmt: skip
    else:
        flags |= {"refiner": HEAD_REFINER[stage], "refiner_rank": recipe.refiner_rank, "max_steps": recipe.head_steps,
                  "warmup_steps": 10, "train_mode": recipe.head_train_mode,
                  "learning_rate": recipe.head_learning_rate or recipe.learning_rate}  # fmt: skip
        if recipe.head_train_rows:
            flags |= {"max_train_samples": recipe.head_train_rows, "train_rows_seed": recipe.seed}
    if recipe.eval_held_out:
        if drafter and recipe.eval_on_start and resume is None:
            flags["eval_on_start"] = True  # the step-0 figure, once: a resumed run has it in its log
        flags |= {"eval_held_out": recipe.eval_held_out, "eval_strategy": "steps", "eval_steps": recipe.save_steps,
                  "load_best_model_at_end": True, "metric_for_best_model": "eval_tau_estimate",
                  "greater_is_better": True, "early_stopping_patience": recipe.patience,
                  "per_device_eval_batch_size": recipe.batch_size}  # fmt: skip
    if resume is not None:
        flags["resume_from_checkpoint"] = str(resume)
    return flags | (recipe.drafter_args if drafter else recipe.head_args)


def training_arguments(flags: dict) -> tuple[RunArguments, XPressTrainingArguments]:
    """`training_flags` as the two argument dataclasses of a run; a flag neither knows is a ValueError naming it."""
    return HfArgumentParser((RunArguments, XPressTrainingArguments)).parse_dict(flags)


def train_refiner_command(flags: dict) -> str:
    """The `examples/train_refiner.py` command a training stage's flags are."""
    words = ["python", "examples/train_refiner.py"]
    for key, value in flags.items():
        words += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return shlex.join(words)


def file_sha256(path: Path) -> str | None:
    """The SHA-256 of a file, or None when it does not exist."""
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def final_logs(folder: Path) -> dict:
    """What a training stage's Trainer state says (finished, or its newest checkpoint): the step, the last logged
    training metrics, the best held-out evaluation, the training wall time over every session (`train_seconds`) and
    the whole log history (the curves)."""
    state_file = folder / "trainer_state.json"
    checkpoint = last_checkpoint(folder)
    if not state_file.is_file() and checkpoint is not None:
        state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        return {}
    state = json.loads(state_file.read_text())
    history = state.get("log_history", [])
    logs = [entry for entry in history if "loss" in entry]
    return {
        "global_step": state.get("global_step"), "last_log": logs[-1] if logs else None,
        "best_metric": state.get("best_metric"), "best_model_checkpoint": state.get("best_model_checkpoint"),
        "train_seconds": max((e["train_seconds"] for e in history if "train_seconds" in e), default=None),
        "curves": history,
    }  # fmt: skip


def snapshot_stage(name: str, out: Path, snapshots: Path, dtype_name: str = "float32") -> Path | None:
    """Write the newest checkpoint of a training stage to `<snapshots>/<name>` without optimizer state (small enough to
    commit; `training.snapshot_checkpoint`), and the best one the same way to `<snapshots>/<name>-best` when it is
    another checkpoint, so the next session resumes the run and still knows its best model."""
    latest = last_checkpoint(out / name)
    if latest is None:
        return None
    weights_dtype = None if dtype_name == "float32" else DTYPES[dtype_name]  # the checkpoints' own dtype by default
    destination = snapshot_checkpoint(latest, snapshots / name, weights_dtype=weights_dtype)
    state_file = destination / "trainer_state.json"
    state = json.loads(state_file.read_text())
    best = state.get("best_model_checkpoint")
    if best is not None:
        if Path(best).resolve() == latest.resolve():
            state["best_model_checkpoint"] = str(destination)
        elif Path(best).resolve() != (snapshots / f"{name}-best").resolve():
            best_destination = snapshots / f"{name}-best"
            snapshot_checkpoint(best, best_destination, weights_dtype=weights_dtype)
            state["best_model_checkpoint"] = str(best_destination)
        state_file.write_text(json.dumps(state, indent=2))
    return destination
