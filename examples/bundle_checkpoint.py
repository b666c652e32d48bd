"""Bundle a trained xPress folder as the repository's Hub-style checkpoint, with a model card made from evaluation.

    python examples/bundle_checkpoint.py --checkpoint runs/v2/xpress \\
        --results benchmarks/results/<run>.json --training-summary runs/v2/training_summary.json \\
        --out checkpoints/xpress-smollm2-135m-instruct

The weights are saved in `--dtype` (bfloat16 keeps the folder small; `from_pretrained(..., dtype=torch.float32)`
upcasts them exactly). The card is rendered with huggingface_hub's card tools from
`modeling_xpress/hub_cards/xpress_model_card.md`; its table is `reports.card_rows(summarize(results))`, recomputed
from the raw records of the evaluation JSON, and its training section from the pipeline's `training_summary.json`.
"""

import argparse
import json
from pathlib import Path

import torch

from modeling_xpress import XPressModel
from modeling_xpress.assets import DTYPES
from modeling_xpress.cards import render_model_card
from modeling_xpress.reports import card_rows, summarize

TARGET_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIZE_LIMIT_MB = 50


def evaluation_summary(results: dict) -> str:
    s, env = results["settings"], results["environment"]
    prompts = ", ".join(f"{name} {len(d['prompt_ids'])}" for name, d in results["datasets"].items())
    return (
        f"Measured on CPU ({env.get('cpu') or env.get('platform')}, {env.get('torch_threads')} torch threads, "
        f"target in {env.get('target_dtype')}) with `examples/benchmark.py`: prompts {prompts} (first N of each "
        f"set), at most {s['max_new_tokens']} new tokens, temperatures {s['temperatures']}. τ is tokens committed "
        "per target forward (bonus included); the speed ratios are new tokens per second against plain "
        "`target.generate` on the same prompts in the same run. `dflash` rows are the drafter alone (no head), "
        "`markov` the Markov head, `xpress` this checkpoint; all three continue one drafter with equal budgets. "
        "Small-sample CPU figures: read them as what this 135M pair does on this machine, not as the paper's."
    )


def training_text(summary: dict) -> str:
    lines = ["Trained on CPU with `examples/smollm2_pipeline.py` (2,400 generated prompts, none from the evaluation "
             "sets; responses written by the target itself, greedy).", ""]  # fmt: skip
    lines += ["Losses are each stage's own objective (a head stage adds its refined and consistency terms, so they are "
              "not comparable across stages); the τ estimate is the training batches' T=1 estimate.", ""]
    lines += ["| stage | steps | wall time (min) | final logged loss | τ estimate |", "|---|---|---|---|---|"]
    for stage in ("drafter", "dflash", "markov", "xpress"):
        info = summary.get(stage)
        if not info:
            continue
        log = info.get("last_log") or {}
        wall = info.get("wall_seconds_this_run")
        minutes = "–" if wall is None else f"{wall / 60:.1f}"
        lines.append(f"| {stage} | {info.get('global_step', '–')} | {minutes} | {log.get('loss', float('nan')):.3f} "
                     f"| {log.get('tau_estimate', float('nan')):.3f} |")  # fmt: skip
    settings = summary.get("settings", {})
    if settings:
        keep = ("drafter_steps", "head_steps", "num_draft_layers", "refiner_rank", "batch_size", "anchors",
                "max_seq_length", "learning_rate", "threads", "seed")  # fmt: skip
        lines += ["", "Settings: " + ", ".join(f"`{k}={settings[k]}`" for k in keep if k in settings) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="trained xPress folder (refiner='xpress')")
    parser.add_argument("--results", required=True, help="evaluation JSON written by examples/benchmark.py")
    parser.add_argument("--training-summary", required=True, help="training_summary.json of the pipeline")
    parser.add_argument("--out", default="checkpoints/xpress-smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repo-id", default="xpress/xpress-smollm2-135m-instruct", help="name shown in the card")
    args = parser.parse_args()

    model = XPressModel.from_pretrained(args.checkpoint, dtype=DTYPES[args.dtype])
    results = json.loads(Path(args.results).read_text())
    summary = json.loads(Path(args.training_summary).read_text())
    out = Path(args.out)
    model.save_pretrained(out)  # its custom_generate recipe finds the folder it runs from: nothing to rewrite
    order = {name: i for i, name in enumerate([*results["datasets"], "all"])}
    rows = sorted(card_rows(summarize(results)), key=lambda r: (r["temperature"], order[r["dataset"]]))  # stable
    card = render_model_card(
        model.config,
        results=rows,
        repo_id=args.repo_id,
        target_model=TARGET_REPO,
        training_summary=training_text(summary),
        evaluation_summary=evaluation_summary(results),
    )
    card.save(out / "README.md")
    size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    print(f"wrote {out} ({size_mb:.1f} MB)")
    if size_mb > SIZE_LIMIT_MB:
        raise SystemExit(f"{out} is {size_mb:.1f} MB, over the {SIZE_LIMIT_MB} MB the repository allows for it")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
