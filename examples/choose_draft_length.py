"""Choose the draft-confidence threshold (issue 10 item 4) on held-out training prompts, and show its effect on speed.

Each block is cut after the first draft whose cumulative confidence falls below a threshold (`generation.draft_length`),
so fewer drafts are verified. On a CPU a 16-token verification costs ~1.4 plain decoding steps while most blocks are
accepted only 1-2 tokens deep, so verifying fewer drafts can pay. This sweeps thresholds through `spec_generate` and
times plain `target.generate` on the same prompts in the same run (entries rotated per prompt, so machine-load drifts
hit every entry alike), greedy, and writes the raw records and a summary as JSON.

The prompts are a held-out split of the training data: `training_prompts(7200, seed=0)` rows 7000..7199 are generated
like the training prompts but reserved — never trained on — for choices like this one. Never HumanEval / MT-Bench.
`--kinds task` takes them from the task-shaped set's held-out rows instead (`TASK_HELD_OUT_PROMPTS`: function stubs,
role play, extraction, puzzles, essays), closer in shape to the evaluation sets without being them; `--kinds mined`
from the held-out rows of the prompts mined from the standard library (`MINED_HELD_OUT_PROMPTS`). `--target gemma`
measures Gemma-3-270M and its checkpoint on the completion generator's held-out rows (text to continue).

    python examples/choose_draft_length.py                      # bundled checkpoint, bf16, 1 thread, 10 prompts
    python examples/choose_draft_length.py --thresholds none,0.2,0.4 --caps 4,8 --prompts 20
    python examples/choose_draft_length.py --compile --dtype float32 --threads 2 --caps 1,3,7
    python examples/choose_draft_length.py --compile --dtype float32 --threads 2 --caps 1,2,3,4,auto
    python examples/choose_draft_length.py --compile --dtype float32 --threads 2 --thresholds "" --caps 2,3,4 \
        --linear-layouts input_major,packed        # an A/B of the products' layout, same run

A cap of `auto` is `num_assistant_tokens="auto"`: the cap chosen on this machine from the checkpoint's
`config.draft_acceptance` (`draft_cap.choose_draft_cap`, printed). Every setting that verifies whole blocks with the
head on (`t=None`) also reports `draft_acceptance`, the fraction of blocks whose first k drafts were accepted
(`draft_cap.acceptance_from_blocks`): what `examples/bundle_checkpoint.py --acceptance` stores in the config.

With `--compile` the settings run `spec_generate(compile=True)` (one static cache length for all prompts, every
setting compiled before timing). The compiled loop verifies a bucketed width (2, 4, 8 or the whole block) that holds
the drafts the rule keeps, so a cut saves target compute there too: on this CPU, much in fp32 and little in bf16.
"""

import argparse
import json
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import DTYPES, load_gguf_target
from modeling_xpress.bench.benchmark import environment_info, method_info, prompt_ids, run_plain
from modeling_xpress.bench.demo import BUNDLED, bundled_pair
from modeling_xpress.draft_cap import acceptance_from_blocks
from modeling_xpress.decoding import spec_generate
from modeling_xpress.stats import WallClock
from modeling_xpress.training.prompts import GENERATORS
from modeling_xpress.training.regeneration import held_out_indices, held_out_prompts

def settings_of(thresholds: list[float | None], caps: list[int], heads_off: list[float | None],
                caps_heads_off: list[int] = ()) -> list[dict]:  # fmt: skip
    """Named spec_generate settings. A threshold of None runs as 0 (no cut) so that the config default, whatever it
    is, does not leak into the baseline; "K=0" runs switch the head off (the drafter's own marginals)."""
    out = [{"name": f"t={t}", "threshold": t, "cap": None, "k0": False} for t in thresholds]
    out += [{"name": f"cap={c}", "threshold": None, "cap": c, "k0": False} for c in caps]
    out += [{"name": f"t={t},K=0", "threshold": t, "cap": None, "k0": True} for t in heads_off]
    out += [{"name": f"cap={c},K=0", "threshold": None, "cap": c, "k0": True} for c in caps_heads_off]
    return out


def with_layouts(settings: list[dict], layouts: list[str]) -> list[dict]:
    """Each setting once per `linear_layout` (named "<setting>@<layout>" when there are several): an A/B of the
    products' layout in one run."""
    if len(layouts) == 1:
        return [{**s, "linear_layout": layouts[0]} for s in settings]
    return [{**s, "name": f"{s['name']}@{layout}", "linear_layout": layout} for s in settings for layout in layouts]


