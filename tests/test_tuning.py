"""Machine-chosen settings that do not flip between processes (`modeling_xpress/tuning.py`, used by `draft_cap.py`).

The decision logic is tested on clocked stand-in timings, so it means the same on a busy CI machine: the comparison
prefers the simpler setting unless the rounds resolve a difference; under a simulated background load the choice is
the idle one or a simpler one, never one slower than the idle choice by more than the noise the measurement reported;
a measurement's cost is bounded by its budget on a fake clock. The records: written by the first process, read by
the next (no timing), replaced on request, not written when too noisy, keyed by threads and dtype. The real thing,
fresh processes on the bundled checkpoint and SmolLM2, is `test_fresh_processes_reuse_one_choice` (slow).
"""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import modeling_xpress.cpu_layouts as layouts
import modeling_xpress.tuning as tuning
from modeling_xpress.draft_cap import choose_draft_cap, choose_draft_shape, expected_tokens
from modeling_xpress.tuning import MIN_ADVANTAGE, compare, measure_rounds
from tests.builders import tiny_llama, tiny_xpress

REPO = Path(__file__).resolve().parent.parent

# The bundled checkpoint's held-out acceptance (its config.json).
BUNDLED_ACCEPTANCE = json.loads((REPO / "checkpoints" / "xpress-smollm2-135m-instruct" / "config.json")
                                .read_text())["draft_acceptance"]  # fmt: skip


# --- the comparison -------------------------------------------------------------------------------------------------


def test_compare_prefers_the_simpler_setting_unless_the_rounds_resolve_a_difference():
    steady = [100.0] * 7
    assert compare([steady, [102.0] * 7]).chosen == 0  # 2% faster: below MIN_ADVANTAGE
    assert compare([steady, [110.0] * 7]).chosen == 1  # 10% faster in every round: resolved
    # 10% faster on the median, but round by round anywhere from 15% slower to 35% faster: not resolved
    noisy = [100.0 * r for r in (1.3, 0.9, 1.25, 0.95, 1.1, 0.85, 1.35)]
    result = compare([steady, noisy])
    assert result.fastest == 1 and result.chosen == 0
    assert result.slowdowns[0] == pytest.approx(math.log(1.1)) and result.resolutions[0] > math.log(1.1)
    # A slow spell that hits a whole round hits both candidates: paired, it cancels
    spells = [1.0, 3.0, 1.2, 2.5, 1.0, 1.8, 4.0]
    assert compare([[100.0 / s for s in spells], [110.0 / s for s in spells]]).chosen == 1
    # The simplest within the noise of the fastest, not of its neighbour: 0 is 2.5% behind 2, 1 is 1% behind it
    assert compare([[97.5] * 5, [99.0] * 5, [100.0] * 5]).chosen == 0
    assert compare([[90.0] * 5, [99.0] * 5, [100.0] * 5]).chosen == 1
    with pytest.raises(ValueError, match="same number"):
        compare([[1.0, 2.0], [1.0]])


def cap_rates(verify_ms: list[float], draft_ms: float, acceptance) -> list[float]:
    return [expected_tokens(acceptance, c) / (draft_ms + v) for c, v in enumerate(verify_ms, 1)]


# Idle verification products of caps 1..6 (ms), shaped as measured on the 2-core EPYC (flat, then dearer): 3 drafts pay.
IDLE_VERIFY_MS = [30.0, 30.5, 31.0, 40.0, 46.0, 52.0]
IDLE_DRAFT_MS = 8.0


