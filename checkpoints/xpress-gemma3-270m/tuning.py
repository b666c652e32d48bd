"""Settings chosen by timing on this machine, made stable: a robust comparison of timed candidates, and a record per
machine and models in the cache directory that later processes reuse instead of timing again.

`draft_cap.choose_draft_cap` and `choose_draft_shape` time a few candidate settings (drafts per block, tree budgets)
and want the one with the most tokens per second. Timings on a shared CPU are noisy (issue 49's probe: in one table,
verifying 2 drafts 32.3 ms and 3 drafts 27.6 ms), so a choice made from one timing each flipped between processes on
differences of a few percent (1, 2 or 3 drafts; a 4-node tree or linear blocks). Here:

* **Repeats and paired rounds** (`measure_rounds`): every candidate's jobs are timed once per round, in turn, for at
  least `MIN_ROUNDS` rounds and more while `BUDGET_SECONDS` lasts (at most `MAX_ROUNDS`), and once more while
  `SETTLE_BUDGET_SECONDS` lasts where those rounds left the choice to their noise (`Comparison.settled`). A candidate
  is compared with another round by round (`compare`), so a slow spell that hits one round hits both.
* **A noise check that prefers the simpler setting** (`compare`): candidates come in order of simplicity (fewer drafts
  first; linear blocks before trees). The fastest is the one with the best median rate; the chosen one is the first
  candidate that is not slower than it by more than what the rounds can resolve: the median of its paired slowdowns
  must exceed both `MIN_ADVANTAGE` and a 95% bound on the error of that median (its standard error, from the spread
  of the paired slowdowns, times Student's t for that many rounds) before a simpler setting is passed over. A busy
  machine widens that error, so it falls back on the simpler setting instead of locking in a lucky timing.
* **A record per machine, models and setting** (`Records`): the measured rounds are written as JSON under
  `<cache>/choices/` (`$XPRESS_CACHE`, default `~/.cache/xpress`) and read back by any later process with the same
  key (the CPU model and flags or the GPU name, torch's version and thread count, the models' parameter shapes and
  dtypes, the setting and the timed jobs); the choice is recomputed from them. A measurement too noisy to resolve
  `RECORD_NOISE` is used but not recorded, so a busy moment is never kept. One taken while this process got less
  than `MIN_CPU_SHARE` of the CPU time its threads asked for decides nothing: other jobs on the cores slow every job
  alike (beside a training run on two cores, two threads' 2-row products took 1.1 s where one thread's took 40 ms, and
  verifying 15 drafts cost what verifying 1 did, in every round), which favours the settings that do more per step and
  which no spread shows; the simplest setting is taken and nothing recorded. `XPRESS_REMEASURE=1` (or
  `remeasure=True`) times again and replaces the record.

This file travels with every saved checkpoint; it imports only torch and the standard library.
"""

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

CACHE_ENV_VAR = "XPRESS_CACHE"  # the cache folder (default ~/.cache/xpress); `bench.assets` keeps SmolLM2 there too
REMEASURE_ENV_VAR = "XPRESS_REMEASURE"  # "1": ignore the records, time again and replace them

# A more complex setting must be at least this much faster (median of the paired rounds) than a simpler one to be
# chosen over it: differences below it are within what the products-only estimate can tell (it leaves attention,
# norms and the head's decode out) and flipped between processes when they decided.
MIN_ADVANTAGE = 0.03
# A measurement whose worst resolution (the error bound of a paired slowdown) is above this is used in its process but
# not recorded: a later process measures again.
RECORD_NOISE = 0.10
# A CPU measurement during which this process's CPU time was below this share of wall time x threads decides nothing
# (the simplest setting) and is not recorded: other jobs held the cores (measured: 0.49-0.50 with two threads on two
# cores beside a training run).
MIN_CPU_SHARE = 0.8
# Rounds: at least MIN_ROUNDS (a spread from fewer is no estimate), more while BUDGET_SECONDS of timing last. On a busy
# machine a round is slow and the first MIN_ROUNDS (and a warm-up) are most of the cost: their spread is wide, so the
# choice is the simplest setting and it is not recorded.
MIN_ROUNDS, MAX_ROUNDS = 3, 15
BUDGET_SECONDS = 8.0
# Rounds that leave a choice to their noise (a simpler candidate kept only because its slowdown, beyond MIN_ADVANTAGE,
# was within the rounds' error: `Comparison.settled`) get one more call, for up to SETTLE_BUDGET_SECONDS (at most
# SETTLE_ROUNDS more rounds). Gemma-3-270M's compiled caps on two cores: 2.3 s a round (ten candidate widths, each
# with its own packs), 5 rounds in the budget, and 3 drafts kept within ±12% of 5 drafts' 10% lead, which decoding
# then measured at 15% (26.8 against 23.4 tokens/s).
SETTLE_ROUNDS, SETTLE_BUDGET_SECONDS = 15, 16.0
RECORD_FORMAT = 1