def run_setting(target, xpress, ids, max_new_tokens: int, setting: dict, compile: bool = False,
                max_cache_len: int | None = None):  # fmt: skip
    saved = xpress.config.jacobi_max_iters
    xpress.config.jacobi_max_iters = 0 if setting["k0"] else saved
    clock = WallClock(ids.device)
    try:
        start = clock.now()
        out = spec_generate(xpress, target, ids, max_new_tokens=max_new_tokens, temperature=0.0,
                            assistant_confidence_threshold=setting["threshold"] or 0.0,
                            num_assistant_tokens=setting["cap"], compile=compile, max_cache_len=max_cache_len,
                            linear_layout=setting.get("linear_layout", "auto"))  # fmt: skip
        return out.sequences, clock.now() - start, out.stats
    finally:
        xpress.config.jacobi_max_iters = saved


def summarize(records: list[dict], names: list[str], block_size: int | None = None) -> dict[str, dict]:
    plain = [r for r in records if r["entry"] == "plain"]
    plain_rate = sum(r["new_tokens"] for r in plain) / sum(r["seconds"] for r in plain)
    out = {"plain": {"tokens_per_s": plain_rate, "speed_vs_plain": 1.0}}
    for name in names:
        rows = [r for r in records if r["entry"] == name]
        rate = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        taus = [t for r in rows for t in r["acceptance_lengths"]]
        lengths = [n for r in rows for n in r["draft_lengths"]]
        out[name] = {
            "compiled_in_timed_calls": sum(bool(r.get("time_compile")) for r in rows),  # 0: all compiled beforehand
            "tokens_per_s": rate,
            "speed_vs_plain": rate / plain_rate,
            "mean_tau": sum(taus) / len(taus),
            "mean_draft_length": sum(lengths) / len(lengths),
            "identical_to_plain": sum(r["identical_to_plain"] for r in rows),
            "prompts": len(rows),
        }
        if name == "t=None" and block_size is not None:  # whole blocks, head on: every position is measured
            out[name]["draft_acceptance"] = acceptance_from_blocks(taus, lengths, block_size)
    return out


