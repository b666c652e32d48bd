"""Eager vs compiled decoding on a Qwen3-8B-shaped target (random weights), side by side in one run.

    python examples/gpu_check.py --out gpu_check.json              # one H200: < 5 minutes
    python examples/gpu_check.py --tiny --out /tmp/gpu_check.json  # small shapes on CPU: exercises the script

Builds a Qwen3-8B-shaped target (hidden 4096, 36 layers, 32/8 heads, MLP 12288, vocab 151936; bf16) and a 5-layer
dFlash-b16 drafter with a rank-256 xPress head (SPEC §9), then measures:

* plain decoding: eager `generate` and `generate(cache_implementation="static")` (transformers compiles the
  forward; first call and steady state), tokens/s;
* one xPress step: `generate(assistant_model=)`, eager `spec_generate` and `spec_generate(compile=True)`, with its
  split (drafter / lm_head / refiner / verification) and the compile time;
* draft trees: eager `spec_generate(tree_nodes=N)` at N = 16, 32, 64, one step's split, output against the linear
  loop's;
* refiner latency per Jacobi K (1, 2, 4, 8), eager and compiled (early exit off: K passes each);
* the fraction of wall time the GPU is busy (torch.profiler: union of kernel intervals / wall time) and the number of
  kernels, for one eager and one compiled xPress call.

Random weights give τ ≈ 1 (every step commits one token), so step times and tokens/s measure cost, not speed-up.
Cost does not depend on weight values. Writes every number to the JSON at --out.
"""

import argparse
import functools
import json
import platform
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.bench.benchmark import compiled_plain_kwargs
from modeling_xpress.compiled import jacobi_fixed_iterations
from modeling_xpress.decoding import spec_generate
from modeling_xpress.stats import WallClock, median_seconds

SHAPES = {
    # Qwen3-8B target; 5-layer block-16 drafter with a rank-256 xPress head
    "full": dict(target=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, intermediate_size=12288, vocab_size=151936),
                 drafter=dict(num_hidden_layers=5, block_size=16, refiner_rank=256)),
    # small enough for a CPU: exercises every measurement of the script
    "tiny": dict(target=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, intermediate_size=128, vocab_size=512),
                 drafter=dict(num_hidden_layers=2, block_size=8, refiner_rank=16)),
}  # fmt: skip
JACOBI_KS = (1, 2, 4, 8)


