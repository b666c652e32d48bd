"""The interface of the seam between the decode loops and hardware-specific tuning of their matrix products.

A decode step multiplies a few rows (a verification's anchor and drafts, a drafter block) by every weight of a model.
How `F.linear` runs such products fastest depends on the hardware: on some CPUs another operand order or weights
prepacked for the BLAS are several times faster (`cpu_layouts.py`); on a GPU `F.linear` as it is. The loops never
decide that themselves: each decoder (the compiled one, the eager loop, `generate`'s candidate generator) owns one
`LinearPolicy`, made by `layout_policy.linear_policy`, and asks it for the context to run a group of products in ("verify",
"drafter", "head": the target's verification, the drafter's forward, the draft readout). This module is the interface
and the policy of devices without tuning (input-major everywhere); `cpu_layouts.py` is the CPU's, and
`layout_policy.py` picks one (importing `cpu_layouts` only for a CPU).

This file travels with every saved checkpoint; it imports only torch and its siblings.
"""

import contextlib
import statistics
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .stats import WallClock

# How `F.linear` over a few rows is computed (`spec_generate(..., linear_layout=...)`): "auto" times the layouts on the
# models' own weights once per row count and leaves input-major only where another is clearly faster (on a GPU:
# never); "input_major" is `F.linear` as it is; "weight_major" computes (W @ x.T).T; "packed" multiplies by prepacked
# weights (CPU, float32): MKL packs in the compiled graphs and the eager drafter, oneDNN reorders in the eager
# verification.
LINEAR_LAYOUTS = ("auto", "input_major", "weight_major", "packed")


def check_linear_layout(linear_layout) -> None:
    if linear_layout not in LINEAR_LAYOUTS:
        raise ValueError(
            f"linear_layout must be one of {', '.join(map(repr, LINEAR_LAYOUTS))}, got {linear_layout!r}: 'auto' "
            "times the layouts on the models' weights and leaves input-major where no other is clearly faster, "
            "'input_major' is F.linear as is, 'weight_major' computes it as (W @ x.T).T, 'packed' multiplies by "
            "prepacked weights (float32 on a CPU)."
        )


def linear_weights(*modules: nn.Module) -> list[torch.Tensor]:
    """The weights of every `nn.Linear` in the modules (each tensor once: a tied lm_head counts once)."""
    seen, weights = set(), []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear) and id(sub.weight) not in seen:
                seen.add(id(sub.weight))
                weights.append(sub.weight)
    return weights


def timing_input(rows: int, weight: torch.Tensor) -> torch.Tensor:
    """Random input rows for timing products with `weight`, from a generator of their own: timing never moves the
    caller's random state (a seeded call reproduces, the first one included)."""
    generator = torch.Generator(device=weight.device).manual_seed(0)
    return torch.randn(rows, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)


def product_sweeps(jobs: Sequence[tuple[Sequence[torch.Tensor], int, Callable]]) -> list[Callable[[], object]]:
    """One zero-argument sweep per job (weights, rows, product): `rows` random input rows (`timing_input`, one per
    shape, made here) through every weight in turn as `product(x, weight)`, as a forward multiplies them (each weight
    once, so they stream from memory)."""
    inputs = {}
    for weights, rows, _ in jobs:
        for weight in weights:
            inputs.setdefault((rows, weight.shape[1], weight.dtype), timing_input(rows, weight))

    def sweep(weights, rows, product):
        return lambda: [product(inputs[rows, w.shape[1], w.dtype], w) for w in weights]

    return [sweep(*job) for job in jobs]


@torch.no_grad()
def time_rounds(sweeps: Sequence, device: torch.device, rounds: int) -> list[list[float]]:
    """Seconds of each zero-argument `sweep` in each of `rounds` rounds after one untimed round; a round runs every
    sweep once, in turn, so a drift in the machine's speed hits them alike."""
    now = WallClock(device).now
    samples = [[] for _ in sweeps]
    for round_ in range(rounds + 1):
        for i, sweep in enumerate(sweeps):
            start = now()
            sweep()
            if round_:  # the first round warms up
                samples[i].append(now() - start)
    return samples


