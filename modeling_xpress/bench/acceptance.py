"""What a checkpoint carries about itself: `draft_acceptance` and `tree_acceptance`, measured by greedy decoding of
held-out prompts (the same measurements as `examples/choose_draft_length.py`'s whole-block setting and
`examples/tree_benchmark.py`'s head trees, for one model at a time: what the pipeline's measure stage runs).

Per prompt, `measure_prompt` decodes with plain `target.generate` (the reference), with whole linear blocks (every
draft verified: each block's accepted length and drafts give `draft_acceptance`, `draft_cap.acceptance_from_blocks`),
with the head switched off (`jacobi_max_iters=0`: the drafter's own marginals, for comparison) and with draft trees of
each node budget (τ per budget: `tree_acceptance`). Every xPress output is checked against the reference: greedy
decoding must give the target's own output. `summarize_acceptance` pools the prompts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..decoding import check_tree_arguments, spec_generate
from ..draft_cap import acceptance_from_blocks
from .benchmark import config_setting, run_plain


def tree_refusal(target) -> str | None:
    """Why the decoding loop refuses draft trees for this target (its own check, e.g. sliding-window layers), or None."""
    try:
        check_tree_arguments(target, 1, None, None, None, None, None)
    except ValueError as error:
        return str(error)
    return None


def _decode(xpress, target, ids: torch.Tensor, reference: torch.Tensor, max_new_tokens: int, **kwargs) -> dict:
    start = time.perf_counter()
    out = spec_generate(xpress, target, ids, max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)
    return {
        "seconds": round(time.perf_counter() - start, 4),
        "acceptance_lengths": list(out.stats.acceptance_lengths),
        "draft_lengths": list(out.stats.draft_lengths),
        "identical": bool(torch.equal(out.sequences, reference)),
    }


@torch.inference_mode()
def measure_prompt(target, xpress, ids: torch.Tensor, max_new_tokens: int, tree_nodes: Sequence[int] = ()) -> dict:
    """One held-out prompt ((1, T) ids): plain greedy decoding, whole linear blocks with the head on and off, and a
    tree of each of `tree_nodes` nodes (pass none where `tree_refusal(target)` says why not)."""
    reference, plain_seconds = run_plain(target, ids, max_new_tokens, 0.0, 0)
    whole = xpress.config.block_size - 1
    linear = dict(num_assistant_tokens=whole, assistant_confidence_threshold=0.0)  # every draft of every block
    record = {"prompt_tokens": ids.shape[1], "new_tokens": int(reference.shape[1] - ids.shape[1]),
              "plain_seconds": round(plain_seconds, 4),
              "linear": _decode(xpress, target, ids, reference, max_new_tokens, **linear)}  # fmt: skip
    with config_setting(xpress, jacobi_max_iters=0):
        record["head_off"] = _decode(xpress, target, ids, reference, max_new_tokens, **linear)
    record["trees"] = {str(n): _decode(xpress, target, ids, reference, max_new_tokens, tree_nodes=n) for n in tree_nodes}
    return record


def _tau(runs: list[dict]) -> float:
    lengths = [a for run in runs for a in run["acceptance_lengths"]]
    return sum(lengths) / len(lengths) if lengths else 1.0


def summarize_acceptance(records: Sequence[dict], block_size: int) -> dict:
    """Pool `measure_prompt` records: `draft_acceptance` (s_1..s_{B-1} of the whole linear blocks), τ with the head on
    and off, `tree_acceptance` {N: τ}, and how many outputs were the target's own (every one must be)."""
    linear = [r["linear"] for r in records]
    budgets = list(records[0]["trees"]) if records else []
    runs = linear + [r["head_off"] for r in records] + [r["trees"][n] for r in records for n in budgets]
    return {
        "prompts": len(records),
        "draft_acceptance": acceptance_from_blocks(
            [a for run in linear for a in run["acceptance_lengths"]], [d for run in linear for d in run["draft_lengths"]],
            block_size,
        ),
        "tau": _tau(linear),
        "tau_head_off": _tau([r["head_off"] for r in records]),
        "tree_acceptance": {int(n): _tau([r["trees"][n] for r in records]) for n in budgets},
        "identical": sum(run["identical"] for run in runs),
        "outputs": len(runs),
        "new_tokens": sum(r["new_tokens"] for r in records),
    }
