"""Evaluate xPress checkpoints on SmolLM2-135M-Instruct: τ, the Jacobi K sweep, refiner latency and speed vs plain
decoding, on HumanEval and MT-Bench first turns, all measured in one run (see benchmarks/README.md). With `--target
gemma`, on Gemma-3-270M, a base model: HumanEval's raw tasks, completed as they are (no chat turns, no MT-Bench).

    python examples/benchmark.py --methods dflash=ckpt/dflash markov=ckpt/markov xpress=ckpt/xpress \\
        --limit 20 --dtype bfloat16 --threads 2
    python examples/benchmark.py --target gemma --methods xpress=checkpoints/xpress-gemma3-270m --limit 20

Writes benchmarks/results/<run-name>.json (raw), .md (tables) and -*.png (plots).
"""

import argparse
import sys
import time
from datetime import datetime, timezone

import torch

from modeling_xpress.bench.assets import DTYPES, load_gguf_target
from modeling_xpress.bench.benchmark import evaluation_prompt_sets, load_methods, run_benchmark, write_results
from modeling_xpress.bench.demo import BUNDLED, bundled_pair
from modeling_xpress.bench.settings import DEFAULT_ENTRIES, ENTRIES, BenchmarkSettings


def parse_dtype(name: str) -> torch.dtype:
    """'float32' / 'bfloat16' → torch dtype."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_method_spec(spec: str) -> tuple[str, str]:
    """'name=path' → (name, path), e.g. 'xpress=checkpoints/xpress'."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"a method is given as name=path (e.g. xpress=checkpoints/xpress), got {spec!r}")
    return name, path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2",
                        help="the target: SmolLM2-135M-Instruct (default) or Gemma-3-270M (a base model)")
    parser.add_argument("--methods", nargs="+", required=True, metavar="NAME=PATH",
                        help="saved xPress folders to compare, e.g. dflash=... markov=... xpress=...")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="load with AutoModel and the code inside each folder instead of the installed package")
    parser.add_argument("--limit", type=int, default=None,
                        help="first N prompts of each dataset (default: all 164 + 80; hours on a CPU)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="bfloat16 is the speed setting; float32 for exactness")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--k-values", type=int, nargs="*", default=list(range(1, 9)),
                        help="fixed Jacobi iteration counts of the sweep (none: no sweep)")
    parser.add_argument("--no-adaptive", action="store_true", help="skip the adaptive (early-exit) sweep point")
    parser.add_argument("--latency-blocks", type=int, default=8)
    parser.add_argument("--latency-repeats", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--run-name", default=None, help="file stem of the outputs (default: date, dtype, limit)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--entries", nargs="+", default=list(DEFAULT_ENTRIES), choices=list(ENTRIES),
                        help="speculative entry points per method: target.generate(assistant_model=) (generate), "
                        "spec_generate, and spec_generate(compile=True) with one static cache length for the run "
                        "(spec_generate_compiled; compiled during the warm-up, its seconds recorded). spec_generate "
                        "is always measured: tau, the K sweep and the draft timers come from it")
    parser.add_argument("--no-compiled-plain", action="store_true",
                        help="skip the second baseline: plain generate with a static cache and torch.compile")
    parser.add_argument("--num-assistant-tokens", type=draft_cap_arg, default=None,
                        help="drafts verified per block by every method (default: each checkpoint config's own), or "
                        "'auto': each method's cap chosen on this machine for each loop (eager, compiled) from its config's "
                        "draft_acceptance (measured on held-out prompts by examples/choose_draft_length.py, never on "
                        "these sets)")
    return parser.parse_args()


def draft_cap_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    settings = BenchmarkSettings(
        max_new_tokens=args.max_new_tokens, temperatures=tuple(args.temperatures), k_values=tuple(args.k_values),
        adaptive=not args.no_adaptive, limit=args.limit, seed=args.seed, latency_blocks=args.latency_blocks,
        latency_repeats=args.latency_repeats, entries=tuple(args.entries), compiled_plain=not args.no_compiled_plain,
        num_assistant_tokens=args.num_assistant_tokens,
    )  # fmt: skip
    paths = dict(parse_method_spec(spec) for spec in args.methods)
    run_name = args.run_name or (
        f"{datetime.now(timezone.utc):%Y%m%d-%H%M}-{args.dtype}-limit{args.limit if args.limit else 'all'}"
    )

    start = time.perf_counter()
    pair = bundled_pair(args.target)
    target, tokenizer = load_gguf_target(pair.target, dtype=dtype)
    methods = load_methods(paths, dtype=dtype, device=target.device, trust_remote_code=args.trust_remote_code)
    prompt_sets = evaluation_prompt_sets(tokenizer, limit=args.limit, chat=pair.chat)
    load_seconds = time.perf_counter() - start
    counts = ", ".join(f"{name} {len(s.ids)}" for name, s in prompt_sets.items())
    print(f"limit: {args.limit if args.limit else 'none (full sets)'} -> prompts {counts}; dtype {args.dtype}; "
          f"threads {torch.get_num_threads()}; max_new_tokens {args.max_new_tokens}; "
          f"methods {list(paths)}")  # fmt: skip

    results = run_benchmark(
        target, methods, prompt_sets, settings, progress=not args.no_progress,
        metadata={"target": pair.target, "checkpoints": paths, "command": sys.argv, "load_seconds": load_seconds},
    )  # fmt: skip
    written = write_results(results, args.out_dir, run_name)
    print(written["markdown"].read_text())
    print(f"wall time {results['wall_time_s']:.0f} s (+ {load_seconds:.0f} s loading)")
    for kind, path in written.items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
