"""Bundle a trained xPress folder as the repository's Hub-style checkpoint, with a model card made from evaluation.

    python examples/bundle_checkpoint.py --checkpoint runs/v3-heads/xpress \\
        --results benchmarks/results/smollm2-v3-eval-T0.json benchmarks/results/smollm2-v3-eval-T1.json \\
        --training-summary runs/v3/training_summary.json:drafter \\
                           runs/v3-heads/training_summary.json:markov,xpress \\
        --out checkpoints/xpress-smollm2-135m-instruct

    python examples/bundle_checkpoint.py --target gemma --checkpoint runs/gemma3-270m/model \\
        --results benchmarks/results/gemma-humaneval20-float32.json \\
        --training-summary runs/gemma3-270m/training_summary.json

`--target` names the bundled pair (`make demo TARGET=...`): the target's Hub repository, the default `--out` folder
and the size the repository allows for it. A checkpoint made by the pipeline's `measure` stage already carries its
held-out `draft_acceptance`, which is kept unless `--acceptance` replaces it.

`--acceptance` takes held-out decoding runs of the same checkpoint (`examples/choose_draft_length.py`, whole blocks:
its `t=None` setting) and stores the fraction of blocks whose first k drafts were accepted as `config.draft_acceptance`,
which `spec_generate(..., num_assistant_tokens="auto")` and `make demo` weigh against this machine's verification cost.

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
from modeling_xpress.bench.assets import DTYPES
from modeling_xpress.bench.demo import BUNDLED, bundled_pair
from modeling_xpress.cards import render_model_card
from modeling_xpress.draft_cap import acceptance_from_blocks
from modeling_xpress.bench.reports import card_rows, summarize
from modeling_xpress.pipeline.records import training_table


def merge_results(runs: list[dict]) -> dict:
    """Evaluation runs of the same prompts (e.g. one per temperature, each with its own baselines) as one results
    dict: records joined, temperatures listed in run order; everything else from the first run."""
    first = runs[0]
    for run in runs[1:]:
        same_tokens = run["settings"]["max_new_tokens"] == first["settings"]["max_new_tokens"]
        if run["datasets"] != first["datasets"] or not same_tokens:
            raise SystemExit("the --results runs must share prompts and max_new_tokens; they differ")
        if set(run["settings"]["temperatures"]) & set(first["settings"]["temperatures"]):
            raise SystemExit("two --results runs measured the same temperature; pass each temperature once")
    merged = dict(first)
    merged["records"] = [r for run in runs for r in run["records"]]
    merged["settings"] = {
        **first["settings"],
        "temperatures": [t for run in runs for t in run["settings"]["temperatures"]],
        "entries": list(dict.fromkeys(e for run in runs for e in run["settings"].get("entries", []))),
    }
    merged["runs"] = [run.get("run_name") for run in runs]
    return merged


def evaluation_summary(results: dict) -> str:
    s, env = results["settings"], results["environment"]
    methods = {r["method"] for r in results["records"]}
    prompts = ", ".join(f"{name} {len(d['prompt_ids'])}" for name, d in results["datasets"].items())
    entries = ", ".join(f"`{e}`" for e in s.get("entries", ["generate", "spec_generate"]))
    compiled = "" if not s.get("compiled_plain") else (
        " and (`_vs_compiled`) against plain `generate` with a static cache and `torch.compile`, the fastest plain "
        "decoding on this machine"
    )  # fmt: skip
    return (
        f"Measured on CPU ({env.get('cpu') or env.get('platform')}, {env.get('torch_threads')} torch threads, "
        f"target in {env.get('target_dtype')}) with `examples/benchmark.py`: prompts {prompts} (first N of each "
        f"set), at most {s['max_new_tokens']} new tokens, temperatures {s['temperatures']}, entries {entries} "
        "(`spec_generate_compiled` is `spec_generate(compile=True)`). τ is tokens committed per target forward "
        "(bonus included); the speed ratios are new tokens per second against eager plain `target.generate`"
        f"{compiled}, on the same prompts in the same run. "
        + ("`dflash` rows are the drafter alone (no head), `markov` the Markov head, `xpress` this checkpoint: the two "
           "heads were trained on that same drafter, frozen, with equal budgets. " if "markov" in methods else
           "`dflash` rows are this checkpoint with its head switched off (`jacobi_max_iters=0`), `xpress` with it on. "
           if "dflash" in methods else "")
        + "Small-sample CPU figures: read them as what this pair does on this machine, not as the paper's." + (
            " Every entry verified at most the drafts per block its own loop (eager or compiled) chose on this "
            "machine from the checkpoint's held-out `draft_acceptance` (`num_assistant_tokens=\"auto\"`, the default)."
            if s.get("num_assistant_tokens") == "auto" else
            f" Every method verified at most {s['num_assistant_tokens']} drafts per block (`num_assistant_tokens`, "
            "chosen on held-out training prompts, never on these sets)." if s.get("num_assistant_tokens") else ""
        )
    )  # fmt: skip


def training_text(stages: dict, target: str, description: str | None, token_vocab: str = "full") -> str:
    """`stages`: stage name → that stage's entry of a pipeline `training_summary.json` (command, steps, logs);
    `description`: the recipe's, from that summary's settings; `token_vocab`: the saved head's `refiner_token_vocab`."""
    compacted = (" The trained head's token table was then compacted to the draft vocabulary "
                 "(`XPressModel.compact_token_table`: one shared row for every other token)." if token_vocab == "draft"
                 else "")  # fmt: skip
    if target != "smollm2":
        return (f"Trained on CPU with the xPress pipeline (`python -m modeling_xpress.pipeline --target "
                f"{bundled_pair(target).target} --recipe {bundled_pair(target).target}`) on responses written by the "
                f"target itself to generated prompts (`modeling_xpress.training.prompts`), none from the evaluation "
                f"sets; 100 held-out rows are scored every 250 steps (the τ estimate: T=1, teacher forced, blocks "
                f"anchored uniformly in the responses). {description or ''}{compacted}\n\n" + training_table(stages))
    return ("Trained on CPU with the xPress pipeline (`python -m modeling_xpress.pipeline`, the SmolLM2 recipes "
            "`recipes/smollm2-*.json`; the runs were made by its predecessor, `examples/smollm2_pipeline.py`) on "
            "responses written by the target itself (greedy) to generated prompts (`modeling_xpress.training.prompts`), "
            "none from the evaluation sets; held-out prompts (general set 7000..7199, task-shaped set 3000..3199) are "
            "never trained on, and 100 held-out rows are scored every 250 steps (the τ estimate: T=1, teacher forced, "
            "blocks anchored uniformly in the responses).\n\n" + training_table(stages))  # fmt: skip