def build_models(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Random target and drafter of the given shape. The head is randomised too (a fresh one adds δ = 0)."""
    torch.manual_seed(seed)
    spec = SHAPES[shape]
    config = Qwen3Config(**spec["target"], max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, tie_word_embeddings=False)  # fmt: skip
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
        xpress_config = XPressConfig.from_target_config(config, refiner="xpress", **spec["drafter"])
        xpress = XPressModel(xpress_config).to(dtype).eval()
    with torch.no_grad():
        for p in xpress.refiner.parameters():
            p.normal_(std=0.02)
    return target, xpress


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy continuations differ (None: equal). In bf16, near-ties between
    batched and single-token forwards can flip a token; from there the continuations part."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def timed(clock: WallClock, fn):
    start = clock.now()
    out = fn()
    return out, clock.now() - start


def plain_decoding(target, ids, new_tokens: int, clock: WallClock) -> dict:
    """Eager and static-cache compiled `generate`: tokens/s (steady state) and the compiled first call."""
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    target.generate(ids, **greedy)  # warm-up
    eager, eager_s = timed(clock, lambda: target.generate(ids, **greedy))
    # The benchmark's compiled baseline: a static cache and transformers' torch.compile (asked for off CUDA too).
    static = dict(greedy, **compiled_plain_kwargs(ids.shape[1] + new_tokens))
    _, first_s = timed(clock, lambda: target.generate(ids, **static))
    compiled, compiled_s = timed(clock, lambda: target.generate(ids, **static))
    return {
        "eager_tokens_per_s": new_tokens / eager_s,
        "compiled_tokens_per_s": new_tokens / compiled_s,
        "compiled_first_call_s": first_s,
        "compiled_first_difference": first_difference(compiled[0].tolist(), eager[0].tolist()),
        "sequence": eager[0, ids.shape[1] :].tolist(),
    }


def step_report(stats, seconds: float) -> dict:
    """Per verification step: wall time and the section split (the prefill is amortised into `verify`)."""
    steps = max(len(stats.acceptance_lengths), 1)
    return {
        "steps": steps,
        "mean_tau": stats.mean_tau,
        "tokens_per_s": stats.new_tokens / seconds,
        "step_ms": 1e3 * seconds / steps,
        **{f"{name}_ms": 1e3 * stats.seconds(name) / steps for name in ("drafter", "lm_head", "refiner", "verify")},
        "compile_s": getattr(stats, "time_compile", 0.0),
    }


def xpress_steps(target, xpress, ids, new_tokens: int, clock: WallClock) -> dict:
    """One xPress step through `generate(assistant_model=)`, eager `spec_generate` and `spec_generate(compile=True)`."""
    results = {}
    kwargs = dict(max_new_tokens=new_tokens, stop_token_ids=[])
    target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=xpress)  # warm-up
    _, seconds = timed(clock, lambda: target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                       do_sample=False, assistant_model=xpress))  # fmt: skip
    results["assisted_generate_eager"] = step_report(xpress.generation_stats, seconds)
    spec_generate(xpress, target, ids, max_new_tokens=8)  # warm-up
    eager, seconds = timed(clock, lambda: spec_generate(xpress, target, ids, **kwargs))
    results["spec_generate_eager"] = step_report(eager.stats, seconds)
    first, first_s = timed(clock, lambda: spec_generate(xpress, target, ids, compile=True, **kwargs))
    results["spec_generate_compiled_first_call"] = {**step_report(first.stats, first_s), "wall_s": first_s}
    spec_generate(xpress, target, ids, compile=True, **kwargs)  # CUDA graphs are recorded in the first calls
    compiled, seconds = timed(clock, lambda: spec_generate(xpress, target, ids, compile=True, **kwargs))
    results["spec_generate_compiled"] = step_report(compiled.stats, seconds)
    results["compiled_first_difference"] = first_difference(compiled.sequences[0].tolist(), eager.sequences[0].tolist())
    results["sequence"] = eager.sequences[0, ids.shape[1] :].tolist()
    return results


def tree_steps(target, xpress, ids, new_tokens: int, clock: WallClock, budgets: list[int], reference: list[int]) -> dict:
    """Eager `spec_generate(tree_nodes=N)` per budget: one step's cost (random weights: the drafter's tree is as wide
    as N allows, the target accepts ~nothing) and whether the output is the eager linear loop's."""
    results = {}
    for nodes in budgets:
        kwargs = dict(max_new_tokens=new_tokens, stop_token_ids=[], tree_nodes=nodes)
        spec_generate(xpress, target, ids, **{**kwargs, "max_new_tokens": 8})  # warm-up
        out, seconds = timed(clock, lambda: spec_generate(xpress, target, ids, **kwargs))
        results[f"tree_{nodes}"] = {**step_report(out.stats, seconds),
                                    "first_difference": first_difference(out.sequences[0, ids.shape[1]:].tolist(),
                                                                         reference)}  # fmt: skip
    return results


def refiner_latency(xpress, device, dtype, clock: WallClock, repeats: int) -> dict:
    """Seconds per block refinement at each fixed K (early exit off), eager and compiled, on random drafter outputs."""
    n, vocab = xpress.config.num_draft_tokens, xpress.config.vocab_size
    hidden = torch.randn(1, n + 1, xpress.config.hidden_size, device=device, dtype=dtype)  # every slot of a block
    base = torch.randn(1, n, vocab, device=device, dtype=dtype) * 4
    last = torch.zeros(1, 2, dtype=torch.long, device=device)  # the token before the anchor, the anchor
    folded = xpress.refiner.folded()
    cuda = device.type == "cuda"
    if cuda:
        for tensor in (folded.token_table, folded.hidden_weight, folded.global_weight, folded.mix):
            torch._dynamo.mark_static_address(tensor)
    mode = "reduce-overhead" if cuda else None

    def per_call(fn) -> float:  # 3 warm-up calls: CUDA graphs are recorded in the first ones
        return median_seconds(fn, repeats, warmup=3, clock=clock)

    def step(fn):
        def call():
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            return fn(hidden, base, last)

        return call

    out = {}
    with torch.no_grad():
        for k in JACOBI_KS:
            eager = functools.partial(xpress.refine, max_iters=k, early_exit=False)
            compiled = torch.compile(
                functools.partial(jacobi_fixed_iterations, xpress.refiner, folded, iterations=k),
                mode=mode, fullgraph=True, dynamic=False,
            )  # fmt: skip
            out[f"K={k}"] = {"eager_ms": 1e3 * per_call(step(eager)), "compiled_ms": 1e3 * per_call(step(compiled))}
    return out


