"""The evaluation harness measures what it claims: τ on a constructed pair where it is known in advance, the K sweep
against the adaptive setting, the greedy-identity count, and complete JSON / Markdown / PNG outputs; the reports are
rendered without torch."""

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import modeling_xpress.bench.benchmark as bench
from modeling_xpress.bench import reports
from modeling_xpress.bench.benchmark import PromptSet, run_benchmark, write_results
from modeling_xpress.bench.reports import summarize
from modeling_xpress.bench.settings import (
    ADAPTIVE_SETTING,
    COMPILED_PLAIN,
    COMPILED_SPEC,
    DEFAULT_ENTRIES,
    BenchmarkSettings,
)
from modeling_xpress.cards import render_model_card
from modeling_xpress.training.synthetic import constructed_permutation_pair
from tests.builders import load_example, perfect_head, permutation_target, tiny_llama, tiny_tokenizer, tiny_xpress

BLOCK = 8
STEPS = 4
MAX_NEW = 1 + STEPS * BLOCK  # the prefill emits one token, then every step commits a whole block
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli():
    """examples/benchmark.py imported as a module: the parsers of its command-line strings live there."""
    return load_example("benchmark")


@pytest.fixture(autouse=True)
def few_threads():
    # The test machine is shared; a tiny model gains nothing from more threads.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def perfect_methods():
    """A target and three heads on it: xPress and Markov constructed to know the permutation, and no head."""
    target, xpress = constructed_permutation_pair(vocab_size=64, block_size=BLOCK)
    _, perm = permutation_target(64)  # same seed as inside the pair: the same permutation
    markov = tiny_xpress(target, refiner="markov", refiner_rank=64, randomize_head=False, block_size=BLOCK,
                         num_hidden_layers=1, intermediate_size=64)  # fmt: skip
    perfect_head(markov, perm)
    dflash = tiny_xpress(target, refiner="none", block_size=BLOCK, num_hidden_layers=1, intermediate_size=64)
    return target, {"dflash": dflash, "markov": markov, "xpress": xpress}


@pytest.fixture(scope="module")
def perfect_run():
    torch.set_num_threads(1)
    target, methods = perfect_methods()
    sets = {"a": [[5, 9], [1, 2, 3]], "b": [[7]]}
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0,), k_values=(1, 7, 8),
                                 latency_blocks=2, latency_repeats=2, compiled_plain=False)  # fmt: skip
    return run_benchmark(target, methods, sets, settings, progress=False)


def rows(summary, table, **match):
    return [r for r in summary[table] if all(r[k] == v for k, v in match.items())]


def test_tau_equals_known_block_size_on_perfect_pair(perfect_run):
    summary = perfect_run["summary"]
    for method in ("xpress", "markov"):
        for dataset in ("a", "b", reports.ALL):
            (row,) = rows(summary, "tau", method=method, dataset=dataset, temperature=0.0)
            assert row["tau"] == BLOCK  # exactly: every verification commits a whole block
            assert row["verifications"] == STEPS * (2 if dataset == "a" else 1 if dataset == "b" else 3)
        for entry in DEFAULT_ENTRIES:  # both entry points see the same τ
            (row,) = rows(summary, "throughput", method=method, entry=entry, dataset=reports.ALL, temperature=0.0)
            assert row["tau"] == BLOCK
    (none,) = rows(summary, "tau", method="dflash", dataset=reports.ALL, temperature=0.0)
    assert none["tau"] < 2  # a random drafter without a head: the measurement is not stuck at the block size


def test_k_sweep_reaches_adaptive_tau_once_k_covers_the_block(perfect_run):
    summary = perfect_run["summary"]
    (adaptive,) = rows(summary, "sweep", method="xpress", dataset=reports.ALL, setting=ADAPTIVE_SETTING)
    assert adaptive["tau"] == BLOCK
    for k in (7, 8):  # K ≥ n = block_size - 1 reaches the sequential decode (Theorem 1)
        (row,) = rows(summary, "sweep", method="xpress", dataset=reports.ALL, setting=f"K={k}")
        assert row["tau"] == adaptive["tau"]
        assert row["mean_jacobi_iterations"] <= k
    (k1,) = rows(summary, "sweep", method="xpress", dataset=reports.ALL, setting="K=1")
    assert k1["tau"] < BLOCK and k1["mean_jacobi_iterations"] == 1  # one pass fixes only the first position(s)
    assert {r["method"] for r in summary["sweep"]} == {"xpress"}  # only xPress heads are swept


