"""Run by test_vllm_plugin.py with .venv-vllm's Python: many sampled continuations of one prompt from vLLM with an
xPress drafter (probabilistic drafts), written as JSON for the χ² test in the main environment.

    python tests/vllm_sampling_engine.py TARGET CHECKPOINT OUT.json --samples 3000
"""

import argparse
import json

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--prompt", type=int, nargs="+", default=[5, 17, 3])
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    spec = {"method": "dflash", "model": args.checkpoint, "num_speculative_tokens": 3,
            "draft_sample_method": "probabilistic"}  # fmt: skip
    llm = LLM(model=args.target, dtype="float32", speculative_config=spec, enforce_eager=True, max_model_len=64,
              gpu_memory_utilization=0.2, disable_log_stats=False, seed=0, max_num_seqs=64)  # fmt: skip
    params = [SamplingParams(temperature=args.temperature, max_tokens=3, seed=i, ignore_eos=True)
              for i in range(args.samples)]  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=args.prompt)] * args.samples, params, use_tqdm=False)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    with open(args.out, "w") as f:
        json.dump({"sequences": [list(o.outputs[0].token_ids) for o in outputs],
                   "drafts": counters.get("vllm:spec_decode_num_drafts"),
                   "accepted": counters.get("vllm:spec_decode_num_accepted_tokens")}, f)  # fmt: skip


if __name__ == "__main__":
    main()
