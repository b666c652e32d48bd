"""What a generation call measured, and the clocks it measures with.

`XPressGenerationStats` is left at `xpress.generation_stats` by every call (`generate(assistant_model=xpress)`,
`spec_generate`) and returned in `spec_generate`'s output. Timing adds no device synchronisation to generation
(`SectionTimer`); benchmarks synchronise on purpose (`WallClock`).

This file travels with every saved checkpoint; it imports only torch.
"""

import statistics
import time
from dataclasses import dataclass, field

import torch

SECTIONS = ("drafter", "lm_head", "refiner", "verify")


def _elapsed(start, end) -> float:
    """Seconds between two marks of a `SectionTimer`: perf_counter floats, or CUDA events (waits for the end event)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass
class XPressGenerationStats:
    """What one generation call measured. τ counts tokens committed per target verification, bonus included.

    Section times (seconds) are read as `time_drafter`, `time_lm_head`, `time_refiner` (Jacobi / Markov serial decode /
    plain argmax, including drawing the block's Gumbel noise when sampling), `time_verify` (spec_generate: target
    verification and acceptance; generate: the time between two draft calls, i.e. transformers' verification step)
    and `time_total`. On a GPU they come from CUDA events that are only waited for when a time is read, so measuring
    adds no synchronisation to generation.
    """

    acceptance_lengths: list[int] = field(default_factory=list)  # per verification step, 1 ≤ τ_step ≤ block_size
    jacobi_iterations: list[int] = field(default_factory=list)  # refiner passes per drafted block
    draft_lengths: list[int] = field(default_factory=list)  # drafts verified per block, after the draft-length cut
    new_tokens: int = 0
    _spans: dict[str, list] = field(default_factory=lambda: {name: [] for name in SECTIONS}, repr=False)
    _total: tuple | None = field(default=None, repr=False)

    def record(self, section: str, start, end) -> None:
        """Charge the span between two `SectionTimer` marks to `section` (one of `SECTIONS`)."""
        self._spans[section].append((start, end))

    def record_total(self, start, end) -> None:
        self._total = (start, end)

    def seconds(self, section: str) -> float:
        return sum(_elapsed(start, end) for start, end in self._spans[section])

    time_drafter = property(lambda self: self.seconds("drafter"))
    time_lm_head = property(lambda self: self.seconds("lm_head"))
    time_refiner = property(lambda self: self.seconds("refiner"))
    time_verify = property(lambda self: self.seconds("verify"))
    time_total = property(lambda self: 0.0 if self._total is None else _elapsed(*self._total))

    @property
    def mean_tau(self) -> float:
        """τ averaged over the verification steps of a draft. A call whose every token came from a target step
        without drafts (`max_new_tokens` of 1 or 2: the prefill's token, then one the target emits alone) committed
        one token per target step: τ = 1. 0 only when nothing was committed."""
        if not self.acceptance_lengths:
            return 1.0 if self.new_tokens else 0.0
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    @property
    def mean_jacobi_iterations(self) -> float:
        return sum(self.jacobi_iterations) / max(len(self.jacobi_iterations), 1)

    @property
    def mean_draft_length(self) -> float:
        return sum(self.draft_lengths) / max(len(self.draft_lengths), 1)

    def as_dict(self) -> dict:
        return {
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_tau": self.mean_tau,
            "jacobi_iterations": list(self.jacobi_iterations),
            "mean_jacobi_iterations": self.mean_jacobi_iterations,
            "draft_lengths": list(self.draft_lengths),
            "mean_draft_length": self.mean_draft_length,
            **{f"time_{name}": self.seconds(name) for name in SECTIONS},
            "time_total": self.time_total,
            "new_tokens": self.new_tokens,
        }


class SectionTimer:
    """Marks for timing the sections of generation without adding device synchronisations.

    On CPU a mark is `time.perf_counter()`. On CUDA it is an event recorded on the current stream, so the GPU work
    launched between two marks is what their span measures; nothing waits for it until the statistics are read.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class WallClock:
    """End-to-end wall clock for benchmarks: synchronises CUDA, so a span covers the GPU work launched inside it.
    Generation itself uses `SectionTimer`, which never synchronises."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def median_seconds(fn, repeats: int, *, warmup: int = 1, clock: WallClock | None = None) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed ones (`clock`: a `WallClock` to
    synchronise a GPU; default, the host clock)."""
    now = clock.now if clock is not None else time.perf_counter
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = now()
        fn()
        samples.append(now() - start)
    return statistics.median(samples)


__all__ = ["SECTIONS", "SectionTimer", "WallClock", "XPressGenerationStats", "median_seconds"]