def test_config_is_restored_after_the_sweep():
    _, methods = perfect_methods()
    before = (methods["xpress"].config.jacobi_max_iters, methods["xpress"].config.jacobi_early_exit)
    with pytest.raises(RuntimeError):
        with bench.jacobi_setting(methods["xpress"], 2, False):
            assert methods["xpress"].config.jacobi_max_iters == 2
            raise RuntimeError("interrupted")
    assert (methods["xpress"].config.jacobi_max_iters, methods["xpress"].config.jacobi_early_exit) == before


def test_draft_cap_applies_to_every_method_for_the_run_only():
    """num_assistant_tokens caps every method's drafts per block in every record (the perfect pair would accept whole
    blocks: each verification commits the cap + 1), is stored with the methods, and each config's own value is back
    afterwards."""
    target, methods = perfect_methods()
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0,), k_values=(), adaptive=False,
                                 latency_blocks=1, latency_repeats=1, compiled_plain=False,
                                 num_assistant_tokens=2)  # fmt: skip
    results = run_benchmark(target, methods, {"a": [[5, 9], [1, 2, 3]]}, settings, progress=False)
    spec = [r for r in results["records"] if r["stats"] is not None and r["entry"] == "spec_generate"]
    assert spec and all(max(r["stats"]["draft_lengths"]) == 2 for r in spec)
    assert all(r["identical_to_plain"] for r in results["records"] if r["entry"] != "plain")
    accepted = [n for r in spec if r["method"] == "xpress" for n in r["stats"]["acceptance_lengths"]]
    assert max(accepted) == 3 and accepted.count(3) >= len(accepted) - 2  # 2 drafts + the bonus, but a cut last block
    assert {m["num_assistant_tokens"] for m in results["methods"].values()} == {2}
    assert results["settings"]["num_assistant_tokens"] == 2
    assert all(model.config.num_assistant_tokens is None for model in methods.values())


def test_auto_draft_cap_is_each_methods_own_choice(monkeypatch):
    """num_assistant_tokens="auto": each method verifies the cap its own draft_acceptance picks on this machine (the
    products' timing made equal here, so E(c) alone decides: the longest measured cap), the choices are stored per
    loop, and each config's own cap is back afterwards."""
    from modeling_xpress.cpu_layouts import CpuLinearPolicy

    monkeypatch.setattr(CpuLinearPolicy, "products_samples", lambda self, jobs, rounds=5: [[1e-3] * rounds] * len(jobs))
    target, methods = perfect_methods()
    acceptance = {"dflash": [0.5], "markov": [0.9, 0.8], "xpress": [1.0, 1.0, 1.0]}
    for name, model in methods.items():
        model.config.draft_acceptance = acceptance[name]
    methods["markov"].config.num_assistant_tokens = 1  # "auto" overrides a config's own cap for the run
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0,), k_values=(), adaptive=False,
                                 latency_blocks=1, latency_repeats=1, compiled_plain=False,
                                 num_assistant_tokens="auto")  # fmt: skip
    results = run_benchmark(target, methods, {"a": [[5, 9], [1, 2, 3]]}, settings, progress=False)
    assert {name: set(loops) for name, loops in results["draft_caps"].items()} == {n: {"eager"} for n in methods}
    chosen = {name: loops["eager"]["cap"] for name, loops in results["draft_caps"].items()}
    assert chosen == {"dflash": 1, "markov": 2, "xpress": 3}
    assert {name: m["num_assistant_tokens"] for name, m in results["methods"].items()} == {
        name: {"eager": cap} for name, cap in chosen.items()
    }
    spec = [r for r in results["records"] if r["stats"] is not None and r["entry"] == "spec_generate"]
    for name, cap in chosen.items():
        lengths = [n for r in spec if r["method"] == name for n in r["stats"]["draft_lengths"]]
        assert lengths and max(lengths) == cap
    xpress_accepted = [n for r in spec if r["method"] == "xpress" for n in r["stats"]["acceptance_lengths"]]
    assert max(xpress_accepted) == 4  # the perfect head: 3 drafts + the bonus per verification
    assert results["settings"]["num_assistant_tokens"] == "auto"
    assert "at most 3 (eager) drafts verified per block (chosen on this machine)" in reports.markdown_report(results)
    assert methods["markov"].config.num_assistant_tokens == 1
    assert all(methods[name].config.num_assistant_tokens is None for name in ("dflash", "xpress"))


