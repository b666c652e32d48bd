"""Refiner microbenchmark: the latency of `model.refine` per drafted block, on real drafter outputs.

A short greedy `spec_generate` run records the inputs of the model's first `refine` calls (untimed); each recorded
block is then refined again and again under a wall clock: per K for an xPress head (early exit off, plus the adaptive
setting), the Markov head's serial decode, or the plain argmax of a drafter without a head. `benchmark.run_benchmark`
stores the raw seconds; `reports.summarize` reports median and p10–p90 per setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..decoding import spec_generate
from ..stats import WallClock
from .settings import BenchmarkSettings, sweep_settings


@dataclass
class CapturedBlock:
    """What `refine` received for one real drafted block."""

    hidden: torch.Tensor  # (1, B, H) drafter states of the block's slots, the anchor's first
    base_logits: torch.Tensor  # (1, n, V)
    last_tokens: torch.Tensor  # (1, 2) the token before the anchor, the anchor


class _EnoughBlocks(Exception):
    """Raised inside `refine` once enough blocks are recorded, to end the capture run early."""


@contextlib.contextmanager
def recording_refine_inputs(model, limit: int) -> Iterator[list[CapturedBlock]]:
    """Record the inputs of the model's next `limit` `refine` calls, then raise `_EnoughBlocks` out of the caller.
    An instance attribute shadows the method while recording."""
    captured: list[CapturedBlock] = []
    original = model.refine

    def recording(hidden, base_logits, last_tokens, **kwargs):
        captured.append(CapturedBlock(hidden.detach().clone(), base_logits.detach().clone(), last_tokens.clone()))
        if len(captured) >= limit:
            raise _EnoughBlocks
        return original(hidden, base_logits, last_tokens, **kwargs)

    model.refine = recording
    try:
        yield captured
    finally:
        del model.refine  # the class method is visible again


def capture_blocks(target, model, prompts: Sequence[torch.Tensor], num_blocks: int, max_new_tokens: int):
    """Real drafter outputs for `num_blocks` blocks: greedy `spec_generate` over the prompts, stopped as soon as
    enough were drafted. Not timed (copying the inputs would distort the refiner timer)."""
    with recording_refine_inputs(model, num_blocks) as captured:
        for ids in prompts:
            try:
                spec_generate(model, target, ids, max_new_tokens=max_new_tokens)
            except _EnoughBlocks:
                break
    return captured


def _refine_call(model, block: CapturedBlock, max_iters: int | None, early_exit: bool | None) -> Callable[[], object]:
    return lambda: model.refine(block.hidden, block.base_logits, block.last_tokens, max_iters=max_iters,
                                early_exit=early_exit)  # fmt: skip


def refine_latency_settings(model, settings: BenchmarkSettings) -> list[tuple[str, int | None, bool | None]]:
    """What to time for one model: each fixed K (early exit off) and adaptive for an iterative head (xPress); the one
    fixed decode (Markov serial / plain argmax) otherwise."""
    if model.refiner.iterative:
        return sweep_settings(model, settings)
    return [(model.refiner.decode_name, None, None)]


@torch.inference_mode()
def measure_refine_latency(model, blocks: Sequence[CapturedBlock], settings: BenchmarkSettings) -> list[dict]:
    """Seconds per `refine` call on real blocks, per setting. Settings are interleaved within each repeat so that a
    load spike hits all of them; the median over repeats × blocks is what the summary reports."""
    if not blocks:
        return []
    clock = WallClock(blocks[0].base_logits.device)
    plan = refine_latency_settings(model, settings)
    samples: dict[str, list[float]] = {label: [] for label, _, _ in plan}
    calls = {label: [_refine_call(model, b, k, e) for b in blocks] for label, k, e in plan}
    for fns in calls.values():  # untimed first call: builds the folded operators
        fns[0]()
    for _ in range(settings.latency_repeats):
        for label, fns in calls.items():
            for fn in fns:
                start = clock.now()
                fn()
                samples[label].append(clock.now() - start)
    return [{"setting": label, "refiner": model.config.refiner, "seconds": samples[label]} for label, _, _ in plan]


__all__ = [
    "CapturedBlock",
    "capture_blocks",
    "measure_refine_latency",
    "recording_refine_inputs",
    "refine_latency_settings",
]