def simulated_rounds(rng: random.Random, rounds: int, load: float) -> list[list[float]]:
    """Per cap, its tokens per second in each round of a machine under a background load: a slow spell per round
    (common to the round's jobs, up to 1 + 2·load times slower) and independent jitter per job (log-normal, σ = load
    / 4, with the odd job 3x slower when a background process grabs its core)."""
    rates = [[] for _ in IDLE_VERIFY_MS]
    for _ in range(rounds):
        spell = 1 + 2 * load * rng.random()

        def slowed(ms):
            grabbed = 3.0 if rng.random() < load / 10 else 1.0
            return ms * spell * grabbed * math.exp(rng.gauss(0, load / 4))

        draft = slowed(IDLE_DRAFT_MS)
        for c, verify in enumerate(IDLE_VERIFY_MS, 1):
            rates[c - 1].append(expected_tokens(BUNDLED_ACCEPTANCE, c) / (draft + slowed(verify)))
    return rates


def test_under_load_the_choice_is_the_idle_one_or_simpler():
    """Clocked stand-ins for 900 measurements on a busy machine (three loads): each chooses the idle choice or fewer
    drafts, or a setting whose idle rate is below the idle choice's by no more than the noise that measurement
    reported (here: never more drafts). The noise check is what does it: the fastest median alone takes more drafts,
    slower on the idle machine, in some of them."""
    idle_rates = cap_rates(IDLE_VERIFY_MS, IDLE_DRAFT_MS, BUNDLED_ACCEPTANCE)
    idle = compare([[r] * 9 for r in idle_rates]).chosen
    assert idle == 2  # 3 drafts: the fastest on these costs, 5% ahead of 2

    def beyond_noise(candidate, result):  # a more complex setting, slower when idle by more than the noise
        return candidate > idle and math.log(idle_rates[idle] / idle_rates[candidate]) > result.noise

    rng = random.Random(0)
    chosen, fastest_median_more = [], 0
    for load in (0.3, 0.6, 1.0):
        for trial in range(300):
            rounds = tuning.MIN_ROUNDS + trial % (tuning.MAX_ROUNDS - tuning.MIN_ROUNDS + 1)
            result = compare(simulated_rounds(rng, rounds, load))
            assert not beyond_noise(result.chosen, result), (load, trial, result)
            chosen.append(result.chosen)
            fastest_median_more += result.fastest > idle
    assert idle in chosen and min(chosen) < idle  # the idle choice when resolved, a simpler one when not
    assert fastest_median_more > 0  # without the check, a busy moment would have picked a slower setting
    quiet = [compare(simulated_rounds(rng, tuning.MAX_ROUNDS, load=0.02)).chosen for _ in range(50)]
    assert set(quiet) == {idle}  # a quiet machine: the same choice every time


def test_measurement_is_bounded_by_its_budget(monkeypatch):
    """On a fake clock where a round of every job takes 3 s: the minimum rounds, then as many as the budget allows."""
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    calls = []

    def measure(rounds):
        calls.append(rounds)
        clock[0] += 3.0 * (rounds + 1)  # its warm-up round too
        return [[1.0] * rounds, [2.0] * rounds]

    samples = measure_rounds(measure, budget=8.0)
    assert calls == [tuning.MIN_ROUNDS, 1]  # 8 s at 3 s a round: one more round and its warm-up
    assert len(samples[0]) == len(samples[1]) == tuning.MIN_ROUNDS + 1
    assert clock[0] <= 3.0 * (tuning.MIN_ROUNDS + 1) + 8.0
    calls.clear()
    clock[0] = 0.0
    measure_rounds(lambda rounds: calls.append(rounds) or [[1.0] * rounds], budget=8.0)  # an instant machine
    assert calls == [tuning.MIN_ROUNDS, tuning.MAX_ROUNDS - tuning.MIN_ROUNDS]
    calls.clear()

    def preparing(rounds):  # the first call's warm-up prepares layouts for 30 s; a round of its jobs takes 1 s
        clock[0] += (30.0 if not calls else 1.0) + 1.0 * rounds
        calls.append(rounds)
        return [[0.25] * rounds, [0.75] * rounds]

    measure_rounds(preparing, budget=8.0)
    assert calls == [tuning.MIN_ROUNDS, 7]  # paced by the rounds, not by the preparation