def test_auto_draft_cap_gives_each_loop_its_own_choice(monkeypatch):
    """With the compiled entry measured, "auto" chooses a cap for each loop, and each entry verifies its loop's: the
    eager loops (generate, spec_generate) the eager choice, spec_generate(compile=True) the compiled one (the two
    choices made to differ here)."""
    from modeling_xpress import draft_cap

    @dataclass
    class Choice:  # the fields of a DraftCapChoice the benchmark reads
        cap: int
        compiled: bool
        tokens_per_second = (1.0,)

    def choose(xpress, target, *, compiled=True, **kwargs):
        return Choice(cap=3 if compiled else 2, compiled=compiled)

    monkeypatch.setattr(draft_cap, "choose_draft_cap", choose)
    target, methods = perfect_methods()
    methods = {"xpress": methods["xpress"]}
    methods["xpress"].config.draft_acceptance = [1.0, 1.0, 1.0]
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0,), k_values=(), adaptive=False,
                                 latency_blocks=1, latency_repeats=1, compiled_plain=False,
                                 entries=("spec_generate", COMPILED_SPEC),
                                 num_assistant_tokens="auto")  # fmt: skip
    results = run_benchmark(target, methods, {"a": [[5, 9], [1, 2, 3]]}, settings, progress=False)
    assert results["methods"]["xpress"]["num_assistant_tokens"] == {"eager": 2, "compiled": 3}
    lengths = defaultdict(set)
    for r in results["records"]:
        if r["stats"] is not None and r["method"] == "xpress":
            lengths[r["entry"]] |= set(r["stats"]["draft_lengths"])
    assert max(lengths["spec_generate"]) == 2 and max(lengths[COMPILED_SPEC]) == 3
    assert all(r["identical_to_plain"] for r in results["records"] if r["entry"] != "plain")


def test_auto_draft_cap_needs_every_methods_acceptance():
    target, methods = perfect_methods()
    methods["xpress"].config.draft_acceptance = [0.5, 0.2]
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0,), k_values=(), adaptive=False,
                                 compiled_plain=False, num_assistant_tokens="auto")  # fmt: skip
    with pytest.raises(ValueError, match=r"draft_acceptance, which \['dflash', 'markov'\] lack"):
        run_benchmark(target, methods, {"a": [[5, 9]]}, settings, progress=False)


def test_greedy_identity_counts_every_prompt(perfect_run):
    identity = perfect_run["summary"]["identity"]
    assert identity and all(r["identical"] == r["prompts"] for r in identity)
    assert {(r["entry"], r["setting"]) for r in identity if r["method"] == "xpress"} >= {
        ("generate", "config"), ("spec_generate", "config"), ("spec_generate", "K=1"), ("spec_generate", "adaptive")
    }  # fmt: skip


def test_greedy_identity_count_sees_a_mismatch(monkeypatch):
    """If the plain reference of one prompt differs, exactly that prompt drops out of every method's count."""
    target, methods = perfect_methods()
    original = bench.run_plain

    def corrupted_second_prompt(target, ids, max_new_tokens, temperature, seed):
        out, seconds = original(target, ids, max_new_tokens, temperature, seed)
        if ids.shape[1] == 3:  # the second prompt of the set
            out = out.clone()
            out[0, -1] = (out[0, -1] + 1) % target.config.vocab_size
        return out, seconds

    monkeypatch.setattr(bench, "run_plain", corrupted_second_prompt)
    settings = BenchmarkSettings(max_new_tokens=12, temperatures=(0.0,), k_values=(), adaptive=False, compiled_plain=False,
                                 latency_blocks=1, latency_repeats=1)  # fmt: skip
    results = run_benchmark(target, methods, {"a": [[5, 9], [1, 2, 3], [4]]}, settings, progress=False)
    counts = {(r["method"], r["entry"]): (r["identical"], r["prompts"])
              for r in results["summary"]["identity"] if r["dataset"] == "a"}  # fmt: skip
    assert counts == {(m, e): (2, 3) for m in methods for e in DEFAULT_ENTRIES}


def test_latency_covers_every_k_and_the_serial_markov_decode(perfect_run):
    latency = perfect_run["summary"]["latency"]
    assert [r["setting"] for r in latency if r["method"] == "xpress"] == ["K=1", "K=7", "K=8", "adaptive"]
    assert [r["setting"] for r in latency if r["method"] == "markov"] == ["serial"]
    assert [r["setting"] for r in latency if r["method"] == "dflash"] == ["argmax"]
    assert all(r["median_us"] > 0 and r["blocks"] == 2 and r["samples"] == 2 * 2 for r in latency)  # blocks × repeats


