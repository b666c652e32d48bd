"""What a frequency-ranked draft vocabulary does to the bundled SmolLM2 checkpoint: lm_head and refiner time per
block, τ, and the speed of `spec_generate`, for several vocabulary sizes, measured side by side in one run.

    python examples/draft_vocabulary.py --sizes 2048 4096 8192 --prompts 8 --max-new-tokens 96 --threads 1

The vocabulary is ranked on the training responses (`data/smollm2_responses`); the prompts are a held-out split of
the training prompt generator (`training_prompts(7200)` rows 7000.., never trained on, never HumanEval/MT-Bench).
The restriction is applied to the trained checkpoint as it is (`with_draft_vocabulary`: the head keeps its readout
rows of the kept tokens); a drafter trained with the restriction would do at least as well on them.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from modeling_xpress import XPressModel
from modeling_xpress.bench.assets import DTYPES, load_smollm2
from modeling_xpress.bench.benchmark import chat_prompt_ids, environment_info
from modeling_xpress.bench.demo import BUNDLED_CHECKPOINT
from modeling_xpress.training.regeneration import held_out_prompts, load_responses
from modeling_xpress.training import frequency_ranked_vocabulary, with_draft_vocabulary



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data", default="data/smollm2_responses")
    parser.add_argument("--out", default="benchmarks/results/smollm2-draft-vocabulary.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    target, tokenizer = load_smollm2(dtype=DTYPES[args.dtype])
    full = XPressModel.from_pretrained(BUNDLED_CHECKPOINT, dtype=DTYPES[args.dtype]).eval()
    responses = load_responses(args.data)
    methods = {"full": full}
    coverage = {}
    response_tokens = torch.tensor([t for row in responses for t, m in zip(row["input_ids"], row["loss_mask"]) if m])
    for size in args.sizes:
        ids = frequency_ranked_vocabulary(responses, size, always=(tokenizer.eos_token_id,))
        methods[f"top{size}"] = with_draft_vocabulary(full, ids).eval()
        coverage[f"top{size}"] = float(torch.isin(response_tokens, ids).float().mean())
    prompts = held_out_prompts(args.prompts)
    prompt_ids = chat_prompt_ids(tokenizer, prompts)

    records = {name: [] for name in ["plain", *methods]}
    for ids in prompt_ids:  # methods interleaved per prompt, so load changes hit all of them alike
        start = time.perf_counter()
        plain = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        records["plain"].append({"seconds": time.perf_counter() - start, "new_tokens": plain.shape[1] - ids.shape[1]})
        for name, model in methods.items():
            start = time.perf_counter()
            out = model.spec_generate(target, ids, max_new_tokens=args.max_new_tokens)
            seconds = time.perf_counter() - start
            stats = out.stats
            blocks = len(stats.jacobi_iterations)
            records[name].append({
                "seconds": seconds, "new_tokens": stats.new_tokens, "tau": stats.mean_tau, "blocks": blocks,
                "lm_head_ms_per_block": 1e3 * stats.time_lm_head / blocks, "refiner_ms_per_block": 1e3 * stats.time_refiner / blocks,
                "drafter_ms_per_block": 1e3 * stats.time_drafter / blocks, "identical": bool(torch.equal(out.sequences, plain)),
            })  # fmt: skip

    plain_speed = sum(r["new_tokens"] for r in records["plain"]) / sum(r["seconds"] for r in records["plain"])
    summary = {}
    for name in methods:
        rows = records[name]
        speed = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        summary[name] = {
            "draft_vocab_size": methods[name].config.draft_vocab_size or methods[name].config.vocab_size,
            "training_response_token_coverage": coverage.get(name, 1.0),
            "mean_tau": statistics.mean(r["tau"] for r in rows),
            "median_lm_head_ms_per_block": statistics.median(r["lm_head_ms_per_block"] for r in rows),
            "median_refiner_ms_per_block": statistics.median(r["refiner_ms_per_block"] for r in rows),
            "median_drafter_ms_per_block": statistics.median(r["drafter_ms_per_block"] for r in rows),
            "speed_vs_plain": speed / plain_speed,
            "identical": sum(r["identical"] for r in rows),
        }
        print(name, json.dumps(summary[name]))
    result = {"settings": vars(args), "environment": environment_info(target), "prompts": list(prompts),
              "records": records, "summary": summary}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