def time_sweeps(sweeps: Sequence, device: torch.device, repeats: int) -> list[float]:
    """Median seconds of each zero-argument `sweep` over `repeats` rounds (`time_rounds`)."""
    return [statistics.median(times) for times in time_rounds(sweeps, device, repeats)]


class LinearPolicy:
    """How one decoder's few-row products run: this base class runs every group input-major (`F.linear` as it is),
    the right choice on a GPU; `cpu_layouts.CpuLinearPolicy` decides per group and row count on a CPU.

    `weights`: the weights each group multiplies by (`linear_weights`), by group name. A group's layout for a row
    count is decided once (`kind`) and never changes, so a traced graph can read it as a constant; `prepare` decides
    it (and, on a CPU, makes the packs it needs) before a graph first runs; `mode` is the context to run the group's
    products in (entered inside a compiled function, it is traced into the graph)."""

    KINDS = ("input_major",)  # the layouts this policy may decide

    def __init__(self, linear_layout: str, weights: dict[str, list[torch.Tensor]]):
        check_linear_layout(linear_layout)
        self.linear_layout = linear_layout
        self.weights = weights
        self.kinds: dict[tuple[str, int], str] = {}  # (group, rows) -> layout, decided once

    def decide(self, group: str, rows: int) -> str:
        return "input_major"

    def kind(self, group: str, rows: int) -> str:
        """The layout of `group`'s products over `rows` rows, one of `KINDS`: "input_major", "weight_major", "packed"
        (MKL packs for that many rows) or "onednn" (oneDNN-reordered weights)."""
        if (group, rows) not in self.kinds:
            self.kinds[group, rows] = self.decide(group, rows)
        return self.kinds[group, rows]

    def prepare(self, group: str, rows: int, *more_rows: int) -> None:
        """Decide the layout of (`group`, `rows`) before its products first run (and whatever it needs for them,
        also for `more_rows` row counts of the same products)."""
        self.kind(group, rows)

    def prepare_widths(self, group: str, most: int) -> None:
        """`prepare` `group` for every row count 2..`most`: an eager loop's verification widths, decided when the loop
        is made rather than mid-generation (its last blocks verify fewer drafts, and each first width costs a timing on
        a CPU), and its packs made once."""
        for rows in range(2, most + 1):
            self.prepare(group, rows)

    def release(self) -> None:
        """Drop what `prepare` made (packs); made again by the next `prepare`."""

    def mode(self, group: str, rows: int, max_rows: int):
        """The context that runs `group`'s products over at most `max_rows` rows in the layout decided for `rows`
        (input-major where nothing was decided: a graph run without `prepare`)."""
        return contextlib.nullcontext()

    def decided(self, kind: str) -> frozenset:
        """The (group, rows) decided so far whose layout is `kind`."""
        return frozenset(key for key, value in self.kinds.items() if value == kind)

    def products_samples(self, jobs: Sequence[tuple[str, int]], *, rounds: int = 5) -> list[list[float]]:
        """Seconds of each job (group, rows) in each of `rounds` rounds: one pass of `rows` input rows through every
        weight of the group in turn, as a forward multiplies them (each weight once, so they stream from memory), in
        the group's layout for that many rows."""
        device = next(iter(self.weights.values()))[0].device
        return time_rounds(product_sweeps([(self.weights[group], rows, F.linear) for group, rows in jobs]), device,
                           rounds)  # fmt: skip

    def products_seconds(self, jobs: Sequence[tuple[str, int]], *, repeats: int = 5) -> list[float]:
        """Median seconds of each job (`products_samples`)."""
        return [statistics.median(times) for times in self.products_samples(jobs, rounds=repeats)]


__all__ = [
    "LINEAR_LAYOUTS", "LinearPolicy", "check_linear_layout", "linear_weights", "product_sweeps", "time_rounds",
    "time_sweeps", "timing_input",
]  # fmt: skip