def test_rounds_that_leave_the_choice_to_noise_get_more(monkeypatch):
    """On a fake clock (2 s a round): candidate 1 is 10% faster, but the budget's rounds are too noisy to resolve it,
    so the simpler candidate would be kept on noise (`Comparison.settled` False); one more call within
    `SETTLE_BUDGET_SECONDS` resolves it. Rounds that settle the choice get no extra call."""
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    swings = [1.3, 0.8, 1.25, 0.85, 1.35, 0.9]

    def stand_in(noisy_calls):
        calls = []

        def measure(rounds):  # seconds per round of two jobs: candidate 0's and candidate 1's
            calls.append(rounds)
            clock[0] += 2.0 * (rounds + 1)
            noisy = len(calls) <= noisy_calls
            second = [1 / (1.1 * (swings[(len(calls) + r) % 6] if noisy else 1.0)) for r in range(rounds)]
            return [[1.0] * rounds, second]

        return measure, calls

    def decide(samples):
        return compare([[1 / t for t in times] for times in samples])

    budgeted, calls = stand_in(noisy_calls=2)
    samples = measure_rounds(budgeted)
    assert calls == [tuning.MIN_ROUNDS, 3] and not decide(samples).settled and decide(samples).chosen == 0
    measure, calls = stand_in(noisy_calls=2)
    samples = measure_rounds(measure, settled=lambda rounds: decide(rounds).settled)
    extra = min(tuning.SETTLE_ROUNDS, int(tuning.SETTLE_BUDGET_SECONDS / 2.0) - 1)
    assert calls == [tuning.MIN_ROUNDS, 3, extra] and len(samples[0]) == tuning.MIN_ROUNDS + 3 + extra
    assert decide(samples).settled and decide(samples).chosen == 1
    steady, calls = stand_in(noisy_calls=0)  # settled after the budget: no more rounds
    assert decide(measure_rounds(steady, settled=lambda rounds: decide(rounds).settled)).chosen == 1
    assert calls == [tuning.MIN_ROUNDS, 3]
    key = {"machine": tuning.machine(torch.device("cpu")), "jobs": [["candidate", 0], ["candidate", 1]]}
    measure, calls = stand_in(noisy_calls=2)  # what a choice does (`timed_choice`), recorded once settled
    timed = tuning.timed_choice("settle-test", key, measure, decide)
    assert len(calls) == 3 and timed.comparison.chosen == 1 and timed.record is not None


# --- records ------------------------------------------------------------------------------------------------------


def stand_in_costs(monkeypatch, calls: list, jitter: float = 0.0):
    """Products timed as rows · width of the weights (the verification grows with its tokens), with optional jitter."""
    rng = random.Random(1)

    def products_samples(jobs, rounds=5):
        calls.append(len(jobs))
        return [[1e-6 * rows * sum(w.shape[0] for w in weights) * math.exp(rng.gauss(0, jitter))
                 for _ in range(rounds)] for weights, rows, _ in jobs]  # fmt: skip

    monkeypatch.setattr(layouts, "products_samples", products_samples)


def pair(**config):
    target = tiny_llama()
    return target, tiny_xpress(target, block_size=8, draft_acceptance=[0.9, 0.8, 0.7, 0.6, 0.3, 0.2, 0.1], **config)