@pytest.fixture(scope="module")
def random_run(tmp_path_factory):
    """Random tiny models through chat-templated text prompts, two temperatures, both plain baselines (eager and
    static cache + torch.compile), written to disk."""
    torch.set_num_threads(1)
    target = tiny_llama()
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    tokenizer.chat_template = "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}t4"
    methods = {refiner: tiny_xpress(target, refiner=refiner) for refiner in ("none", "markov", "xpress")}
    sets = {
        "code": PromptSet(bench.chat_prompt_ids(tokenizer, ["t5 t6 t7", "t9 t10"]), ["c0", "c1"]),
        "chat": PromptSet(bench.chat_prompt_ids(tokenizer, ["t11 t12 t13 t14", "t15", "t16 t17"]), ["m0", "m1", "m2"]),
    }
    settings = BenchmarkSettings(max_new_tokens=10, temperatures=(0.0, 1.0), k_values=(1, 2), limit=2,
                                 latency_blocks=2, latency_repeats=2)  # fmt: skip
    results = run_benchmark(target, methods, sets, settings, metadata={"note": "test"}, progress=False)
    out = tmp_path_factory.mktemp("results")
    return results, write_results(results, out, "tiny-run"), methods


def test_outputs_are_written_with_expected_content(random_run):
    results, paths, methods = random_run
    assert set(paths) == {"json", "markdown", "tau_vs_k", "draft_breakdown", "refiner_latency"}
    for key in ("tau_vs_k", "draft_breakdown", "refiner_latency"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads(paths["json"].read_text())
    for key in ("settings", "environment", "methods", "datasets", "records", "latency", "summary", "wall_time_s",
                "started_utc", "metadata", "run_name"):  # fmt: skip
        assert key in saved
    assert saved["settings"]["limit"] == 2 and saved["datasets"]["chat"]["prompt_ids"] == ["m0", "m1"]
    assert saved["environment"]["target_dtype"] == "float32" and saved["environment"]["torch"] == torch.__version__
    assert saved["metadata"] == {"note": "test"}
    # Per prompt and temperature: plain eager and compiled, 2 entries × 3 methods, the xPress sweep (K=1, K=2, adaptive).
    assert len(saved["records"]) == 2 * 2 * 2 * (2 + 2 * 3 + 3)
    assert all(r["seconds"] > 0 and 1 <= r["new_tokens"] <= 10 for r in saved["records"])
    assert summarize(saved) == saved["summary"]  # every table is a function of the raw records
    markdown = paths["markdown"].read_text()
    for heading in ("Mean acceptance length", "Jacobi sweep", "speed ratio", "Greedy identity", "Draft step",
                    "Refinement latency", "tiny-run-tau_vs_k.png", "against compiled plain decoding"):  # fmt: skip
        assert heading in markdown


def test_compiled_plain_baseline_is_compiled_once_exact_and_a_ratio_of_its_own(random_run):
    """The compiled baseline (static cache + torch.compile through generate): compiled in the warm-up (its first call
    far slower than its second), greedy-identical to eager plain decoding in fp32, and every speculative row carries
    its ratio against it, consistent with the two rates."""
    results, _, methods = random_run
    warm = results["warm_up"]
    assert warm["compiled_plain_first_call_s"] > 5 * warm["compiled_plain_second_call_s"]
    (compiled,) = rows(results["summary"], "identity", entry=COMPILED_PLAIN, dataset=reports.ALL)
    assert compiled["identical"] == compiled["prompts"] == 4
    for row in rows(results["summary"], "throughput", dataset=reports.ALL):
        assert row["compiled_plain_tokens_per_s"] > 0
        assert row["speedup_vs_compiled"] == pytest.approx(row["tokens_per_s"] / row["compiled_plain_tokens_per_s"])
    (baseline,) = rows(results["summary"], "throughput", entry=COMPILED_PLAIN, dataset=reports.ALL,
                       temperature=0.0)  # fmt: skip
    assert baseline["speedup_vs_compiled"] == pytest.approx(1.0)


def test_entries_need_a_spec_generate_entry():
    assert BenchmarkSettings(entries=("spec_generate",)).entries == ("spec_generate",)
    for entries in [(), ("generate",), ("spec_generate", "spec_generate"), ("spec_generate", "beam")]:
        with pytest.raises(ValueError, match="entries"):
            BenchmarkSettings(entries=entries)
    # The compiled entry alone gives τ too, but the K sweep needs the eager loop.
    alone = (COMPILED_SPEC,)
    assert BenchmarkSettings(entries=alone, k_values=(), adaptive=False).entries == alone
    with pytest.raises(ValueError, match="K sweep runs through spec_generate"):
        BenchmarkSettings(entries=alone)


def test_compiled_speculative_entry_is_compiled_in_the_warm_up_and_matches_spec_generate():
    """`spec_generate_compiled` (spec_generate(compile=True), one cache length for the run): every measured call reuses
    what the warm-up compiled (no compile seconds in any record, though the prompts differ in length), greedy outputs
    are the target's, and at T=0 and T=1 it sees spec_generate's τ (compiled == eager, draw for draw)."""
    target, methods = perfect_methods()
    methods = {"xpress": methods["xpress"], "dflash": methods["dflash"]}
    settings = BenchmarkSettings(max_new_tokens=MAX_NEW, temperatures=(0.0, 1.0), k_values=(), adaptive=False,
                                 latency_blocks=1, latency_repeats=1, compiled_plain=False,
                                 entries=("spec_generate", COMPILED_SPEC))  # fmt: skip
    results = run_benchmark(target, methods, {"a": [[5, 9], [1, 2, 3]], "b": [[7]]}, settings, progress=False)
    assert set(results["warm_up"]["spec_compiled_compile_s"]) == set(methods)
    compiled = [r for r in results["records"] if r["entry"] == COMPILED_SPEC]
    assert len(compiled) == 2 * 2 * 3 and all(r["stats"]["time_compile"] == 0 for r in compiled)
    summary = results["summary"]
    for method in methods:
        for temperature in (0.0, 1.0):
            (spec,) = rows(summary, "throughput", method=method, entry="spec_generate", dataset=reports.ALL,
                           temperature=temperature)  # fmt: skip
            (comp,) = rows(summary, "throughput", method=method, entry=COMPILED_SPEC, dataset=reports.ALL,
                           temperature=temperature)  # fmt: skip
            assert comp["tau"] == spec["tau"] and comp["prompts"] == 3
    identity = rows(summary, "identity", entry=COMPILED_SPEC, dataset=reports.ALL)
    assert len(identity) == 2 and all(r["identical"] == r["prompts"] == 3 for r in identity)
    (card,) = [r for r in reports.card_rows(summary) if r["method"] == "xpress" and r["dataset"] == reports.ALL
               and r["temperature"] == 0.0]  # fmt: skip
    (comp,) = rows(summary, "throughput", method="xpress", entry=COMPILED_SPEC, dataset=reports.ALL,
                   temperature=0.0)  # fmt: skip
    assert card["speedup_spec_generate_compiled"] == comp["speedup"]


def test_max_cache_len_is_checked():
    target, methods = perfect_methods()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="max_cache_len sizes the static caches of compile=True"):
        methods["xpress"].spec_generate(target, ids, max_new_tokens=4, max_cache_len=64)
    with pytest.raises(ValueError, match="cannot hold this call"):
        methods["xpress"].spec_generate(target, ids, max_new_tokens=40, compile=True, max_cache_len=32)


