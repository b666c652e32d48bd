"""Eager vs compiled, plain vs xPress, on SmolLM2-135M-Instruct and the bundled checkpoint, on a CPU (`--target
gemma`: Gemma-3-270M and its checkpoint, on held-out prompts of the completion generator it was trained on).

    python examples/compiled_cpu_benchmark.py --threads 2 --prompts 6 --max-new-tokens 128
    python examples/compiled_cpu_benchmark.py --target gemma --dtype float32 --threads 2 --prompts 10

Four decoders on the same chat prompts (held-out training-style prompts from `modeling_xpress.training.prompts`,
never an evaluation set), in one run, interleaved per prompt so that load spikes hit them all:

* plain eager: `target.generate` (greedy);
* plain compiled: `generate` with a static cache of one fixed length and transformers' `torch.compile`;
* xPress eager: `spec_generate(xpress, target, ids)`;
* xPress compiled: `spec_generate(xpress, target, ids, compile=True)`.

Each decoder is warmed up (and compiled) first, once per static-cache length it will use; the warm-up times (which
hold the compilation) are reported apart. Reports
tokens/s, the ratios against both plain decoders, mean τ, and greedy identity against plain eager decoding (counted
honestly: in bfloat16 a near-tie can flip between a batched and a single-token forward). Writes
benchmarks/results/<name>.json.
"""

import argparse
import json
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import DTYPES, load_gguf_target
from modeling_xpress.bench.benchmark import compiled_plain_kwargs, prompt_ids
from modeling_xpress.bench.demo import BUNDLED, bundled_pair
from modeling_xpress.compiled import cache_length
from modeling_xpress.decoding import spec_generate
from modeling_xpress.training.prompts import GENERATORS
from modeling_xpress.training.regeneration import held_out_prompts

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
DECODERS = ("plain_eager", "plain_compiled", "xpress_eager", "xpress_compiled")


