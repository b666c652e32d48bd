"""The drafter's products in bfloat16 ("auto" where faster, `cpu_layouts.Bfloat16Linear`) against the same loop with
them kept in float32, side by side in one process, on a bundled pair and held-out prompts of its training generator.

    python examples/drafter_precision_ab.py --target gemma --prompts 10 --max-new-tokens 96

Six decoders per prompt, in turn (so load spikes hit them all): plain `generate`, plain `generate` with a static cache
and `torch.compile`, and `spec_generate` eager and compiled, each with the drafter's products in float32 and with
"auto" free to choose bfloat16. Each xPress setting has its own drafter instance, so its compiled decoder keeps the
layouts decided for it. Prints tokens/s, the ratios, τ, drafts per block, greedy identity against plain `generate`,
and the drafter products' timing that decided bfloat16.
"""

import argparse
import time

import torch

import modeling_xpress.cpu_layouts as layouts
from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import DTYPES, load_gguf_target
from modeling_xpress.bench.benchmark import compiled_plain_kwargs, prompt_ids
from modeling_xpress.bench.demo import BUNDLED, bundled_pair
from modeling_xpress.decoding import spec_generate
from modeling_xpress.training.prompts import GENERATORS
from modeling_xpress.training.regeneration import held_out_prompts

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--target", choices=sorted(BUNDLED), default="smollm2")
parser.add_argument("--prompts", type=int, default=10, help="number of held-out prompts")
parser.add_argument("--max-new-tokens", type=int, default=96)
parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
parser.add_argument("--threads", type=int, default=2)


def main() -> None:
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pair = bundled_pair(args.target)
    target, tokenizer = load_gguf_target(pair.target, DTYPES[args.dtype])
    drafters = {bf16: XPressModel.from_pretrained(str(pair.checkpoint), dtype=DTYPES[args.dtype]).eval()
                for bf16 in (False, True)}  # fmt: skip
    prompts = prompt_ids(tokenizer, held_out_prompts(args.prompts, kinds=GENERATORS[pair.settings_kinds]),
                         chat=pair.chat)
    n = args.max_new_tokens
    max_cache_len = max(ids.shape[1] for ids in prompts) + n + 2 * drafters[False].config.block_size
    timed_pays = layouts.bfloat16_pays

    def plain(kwargs):
        return lambda ids: (target.generate(ids, **kwargs)[0, ids.shape[1] :].tolist(), None)

    def xpress(compile: bool, bf16: bool):
        def run(ids):
            layouts.bfloat16_pays = timed_pays if bf16 else (lambda *args, **kwargs: False)
            try:
                out = spec_generate(drafters[bf16], target, ids, max_new_tokens=n, compile=compile,
                                    max_cache_len=max_cache_len if compile else None)  # fmt: skip
            finally:
                layouts.bfloat16_pays = timed_pays
            lengths = out.stats.draft_lengths
            return out.sequences[0, ids.shape[1] :].tolist(), (out.stats.mean_tau, sum(lengths) / len(lengths))

        return run

    greedy = dict(max_new_tokens=n, do_sample=False)
    decoders = {"plain": plain(greedy), "plain compiled": plain(dict(greedy, **compiled_plain_kwargs(max_cache_len)))}
    for compile in (False, True):
        for bf16 in (False, True):
            name = f"{'compiled' if compile else 'eager'} {'auto' if bf16 else 'float32 drafter'}"
            decoders[name] = xpress(compile, bf16)
    totals = {name: {"seconds": 0.0, "tokens": 0, "stats": [], "identical": 0} for name in decoders}
    with torch.inference_mode():
        for name, run in decoders.items():  # warm-up: compilation, layouts, drafts per block
            start = time.perf_counter()
            run(prompts[0])
            print(f"warm-up {name}: {time.perf_counter() - start:.1f}s", flush=True)
        for i, ids in enumerate(prompts):
            reference = None
            for name, run in decoders.items():
                start = time.perf_counter()
                tokens, stats = run(ids)
                total = totals[name]
                total["seconds"] += time.perf_counter() - start
                total["tokens"] += len(tokens)
                reference = tokens if reference is None else reference
                total["identical"] += tokens == reference
                if stats is not None:
                    total["stats"].append(stats)
            print(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{name} {t['tokens'] / t['seconds']:.1f}" for name, t in totals.items()), flush=True)  # fmt: skip

    speed = {name: t["tokens"] / t["seconds"] for name, t in totals.items()}
    print(f"\n{'decoder':26s} {'tok/s':>6s} {'vs plain':>8s} {'vs compiled plain':>17s} {'tau':>5s} {'drafts':>6s} "
          f"identical")  # fmt: skip
    for name, t in totals.items():
        tau = drafts = ""
        if t["stats"]:
            tau = f"{sum(s[0] for s in t['stats']) / len(t['stats']):.2f}"
            drafts = f"{sum(s[1] for s in t['stats']) / len(t['stats']):.1f}"
        print(f"{name:26s} {speed[name]:6.2f} {speed[name] / speed['plain']:8.2f} "
              f"{speed[name] / speed['plain compiled']:17.2f} {tau:>5s} {drafts:>6s} {t['identical']}/{len(prompts)}")
    for (against, _, rows, threads), (bf16, fp32) in layouts._BF16_TIMINGS.items():
        print(f"drafter products over {rows} rows, {threads} threads: {fp32 * 1e3:.1f} ms float32 ({against}), "
              f"{bf16 * 1e3:.1f} ms bfloat16")


if __name__ == "__main__":
    main()