def test_speed_rows_and_breakdown_are_complete(random_run):
    results, _, methods = random_run
    summary = results["summary"]
    for method in methods:
        for entry in DEFAULT_ENTRIES:
            for temperature in (0.0, 1.0):
                (row,) = rows(summary, "throughput", method=method, entry=entry, dataset=reports.ALL,
                              temperature=temperature)  # fmt: skip
                assert row["speedup"] > 0 and row["prompts"] == 4
    parts = rows(summary, "breakdown", method="xpress", temperature=1.0)[0]
    assert parts["drafter_ms_per_block"] > 0 and parts["lm_head_ms_per_block"] > 0 and parts["refiner_ms_per_block"] > 0
    identity = rows(summary, "identity", dataset=reports.ALL, setting="config")
    assert len(identity) == 6 and all(r["identical"] == r["prompts"] == 4 for r in identity)  # fp32: exact


def test_card_rows_render_into_the_model_card(random_run):
    results, _, methods = random_run
    card_rows = reports.card_rows(results["summary"])
    assert {"method", "dataset", "temperature", "tau", "speedup_spec_generate", "speedup_generate"} <= set(card_rows[0])
    card = render_model_card(methods["xpress"].config, results=[r for r in card_rows if r["method"] == "xpress"])
    assert "speedup_generate" in str(card)


def test_load_methods_round_trip(tmp_path, cli):
    target = tiny_llama()
    model = tiny_xpress(target)
    model.save_pretrained(tmp_path / "xp")
    name, path = cli.parse_method_spec(f"xp={tmp_path / 'xp'}")
    loaded = bench.load_methods({name: path}, dtype=torch.bfloat16)["xp"]
    assert loaded.dtype == torch.bfloat16 and not loaded.training
    assert loaded.config.refiner == model.config.refiner
    with pytest.raises(ValueError, match="not a saved xPress folder"):
        bench.load_methods({"missing": tmp_path / "nowhere"})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1, got 0"),
        (dict(temperatures=(0.0, -1.0)), r"temperatures must be >= 0, got \[0.0, -1.0\]"),
        (dict(temperatures=()), "temperatures is empty"),
        (dict(k_values=(0, 1)), r"k_values must be >= 1.*\[0, 1\]"),
        (dict(k_values=(2, 2)), "duplicates"),
        (dict(limit=0), "limit must be >= 1"),
        (dict(latency_repeats=0), "latency_repeats must be >= 1"),
        (dict(num_assistant_tokens=0), "num_assistant_tokens must be a positive int, 'auto'"),
        (dict(num_assistant_tokens="max"), "num_assistant_tokens must be a positive int, 'auto'"),
    ],
)
def test_settings_name_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchmarkSettings(**kwargs)