def make_decoders(target, xpress, max_new_tokens: int, max_cache_len: int):
    """name → fn(ids) → (new token ids, mean τ or None, compile seconds or None)."""
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    compiled_plain = dict(greedy, **compiled_plain_kwargs(max_cache_len))

    def plain(kwargs):
        def run(ids):
            return target.generate(ids, **kwargs)[0, ids.shape[1] :].tolist(), None, None

        return run

    def xpress_loop(compile: bool):
        def run(ids):
            out = spec_generate(xpress, target, ids, max_new_tokens=max_new_tokens, compile=compile)
            compile_s = getattr(out.stats, "time_compile", None)
            return out.sequences[0, ids.shape[1] :].tolist(), out.stats.mean_tau, compile_s

        return run

    return {"plain_eager": plain(greedy), "plain_compiled": plain(compiled_plain),
            "xpress_eager": xpress_loop(False), "xpress_compiled": xpress_loop(True)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2",
                        help="the bundled pair's target: SmolLM2-135M-Instruct (default) or Gemma-3-270M")
    parser.add_argument("--checkpoint", default=None, help="xPress folder (default: the target's bundled one)")
    parser.add_argument("--prompts", type=int, default=6, help="number of held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--name", default=None, help="file stem of the JSON (default: date, dtype, threads)")
    args = parser.parse_args()
    if args.prompts < 1 or args.max_new_tokens < 2:
        raise SystemExit("--prompts must be >= 1 and --max-new-tokens >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    pair = bundled_pair(args.target)
    args.checkpoint = args.checkpoint or str(pair.checkpoint)
    target, tokenizer = load_gguf_target(pair.target, dtype)
    xpress = XPressModel.from_pretrained(args.checkpoint, dtype=dtype).eval()
    prompts = prompt_ids(tokenizer, held_out_prompts(args.prompts, kinds=GENERATORS[pair.settings_kinds]),
                         chat=pair.chat)
    # one static length for every prompt (and the warm-up), so each compiled decoder compiles once
    max_cache_len = max(ids.shape[1] for ids in prompts) + args.max_new_tokens + 2 * xpress.config.block_size
    decoders = make_decoders(target, xpress, args.max_new_tokens, max_cache_len)

    # Warm-up (compilation): one prompt per static-cache length that compiled xPress will use for these prompts.
    buckets = {}
    for ids in prompts:
        buckets.setdefault(cache_length(ids.shape[1], args.max_new_tokens, xpress.config.block_size), ids)
    warmup = {}
    with torch.inference_mode():
        for name, run in decoders.items():
            start = time.perf_counter()
            compile_s = [run(ids)[2] for ids in buckets.values()]
            warmup[name] = {"first_calls_s": time.perf_counter() - start, "calls": len(buckets),
                            "compile_s": None if compile_s[0] is None else sum(compile_s)}  # fmt: skip
            print(f"warm-up {name}: {warmup[name]['first_calls_s']:.1f}s", flush=True)

        rows = []
        for i, ids in enumerate(prompts):
            row = {"prompt_tokens": ids.shape[1]}
            for name, run in decoders.items():
                start = time.perf_counter()
                tokens, tau, compile_s = run(ids)
                row[name] = {"seconds": time.perf_counter() - start, "new_tokens": len(tokens), "tokens": tokens,
                             "mean_tau": tau, "compile_s": compile_s}  # fmt: skip
            reference = row["plain_eager"]["tokens"]
            for name in DECODERS[1:]:
                row[name]["equals_plain_eager"] = row[name]["tokens"] == reference
            rows.append(row)
            speeds = (f"{name} {row[name]['new_tokens'] / row[name]['seconds']:.1f} tok/s" for name in DECODERS)
            print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(speeds), flush=True)

    summary = {}
    for name in DECODERS:
        tokens = sum(row[name]["new_tokens"] for row in rows)
        seconds = sum(row[name]["seconds"] for row in rows)
        taus = [row[name]["mean_tau"] for row in rows if row[name]["mean_tau"] is not None]
        summary[name] = {
            "tokens_per_s": tokens / seconds,
            "mean_tau": sum(taus) / len(taus) if taus else None,
            "greedy_identical_prompts": None if name == "plain_eager" else
            sum(row[name]["equals_plain_eager"] for row in rows),
        }  # fmt: skip
    for name in DECODERS:
        summary[name]["vs_plain_eager"] = summary[name]["tokens_per_s"] / summary["plain_eager"]["tokens_per_s"]
        summary[name]["vs_plain_compiled"] = summary[name]["tokens_per_s"] / summary["plain_compiled"]["tokens_per_s"]

    print(f"\n{'decoder':16s} {'tok/s':>7s} {'vs eager':>9s} {'vs compiled':>11s} {'tau':>5s} {'identical':>9s} "
          f"{'warm-up s':>12s}")  # fmt: skip
    for name in DECODERS:
        s = summary[name]
        tau = "" if s["mean_tau"] is None else f"{s['mean_tau']:.2f}"
        same = "" if s["greedy_identical_prompts"] is None else f"{s['greedy_identical_prompts']}/{len(rows)}"
        print(f"{name:16s} {s['tokens_per_s']:7.2f} {s['vs_plain_eager']:9.2f} {s['vs_plain_compiled']:11.2f} "
              f"{tau:>5s} {same:>9s} {warmup[name]['first_calls_s']:12.1f}")  # fmt: skip

    stamp = datetime.now(timezone.utc)
    name = args.name or f"compiled-cpu-{stamp:%Y%m%d-%H%M}-{args.dtype}-t{torch.get_num_threads()}"
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {"target": pair.target, "checkpoint": args.checkpoint, "prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens,
                "dtype": args.dtype, "threads": torch.get_num_threads(), "max_cache_len": max_cache_len,
                "torch": torch.__version__, "date": stamp.isoformat()}  # fmt: skip
    path.write_text(json.dumps({"settings": settings, "warmup": warmup, "summary": summary, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