def cache_dir() -> Path:
    """`$XPRESS_CACHE`, or `~/.cache/xpress` (not created here)."""
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "xpress").expanduser()


def remeasure_requested() -> bool:
    """`XPRESS_REMEASURE` set to anything but "" or "0"."""
    return os.environ.get(REMEASURE_ENV_VAR, "") not in ("", "0")


def check_remeasure(remeasure) -> None:
    if not isinstance(remeasure, bool):
        raise ValueError(
            f"remeasure must be True (time again and replace this machine's record) or False (read the record where "
            f"there is one), got {remeasure!r}"
        )


# --- comparing timed candidates ---------------------------------------------------------------------------------


@dataclass
class Comparison:
    """Candidates (in order of simplicity) compared by their per-round rates (higher is better). `fastest`: the best
    median rate; `slowdowns[i]`: median over rounds of log(rate_fastest / rate_i), paired by round; `resolutions[i]`:
    the slowdown candidate i must exceed to count as slower (`MIN_ADVANTAGE` or the 95% error bound of that median,
    the larger); `chosen`: the first candidate that is not slower."""

    medians: list[float]
    fastest: int
    slowdowns: list[float]
    resolutions: list[float]
    chosen: int

    @property
    def settled(self) -> bool:
        """Whether the rounds decided the choice: it is the fastest, or within `MIN_ADVANTAGE` of it. Not settled: a
        simpler candidate whose slowdown, beyond `MIN_ADVANTAGE`, the rounds could not resolve (more rounds might)."""
        return self.chosen == self.fastest or self.slowdowns[self.chosen] <= MIN_ADVANTAGE

    @property
    def noise(self) -> float:
        """The worst resolution: the largest slowdown these rounds could not tell from none."""
        return max(self.resolutions)

    def note(self, i: int) -> str:
        """Candidate i against the fastest, in words, for a table."""
        if i == self.fastest:
            return "fastest"
        slower = math.expm1(self.slowdowns[i])
        within = "within" if self.slowdowns[i] <= self.resolutions[i] else "beyond"
        return f"{100 * slower:+.1f}% time, {within} ±{100 * math.expm1(self.resolutions[i]):.1f}%"


def _median_standard_error(values: Sequence[float]) -> float:
    """Standard error of the median of `values`, from their median absolute deviation (a normal spread's σ is 1.4826
    MAD; the median's standard error is 1.2533 σ / √n). Robust to the odd round a background job ruined."""
    centre = statistics.median(values)
    mad = statistics.median(abs(v - centre) for v in values)
    return 1.2533 * 1.4826 * mad / math.sqrt(len(values))


# Student's t, two-sided 95%, by degrees of freedom: few rounds give a rough spread, which the bound widens for.
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20, 12: 2.18,
        13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09, 21: 2.08, 22: 2.07, 23: 2.07,
        24: 2.06, 25: 2.06, 26: 2.06, 27: 2.05, 28: 2.05, 29: 2.05}  # fmt: skip


def _t95(n: int) -> float:
    return _T95.get(n - 1, 2.0)


def compare(rates: Sequence[Sequence[float]]) -> Comparison:
    """The simplest candidate not resolvably slower than the fastest. `rates[i][r]`: candidate i's rate (tokens per
    second, or any higher-is-better figure) in round r; candidates in order of simplicity, all with the same rounds."""
    if not rates or len({len(r) for r in rates}) != 1 or not rates[0]:
        raise ValueError(
            f"compare needs the same number (>= 1) of rounds for every candidate, got {list(map(len, rates))}"
        )
    medians = [statistics.median(r) for r in rates]
    fastest = max(range(len(rates)), key=lambda i: (medians[i], -i))
    slowdowns, resolutions = [], []
    for candidate in rates:
        paired = [math.log(best / own) for best, own in zip(rates[fastest], candidate)]
        slowdowns.append(statistics.median(paired))
        resolutions.append(max(MIN_ADVANTAGE, _t95(len(paired)) * _median_standard_error(paired)))
    chosen = next(i for i in range(len(rates)) if slowdowns[i] <= resolutions[i])
    return Comparison(medians=medians, fastest=fastest, slowdowns=slowdowns, resolutions=resolutions, chosen=chosen)


