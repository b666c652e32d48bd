"""Make the drafter's training data: SmolLM2-135M-Instruct answers our own generated prompts.

    python examples/make_training_data.py --n-prompts 2400 --max-new-tokens 256 --batch-size 32 \
        --out data/smollm2_responses --shard-dir cache/regen_shards

    python examples/make_training_data.py --kinds task --n-prompts 3200 --dtype bfloat16 \
        --out data/smollm2_task_responses --shard-dir cache/regen_task_shards      # task-shaped prompts

    python examples/make_training_data.py --kinds mined --n-prompts 1600 --dtype float32 \
        --out data/smollm2_mined_responses --shard-dir cache/regen_mined_shards    # mined from the standard library

On a 2-core CPU this takes the better part of an hour, so run it in the background. Finished shards
are kept in --shard-dir; rerunning the same command resumes where it stopped. The result is
<out>/responses.parquet (columns input_ids, loss_mask) and <out>/meta.json (counts, token totals,
timings and settings); read it with `modeling_xpress.training.regeneration.load_responses(out)`.
"""

import argparse
import json
import time
from collections import Counter

import torch

from modeling_xpress.bench import assets
from modeling_xpress.training.mined_prompts import mined_corpus_version
from modeling_xpress.training.prompts import GENERATORS, training_prompts
from modeling_xpress.training.regeneration import (
    regenerate_responses,
    response_set_meta,
    stop_token_ids,
    write_response_set,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n-prompts", type=int, default=2400)
    parser.add_argument("--first-prompt", type=int, default=0,
                        help="answer prompts first..n-1 only: training_prompts(n) is prefix-stable, so a larger set "
                             "can extend an existing one (e.g. --n-prompts 7200 --first-prompt 2400)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt generator (and of sampling)")
    parser.add_argument("--kinds", choices=sorted(GENERATORS), default="default",
                        help="default: code, math and chat prompts; task: function stubs, role play, extraction, "
                        "reasoning puzzles and essays (modeling_xpress.training.prompts.TASK_KINDS; prompts "
                        "3000..3199 held out); mined: the standard library's documented functions as stubs to "
                        "complete or code to explain, its documentation as passages (MINED_KINDS; prompts 3000..3199 "
                        "held out)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=sorted(assets.DTYPES), default="float32",
                        help="bfloat16 is ~2x faster on CPUs with AMX; float32 is the exact reference")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads; use 1 when another job shares a 2-core CPU (oversubscribed "
                             "OpenMP threads spin against each other and run several times slower)")
    parser.add_argument("--out", default="data/smollm2_responses")
    parser.add_argument("--shard-dir", default="cache/regen_shards")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2(dtype=assets.DTYPES[args.dtype])
    kinds = GENERATORS[args.kinds]
    prompts = training_prompts(args.n_prompts, seed=args.seed, kinds=kinds)
    if not 0 <= args.first_prompt < args.n_prompts:
        raise SystemExit(f"--first-prompt must be in [0, {args.n_prompts}), got {args.first_prompt}")
    prompts = prompts.select(range(args.first_prompt, args.n_prompts))
    print(f"{len(prompts)} prompts {dict(Counter(prompts['kind']))}; shards in {args.shard_dir}", flush=True)

    start = time.perf_counter()
    responses = regenerate_responses(
        model, tokenizer, prompts,
        max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, do_sample=args.do_sample,
        temperature=args.temperature, shard_dir=args.shard_dir, shard_size=args.shard_size, seed=args.seed,
    )
    wall_time = time.perf_counter() - start

    source = assets.GGUF_PACKAGES[assets.SMOLLM2]
    meta = response_set_meta(
        responses,
        model={"name": source.folder, "dtype": args.dtype,
               "source": f"PyPI {source.package}=={source.version}: {source.member}, dequantised by transformers"},
        prompts={"generator": "modeling_xpress.training.prompts.training_prompts", "n": len(prompts),
                 "seed": args.seed, "indices": [args.first_prompt, args.n_prompts], "kinds": list(kinds)}
                | ({"mined_from": f"the standard library of {mined_corpus_version()}"} if args.kinds == "mined" else {}),
        generation={"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample,
                    "temperature": args.temperature if args.do_sample else None, "batch_size": args.batch_size,
                    "shard_size": args.shard_size, "system_prompt": "chat template default"},
        kinds=prompts["kind"], stop_ids=stop_token_ids(model, tokenizer), shard_dir=args.shard_dir,
        wall_seconds=wall_time,
    )  # fmt: skip
    write_response_set(args.out, responses, meta)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