def test_a_later_process_reads_the_record_instead_of_timing(monkeypatch):
    calls = []
    stand_in_costs(monkeypatch, calls)
    target, xpress = pair()
    first = choose_draft_cap(xpress, target, compiled=False)
    assert calls and first.measure_seconds > 0 and first.record is not None
    record = json.loads(Path(first.record).read_text())
    assert Path(first.record).parent == tuning.Records("draft-cap").folder
    assert record["key"]["machine"]["threads"] == torch.get_num_threads() and len(record["samples"]) == 13
    # "Another process": new model objects of the same shapes, nothing kept in memory
    calls.clear()
    target, xpress = pair()
    again = choose_draft_cap(xpress, target, compiled=False)
    assert calls == [] and again.measure_seconds == 0 and again.record == first.record
    assert again.cap == first.cap and again.verify_seconds == first.verify_seconds
    assert "read from" in again.table()
    # Asked to measure again: by the environment, or by the argument
    target, xpress = pair()
    monkeypatch.setenv(tuning.REMEASURE_ENV_VAR, "1")
    assert choose_draft_cap(xpress, target, compiled=False).measure_seconds > 0 and calls
    monkeypatch.delenv(tuning.REMEASURE_ENV_VAR)
    calls.clear()
    assert choose_draft_cap(xpress, target, compiled=False, remeasure=True).measure_seconds > 0 and calls
    # The shape choice keeps its own record, read back the same way
    xpress.config.tree_acceptance = {4: 2.0, 8: 2.4}
    shape = choose_draft_shape(xpress, target, compiled=False)
    assert shape.record is not None and Path(shape.record).name.startswith("draft-shape-")
    calls.clear()
    target, xpress = pair(tree_acceptance={4: 2.0, 8: 2.4})
    assert choose_draft_shape(xpress, target, compiled=False).measure_seconds == 0 and calls == []


