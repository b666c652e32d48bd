"""Draft trees against linear blocks on the real model, side by side in one run.

SmolLM2-135M-Instruct with the bundled checkpoint, one prompt at a time: plain `target.generate`, then
`spec_generate` with linear blocks (the machine-chosen cap, and whole blocks) and with draft trees of N nodes built
from the head's path-conditioned distributions ("head tree") and from the drafter's marginals ("marginal tree",
`jacobi_max_iters=0`); `--nodes ... auto` adds `tree_nodes="auto"`. Every method decodes every prompt in turn, so
all see the same machine state. Prints τ (tokens per verification), tokens/s and the speed ratio against plain
decoding measured in this run, and, greedy, whether every output is the target's own greedy output. With
`--temperature T` every method samples (plain `generate` too), each call seeded alike; outputs then differ by method
(lossless is a distribution property, tested by the χ² tests), so no identity column.

    python examples/tree_benchmark.py --held-out 10               # held-out training prompts (choose settings here)
    python examples/tree_benchmark.py --held-out 10 --compile     # compiled loops, and compiled plain decoding
    python examples/tree_benchmark.py --eval 20 --max-new-tokens 256 --nodes 4 8 16 auto   # HumanEval + MT-Bench
    python examples/tree_benchmark.py --eval 20 --max-new-tokens 256 --nodes 4 8 16 auto --temperature 1

A long run can be split: `--record F.jsonl` appends each prompt's figures (every method, side by side, with the
machine they ran on) when that prompt is done, a later run with the same `--record` and settings skips the prompts
already there, and `--stop-after MINUTES` ends a run after the prompt that crosses that time. The table is printed
from every recorded prompt, with how many of the prompts it covers.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModel

from modeling_xpress.bench.assets import load_smollm2
from modeling_xpress.bench.benchmark import chat_prompt_ids, compiled_plain_kwargs, config_setting, environment_info
from modeling_xpress.bench.demo import BUNDLED_CHECKPOINT


def methods(xpress, nodes: list) -> dict:
    """name → (spec_generate kwargs, config overrides)."""
    out = {"linear, chosen cap": ({}, {}), "linear, whole block": ({"num_assistant_tokens": 15}, {})}
    for n in nodes:
        out[f"marginal tree N={n}"] = ({"tree_nodes": n}, {"jacobi_max_iters": 0})
        out[f"head tree N={n}"] = ({"tree_nodes": n}, {})
    return out


def node_budget(value: str):
    return value if value == "auto" else int(value)


def prompt_texts(args) -> list[str]:
    if args.held_out:
        from modeling_xpress.training.prompts import GENERATORS
        from modeling_xpress.training.regeneration import held_out_prompts

        return held_out_prompts(args.held_out, kinds=GENERATORS[args.kinds])
    from modeling_xpress.bench.assets import humaneval_prompts, mtbench_prompts

    return [row["prompt"] for row in humaneval_prompts().select(range(args.eval))] + [
        row["prompt"] for row in mtbench_prompts().select(range(args.eval))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--held-out", type=int, default=None, metavar="N")
    parser.add_argument("--kinds", choices=("default", "task", "mined"), default="task")
    parser.add_argument("--eval", type=int, default=None, metavar="N", help="N HumanEval + N MT-Bench prompts")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--nodes", type=node_budget, nargs="+", default=[4, 8, 16], help="node budgets, or auto")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: every method samples")
    parser.add_argument("--compile", action="store_true",
                        help="spec_generate(compile=True) for every xPress method, and compiled plain generate too "
                        "(static cache, transformers' torch.compile); everything is compiled before timing")
    parser.add_argument("--json", default=None, help="also write the per-method totals here")
    parser.add_argument("--record", default=None, help="per-prompt JSON lines: appended as prompts finish; prompts "
                        "already recorded with the same settings are skipped (resume a long run)")
    parser.add_argument("--stop-after", type=float, default=None, metavar="MINUTES",
                        help="stop after the prompt that crosses this many minutes (with --record, resume later)")
    args = parser.parse_args()
    if not args.held_out and not args.eval:
        parser.error("pass --held-out N or --eval N")
    if args.stop_after is not None and not args.record:
        parser.error("--stop-after needs --record, to resume from")

    target, tokenizer = load_smollm2(dtype=torch.float32)
    xpress = AutoModel.from_pretrained(str(BUNDLED_CHECKPOINT), trust_remote_code=True, dtype=torch.float32).eval()
    prompts = chat_prompt_ids(tokenizer, prompt_texts(args))
    table = methods(xpress, args.nodes)
    plains = ["plain", *(["plain, compiled"] if args.compile else [])]
    totals = {name: {"seconds": 0.0, "tokens": 0, "steps": 0, "accepted": 0, "identical": 0}
              for name in [*plains, *table]}
    cache_len = 256 * -(-(max(ids.shape[1] for ids in prompts) + args.max_new_tokens + 64 + 32) // 256)
    compiled = {"compile": True, "max_cache_len": cache_len} if args.compile else {}
    greedy = args.temperature == 0
    sampling = {"do_sample": False} if greedy else {"do_sample": True, "temperature": args.temperature, "top_k": 0,
                                                    "top_p": 1.0}  # fmt: skip

    def run(name, ids):
        if name in plains:
            extra = compiled_plain_kwargs(cache_len) if name == "plain, compiled" else {}
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  **sampling, **extra)  # fmt: skip
            return out, time.perf_counter() - start, None
        kwargs, overrides = table[name]
        with config_setting(xpress, **overrides):
            start = time.perf_counter()
            out = xpress.spec_generate(target, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                       **kwargs, **compiled)  # fmt: skip
            return out.sequences, time.perf_counter() - start, out.stats

    settings = {k: getattr(args, k) for k in ("held_out", "kinds", "eval", "max_new_tokens", "nodes", "temperature",
                                              "compile")}  # fmt: skip
    recorded = {}
    if args.record and Path(args.record).exists():
        for line in Path(args.record).read_text().splitlines():
            row = json.loads(line)
            if row["settings"] == settings and set(row["methods"]) == set(totals):
                recorded[row["prompt"]] = row
    todo = [i for i in range(len(prompts)) if i not in recorded]
    if todo:
        for name in totals:  # warm up every path (and choose the linear cap) before timing
            run(name, prompts[0][:, :8])
    environment = environment_info(target)
    machine = {"cpu": environment["cpu"], "threads": environment["torch_threads"], "torch": environment["torch"]}
    start = time.perf_counter()
    for i in todo:
        ids, row = prompts[i], {}
        reference = None
        for name in totals:
            torch.manual_seed(i)
            sequences, seconds, stats = run(name, ids)
            reference = sequences if reference is None else reference
            row[name] = {"seconds": seconds, "tokens": sequences.shape[1] - ids.shape[1],
                         "steps": len(stats.acceptance_lengths) if stats else 0,
                         "accepted": sum(stats.acceptance_lengths) if stats else 0,
                         "identical": int(torch.equal(sequences, reference))}  # fmt: skip
        recorded[i] = {"prompt": i, "settings": settings, "machine": machine, "methods": row}
        if args.record:
            with open(args.record, "a") as f:
                f.write(json.dumps(recorded[i]) + "\n")
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
        if args.stop_after is not None and time.perf_counter() - start > 60 * args.stop_after:
            print(f"stopped after {args.stop_after:g} minutes; run again with the same --record to go on")
            break
    for row in recorded.values():
        for name, figures in row["methods"].items():
            for key, value in figures.items():
                totals[name][key] += value

    plain_rate = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    loops = "compiled loops" if args.compile else "eager loops"
    decoding = "greedy" if greedy else f"T={args.temperature:g}"
    machines = sorted({json.dumps(row["machine"], sort_keys=True) for row in recorded.values()})
    print(f"\n{len(recorded)}/{len(prompts)} prompts x {args.max_new_tokens} new tokens, fp32 {decoding}, {loops}, "
          f"on {'; '.join(machines)}")  # fmt: skip
    print(f"{'method':<24} {'tau':>5} {'tok/s':>7} {'vs plain':>9} identical")
    for name, entry in totals.items():
        rate = entry["tokens"] / entry["seconds"]
        tau = entry["accepted"] / entry["steps"] if entry["steps"] else 1.0
        entry.update(tau=tau, tokens_per_s=rate, vs_plain=rate / plain_rate, identical=entry["identical"] if greedy else None)
        same = f"{entry['identical']}/{len(recorded)}" if greedy else "n/a"
        print(f"{name:<24} {tau:5.2f} {rate:7.1f} {rate / plain_rate:8.2f}x {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "prompts_done": len(recorded), "prompts": len(prompts),
                       "machines": [json.loads(m) for m in machines], "totals": totals}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