def test_input_errors_name_the_problem(cli):
    with pytest.raises(ValueError, match="name=path.*'xpress'"):
        cli.parse_method_spec("xpress")
    with pytest.raises(ValueError, match="dtype must be one of.*'float16'"):
        cli.parse_dtype("float16")
    with pytest.raises(ValueError, match="no chat_template"):
        bench.chat_prompt_ids(tiny_tokenizer(8), ["t1"])
    assert cli.draft_cap_arg("auto") == "auto" and cli.draft_cap_arg("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="a positive integer or 'auto', got 'max'"):
        cli.draft_cap_arg("max")
    with pytest.raises(ValueError, match="2 prompts but 1 ids"):
        PromptSet([[1], [2]], ["x"])
    with pytest.raises(ValueError, match="run_name must be a plain file stem"):
        write_results({}, "/tmp", "../escape")
    target, methods = perfect_methods()
    with pytest.raises(ValueError, match="'plain' names the target-alone baseline"):
        run_benchmark(target, {"plain": methods["xpress"]}, {"a": [[1]]}, progress=False)
    with pytest.raises(ValueError, match=r"prompt sets \['a'\] are empty"):
        run_benchmark(target, methods, {"a": []}, progress=False)
    with pytest.raises(ValueError, match="different target"):
        run_benchmark(tiny_llama(), methods, {"a": [[1]]}, progress=False)


# ---------------------------------------------------------------------------------------------------------------------
# Reports without torch
# ---------------------------------------------------------------------------------------------------------------------


def small_results() -> dict:
    """A hand-made run: one prompt at T=0, plain decoding and one xPress method, whose τ and speed are known."""
    stats = {"acceptance_lengths": [4, 2], "jacobi_iterations": [3, 1], "mean_tau": 3.0, "time_drafter": 0.02,
             "time_lm_head": 0.01, "time_refiner": 0.01, "time_verify": 0.1}  # fmt: skip
    context = {"dataset": "a", "temperature": 0.0, "prompt_index": 0, "prompt_id": "p0", "prompt_tokens": 3}
    plain = {**context, "entry": "plain", "method": None, "setting": None, "new_tokens": 10, "seconds": 1.0,
             "identical_to_plain": None, "stats": None}  # fmt: skip
    compiled = {**plain, "entry": "plain_compiled", "seconds": 0.8, "identical_to_plain": True}
    runs = [("generate", "config", 0.8), ("spec_generate", "config", 0.5), ("spec_generate", "K=1", 0.6),
            ("spec_generate", "adaptive", 0.5)]  # fmt: skip
    records = [plain, compiled] + [
        {**context, "entry": entry, "method": "xpress", "setting": setting, "new_tokens": 10, "seconds": seconds,
         "identical_to_plain": True, "stats": stats}
        for entry, setting, seconds in runs
    ]  # fmt: skip
    return {
        "run_name": "small", "started_utc": "2025-01-01T00:00:00+00:00", "wall_time_s": 12.0,
        "settings": {"temperatures": [0.0], "limit": 1, "max_new_tokens": 10, "seed": 0},
        "environment": {"target_model": "tiny", "target_dtype": "float32", "device": "cpu", "cpu": "a CPU",
                        "cuda_device": None, "torch_threads": 1, "torch": "x", "transformers": "y",
                        "git_commit": "abc", "git_dirty": False},
        "methods": {"xpress": {"refiner": "xpress", "block_size": 8, "jacobi_max_iters": 7, "jacobi_early_exit": True}},
        "datasets": {"a": {"prompts": 1}},
        "records": records,
        "latency": {"xpress": {"blocks": 1, "results": [{"setting": "K=1", "refiner": "xpress",
                                                          "seconds": [1e-4, 2e-4, 3e-4]}]}},
        "warm_up": {"compiled_plain_first_call_s": 61.0, "compiled_plain_second_call_s": 0.2},
    }  # fmt: skip


def test_reports_summarize_and_render_without_torch():
    """`reports` is a pure function of the saved results: it imports and renders in a process where torch cannot be
    imported (with `settings`, the labels it reads: their folder loaded as a package of its own, since the package's
    __init__ needs torch)."""
    code = """
import json, sys, types
sys.modules["torch"] = None  # `import torch` now raises
bench = types.ModuleType("bench")
bench.__path__ = [sys.argv[1]]
sys.modules["bench"] = bench
from bench import reports
results = json.loads(sys.stdin.read())
results["summary"] = reports.summarize(results)
print(json.dumps({"markdown": reports.markdown_report(results), "cards": reports.card_rows(results["summary"])}))
"""
    path = ROOT / "modeling_xpress" / "bench"
    done = subprocess.run([sys.executable, "-c", code, str(path)], input=json.dumps(small_results()),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    markdown = out["markdown"]
    assert markdown.startswith("# Benchmark `small`")
    assert "| xpress | 3.00 | 3.00 |" in markdown  # τ = (4 + 2) / 2 for dataset a and the pooled column
    assert "| xpress | spec_generate | 2.00× | 2.00× |" in markdown  # 10 tokens in 0.5 s vs plain's 10 in 1.0 s
    assert "| xpress | generate | 1.25× | 1.25× |" in markdown
    assert "| plain (static cache + torch.compile) | generate | 1.25× | 1.25× |" in markdown  # 10 in 0.8 s
    assert "| xpress | spec_generate | 1.60× | 1.60× |" in markdown  # against the compiled 12.5 tokens/s
    assert "compiled for 61.0 s" in markdown
    assert "| plain | plain_compiled | – | 1/1 | 1/1 |" in markdown
    assert "| K=1 | 3.00 (2.0) | 3.00 (2.0) |" in markdown  # mean Jacobi iterations (3 + 1) / 2
    assert "| xpress | spec_generate | config | 1/1 | 1/1 |" in markdown
    assert "| xpress | xpress | K=1 | 200 | 40–360 | 3 |" in markdown  # median µs; p10–p90 as statistics.quantiles
    (row,) = [r for r in out["cards"] if r["dataset"] == reports.ALL]
    assert row == {"method": "xpress", "dataset": "all", "temperature": 0.0, "tau": 3.0, "speedup_spec_generate": 2.0,
                   "speedup_generate": 1.25, "speedup_spec_generate_vs_compiled": 1.6}  # fmt: skip


def test_training_curves_plot(tmp_path):
    from modeling_xpress.bench.plots import plot_training_curves

    history = [{"step": 5, "loss": 3.0, "tau_estimate": 1.1}, {"step": 10, "loss": 2.5, "tau_estimate": 1.2},
               {"step": 10, "eval_loss": 2.7, "eval_tau_estimate": 1.15}]  # fmt: skip
    path = plot_training_curves({"drafter": history, "xpress": history[:2]}, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_training_curves({"drafter": [{"step": 1, "eval_loss": 1.0}]}, tmp_path / "none.png") is None


def test_tau_of_a_temperature_measured_only_compiled_comes_from_the_compiled_entry():
    """Two runs joined (as bundle_checkpoint does): T=0 through spec_generate and its compiled twin, T=1 through the
    compiled entry alone. τ at T=0 stays spec_generate's; T=1 gets a τ row (and card row) from the compiled records."""
    results = small_results()
    t0 = results["records"]
    compiled_stats = {**t0[3]["stats"], "acceptance_lengths": [5, 3], "mean_tau": 4.0}
    twin = {**t0[3], "entry": COMPILED_SPEC, "seconds": 0.4, "stats": compiled_stats}
    t1 = [{**r, "temperature": 1.0, "identical_to_plain": None} for r in t0[:2]]
    t1.append({**twin, "temperature": 1.0, "identical_to_plain": None, "stats": {**compiled_stats,
               "acceptance_lengths": [2, 2]}})  # fmt: skip
    results["records"] = t0 + [twin] + t1
    summary = summarize(results)
    taus = {r["temperature"]: r["tau"] for r in summary["tau"] if r["dataset"] == reports.ALL}
    assert taus == {0.0: 3.0, 1.0: 2.0}
    (card,) = [r for r in reports.card_rows(summary) if r["dataset"] == reports.ALL and r["temperature"] == 1.0]
    assert card["speedup_spec_generate"] is None and card["speedup_spec_generate_compiled"] == pytest.approx(2.5)
    # the report says which entry a τ came from: a note appears only when a temperature had no eager entry
    note = "τ is that of `spec_generate(compile=True)`"
    assert note in reports.markdown_report({**results, "summary": summary})
    eager_only = small_results()
    assert note not in reports.markdown_report({**eager_only, "summary": summarize(eager_only)})


def test_acceptance_a_checkpoint_carries_is_measured_on_a_known_pair():
    """`bench.acceptance` (the pipeline's measure stage): on the constructed pair, whose head knows the target, every
    block is accepted whole (draft_acceptance all 1, τ = B), the head switched off drafts the drafter's marginals (τ
    near 1), and a best-first tree of N nodes follows the one right path (τ = N + 1 but for the last step); every output is the target's.
    A target with layers no verification mask expresses (chunked attention) gets the decoding loop's reason for
    refusing trees; a sliding-window one gets none."""
    from modeling_xpress.bench.acceptance import measure_prompt, summarize_acceptance, tree_refusal
    from transformers import Llama4TextConfig

    from tests.builders import tiny_gemma3

    target, xpress = constructed_permutation_pair(vocab_size=64, block_size=BLOCK)
    records = [measure_prompt(target, xpress, torch.tensor([ids]), MAX_NEW, tree_nodes=(2, 4))
               for ids in ([5, 9], [1, 2, 3])]  # fmt: skip
    summary = summarize_acceptance(records, BLOCK)
    assert summary["identical"] == summary["outputs"] == 2 * 4
    assert summary["tau"] == BLOCK and summary["draft_acceptance"] == [1.0] * (BLOCK - 1)
    assert summary["tau_head_off"] < 2
    trees = summary["tree_acceptance"]  # (the last step of a prompt is cut short by max_new_tokens)
    assert list(trees) == [2, 4] and all(n < tau <= n + 1 for n, tau in trees.items())
    assert tree_refusal(target) is None and tree_refusal(tiny_gemma3()) is None
    chunked = type("Chunked", (), {"config": Llama4TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=64,
                                                              num_attention_heads=4, num_key_value_heads=2,
                                                              head_dim=16, vocab_size=96)})()  # fmt: skip
    assert "chunked_attention" in tree_refusal(chunked)


def test_a_base_model_gets_plain_text_and_humaneval_alone(monkeypatch):
    """A pretrained base model (Gemma-3-270M) continues text: its prompts are tokenized as they are (no chat turn),
    and its evaluation is HumanEval's raw tasks; an instruct model gets chat turns and MT-Bench too."""
    import datasets

    from modeling_xpress.bench import assets
    from tests.builders import char_tokenizer

    tokenizer = char_tokenizer()
    texts = ["def f(x):\n", "Question: why?\nAnswer:"]
    plain = bench.prompt_ids(tokenizer, texts, chat=False)
    assert [ids[0].tolist() for ids in plain] == [tokenizer(t)["input_ids"] for t in texts]
    chat = bench.prompt_ids(tokenizer, texts)
    assert [ids.tolist() for ids in chat] == [ids.tolist() for ids in bench.chat_prompt_ids(tokenizer, texts)]
    assert chat[0].shape[1] > plain[0].shape[1]  # the turn's markers around the same text

    asked = []

    def humaneval(chat=True):
        asked.append(chat)
        template = "Complete: {}" if chat else "{}"
        return datasets.Dataset.from_dict({"id": ["HumanEval/0", "HumanEval/1"],
                                           "prompt": [template.format(t) for t in texts]})  # fmt: skip

    monkeypatch.setattr(assets, "humaneval_prompts", humaneval)
    monkeypatch.setattr(assets, "mtbench_prompts", lambda: datasets.Dataset.from_dict({"id": ["81"], "prompt": ["Hi"]}))
    base = bench.evaluation_prompt_sets(tokenizer, limit=1, chat=False)
    assert list(base) == ["humaneval"] and base["humaneval"].ids == ["HumanEval/0"]
    assert base["humaneval"].input_ids[0].tolist() == plain[0].tolist()
    instruct = bench.evaluation_prompt_sets(tokenizer, limit=1)
    assert list(instruct) == ["humaneval", "mtbench"] and asked == [False, True]


def test_the_bundled_pairs_name_their_targets_and_refuse_unknown_names():
    from modeling_xpress.bench.assets import GGUF_PACKAGES
    from modeling_xpress.bench.demo import BUNDLED, BUNDLED_CHECKPOINT, bundled_pair

    assert bundled_pair("smollm2").checkpoint == BUNDLED_CHECKPOINT and bundled_pair("smollm2").chat
    gemma = bundled_pair("gemma")
    assert not gemma.chat and gemma.held_out_kinds == "completion" and gemma.target in GGUF_PACKAGES
    assert all(pair.target in GGUF_PACKAGES for pair in BUNDLED.values())
    with pytest.raises(ValueError, match="not a bundled pair; choose one of \\['gemma', 'smollm2'\\]"):
        bundled_pair("llama")