def test_records_are_per_thread_count_and_dtype(monkeypatch):
    calls = []
    stand_in_costs(monkeypatch, calls)
    target, xpress = pair()
    first = choose_draft_cap(xpress, target, compiled=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        calls.clear()
        other = choose_draft_cap(xpress, target, compiled=False)
        assert calls and other.record != first.record
    finally:
        torch.set_num_threads(threads)
    target, xpress = pair()
    xpress.to(torch.bfloat16)
    calls.clear()
    assert choose_draft_cap(xpress, target, compiled=False).record != first.record and calls
    calls.clear()
    assert choose_draft_cap(xpress, target, compiled=True).record != first.record and calls  # compiled layouts


def test_a_noisy_measurement_is_used_but_not_kept(monkeypatch):
    calls = []
    stand_in_costs(monkeypatch, calls, jitter=0.5)  # every job anywhere from 0.4x to 2.7x its time
    target, xpress = pair()
    noisy = choose_draft_cap(xpress, target, compiled=False)
    assert noisy.record is None and noisy.comparison.noise > tuning.RECORD_NOISE
    assert "too noisy to keep" in noisy.table()
    assert not list(tuning.Records("draft-cap").folder.glob("*.json"))
    calls.clear()
    target, xpress = pair()
    choose_draft_cap(xpress, target, compiled=False)
    assert calls  # measured again


def test_a_measurement_on_cores_other_jobs_hold_decides_nothing(monkeypatch):
    """Steady products (so the rounds resolve everything) while this process waits for the CPU (here: sleeps, as a
    thread does that other jobs keep off the cores): its CPU time is a small share of the wall time, so the simplest
    setting is taken whatever the rounds say, and nothing is recorded."""
    import time

    calls = []
    stand_in_costs(monkeypatch, calls)
    timed = layouts.products_samples

    def waiting(jobs, rounds=5):
        time.sleep(0.02 * rounds)
        return timed(jobs, rounds=rounds)

    monkeypatch.setattr(layouts, "products_samples", waiting)
    monkeypatch.setattr(tuning, "MIN_CPU_SHARE", 0.8)  # (off for the other tests: conftest.py)
    target, xpress = pair()
    busy = choose_draft_cap(xpress, target, compiled=False)
    assert busy.comparison.noise <= tuning.RECORD_NOISE and busy.record is None
    assert "other jobs held the CPU" in busy.why_not and "other jobs held the CPU" in busy.table()
    assert busy.cap == 1 and busy.comparison.chosen == 0
    monkeypatch.setattr(layouts, "products_samples", timed)  # the same costs, this process on the CPU: kept
    monkeypatch.setattr(tuning, "MIN_CPU_SHARE", 0.0)  # (whatever this test machine's load)
    target, xpress = pair()
    quiet = choose_draft_cap(xpress, target, compiled=False)
    assert quiet.record is not None and quiet.cap > 1  # the rounds decide (and would have for the busy one)
    assert quiet.comparison.slowdowns == pytest.approx(busy.comparison.slowdowns)


def test_a_broken_record_or_an_unwritable_cache_is_not_an_error(monkeypatch, tmp_path):
    calls = []
    stand_in_costs(monkeypatch, calls)
    target, xpress = pair()
    first = choose_draft_cap(xpress, target, compiled=False)
    Path(first.record).write_text("{not json")
    target, xpress = pair()
    calls.clear()
    again = choose_draft_cap(xpress, target, compiled=False)
    assert calls and again.cap == first.cap and json.loads(Path(again.record).read_text())["samples"]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setattr(tuning.Records, "folder", property(lambda self: blocked / "choices"))  # cannot be made
    target, xpress = pair()
    assert choose_draft_cap(xpress, target, compiled=False).record is None


def test_a_layouts_timing_is_kept_for_the_machine_and_read_by_a_later_process(monkeypatch):
    """Whether prepacked weights pay (`cpu_layouts._prepacked_pays`, the layout of the eager verification and of the
    compiled graphs) is timed once per machine: the rounds go to a record, a later process (its in-process timings
    cleared) decides from it without timing; another row count is timed again; XPRESS_REMEASURE=1 times again; and a
    timing made while other jobs held the CPU is used but not kept."""
    import time

    calls = []

    def products_samples(jobs, rounds=5):  # the prepacked layout 2x faster than either other one
        calls.append([(rows, kind) for _, rows, kind in jobs])
        return [[1.0 if kind in ("packed", "onednn") else 2.0] * rounds for _, _, kind in jobs]

    monkeypatch.setattr(layouts, "products_samples", products_samples)
    monkeypatch.setattr(layouts, "_PREPACKED_TIMINGS", {})
    weights = [torch.randn(48, 16), torch.randn(16, 48)]
    assert layouts._prepacked_pays("onednn", weights, 4, 3)
    assert calls == [[(4, "onednn"), (4, "input_major"), (4, "weight_major")]]
    (record,) = tuning.Records("layout").folder.glob("layout-*.json")
    assert json.loads(record.read_text())["samples"] == [[1.0] * 3, [2.0] * 3, [2.0] * 3]

    layouts._PREPACKED_TIMINGS.clear()  # a later process
    calls.clear()
    assert layouts._prepacked_pays("onednn", [w.clone() for w in weights], 4, 3) and calls == []
    assert layouts._prepacked_pays("onednn", weights, 5, 3) and calls == [[(5, "onednn"), (5, "input_major"),
                                                                           (5, "weight_major")]]  # fmt: skip
    layouts._PREPACKED_TIMINGS.clear()
    calls.clear()
    monkeypatch.setenv(tuning.REMEASURE_ENV_VAR, "1")
    assert layouts._prepacked_pays("onednn", weights, 4, 3) and len(calls) == 1
    monkeypatch.delenv(tuning.REMEASURE_ENV_VAR)

    def waiting(jobs, rounds=5):  # this process kept off the cores
        time.sleep(0.05)
        return products_samples(jobs, rounds)

    monkeypatch.setattr(layouts, "products_samples", waiting)
    monkeypatch.setattr(tuning, "MIN_CPU_SHARE", 0.8)  # (off for the other tests: conftest.py)
    assert layouts._prepacked_pays("packed", weights, 4, 3)
    assert len(list(tuning.Records("layout").folder.glob("layout-*.json"))) == 2  # rows 4 and 5 of "onednn" only


# --- fresh processes, real timings (slow) ------------------------------------------------------------------------

CHOOSE = """
import json, sys, time, torch
from transformers import AutoModel, AutoModelForCausalLM
torch.set_num_threads(2)
target = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
xpress = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True, dtype=torch.float32)
start = time.perf_counter()
choice = xpress.choose_draft_cap(target, compiled=False)
print(json.dumps({"cap": choice.cap, "seconds": time.perf_counter() - start, "measured": choice.measure_seconds,
                  "noise": choice.comparison.noise, "record": choice.record, "why_not": choice.why_not}))
"""


@pytest.mark.slow
def test_fresh_processes_reuse_one_choice(tmp_path):
    """Ten fresh processes (the bundled checkpoint on SmolLM2, fp32, eager, 2 threads) with one new cache folder: the
    first that times the caps on a quiet enough machine keeps its record, and every later one reads it and makes the
    same choice without timing. (A process for which the machine was too busy to resolve its rounds keeps nothing: it
    measured and chose the fewest drafts it could not tell from the fastest, or, where other jobs held the cores, 1;
    the next process measures again.) The figures are printed: the first call's cost, the choices."""
    from modeling_xpress.bench.assets import smollm2_dir

    env = {**os.environ, tuning.CACHE_ENV_VAR: str(tmp_path / "cache")}
    env.pop(tuning.REMEASURE_ENV_VAR, None)
    runs = []
    for _ in range(10):
        done = subprocess.run([sys.executable, "-c", CHOOSE, str(smollm2_dir()),
                               str(REPO / "checkpoints" / "xpress-smollm2-135m-instruct")],
                              capture_output=True, text=True, timeout=900, env=env, cwd=REPO)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("\n".join(json.dumps(run) for run in runs))
    kept = next((i for i, run in enumerate(runs) if run["record"] is not None), len(runs))
    for run in runs[:kept]:  # too busy to keep: each of these measured for itself
        assert run["measured"] > 0
        if "other jobs held the CPU" in (run["why_not"] or ""):
            assert run["cap"] == 1  # the simplest: nothing decided on held cores
    if kept < len(runs):
        assert runs[kept]["measured"] > 0  # the first record is written by a process that timed
        for run in runs[kept + 1 :]:
            assert run["measured"] == 0 and run["cap"] == runs[kept]["cap"] and run["record"] == runs[kept]["record"]


def test_a_tree_must_beat_the_best_line_not_only_the_chosen_one(monkeypatch):
    """Stand-in costs (seconds, so the trees' really timed construction barely counts): 1 draft per block is within
    MIN_ADVANTAGE of the fastest cap (3), so the cap is 1; a tree of 4 nodes is 4% faster than 1 draft but only 1.3%
    faster than 3: linear blocks stay. (Compared with the chosen cap alone, the tree would have won: a cap that fell
    back on fewer drafts would hand trees the win.)"""
    verify = {2: 10.0, 3: 20.0, 4: 15.97, 5: 22.05}  # verification of 1, 2, 3 drafts and of a 4-node tree (rows)

    def products_samples(jobs, rounds=5):
        return [[0.0 if len(weights) == 1 else 10.0 if rows == 8 else verify[rows]] * rounds
                for weights, rows, _ in jobs]  # fmt: skip

    monkeypatch.setattr(layouts, "products_samples", products_samples)
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8, draft_acceptance=[0.5, 0.3, 0.2], tree_acceptance={4: 2.5})
    cap = choose_draft_cap(xpress, target, compiled=False)
    assert cap.cap == 1 and cap.caps[cap.comparison.fastest] == 3
    shape = choose_draft_shape(xpress, target, compiled=False)
    assert shape.lines == [1, 3] and shape.tree_nodes is None
    assert shape.comparison.fastest == 2 and shape.comparison.chosen == 1  # the tree fastest, within noise of 3 drafts
    assert compare([shape.comparison.medians[0:1] * 3, shape.comparison.medians[2:3] * 3]).chosen == 1