def parse_thresholds(text: str) -> list[float | None]:
    return [None if item.strip().lower() == "none" else float(item) for item in text.split(",") if item.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2",
                        help="the bundled pair's target: SmolLM2-135M-Instruct (default) or Gemma-3-270M")
    parser.add_argument("--checkpoint", default=None, help="xPress folder (default: the target's bundled one)")
    parser.add_argument("--thresholds", default="none,0.1,0.2,0.3,0.5")
    parser.add_argument("--caps", default="", help="caps (num_assistant_tokens) to compare, e.g. 4,8 or 2,3,auto")
    parser.add_argument("--heads-off", default="none", help="thresholds also run with jacobi_max_iters=0")
    parser.add_argument("--caps-heads-off", default="", help="caps also run with jacobi_max_iters=0, e.g. 3")
    parser.add_argument("--linear-layouts", default="auto",
                        help="spec_generate's linear_layout, or several to compare, e.g. input_major,packed,auto")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--kinds", choices=sorted(GENERATORS), default=None,
                        help="held-out prompts of this training generator (default: 'default' for SmolLM2, "
                        "'completion' for Gemma, the generator its pipeline recipe trains on)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true", help="time spec_generate(compile=True)")
    parser.add_argument("--out", help="default: benchmarks/results/draft-length-heldout[-compiled-<dtype>].json")
    parser.add_argument("--note", default="", help="stored with the results, e.g. what else the machine was running")
    args = parser.parse_args()
    if args.out is None:
        suffix = f"-compiled-{args.dtype}" if args.compile else ""
        args.out = f"benchmarks/results/draft-length-heldout{suffix}.json"
    torch.set_num_threads(args.threads)

    pair = bundled_pair(args.target)
    args.checkpoint = args.checkpoint or str(pair.checkpoint)
    args.kinds = args.kinds or pair.settings_kinds
    target, tokenizer = load_gguf_target(pair.target, dtype=DTYPES[args.dtype])
    xpress = XPressModel.from_pretrained(args.checkpoint, dtype=DTYPES[args.dtype]).eval()
    kinds = GENERATORS[args.kinds]
    prompts = prompt_ids(tokenizer, held_out_prompts(args.prompts, kinds=kinds), chat=pair.chat)
    held = held_out_indices(kinds)
    caps = [c.strip() if c.strip() == "auto" else int(c) for c in args.caps.split(",") if c.strip()]
    caps_off = [c.strip() if c.strip() == "auto" else int(c) for c in args.caps_heads_off.split(",") if c.strip()]
    settings = settings_of(parse_thresholds(args.thresholds), caps, parse_thresholds(args.heads_off), caps_off)
    settings = with_layouts(settings, [layout.strip() for layout in args.linear_layouts.split(",") if layout.strip()])
    auto_choice = None
    if "auto" in caps + caps_off:  # timed once here; spec_generate(num_assistant_tokens="auto") reuses it
        choice = xpress.choose_draft_cap(target, compiled=args.compile)
        print(f"num_assistant_tokens='auto' on this machine:\n{choice.table()}")
        auto_choice = {"cap": choice.cap, "draft_acceptance": xpress.config.draft_acceptance, "caps": choice.caps,
                       "expected_tokens": choice.expected_tokens, "verify_seconds": choice.verify_seconds,
                       "draft_seconds": choice.draft_seconds, "compiled": choice.compiled}  # fmt: skip
    entries = ["plain"] + [s["name"] for s in settings]
    by_name = {s["name"]: s for s in settings}

    cache_len = None
    if args.compile:  # one static cache length for every prompt: each setting compiles once, in the warm-up
        from modeling_xpress.compiled import cache_length

        cache_len = cache_length(max(p.shape[1] for p in prompts), args.max_new_tokens, xpress.config.block_size)
    records = []
    # inference mode for the warm-up too: graphs compiled outside it would be compiled again inside it
    with torch.inference_mode():
        run_plain(target, prompts[0], 8, 0.0, 0)  # warm-up: one-off costs are not charged to the first prompt
        for setting in settings if args.compile else settings[:1]:  # two blocks: every graph of the loop compiles
            run_setting(target, xpress, prompts[0], 2 * xpress.config.block_size, setting, args.compile, cache_len)
        for index, ids in enumerate(tqdm(prompts, desc="held-out prompts")):
            order = entries[index % len(entries) :] + entries[: index % len(entries)]
            done = {}
            for name in order:
                if name == "plain":
                    done[name] = (*run_plain(target, ids, args.max_new_tokens, 0.0, 0), None)
                else:
                    done[name] = run_setting(target, xpress, ids, args.max_new_tokens, by_name[name], args.compile,
                                             cache_len)  # fmt: skip
            reference = done["plain"][0]
            for name in entries:
                sequences, seconds, stats = done[name]
                records.append({
                    "prompt_index": index, "entry": name, "seconds": seconds,
                    "new_tokens": int(sequences.shape[1] - ids.shape[1]),
                    "identical_to_plain": bool(torch.equal(sequences, reference)),
                    "acceptance_lengths": None if stats is None else list(stats.acceptance_lengths),
                    "draft_lengths": None if stats is None else list(stats.draft_lengths),
                    "verify_widths": getattr(stats, "verify_widths", None),
                    "time_compile": getattr(stats, "time_compile", None),  # 0 in every compiled record: compiled before
                })  # fmt: skip

    summary = summarize(records, [s["name"] for s in settings], xpress.config.block_size)
    thresholds = [s["name"] for s in settings if not s["k0"] and s["cap"] is None]
    best = max(thresholds, key=lambda name: summary[name]["tokens_per_s"]) if thresholds else None
    fastest = max((s["name"] for s in settings), key=lambda name: summary[name]["tokens_per_s"])
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "held_out_split": {"kinds": args.kinds, "training_prompts_n": held.stop, "seed": 0,
                           "rows": [held.start, held.start + len(prompts) - 1]},  # fmt: skip
        "arguments": vars(args),
        "note": args.note,
        "environment": environment_info(target),
        "method": method_info(xpress),
        "settings": settings,
        "summary": summary,
        "fastest_threshold": best,  # among the confidence thresholds alone (no cap, head on)
        "fastest_setting": fastest,  # among every setting run
        "auto_choice": auto_choice,  # what num_assistant_tokens="auto" chose and from what (None: not run)
        "records": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("| setting | tok/s | vs plain | τ | drafts verified | identical |\n|---|---|---|---|---|---|")
    for name, row in summary.items():
        if name == "plain":
            print(f"| plain generate | {row['tokens_per_s']:.1f} | 1.00× | | | |")
            continue
        print(f"| {name} | {row['tokens_per_s']:.1f} | {row['speed_vs_plain']:.2f}× | {row['mean_tau']:.2f} | "
              f"{row['mean_draft_length']:.1f} | {row['identical_to_plain']}/{row['prompts']} |")  # fmt: skip
    print(f"fastest setting: {fastest}; fastest confidence threshold (no cap, head on): {best}; written {args.out}")


if __name__ == "__main__":
    main()