def measure_rounds(measure: Callable[[int], list[list[float]]], *, budget: float = BUDGET_SECONDS,
                   settled: Callable[[list[list[float]]], bool] | None = None) -> list[list[float]]:  # fmt: skip
    """Per job, its seconds in each round: `measure(rounds)` times every job once per round, `rounds` rounds (after its
    own warm-up); called for `MIN_ROUNDS`, then once more for as many rounds as `budget` seconds allow at the pace of
    the first call's rounds (at most `MAX_ROUNDS` in all). So a first measurement costs the first call plus about
    `budget`. Where `settled(samples)` is False (the rounds left the choice to their noise), once more for as many
    rounds as `SETTLE_BUDGET_SECONDS` allow (at most `SETTLE_ROUNDS`)."""
    start = time.perf_counter()
    samples = measure(MIN_ROUNDS)
    # A round's pace: the call's wall time per round (its warm-up counted as one), or the rounds' own timed seconds
    # where less: a warm-up that first prepares layouts (Gemma-3's compiled packs, one per width) costs many rounds.
    timed = statistics.median(sum(round_) for round_ in zip(*samples))
    per_round = max(min((time.perf_counter() - start) / (MIN_ROUNDS + 1), timed), 1e-9)

    def extended(seconds: float, most: int) -> list[list[float]]:  # the rounds so far, and as many more as fit
        more = min(most, int(seconds / per_round) - 1)
        return [old + new for old, new in zip(samples, measure(more))] if more > 0 else samples

    samples = extended(budget, MAX_ROUNDS - MIN_ROUNDS)
    if settled is not None and not settled(samples):
        samples = extended(SETTLE_BUDGET_SECONDS, SETTLE_ROUNDS)
    return samples


# --- records ----------------------------------------------------------------------------------------------------

_CPU: list[dict] = []


def _cpu() -> dict:
    """The CPU as the timings see it: its model name and a digest of its feature flags (the same model name covers
    machines with and without AMX here), from /proc/cpuinfo where there is one."""
    if not _CPU:
        name, flags = platform.processor() or platform.machine(), ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not flags:
                    name = value.strip()
                if key.strip() == "flags":
                    flags = hashlib.sha256(value.strip().encode()).hexdigest()[:12]
                    break
        except OSError:
            pass
        _CPU.append({"cpu": name, "cpu_flags": flags, "logical_cpus": os.cpu_count()})
    return _CPU[0]


