"""What a benchmark run measures, and the labels its records carry.

`BenchmarkSettings` (stored verbatim in the results JSON), the names of the measured entries (`ENTRIES`, the plain
baselines) and of the run settings (`CONFIG_SETTING`, the K sweep's `K=<k>` and `ADAPTIVE_SETTING`; `sweep_settings`,
`setting_order`). `benchmark.py` runs what these say, `latency.py` times the refiner at the same settings, `reports.py`
and `plots.py` read the records back by these labels. Imports only the standard library, so that `reports.py` (which
reads these labels) loads without torch.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


ENTRIES = ("generate", "spec_generate", "spec_generate_compiled")  # the speculative entry points
DEFAULT_ENTRIES = ("generate", "spec_generate")  # measured unless asked: the compiled one compiles per run (a minute)
COMPILED_SPEC = "spec_generate_compiled"  # spec_generate(compile=True), one cache length for the whole run
PLAIN = "plain"  # target.generate alone, eager: the baseline of every speed ratio
COMPILED_PLAIN = "plain_compiled"  # target.generate alone with a static cache and torch.compile (benchmark.py)
CONFIG_SETTING = "config"  # label of runs with the checkpoint's own Jacobi settings
ADAPTIVE_SETTING = "adaptive"


@dataclass
class BenchmarkSettings:
    """Everything that decides what a run measures. Stored verbatim in the results JSON."""

    max_new_tokens: int = 256  # new tokens per generation, at most (EOS may stop earlier)
    temperatures: tuple[float, ...] = (0.0, 1.0)  # 0 = greedy; > 0 = temperature sampling with a fixed seed per prompt
    k_values: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # fixed Jacobi iteration counts of the sweep; () = no sweep
    adaptive: bool = True  # also sweep K = block_size - 1 with early exit
    limit: int | None = None  # first N prompts of each set; None = all
    seed: int = 0  # base seed of the per-prompt sampling generators
    latency_blocks: int = 8  # real drafter blocks captured per method for the refiner microbenchmark
    latency_repeats: int = 30  # timed repeats of each block and setting (the median is reported)
    entries: tuple[str, ...] = DEFAULT_ENTRIES  # speculative entry points measured per method (ENTRIES: all)
    compiled_plain: bool = True  # also measure plain decoding with a static cache and torch.compile
    # drafts verified per block by every method; None: each config's own; "auto": each method's own choice on this
    # machine (`XPressModel.choose_draft_cap`, from its config's draft_acceptance), made once before the run
    num_assistant_tokens: int | str | None = None

    def __post_init__(self) -> None:
        self.temperatures = tuple(float(t) for t in self.temperatures)
        self.k_values = tuple(int(k) for k in self.k_values)
        self.entries = tuple(self.entries)
        unknown = [e for e in self.entries if e not in ENTRIES]
        if unknown or not self.entries or len(set(self.entries)) != len(self.entries):
            raise ValueError(f"entries must be distinct names from {list(ENTRIES)}, got {list(self.entries)}")
        if "spec_generate" not in self.entries and COMPILED_SPEC not in self.entries:
            raise ValueError(f"entries must include spec_generate or {COMPILED_SPEC}: τ and the timers come from it")
        if "spec_generate" not in self.entries and (self.k_values or self.adaptive):
            raise ValueError(
                "the Jacobi K sweep runs through spec_generate, which entries leaves out: add it, or turn the sweep "
                "off (k_values=(), adaptive=False; --k-values --no-adaptive on the command line)"
            )
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperatures:
            raise ValueError("temperatures is empty: give at least one (0 = greedy)")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {list(self.temperatures)}")
        cap = self.num_assistant_tokens
        # a whole number, not a bool (`configuration_xpress.is_integer`, which this module does not import)
        whole = isinstance(cap, numbers.Integral) and not isinstance(cap, bool)
        if cap is not None and cap != "auto" and (not whole or cap < 1):
            raise ValueError(
                f"num_assistant_tokens must be a positive int, 'auto' (each method's choice on this machine) or None "
                f"(each config's own), got {cap!r}"
            )
        if any(k < 1 for k in self.k_values):
            raise ValueError(f"k_values must be >= 1 (Jacobi iterations), got {list(self.k_values)}")
        if len(set(self.k_values)) != len(self.k_values):
            raise ValueError(f"k_values has duplicates: {list(self.k_values)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 prompt per dataset (or None for all), got {self.limit}")
        if self.latency_blocks < 1 or self.latency_repeats < 1:
            raise ValueError(
                f"latency_blocks and latency_repeats must be >= 1, got {self.latency_blocks} and {self.latency_repeats}"
            )


def sweep_settings(model, settings: BenchmarkSettings) -> list[tuple[str, int, bool]]:
    """(label, max_iters, early_exit) of the K sweep for one xPress model: fixed K without early exit, then adaptive.
    The labels are the `setting` of the sweep's records and of the refiner latency rows; `setting_order` sorts them."""
    rows = [(f"K={k}", k, False) for k in settings.k_values]
    if settings.adaptive:
        rows.append((ADAPTIVE_SETTING, model.config.block_size - 1, True))
    return rows


def setting_order(label: str) -> tuple[int, int]:
    """Sort key of run settings: checkpoint config, then K=1, K=2, ..., then adaptive."""
    if label == CONFIG_SETTING:
        return (0, 0)
    return (2, 0) if label == ADAPTIVE_SETTING else (1, int(label.removeprefix("K=")))


def column_name(dataset: str, temperature: float) -> str:
    return f"{dataset} T={temperature:g}"


__all__ = [
    "ADAPTIVE_SETTING",
    "BenchmarkSettings",
    "COMPILED_PLAIN",
    "COMPILED_SPEC",
    "CONFIG_SETTING",
    "DEFAULT_ENTRIES",
    "ENTRIES",
    "PLAIN",
    "column_name",
    "setting_order",
    "sweep_settings",
]
