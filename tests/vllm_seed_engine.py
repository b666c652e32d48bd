"""Run by test_vllm_plugin.py with .venv-vllm's Python: one seeded request, sent alone three times and inside batches
of different compositions (other prompts, greedy, unseeded and other-seeded requests, another copy of itself), through
one vLLM engine; writes {case: [token ids of the seeded request, ...]} as JSON.

    python tests/vllm_seed_engine.py TARGET PROMPTS.json OUT.json --method xpress --checkpoint CHECKPOINT
"""

import argparse
import json

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

SEED = 1234


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("prompts", help="JSON with prompt_token_ids: the first is the seeded request's")
    parser.add_argument("out")
    parser.add_argument("--method", choices=("plain", "xpress"), required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7])
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--schedule", type=int, default=None, metavar="B",
                        help="vLLM's dynamic schedule: draft only while at most B requests run (make serve: 2)")
    args = parser.parse_args()
    spec = None
    if args.method == "xpress":
        spec = {"method": "dflash", "model": args.checkpoint, "num_speculative_tokens": 3,
                "draft_sample_method": "probabilistic"}  # fmt: skip
        if args.schedule:
            spec["num_speculative_tokens_per_batch_size"] = [[1, args.schedule, 3], [args.schedule + 1, 16, 0]]
    llm = LLM(model=args.target, dtype="float32", speculative_config=spec, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.2, disable_log_stats=False, seed=0, max_num_seqs=16)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(open(args.prompts))["prompt_token_ids"]]
    other = prompts[1:]
    results = {}
    for temperature in args.temperatures:
        request = (prompts[0], SamplingParams(temperature=temperature, seed=SEED, max_tokens=args.max_tokens))

        def others(*kinds):  # other requests around it: greedy, unseeded, another seed; staggered lengths
            made = {"greedy": SamplingParams(temperature=0, max_tokens=12),
                    "unseeded": SamplingParams(temperature=1.0, max_tokens=20),
                    "other seed": SamplingParams(temperature=temperature, seed=SEED + 1, max_tokens=30)}  # fmt: skip
            return [(other[i % len(other)], made[kind]) for i, kind in enumerate(kinds)]

        cases = {
            "alone 1": [request],
            "alone 2": [request],
            "alone 3": [request],
            "first of 3": [request, *others("unseeded", "greedy")],
            "third of 5": [*others("other seed", "unseeded"), request, *others("greedy", "unseeded")],
            "last of 4, with a copy": [*others("greedy"), request, *others("unseeded"), request],
        }
        for name, batch in cases.items():
            outputs = llm.generate([p for p, _ in batch], [s for _, s in batch], use_tqdm=False)
            results[f"T={temperature:g} {name}"] = [list(outputs[i].outputs[0].token_ids)
                                                    for i, item in enumerate(batch) if item is request]  # fmt: skip
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    results["drafts"] = counters.get("vllm:spec_decode_num_drafts")
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