def machine(device: torch.device) -> dict:
    """What a timing on `device` depends on besides the models: the processor, torch's version and thread count."""
    device = torch.device(device)
    found = {"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
    else:
        found.update(_cpu())
    return found


def models_digest(*models: torch.nn.Module) -> str:
    """A digest of the models' classes, parameter and buffer names, shapes, dtypes and devices: what their timings
    depend on (their values do not change what a product costs)."""
    parts = []
    for model in models:
        tensors = [(name, list(t.shape), str(t.dtype), t.device.type)
                   for name, t in [*model.named_parameters(), *model.named_buffers()] if t is not None]  # fmt: skip
        parts.append([type(model).__name__, tensors])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


class Records:
    """Measured rounds kept under `<cache>/choices/`, one JSON file per key (a dict of JSON values)."""

    def __init__(self, kind: str):
        self.kind = kind

    @property
    def folder(self) -> Path:
        return cache_dir() / "choices"

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.folder / f"{self.kind}-{digest}.json"

    def read(self, key: dict) -> dict | None:
        """The record of `key`, or None (none, unreadable, another format, or a digest collision)."""
        try:
            record = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        if record.get("format") != RECORD_FORMAT or record.get("key") != json.loads(json.dumps(key)):
            return None
        return record

    def samples(self, key: dict) -> list[list[float]] | None:
        """The kept rounds of `key`'s jobs (one list per job), or None: no usable record, or `XPRESS_REMEASURE=1`."""
        record = None if remeasure_requested() else self.read(key)
        return record["samples"] if record is not None and len(record["samples"]) == len(key["jobs"]) else None

    def write(self, key: dict, samples: dict[str, list[float]], seconds: float) -> Path | None:
        """Write the record atomically (another process reads the old or the new one, never half); None where the
        cache folder cannot be written (the choice then lives in this process only)."""
        path = self.path(key)
        record = {"format": RECORD_FORMAT, "kind": self.kind, "key": key, "samples": samples,
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "measure_seconds": seconds}  # fmt: skip
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                json.dump(record, f, indent=1)
            os.replace(f.name, path)
        except OSError:
            return None
        return path


@dataclass
class Timed:
    """Rounds of timed jobs and what `compare` made of them: `samples[j][r]` job j's seconds in round r, read from a
    record (`measure_seconds` 0) or timed here; `record` the file (None: not kept, `why_not` says why)."""

    samples: list[list[float]]
    comparison: Comparison
    measure_seconds: float
    record: str | None
    why_not: str | None = None

    @property
    def medians(self) -> list[float]:
        return [statistics.median(times) for times in self.samples]

    @property
    def rounds(self) -> int:
        return len(self.samples[0])


def _measured(measure: Callable[[], list[list[float]]]) -> tuple[list[list[float]], float, float]:
    """`measure()`'s rounds, its wall seconds, and the share of the CPU time its threads asked for that this process
    got (below `MIN_CPU_SHARE`: other jobs held the cores)."""
    start, cpu_start = time.perf_counter(), time.process_time()
    samples = measure()
    seconds = time.perf_counter() - start
    return samples, seconds, (time.process_time() - cpu_start) / max(seconds * torch.get_num_threads(), 1e-9)


def recorded_rounds(kind: str, key: dict, measure: Callable[[], list[list[float]]]) -> list[list[float]]:
    """Timed rounds that decide without a comparison of their own (a layout's products, `cpu_layouts`): `key`'s rounds
    from this machine's record of that `kind`, or `measure()`d now and recorded, except on a CPU where this process got
    less than `MIN_CPU_SHARE` of the CPU time its threads asked for (then used in this process only).
    `XPRESS_REMEASURE=1` skips the record."""
    records = Records(kind)
    kept = records.samples(key)
    if kept is not None:
        return kept
    samples, seconds, share = _measured(measure)
    if key["machine"]["device"] != "cpu" or share >= MIN_CPU_SHARE:
        records.write(key, samples, seconds)
    return samples


def tensors_digest(tensors) -> str:
    """A digest of the tensors' shapes, dtypes and devices, in order: what their products' timings depend on."""
    parts = [(list(t.shape), str(t.dtype), t.device.type) for t in tensors]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def timed_choice(kind: str, key: dict, measure: Callable[[int], list[list[float]]],
                 decide: Callable[[list[list[float]]], Comparison], *, remeasure: bool = False) -> Timed:  # fmt: skip
    """The rounds of `key`'s jobs from this machine's record of that `kind`, or timed now (`measure_rounds(measure)`)
    and recorded unless `decide`'s comparison cannot resolve `RECORD_NOISE`; on a CPU, where this process got less
    than `MIN_CPU_SHARE` of the CPU time its threads asked for, the simplest candidate, not recorded (module
    docstring). `remeasure` (or `XPRESS_REMEASURE=1`) skips the record."""
    records = Records(kind)
    kept = None if remeasure else records.samples(key)
    if kept is not None:
        return Timed(kept, decide(kept), 0.0, str(records.path(key)))
    samples, seconds, share = _measured(lambda: measure_rounds(measure, settled=lambda rounds: decide(rounds).settled))
    comparison = decide(samples)
    why_not = None
    if key["machine"]["device"] == "cpu" and share < MIN_CPU_SHARE:
        # Contention slows every job alike (a verification of 15 drafts cost what one of 1 did), which favours the
        # settings that do more per step and which no spread shows: decide nothing from it, take the simplest.
        comparison = dataclasses.replace(comparison, chosen=0)
        why_not = (f"other jobs held the CPU (this process had {100 * share:.0f}% of what it asked for): the simplest "
                   "setting, not kept")  # fmt: skip
    elif comparison.noise > RECORD_NOISE:
        why_not = f"too noisy to keep (±{100 * math.expm1(comparison.noise):.0f}%)"
    path = records.write(key, samples, seconds) if why_not is None else None
    if path is None and why_not is None:
        why_not = f"not kept: {records.folder} cannot be written"
    return Timed(samples, comparison, seconds, None if path is None else str(path), why_not)


__all__ = [
    "BUDGET_SECONDS", "CACHE_ENV_VAR", "Comparison", "MIN_ADVANTAGE", "MIN_CPU_SHARE", "RECORD_NOISE",
    "REMEASURE_ENV_VAR", "Records", "SETTLE_BUDGET_SECONDS", "SETTLE_ROUNDS",
    "Timed", "cache_dir", "check_remeasure", "compare", "machine", "measure_rounds", "models_digest",
    "recorded_rounds", "remeasure_requested", "tensors_digest",
    "timed_choice",
]  # fmt: skip
