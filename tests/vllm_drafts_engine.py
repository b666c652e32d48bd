"""Run by test_vllm_plugin.py with .venv-vllm's Python: greedy continuations from vLLM with an xPress drafter, each
prompt alone and then all at once, and every proposal the drafter made for a prompt alone (recorded inside vLLM's
worker, where the proposer picks its tokens), written as JSON. The test replays each proposal with transformers'
target and `XPressModel` and compares.

    python tests/vllm_drafts_engine.py TARGET CHECKPOINT PROMPTS.json OUT.json --k 3 --max-tokens 16
"""

import argparse
import json

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def record_proposals(worker) -> None:
    """Inside the worker: keep what the proposer's token choice (`_sample_draft_tokens`) returns, step by step."""
    proposer = worker.model_runner.drafter
    choose = proposer._sample_draft_tokens
    proposer.recorded = []

    def recording(hidden_states, sampling_metadata):
        tokens, probs = choose(hidden_states, sampling_metadata)
        proposer.recorded.append(tokens.tolist())
        return tokens, probs

    proposer._sample_draft_tokens = recording


def take_proposals(worker) -> list[list[int]]:
    proposer = worker.model_runner.drafter
    recorded, proposer.recorded = proposer.recorded, []
    return recorded


def served_classes(worker) -> dict[str, str]:
    runner = worker.model_runner
    return {"target": type(runner.model).__name__, "drafter": type(runner.drafter.model).__name__}


def context_waits(worker) -> bool | None:
    """Whether the proposer keeps context writes of steps without drafts for later (`context.context_can_wait`)."""
    return getattr(worker.model_runner.drafter, "_context_waits", None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("checkpoint")
    parser.add_argument("prompts", help="JSON with prompt_token_ids")
    parser.add_argument("out")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    spec = {"method": "dflash", "model": args.checkpoint, "num_speculative_tokens": args.k}
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.load(open(args.prompts))["prompt_token_ids"]]
    llm = LLM(model=args.target, dtype=args.dtype, speculative_config=spec, enforce_eager=args.eager,
              max_model_len=256, gpu_memory_utilization=0.2, disable_log_stats=False, seed=0,
              max_num_seqs=len(prompts))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.collective_rpc(record_proposals)
    alone = []
    for prompt in prompts:
        tokens = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        alone.append({"tokens": tokens, "proposals": llm.collective_rpc(take_proposals)[0]})
    together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    with open(args.out, "w") as f:
        json.dump({"alone": alone, "together": together, "drafts": counters.get("vllm:spec_decode_num_drafts"),
                   "accepted": counters.get("vllm:spec_decode_num_accepted_tokens"),
                   "classes": llm.collective_rpc(served_classes)[0],
                   "context_waits": llm.collective_rpc(context_waits)[0]}, f)  # fmt: skip


if __name__ == "__main__":
    main()
