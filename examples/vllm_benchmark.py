"""xPress in vLLM against vLLM plain and vLLM dFlash with the same drafter and the head off, in one run.

Two steps, because vLLM lives in its own virtualenv (`make vllm`) and the held-out prompts come from the training
package (which needs `datasets`, in .venv):

    .venv/bin/python examples/vllm_benchmark.py prompts --held-out 16 --out runs/vllm/prompts.json
    .venv-vllm/bin/python examples/vllm_benchmark.py run --prompts runs/vllm/prompts.json --json runs/vllm/result.json

`prompts` writes token ids, so every engine sees identical inputs: chat-templated (the target's own template) for an
instruct target, plain text with the tokenizer's BOS for a base model. `--target` names a bundled pair (`smollm2`,
the default, or `gemma`: Gemma-3-270M, a base model, with its held-out completion prompts) or a target folder; a
pair's checkpoint is the default `--checkpoint`:

    .venv/bin/python examples/vllm_benchmark.py prompts --target gemma --held-out 8 --out runs/vllm/gemma.json
    .venv-vllm/bin/python examples/vllm_benchmark.py run --target gemma --prompts runs/vllm/gemma.json --temperatures 0

`run` starts one vLLM engine per method, one after the other, each in its own process: vLLM plain; `dflash`, the
xPress checkpoint with its head switched off (`jacobi_max_iters=0`); `xpress`, the checkpoint as saved; `xpress-dyn`,
the same with vLLM's dynamic schedule (drafts only while at most `--speculate-up-to` requests run, as `make serve`).
Each engine runs every batch size and temperature: output tokens per second, τ from vLLM's own spec-decode counters
(1 + accepted / drafts), and at T=0 whether each output equals vLLM plain's at the same batch size. Timing starts
after a warm-up request; engine start-up (and vLLM's compilation) is not counted. Each setting starts from an empty
prefix cache, so every engine prefills every prompt in full: the settings reuse the same prompts, and a prefix-cache
hit is worth more to vLLM plain than to a speculative engine, which gives up the last matched block (128 tokens on
CPU) to recompute the hidden states its drafter reads. Without the reset, plain took 640 of the 16 held-out prompts'
1,690 tokens from the cache of earlier settings and the speculative engines none.

One run varies by up to ±20% here. `--repeats R` passes over every setting R times inside each engine, and
`--rounds N` starts the engines N times, interleaved (plain, xpress, plain, xpress, ...); the table then gives the
median tok/s of each method, the ratio of medians, and the range of the ratios of samples taken side by side.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from modeling_xpress.bench.demo import BUNDLED

CHECKPOINT = BUNDLED["smollm2"].checkpoint  # with a target folder and no --checkpoint
METHODS = ("plain", "dflash", "xpress", "xpress-dyn")


def resolve_target(args) -> bool | None:
    """`--target NAME` of a bundled pair: its target folder (converted once from its GGUF), its checkpoint unless
    `--checkpoint` is given, and its held-out prompt kinds unless `--kinds` is. Returns whether prompts are chat turns
    (None for a target folder: whether its tokenizer has a chat template)."""
    chat = None
    if args.target in BUNDLED:
        from modeling_xpress.bench.assets import gguf_target_dir

        pair = BUNDLED[args.target]
        args.target, chat = str(gguf_target_dir(pair.target)), pair.chat
        if getattr(args, "kinds", "") is None:
            args.kinds = pair.held_out_kinds
        if getattr(args, "checkpoint", "") is None:
            args.checkpoint = str(pair.checkpoint)
    if getattr(args, "kinds", "") is None:
        args.kinds = "task"
    if getattr(args, "checkpoint", "") is None:
        args.checkpoint = str(CHECKPOINT)
    return chat


def write_prompts(args, chat: bool | None) -> None:
    from transformers import AutoTokenizer

    from modeling_xpress.bench.benchmark import prompt_ids
    from modeling_xpress.training.prompts import GENERATORS
    from modeling_xpress.training.regeneration import held_out_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    texts = held_out_prompts(args.held_out, kinds=GENERATORS[args.kinds])
    chat = bool(tokenizer.chat_template) if chat is None else chat
    ids = [t[0].tolist() for t in prompt_ids(tokenizer, texts, chat=chat)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"source": f"held-out {args.kinds} prompts", "prompt_token_ids": ids}))
    print(f"wrote {len(ids)} prompts ({min(map(len, ids))}..{max(map(len, ids))} tokens) to {args.out}")


def head_off_checkpoint(folder: Path, out: Path) -> Path:
    """The same checkpoint with its head switched off (`jacobi_max_iters=0`): the drafter's own marginals."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["jacobi_max_iters"] = 0
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in os.listdir(folder):
        if name != "config.json" and not (out / name).exists():
            (out / name).symlink_to(folder / name)
    return out


