"""The SmolLM2-135M-Instruct training sequence of issue 4, scripted and resumable.

Stages (each a run of examples/train_refiner.py, so every stage is also reproducible by hand):

1. ``drafter``  — a drafter trained with dFlash's own objective (``--refiner none``), from random weights or, with
   ``--drafter-init target``, from the target's last layers (``modeling_xpress.training.target_init``);
2. from those same weights, three continuations with an equal step budget:
   ``dflash`` (no head: the baseline), ``markov`` (DSpark's Markov head), ``xpress`` (the causal refiner).

A stage whose output folder already holds a final model is skipped; an interrupted stage resumes from its last
checkpoint. `<out>/training_summary.json` records each stage's command, configuration, steps, wall time and final
logged losses.

    python examples/smollm2_pipeline.py --out runs/v7 --recipe v7-task   # the bundled checkpoint's run
    python examples/smollm2_pipeline.py --out runs/v8 --recipe v8-mined  # drafter (2,000 steps), then the heads
    python examples/smollm2_pipeline.py --out runs/v8-wide --recipe v8-wide
    python examples/smollm2_pipeline.py --out runs/v6 --recipe v6-task
    python examples/smollm2_pipeline.py --out runs/v3 --recipe v3
    python examples/smollm2_pipeline.py --out runs/v2 --recipe v2   # the first bundled checkpoint's run

Recipes (each flag can still be set by hand after `--recipe`):

* `v2` — the first bundled checkpoint's run: 2,400 regenerated responses, a random drafter, 1000 + 150 steps, full
  vocabulary, live target (measured: 58 min for the drafter and 8-11 min per head on two cores, target in bf16;
  `--drafter-steps 400 --head-steps 150 --anchors 8 --threads 1` was the pilot). One difference from that run: its
  drafter had QK-norm, while a SmolLM2 drafter built now has none (`XPressConfig.from_target_config` follows the Llama
  target, `qk_norm=False`).
* `v4` — the v3 drafter trained 3,000 more steps (`--continue-from`, a fresh cosine schedule from 3e-4; the v3 run
  ended only because its schedule reached 0, still gaining), then the Markov and xPress heads on it, frozen, as in
  `v3-heads`.
* `v5-deep` — the v3 run with a drafter twice as deep: 4 layers from the target's last four, still reading the
  target's layers 1 and 27 (`--target-layer-ids`), so it trains from the v3 signal cache at the same budget (6,000
  steps, same schedule); then the Markov and xPress heads on it, frozen, as in `v3-heads`. v3's held-out estimate was
  still rising when its schedule ended, and a 2-layer drafter is shallow next to dFlash's 5 for a 36-layer target.
* `v6-task` — the v5 drafter (`drafter-best`) continued on task-shaped data: the 3,000 training rows of
  `data/smollm2_task_responses` (function stubs, role play, extraction, puzzles, essays; `make_training_data.py --kinds
  task`) mixed with the 2,400 rows of `data/smollm2_responses` so the general prompts stay in view, 2,500 steps of a
  fresh cosine schedule from 1.5e-4 (half v4's, warm-up 100: v4's 3e-4 restart lost held-out τ), selected on 100 of
  the task set's held-out prompts (3000..3199), evaluated before the first step too (`--eval-on-start`: the v5 drafter's
  own figure there); then the Markov and xPress heads on it, frozen, as in `v3-heads`. The evaluation prompts are far
  from the v3 data (held-out greedy τ 2.49, evaluation 1.67), and this is the cheapest way to move the drafter there.
* `v7-task` — the v6 drafter continued on the task-shaped sets, now with prompts 3200..4799 too
  (`data/smollm2_task_responses_3200-4800`, 300k response tokens v6 never saw), beside the 2,400 general rows; task
  folders first, so the 100 held-out rows are the same task prompts (3000..3099) that selected v6 and the step-0
  figure is v6's own. 2,000 steps of a fresh cosine schedule from 1.5e-4 (v6's estimate still rose at its last
  evaluation, its schedule at 0), then the Markov and xPress heads on it, frozen, 1,000 steps each at 1e-3 (v6's heads
  peaked at 1,250 of 1,500).
* `v8-mined` — the v7 drafter (`drafter-best`) continued as v7 continued v6, with the first prompts mined from the
  standard library (`data/smollm2_mined_responses`, `make_training_data.py --kinds mined`: documented functions as
  stubs to complete or code to explain, documentation passages to summarize or explain) beside v7's data; task folders
  first, so the 100 held-out rows are those that selected v6 and v7. The first of the README's next levers, since
  templates over small vocabularies are what the evaluation prompts are far from. Drafter run to its 2,000 steps
  (v8's snapshots: held-out decoded τ +5% on mined prompts, +2% on task rows, drafter alone).
  `--precision float32` on a CPU without native bf16. There, a signal cache of all 8,600 rows costs about as
  much target compute as the 2,000 drafter steps read (396 fp32 tokens/s on a 2-core AVX2 EPYC: ~100 minutes before
  the first step), so `--signal-cache '' --stages drafter` trains the drafter against the live target (~7 s per step
  there) and its snapshots carry the run to the next session, whatever its machine. The heads then ran on a CPU with
  native bf16, from a cache of just the rows they read: `--drafter-from checkpoints/training/smollm2-v8/drafter
  --stages markov xpress --head-train-rows 4000 --signal-cache cache/signals-smollm2-v8-heads4000` (10 min of cache,
  then ~4.5 min per head there).
* `v9-mined` — the v8 drafter continued as v8 continued v7, with the next 1,400 mined prompts (1600..2999, before
  the held-out 3000..3199; `make_training_data.py --kinds mined --n-prompts 3000 --first-prompt 1600 --out
  data/smollm2_mined_responses_1600-3000`) added; task folders first, so the held-out rows are still those that
  selected v6-v8. Its drafter ran in fp32 against the live target (`--precision float32 --signal-cache ''
  --stages drafter`, 4-8 s a step on CPUs without native bf16) over three sessions, resumed from its snapshots, to
  its 2,000 steps; the heads as v8's (`--drafter-from checkpoints/training/smollm2-v9/drafter --stages markov xpress
  --head-train-rows 4000 --signal-cache cache/signals-smollm2-v9-heads4000`, bf16 on a CPU with AMX: 10 min of cache,
  ~5 min per head). The bundled checkpoint (v9's xPress head: held-out decoded τ with the xPress
  head +5% on mined prompts, level on task rows at 3 drafts; the evaluation level with v8).
* `v8-wide` — the context lever alone: the v7 drafter (`drafter-best`) continued on v7's own data and schedule, now
  reading target layers 1, 10, 18 and 27 (dFlash's rule for a 4-layer drafter of a 30-layer target) instead of 1 and
  27; `read_more_target_layers` starts the new layers' `fc` columns at zero, so step 0 is v7's drafter exactly. Its
  signal cache holds four layers (about twice v7's 5.3 GB). Prepared, not run yet.
* `v3-heads` — the Markov and xPress heads trained alone (`--train_mode refiner`) on the committed v3 drafter, frozen,
  1,500 steps each at 1e-3: the v3 head stages restarted the co-trained drafter's learning rate at 6e-4 and ended
  below the drafter they started from, so the heads could not be compared with the drafter itself.
* `v3` — all regenerated sets (prompts 0..7599 minus the held-out 7000..7199), a drafter starting from the target's
  last two layers, a 4096-token draft vocabulary, the target's signals cached once (`--signal-cache`) and shared by
  every stage, evaluated every `--eval-steps` on 100 held-out rows and stopped when `eval_tau_estimate` has not improved
  for `--patience` evaluations (the best checkpoint is kept). Stages resume from their last checkpoint, so a run spread
  over several sessions continues where it stopped: at the end of a session,

      python examples/smollm2_pipeline.py --recipe v3 --out runs/v3 --write-snapshots

  writes each stage's newest checkpoint without its optimizer state to `checkpoints/training/smollm2-v3/<stage>`
  (committed; `training.snapshot_checkpoint`), and the next session's run resumes from there when `runs/v3` is empty
  (weights, step, logs, learning-rate schedule; Adam's moments restart). The signal cache is not committed (gigabytes):
  the first stage of a session on a fresh machine writes it again.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from modeling_xpress.bench.assets import DTYPES, smollm2_dir
from modeling_xpress.bench.plots import plot_training_curves
from modeling_xpress.training import snapshot_checkpoint

HEADS = ("dflash", "markov", "xpress")
REFINER_OF = {"dflash": "none", "markov": "markov", "xpress": "xpress"}


def last_checkpoint(folder: Path) -> Path | None:
    checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return checkpoints[-1] if checkpoints else None


def final_logs(folder: Path) -> dict:
    """What a stage's Trainer state says (finished, or its newest checkpoint): the step, the last logged training
    metrics, the best held-out evaluation, the training wall time over every session (`train_seconds`) and the whole
    log history (the curves)."""
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


def snapshot_stage(name: str, args: argparse.Namespace) -> Path | None:
    """Write the newest checkpoint of a stage to `<snapshots>/<name>` without optimizer state (small enough to
    commit; `training.snapshot_checkpoint`), and the best one the same way to `<snapshots>/<name>-best` when it is
    another checkpoint, so the next session resumes the run and still knows its best model."""
    latest = last_checkpoint(Path(args.out) / name)
    if latest is None:
        return None
    dtype_name = getattr(args, "snapshot_dtype", "float32")  # the checkpoints' own dtype unless asked otherwise
    weights_dtype = None if dtype_name == "float32" else DTYPES[dtype_name]
    destination = snapshot_checkpoint(latest, Path(args.snapshots) / name, weights_dtype=weights_dtype)
    state_file = destination / "trainer_state.json"
    state = json.loads(state_file.read_text())
    best = state.get("best_model_checkpoint")
    if best is not None:
        if Path(best).resolve() == latest.resolve():
            state["best_model_checkpoint"] = str(destination)
        elif Path(best).resolve() != (Path(args.snapshots) / f"{name}-best").resolve():
            best_destination = Path(args.snapshots) / f"{name}-best"
            snapshot_checkpoint(best, best_destination, weights_dtype=weights_dtype)
            state["best_model_checkpoint"] = str(best_destination)
        state_file.write_text(json.dumps(state, indent=2))
    return destination


RECIPES = {
    "v2": {"data": "data/smollm2_responses/responses.parquet", "drafter_init": "scratch", "draft_vocab_size": None,
           "signal_cache": None, "eval_held_out": 0, "snapshots": None},
    "v3": {"data": "data/smollm2_responses,data/smollm2_responses_2400-7200,data/smollm2_responses_7200-7600",
           "drafter_init": "target", "draft_vocab_size": 4096, "signal_cache": "cache/signals-smollm2-v3",
           "eval_held_out": 100, "drafter_steps": 6000, "head_steps": 600, "threads": 1, "save_steps": 250,
           "snapshots": "checkpoints/training/smollm2-v3"},
    "v3-heads": {"data": "data/smollm2_responses,data/smollm2_responses_2400-7200,data/smollm2_responses_7200-7600",
                 "signal_cache": "cache/signals-smollm2-v3", "eval_held_out": 100, "head_steps": 1500,
                 "save_steps": 250, "stages": ["markov", "xpress"], "head_train_mode": "refiner",
                 "head_learning_rate": 1e-3, "drafter_from": "checkpoints/training/smollm2-v3/drafter",
                 "snapshots": "checkpoints/training/smollm2-v3-heads"},
    "v4": {"data": "data/smollm2_responses,data/smollm2_responses_2400-7200,data/smollm2_responses_7200-7600",
           "continue_from": "checkpoints/training/smollm2-v3/drafter", "signal_cache": "cache/signals-smollm2-v3",
           "eval_held_out": 100, "drafter_steps": 3000, "learning_rate": 3e-4, "head_steps": 1500,
           "save_steps": 250, "stages": ["drafter", "markov", "xpress"], "head_train_mode": "refiner",
           "head_learning_rate": 1e-3, "snapshots": "checkpoints/training/smollm2-v4"},
    "v5-deep": {"data": "data/smollm2_responses,data/smollm2_responses_2400-7200,data/smollm2_responses_7200-7600",
                "drafter_init": "target", "draft_vocab_size": 4096, "signal_cache": "cache/signals-smollm2-v3",
                "num_draft_layers": 4, "target_layer_ids": "1,27", "eval_held_out": 100, "drafter_steps": 6000,
                "head_steps": 1500, "save_steps": 250, "stages": ["drafter", "markov", "xpress"],
                "head_train_mode": "refiner", "head_learning_rate": 1e-3, "snapshot_dtype": "bfloat16",
                "snapshots": "checkpoints/training/smollm2-v5"},
    "v6-task": {"data": "data/smollm2_responses,data/smollm2_task_responses",
                "continue_from": "checkpoints/training/smollm2-v5/drafter-best", "signal_cache": "cache/signals-smollm2-v6",
                "eval_held_out": 100, "eval_on_start": True, "drafter_steps": 2500, "learning_rate": 1.5e-4,
                "warmup_steps": 100, "head_steps": 1500, "save_steps": 250, "stages": ["drafter", "markov", "xpress"],
                "head_train_mode": "refiner", "head_learning_rate": 1e-3, "snapshot_dtype": "bfloat16",
                "snapshots": "checkpoints/training/smollm2-v6"},
}  # fmt: skip
RECIPES["v7-task"] = {  # v6-task's schedule and selection; more data, another start, fewer steps
    **RECIPES["v6-task"],
    "data": "data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_responses",
    "continue_from": "checkpoints/training/smollm2-v6/drafter", "signal_cache": "cache/signals-smollm2-v7",
    "drafter_steps": 2000, "head_steps": 1000, "snapshots": "checkpoints/training/smollm2-v7",
}  # fmt: skip
RECIPES["v8-wide"] = {  # v7-task's data, schedule and selection; the v7 drafter reading dFlash's four layers
    **RECIPES["v7-task"],
    "continue_from": "checkpoints/training/smollm2-v7/drafter-best", "target_layer_ids": "1,10,18,27",
    "signal_cache": "cache/signals-smollm2-v8-wide", "snapshots": "checkpoints/training/smollm2-v8-wide",
}  # fmt: skip
RECIPES["v8-mined"] = {  # v7-task's schedule and selection; the prompts mined from the standard library added
    **RECIPES["v7-task"],
    "data": "data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_mined_responses,"
            "data/smollm2_responses",
    "continue_from": "checkpoints/training/smollm2-v7/drafter-best", "signal_cache": "cache/signals-smollm2-v8",
    "snapshots": "checkpoints/training/smollm2-v8",
}  # fmt: skip
RECIPES["v9-mined"] = {  # v8-mined's schedule and selection; mined prompts 1600..2999 added (prepared, not run)
    **RECIPES["v8-mined"],
    "data": "data/smollm2_task_responses,data/smollm2_task_responses_3200-4800,data/smollm2_mined_responses,"
            "data/smollm2_mined_responses_1600-3000,data/smollm2_responses",
    "continue_from": "checkpoints/training/smollm2-v8/drafter", "signal_cache": "cache/signals-smollm2-v9",
    "snapshots": "checkpoints/training/smollm2-v9",
}  # fmt: skip


def run_stage(name: str, args: argparse.Namespace, extra: list[str], summary: dict) -> None:
    out = Path(args.out) / name
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        print(f"[{name}] already finished: {out}")
        summary.setdefault(name, {}).update(final_logs(out))
        return
    command = [
        sys.executable, "examples/train_refiner.py", "--target", str(smollm2_dir()), "--target_dtype", args.precision,
        "--data", args.data, "--output_dir", str(out), "--threads", str(args.threads),
        *(["--bf16"] if args.precision == "bfloat16" else []),
        "--per_device_train_batch_size", str(args.batch_size), "--anchors_per_sequence", str(args.anchors),
        "--max_seq_length", str(args.max_seq_length),
        "--learning_rate", str(args.learning_rate if name == "drafter" else args.head_learning_rate),
        "--lr_scheduler_type", "cosine", "--logging_steps", "5", "--save_steps", str(args.save_steps),
        "--save_total_limit", "2", "--report_to", "none", "--seed", str(args.seed), *extra,
    ]  # fmt: skip
    if args.signal_cache:
        command += ["--signal_cache", args.signal_cache]
    resume = last_checkpoint(out)
    snapshot = Path(args.snapshots) / name if args.snapshots else None
    if resume is None and snapshot is not None and (snapshot / "trainer_state.json").is_file():
        resume = snapshot  # a run started in an earlier session (`--write-snapshots` there)
    if args.eval_held_out:
        if args.eval_on_start and name == "drafter" and resume is None:
            command += ["--eval_on_start", "true"]  # the step-0 figure, once: a resumed run has it in its log
        command += [
            "--eval_held_out", str(args.eval_held_out), "--eval_strategy", "steps", "--eval_steps", str(args.save_steps),
            "--load_best_model_at_end", "true", "--metric_for_best_model", "eval_tau_estimate",
            "--greater_is_better", "true", "--early_stopping_patience", str(args.patience),
            "--per_device_eval_batch_size", str(args.batch_size),
        ]  # fmt: skip
    if resume is not None:
        command += ["--resume_from_checkpoint", str(resume)]
    print(f"[{name}] {' '.join(command)}", flush=True)
    start = time.time()
    subprocess.run(command, check=True)
    summary[name] = {"command": command, "wall_seconds_this_run": time.time() - start, **final_logs(out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="v2", help="defaults of a documented run")
    parser.add_argument("--data", help="a parquet file, or comma-separated make_training_data.py folders")
    parser.add_argument("--out", default="runs/smollm2")
    parser.add_argument("--drafter-steps", type=int, default=1000, help="at most; early stopping may end it sooner")
    parser.add_argument("--head-steps", type=int, default=150, help="equal budget for each continuation")
    parser.add_argument("--num-draft-layers", type=int, default=2)
    parser.add_argument("--target-layer-ids", help="drafter stage: the target layers it reads, e.g. 1,27 (default: "
                        "dFlash's rule for --num-draft-layers; a signal cache holds one such list); with "
                        "--continue-from, the layers the drafter reads plus more (read_more_target_layers)")
    parser.add_argument("--drafter-init", choices=["scratch", "target"],
                        help="drafter stage: random weights, or the target's last --num-draft-layers layers")
    parser.add_argument("--draft-vocab-size", type=int, help="drafter stage: frequency-ranked draft vocabulary")
    parser.add_argument("--signal-cache", help="folder of the target's cached signals, shared by every stage ('': "
                        "train against the live target)")
    parser.add_argument("--eval-held-out", type=int, help="held-out rows evaluated every --save-steps (0: none)")
    parser.add_argument("--eval-on-start", action="store_true",
                        help="drafter stage: evaluate before the first step (the figure of the drafter it continues)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="drafter stage: learning-rate warm-up")
    parser.add_argument("--patience", type=int, default=4, help="evaluations without a better eval_tau_estimate")
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--snapshots", help="folder of committed snapshots: a stage with no local checkpoint resumes "
                        "from <snapshots>/<stage>")
    parser.add_argument("--snapshot-dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the snapshots' weights (bfloat16 keeps a 4-layer drafter under 50 MB)")
    parser.add_argument("--write-snapshots", action="store_true",
                        help="write each stage's newest checkpoint to --snapshots (no optimizer state) and exit")
    parser.add_argument("--continue-from", help="drafter stage: continue training this drafter (a new learning-rate "
                        "schedule) instead of building a fresh one")
    parser.add_argument("--drafter-from", help="head stages: start from this drafter instead of <out>/drafter")
    parser.add_argument("--head-train-mode", choices=["full", "refiner"], default="full",
                        help="head stages: co-train the drafter with the head (full) or train the head alone on the "
                        "frozen drafter (refiner; then the no-head baseline is the drafter itself, no dflash stage)")
    parser.add_argument("--head-learning-rate", type=float, help="head stages (default: --learning-rate)")
    parser.add_argument("--head-train-rows", type=int,
                        help="head stages: train on this many training rows, a seeded random choice (--seed) shared "
                        "by every head stage (train_refiner.py --max_train_samples N --train_rows_seed), so one "
                        "--signal-cache of just those rows serves them all; default: every row")
    parser.add_argument("--refiner-rank", type=int, default=64, help="rank of the Markov and xPress heads")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--anchors", type=int, default=32, help="blocks drawn per sequence")
    parser.add_argument("--max-seq-length", type=int, default=640)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--precision", choices=["bfloat16", "float32"], default="bfloat16",
                        help="the target's dtype and the training's autocast (bfloat16: --bf16); float32 on a CPU "
                        "without native bf16 products (no AVX-512 BF16 / AMX), where compute-bound work runs slower in "
                        "bf16 (a 2-core AVX2 EPYC: batched generation ~25 vs ~45 new tokens/s)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stages", nargs="+", default=["drafter", *HEADS], choices=["drafter", *HEADS])
    parser.set_defaults(**{key: value for key, value in RECIPES[parser.parse_known_args()[0].recipe].items()})
    args = parser.parse_args()
    if args.head_learning_rate is None:
        args.head_learning_rate = args.learning_rate
    if args.head_train_mode == "refiner" and "dflash" in args.stages:
        parser.error("--head-train-mode refiner freezes the drafter, so the dflash stage would train nothing: its "
                     "baseline is the drafter itself; leave dflash out of --stages")

    summary_path = Path(args.out) / "training_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["settings"] = vars(args)
    drafter = Path(args.drafter_from) if args.drafter_from else Path(args.out) / "drafter"
    if args.write_snapshots:
        if not args.snapshots:
            parser.error("--write-snapshots needs --snapshots")
        for stage in args.stages:
            written = snapshot_stage(stage, args)
            summary.setdefault(stage, {}).update(final_logs(Path(args.out) / stage))
            print(f"[{stage}] snapshot: {written or 'no checkpoint yet'}")
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
        (Path(args.snapshots) / "training_summary.json").write_text(json.dumps(summary, indent=2, default=str))
        curves = {stage: summary[stage].get("curves", []) for stage in args.stages if stage in summary}
        plot_training_curves(curves, Path(args.snapshots) / "training_curves.png")
        return
    for stage in args.stages:
        if stage == "drafter":
            extra = ["--refiner", "none", "--max_steps", str(args.drafter_steps),
                     "--warmup_steps", str(args.warmup_steps)]  # fmt: skip
            if args.continue_from:  # its architecture and draft vocabulary come with it
                extra += ["--init_from", args.continue_from]
            else:
                extra += ["--block_size", "16", "--num_draft_layers", str(args.num_draft_layers)]
                if args.drafter_init == "target":
                    extra += ["--init_from_target_layers", "last"]
                if args.draft_vocab_size:
                    extra += ["--draft_vocab_size", str(args.draft_vocab_size)]
            if args.target_layer_ids:  # a fresh drafter's context, or more layers for a continued one
                extra += ["--target_layer_ids", args.target_layer_ids]
        else:
            extra = ["--init_from", str(drafter), "--refiner", REFINER_OF[stage], "--refiner_rank",
                     str(args.refiner_rank), "--max_steps", str(args.head_steps), "--warmup_steps", "10",
                     "--train_mode", args.head_train_mode]  # fmt: skip
            if args.head_train_rows:
                extra += ["--max_train_samples", str(args.head_train_rows), "--train_rows_seed", str(args.seed)]
        run_stage(stage, args, extra, summary)
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {summary_path}")


if __name__ == "__main__":
    main()