def gpu_busy(fn, clock: WallClock) -> dict | None:
    """Fraction of wall time some kernel runs (union of kernel intervals / wall time) and the kernel count."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, wall = timed(clock, fn)
    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy, end = 0.0, float("-inf")
    for start, stop in kernels:  # merge overlapping intervals (µs)
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return {"busy_fraction": busy / 1e6 / wall, "kernels": len(kernels), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--tiny", action="store_true", help="small shapes (runs on a CPU in about a minute)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (full), 16 (tiny)")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=None, help="refiner latency repeats (default 50 / 5)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler GPU busy fraction")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = "tiny" if args.tiny else "full"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if shape == "full" and device.type != "cuda":
        raise SystemExit("the full shapes need a GPU (an 8B target); use --tiny on a CPU")
    dtype = torch.bfloat16
    new_tokens = args.new_tokens or (16 if args.tiny else 64)
    repeats = args.repeats or (5 if args.tiny else 50)
    clock = WallClock(device)
    report = {"shape": shape, "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
              "torch": torch.__version__, "dtype": str(dtype), "new_tokens": new_tokens,
              "prompt_length": args.prompt_length}  # fmt: skip

    started = time.perf_counter()
    target, xpress = build_models(shape, device, dtype)
    report["build_s"] = time.perf_counter() - started
    ids = torch.randint(0, target.config.vocab_size, (1, args.prompt_length), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))  # fmt: skip
    print(f"models built in {report['build_s']:.1f}s on {report['device']}", flush=True)

    report["plain"] = plain_decoding(target, ids, new_tokens, clock)
    print(f"plain done ({time.perf_counter() - started:.0f}s)", flush=True)
    report["xpress"] = xpress_steps(target, xpress, ids, new_tokens, clock)
    report["xpress"]["first_difference_from_plain"] = first_difference(report["xpress"]["sequence"],
                                                                       report["plain"]["sequence"])  # fmt: skip
    print(f"xPress steps done ({time.perf_counter() - started:.0f}s)", flush=True)
    budgets = [4, 8] if args.tiny else [16, 32, 64]
    report["trees"] = tree_steps(target, xpress, ids, new_tokens, clock, budgets, report["xpress"]["sequence"])
    print(f"tree steps done ({time.perf_counter() - started:.0f}s)", flush=True)
    report["refiner_latency"] = refiner_latency(xpress, device, dtype, clock, repeats)
    print(f"refiner latency done ({time.perf_counter() - started:.0f}s)", flush=True)
    if not args.no_profile:
        kwargs = dict(max_new_tokens=min(new_tokens, 32), stop_token_ids=[])
        report["gpu_busy"] = {
            "spec_generate_eager": gpu_busy(lambda: spec_generate(xpress, target, ids, **kwargs), clock),
            "spec_generate_compiled": gpu_busy(lambda: spec_generate(xpress, target, ids, compile=True, **kwargs),
                                               clock),
        }  # fmt: skip
    report["total_s"] = time.perf_counter() - started
    for key in ("plain", "xpress"):
        report[key].pop("sequence")

    plain, steps = report["plain"], report["xpress"]
    print(f"\nplain tokens/s: eager {plain['eager_tokens_per_s']:.1f}, compiled {plain['compiled_tokens_per_s']:.1f} "
          f"(first call {plain['compiled_first_call_s']:.1f}s)")  # fmt: skip
    print(f"{'xPress step':34s} {'step ms':>8s} {'drafter':>8s} {'lm_head':>8s} {'refiner':>8s} {'verify':>8s} "
          f"{'tok/s':>7s} {'compile s':>9s}")  # fmt: skip
    for name in ("assisted_generate_eager", "spec_generate_eager", "spec_generate_compiled_first_call",
                 "spec_generate_compiled"):  # fmt: skip
        r = steps[name]
        print(f"{name:34s} {r['step_ms']:8.2f} {r['drafter_ms']:8.2f} {r['lm_head_ms']:8.2f} {r['refiner_ms']:8.2f} "
              f"{r['verify_ms']:8.2f} {r['tokens_per_s']:7.1f} {r['compile_s']:9.1f}")  # fmt: skip
    for name, r in report["trees"].items():
        print(f"{'spec_generate_eager ' + name:34s} {r['step_ms']:8.2f} {r['drafter_ms']:8.2f} {r['lm_head_ms']:8.2f} "
              f"{r['refiner_ms']:8.2f} {r['verify_ms']:8.2f} {r['tokens_per_s']:7.1f}   first difference from "
              f"linear {r['first_difference']}")  # fmt: skip
    print("refiner ms per K: " + ", ".join(f"{k}: eager {v['eager_ms']:.3f} / compiled {v['compiled_ms']:.3f}"
                                           for k, v in report["refiner_latency"].items()))  # fmt: skip
    for name, busy in (report.get("gpu_busy") or {}).items():
        if busy:
            print(f"GPU busy {name}: {busy['busy_fraction']:.1%} of {busy['wall_s']:.2f}s, {busy['kernels']} kernels")
    print(f"first differing token (None: identical) compiled vs eager: plain {plain['compiled_first_difference']}, "
          f"xPress {steps['compiled_first_difference']}; eager xPress vs eager plain "
          f"{steps['first_difference_from_plain']}; total {report['total_s']:.0f}s")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