def spec_counters(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, from vLLM's spec-decode counters."""
    values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}  # counters; the per-position ones are Vectors
    return int(values.get("vllm:spec_decode_num_drafts", 0)), int(values.get("vllm:spec_decode_num_accepted_tokens", 0))


def describe_drafter(worker) -> dict:
    """Runs inside a vLLM worker: which proposer and drafter classes it built, and the head it loaded."""
    drafter = getattr(worker.model_runner, "drafter", None)
    model = getattr(drafter, "model", None)
    refiner = getattr(model, "refiner", None)
    return {"proposer": type(drafter).__name__, "model": type(model).__name__,
            "head": None if refiner is None else type(refiner).__name__,
            "head_sum": None if refiner is None else float(sum(p.double().abs().sum() for p in refiner.parameters()))}  # fmt: skip


def run_engine(args) -> None:
    """One method's engine: every batch size and temperature; writes {setting: result} JSON to args.out."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(Path(args.prompts).read_text())["prompt_token_ids"]]
    spec = None
    if args.method != "plain":
        model = args.checkpoint
        if args.method == "dflash":
            model = str(head_off_checkpoint(Path(args.checkpoint), Path(tempfile.mkdtemp()) / "head-off"))
        spec = {"method": "dflash", "model": model, "num_speculative_tokens": args.k,
                "draft_sample_method": args.draft_sampling}
        if args.method == "xpress-dyn":  # vLLM's dynamic schedule: K drafts up to B running requests, none above
            b = args.speculate_up_to
            spec["num_speculative_tokens_per_batch_size"] = [[1, b, args.k], [b + 1, max(max(args.batches), b + 1), 0]]
    llm = LLM(model=args.target, dtype=args.dtype, speculative_config=spec, max_num_seqs=max(args.batches),
              gpu_memory_utilization=args.memory, max_model_len=args.max_model_len, disable_log_stats=False,
              enforce_eager=args.eager, seed=0)  # fmt: skip
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # warm-up
    results = {}
    for repeat in range(args.repeats):  # repeats interleave the settings, so a slow spell does not hit one setting
        for temperature in args.temperatures:
            for batch in args.batches:
                params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens[i % len(args.max_tokens)],
                                         seed=None) for i in range(len(prompts))]  # fmt: skip
                llm.reset_prefix_cache()  # every setting prefills its prompts in full, as fresh requests would
                drafts0, accepted0 = spec_counters(llm)
                outputs, start = [], time.perf_counter()
                for i in range(0, len(prompts), batch):
                    outputs += llm.generate(prompts[i : i + batch], params[i : i + batch], use_tqdm=False)
                seconds = time.perf_counter() - start
                drafts, accepted = spec_counters(llm)
                tokens = [list(o.outputs[0].token_ids) for o in outputs]
                setting = f"T={temperature:g} batch={batch}"
                r = results.setdefault(setting, {"temperature": temperature, "batch": batch, "seconds": [],
                                                 "new_tokens": [], "tokens_per_s": [], "drafts": 0, "accepted": 0,
                                                 "outputs": []})  # fmt: skip
                r["seconds"].append(seconds)
                r["new_tokens"].append(sum(map(len, tokens)))
                r["tokens_per_s"].append(sum(map(len, tokens)) / seconds)
                r["drafts"] += drafts - drafts0
                r["accepted"] += accepted - accepted0
                r["outputs"].append(tokens)
                print(f"{args.method:10s} {setting}: {r['tokens_per_s'][-1]:6.1f} tok/s", flush=True)
    for r in results.values():
        r["tau"] = 1 + r["accepted"] / r["drafts"] if r["drafts"] else None  # vLLM's τ over all repeats
    if spec is not None:  # needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set by `run`) to send the function
        results["drafter"] = llm.collective_rpc(describe_drafter)[0]
    Path(args.out).write_text(json.dumps(results))


def engine_command(args, method: str, out: str) -> list[str]:
    return [sys.executable, __file__, "engine", "--method", method, "--out", out, "--prompts", args.prompts,
            "--checkpoint", args.checkpoint, "--target", args.target, "--dtype", args.dtype, "--k", str(args.k),
            "--max-tokens", *map(str, args.max_tokens), "--memory", str(args.memory),
            "--max-model-len", str(args.max_model_len), "--draft-sampling", args.draft_sampling,
            "--speculate-up-to", str(args.speculate_up_to), "--repeats", str(args.repeats),
            "--batches", *map(str, args.batches),
            "--temperatures", *map(str, args.temperatures)] + (["--eager"] if args.eager else [])  # fmt: skip


def run(args) -> None:
    import vllm

    # raw[method]: one {setting: result} per round; the rounds interleave the engines (plain, xpress, plain, ...)
    raw, failed, drafters = {}, [], {}
    for round_ in range(args.rounds):
        for method in args.methods:
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                done = subprocess.run(engine_command(args, method, out.name),
                                      env={**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # fmt: skip
                if done.returncode != 0:  # keep the other engines' figures; say which one failed
                    print(f"\n*** the {method} engine failed in round {round_ + 1} (exit {done.returncode}) ***\n")
                    failed.append(f"{method} (round {round_ + 1})")
                    continue
                result = json.loads(Path(out.name).read_text())
            if "drafter" in result:
                drafters[method] = result.pop("drafter")
            raw.setdefault(method, []).append(result)
    if "plain" not in raw:
        sys.exit(f"the plain engine failed in every round: nothing to compare with ({failed})")
    samples = args.rounds * args.repeats
    print(f"\nvLLM {vllm.__version__}, {args.dtype}, K={args.k}, {'/'.join(map(str, args.max_tokens))} new tokens, "
          f"{len(json.loads(Path(args.prompts).read_text())['prompt_token_ids'])} prompts, "
          f"{'eager' if args.eager else 'compiled (vLLM default)'}, {args.rounds} round(s) x {args.repeats} "
          f"repeat(s): median tok/s; 'vs plain' is the ratio of medians, 'paired' the range of the ratios "
          f"of samples taken side by side (same round, same repeat)")  # fmt: skip
    for method, drafter in drafters.items():
        print(f"{method}: {drafter}")
    print(f"{'setting':18s} {'method':10s} {'tok/s':>7s} {'vs plain':>8s} {'paired':>11s} {'tau':>5s} {'drafts':>6s} "
          f"{'identical':>9s}")  # fmt: skip
    methods = [m for m in args.methods if m in raw]
    rows = []
    plain_samples = {s: [x for rnd in raw["plain"] for x in rnd[s]["tokens_per_s"]] for s in raw["plain"][0]}
    for setting, plain in plain_samples.items():
        plain_outputs = raw["plain"][0][setting]["outputs"][0]
        for method in methods:
            results = [rnd[setting] for rnd in raw[method]]
            speeds = [x for r in results for x in r["tokens_per_s"]]
            drafts, accepted = sum(r["drafts"] for r in results), sum(r["accepted"] for r in results)
            tau = 1 + accepted / drafts if drafts else None
            same = total = None
            if results[0]["temperature"] == 0:  # every sample of every round against plain's first
                outputs = [o for r in results for o in r["outputs"]]
                total = len(plain_outputs) * len(outputs)
                same = sum(a == b for o in outputs for a, b in zip(o, plain_outputs))
            paired = [a / b for a, b in zip(speeds, plain)] if len(speeds) == len(plain) else []
            row = {"setting": setting, "method": method, "temperature": results[0]["temperature"],
                   "batch": results[0]["batch"], "tokens_per_s": statistics.median(speeds), "samples": speeds,
                   "speedup": statistics.median(speeds) / statistics.median(plain),
                   "paired_speedups": paired, "tau": tau, "drafts": drafts, "identical": same, "outputs": total,
                   "new_tokens": [n for r in results for n in r["new_tokens"]]}  # fmt: skip
            rows.append(row)
            spread = f"{min(paired):.2f}-{max(paired):.2f}" if paired and method != "plain" else ""
            print(f"{setting:18s} {method:10s} {row['tokens_per_s']:7.1f} {row['speedup']:7.2f}x {spread:>11s} "
                  f"{'' if tau is None else f'{tau:.2f}':>5s} {'' if method == 'plain' else drafts:>6} "
                  f"{'' if same is None else f'{same}/{total}':>9s}")  # fmt: skip
    if samples > 1:
        print(f"plain's own spread, max/min tok/s over its {samples} samples: " + ", ".join(
            f"{s} {max(v) / min(v):.2f}" for s, v in plain_samples.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        settings = {k: getattr(args, k) for k in ("k", "dtype", "max_tokens", "batches", "temperatures", "eager",
                                                  "draft_sampling", "speculate_up_to", "rounds", "repeats")}
        Path(args.json).write_text(json.dumps({"vllm": vllm.__version__, "settings": settings, "rows": rows,
                                               "drafters": drafters, "failed": failed}, indent=1))  # fmt: skip
    if any(r["identical"] is not None and r["identical"] != r["outputs"] for r in rows):
        sys.exit("greedy outputs differ from vLLM plain (see the table)")
    if failed:
        sys.exit(f"engines that failed: {failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="write the token ids of held-out prompts (run with .venv)")
    p.add_argument("--held-out", type=int, default=16)
    p.add_argument("--kinds", choices=("default", "task", "mined", "completion"), default=None,
                   help="held-out prompts of this training generator (default: the pair's, 'task' for a folder)")
    p.add_argument("--target", default="smollm2", help=f"a bundled pair {sorted(BUNDLED)} or a target folder")
    p.add_argument("--out", required=True)
    for name in ("run", "engine"):
        p = sub.add_parser(name, help="measure (run with .venv-vllm)" if name == "run" else argparse.SUPPRESS)
        p.add_argument("--prompts", required=True)
        p.add_argument("--checkpoint", default=None, help="xPress folder (default: the pair's bundled checkpoint)")
        p.add_argument("--target", default="smollm2", help=f"a bundled pair {sorted(BUNDLED)} or a target folder")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
        p.add_argument("--max-tokens", type=int, nargs="+", default=[128],
                       help="new tokens per request; several values are cycled over the prompts (staggered finishes)")
        p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
        p.add_argument("--repeats", type=int, default=1, help="passes over every setting inside each engine")
        p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
        p.add_argument("--memory", type=float, default=0.3, help="gpu_memory_utilization: on CPU, the share of RAM for KV")
        p.add_argument("--max-model-len", type=int, default=2048)
        p.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile) for every engine")
        p.add_argument("--draft-sampling", choices=("greedy", "probabilistic"), default="probabilistic",
                       help="vLLM's draft_sample_method: probabilistic drafts are drawn from q (the head's refined "
                       "distribution) and verified with it; greedy drafts are argmax tokens verified as one-hot")
        p.add_argument("--speculate-up-to", type=int, default=2, metavar="B",
                       help="xpress-dyn: speculate only while at most B requests run (vLLM's "
                       "num_speculative_tokens_per_batch_size; 2 was chosen on held-out prompts, docs/results.md)")
        if name == "run":
            p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
            p.add_argument("--json", default=None)
            p.add_argument("--rounds", type=int, default=1,
                           help="start every engine this many times, interleaved (plain, xpress, plain, xpress, ...)")
        else:
            p.add_argument("--method", choices=METHODS, required=True)
            p.add_argument("--out", required=True)
    args = parser.parse_args()
    chat = resolve_target(args)
    if args.command == "prompts":
        write_prompts(args, chat)
    else:
        {"run": run, "engine": run_engine}[args.command](args)


if __name__ == "__main__":
    main()