def held_out_acceptance(paths: list[str], checkpoint: str, block_size: int) -> list[float]:
    """`draft_acceptance` from the whole-block blocks (setting `t=None`) of choose_draft_length runs of `checkpoint`."""
    lengths, drafts = [], []
    for path in paths:
        run = json.loads(Path(path).read_text())
        if Path(run["arguments"]["checkpoint"]).resolve() != Path(checkpoint).resolve():
            raise SystemExit(f"{path} decoded {run['arguments']['checkpoint']}, not --checkpoint {checkpoint}")
        rows = [r for r in run["records"] if r["entry"] == "t=None"]
        if not rows:
            raise SystemExit(f"{path} has no whole-block setting (t=None): run choose_draft_length with --thresholds none")
        for row in rows:
            lengths += row["acceptance_lengths"]
            drafts += row["draft_lengths"]
    return acceptance_from_blocks(lengths, drafts, block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="trained xPress folder (refiner='xpress')")
    parser.add_argument("--results", required=True, nargs="+",
                        help="evaluation JSON(s) written by examples/benchmark.py (several: one per temperature)")
    parser.add_argument("--training-summary", required=True, nargs="+", metavar="JSON[:STAGE,...]",
                        help="training_summary.json of the pipeline, optionally restricted to some stages, e.g. "
                        "runs/v3/training_summary.json:drafter runs/v3-heads/training_summary.json:markov,xpress")
    parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2", help="the bundled pair (default: %(default)s)")
    parser.add_argument("--out", help="default: the pair's folder under checkpoints/")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--acceptance", nargs="+", metavar="JSON", default=[],
                        help="held-out decoding JSON(s) of this checkpoint by examples/choose_draft_length.py (with "
                        "its whole-block setting t=None): stored as config.draft_acceptance")
    parser.add_argument("--repo-id", help="name shown in the card (default: xpress/<the --out folder's name>)")
    args = parser.parse_args()
    pair = bundled_pair(args.target)
    target_repo = pair.hub_id
    out = Path(args.out or pair.checkpoint)

    model = XPressModel.from_pretrained(args.checkpoint, dtype=DTYPES[args.dtype])
    model.config.target_model_name = target_repo  # training saw a local folder; the card and config name the Hub repo
    if args.acceptance:
        model.config.draft_acceptance = held_out_acceptance(args.acceptance, args.checkpoint, model.config.block_size)
        print("draft_acceptance (held-out):", " ".join(f"{a:.3f}" for a in model.config.draft_acceptance))
    results = merge_results([json.loads(Path(path).read_text()) for path in args.results])
    stages, description = {}, None
    for spec in args.training_summary:
        path, _, keep = spec.partition(":")
        summary = json.loads(Path(path).read_text())
        description = description or summary.get("settings", {}).get("description")
        for stage in keep.split(",") if keep else [k for k in summary if k != "settings"]:
            stages[stage] = summary[stage]
    model.save_pretrained(out)  # its custom_generate recipe finds the folder it runs from: nothing to rewrite
    order = {name: i for i, name in enumerate([*results["datasets"], "all"])}
    rows = sorted(card_rows(summarize(results)), key=lambda r: (r["temperature"], order[r["dataset"]]))  # stable
    card = render_model_card(
        model.config,
        results=rows,
        repo_id=args.repo_id or f"xpress/{out.name}",
        target_model=target_repo,
        training_summary=training_text(stages, args.target, description, model.config.refiner_token_vocab),
        evaluation_summary=evaluation_summary(results),
        chat=pair.chat,
    )
    card.save(out / "README.md")
    size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    print(f"wrote {out} ({size_mb:.1f} MB)")
    if size_mb > pair.size_limit_mb:
        raise SystemExit(f"{out} is {size_mb:.1f} MB, over the {pair.size_limit_mb} MB the repository allows")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
