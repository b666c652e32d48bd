"""Defects found by probing with bad and edge-case inputs: threads, seeds, stored draft vocabularies, dtype changes,
compile limits, unclear errors, memory held after release. Each test here failed on the code before its fix.

The models have shapes no other test module uses (vocab 52/56), so per-process layout timings and compiled graphs
of other tests do not hide what a first call does.
"""

import gc
import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file

import modeling_xpress.compiled as compiled
import modeling_xpress.cpu_layouts as layouts
import modeling_xpress.processors as processors
from modeling_xpress import XPressConfig, XPressModel
from tests.builders import tiny_llama, tiny_xpress

VOCAB = 52


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab_size=VOCAB, num_hidden_layers=2, seed=21)
    return target, tiny_xpress(target, refiner="xpress", block_size=4, num_hidden_layers=1, seed=22)


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def target_greedy(target, ids, max_new_tokens):
    return target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)


def run_in_threads(jobs):
    """Run the zero-argument callables in `jobs` at once; return their results (an exception counts as one)."""
    results = [None] * len(jobs)
    barrier = threading.Barrier(len(jobs))

    def work(i):
        barrier.wait()
        try:
            results[i] = jobs[i]()
        except Exception as error:  # noqa: BLE001 - reported by the test
            results[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


# --- 1, 2: threads ---------------------------------------------------------------------------------------------


def test_compiled_spec_generate_from_threads_is_exact(pair):
    """Several threads decoding with the same models and settings: every output is the target's greedy output
    (they shared one decoder's static caches and write positions, and 12 of 12 came out wrong)."""
    target, xpress = pair
    xpress.spec_generate(target, prompt(5, 0), max_new_tokens=8, compile=True)  # warm: compiled state exists
    prompts = [prompt(4 + i % 3, seed=10 + i) for i in range(6)]
    expected = [target_greedy(target, ids, 20) for ids in prompts]
    jobs = [lambda ids=ids: xpress.spec_generate(target, ids, max_new_tokens=20, compile=True).sequences
            for ids in prompts]  # fmt: skip
    results = run_in_threads(jobs)
    for got, want in zip(results, expected):
        assert not isinstance(got, Exception), repr(got)
        assert torch.equal(got, want)


def test_generate_with_an_xpress_assistant_from_threads(pair, monkeypatch):
    """The eager verification runs in a mode entered by hooks on the target; from several threads one thread's hooks
    fired in another's forward ("trying to pop from empty mode stack"). Forced weight-major so the hooks are armed."""
    target, xpress = pair
    monkeypatch.setattr(layouts, "weight_major_layout", lambda linear_layout, weights, rows: True)
    prompts = [prompt(5, seed=30 + i) for i in range(6)]
    expected = [target_greedy(target, ids, 16) for ids in prompts]
    jobs = [lambda ids=ids: target.generate(ids, assistant_model=xpress, max_new_tokens=16, do_sample=False)
            for ids in prompts]  # fmt: skip
    for _ in range(2):
        results = run_in_threads(jobs)
        for got, want in zip(results, expected):
            assert not isinstance(got, Exception), repr(got)
            assert torch.equal(got, want)


# --- 3: a stored draft vocabulary is validated on load ------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, message",
    [([5, 9, 5, 2], "duplicate"), ([5, -1, 9, 2], "outside the target vocabulary"),
     ([5, 9, 2, 52], "outside the target vocabulary")],
)  # fmt: skip
def test_a_stored_draft_vocabulary_is_validated_on_load(pair, tmp_path, ids, message):
    target, _ = pair
    xpress = tiny_xpress(target, block_size=4, num_hidden_layers=1, draft_vocab_size=4)
    xpress.set_draft_vocabulary([5, 9, 2, 7])
    xpress.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["draft_token_ids"] = torch.tensor(ids)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        XPressModel.from_pretrained(tmp_path)


def test_a_draft_vocabulary_edited_in_place_is_refused_before_drafting(pair):
    target, _ = pair
    xpress = tiny_xpress(target, block_size=4, num_hidden_layers=1, draft_vocab_size=4)
    xpress.set_draft_vocabulary([5, 9, 2, 7])
    xpress.draft_token_ids[1] = 5  # behind set_draft_vocabulary's back
    with pytest.raises(ValueError, match="duplicate"):
        xpress.spec_generate(target, prompt(4, 0), max_new_tokens=4)


# --- 4: seeds ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compile", [False, True])
def test_seeding_reproduces_sampling_first_call_included(compile):
    """The first call for a pair of models used to draw from the global RNG while timing layouts."""
    target = tiny_llama(vocab_size=56, num_hidden_layers=2, seed=41 + compile)
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, num_hidden_layers=1, seed=43)
    ids = torch.randint(0, 56, (1, 5), generator=torch.Generator().manual_seed(0))
    outputs = []
    for _ in range(3):
        torch.manual_seed(7)
        outputs.append(xpress.spec_generate(target, ids, max_new_tokens=24, temperature=1.0, compile=compile,
                                            stop_token_ids=[]).sequences)  # fmt: skip
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[1], outputs[2])


@pytest.mark.parametrize("compile", [False, True])
def test_a_greedy_first_call_leaves_the_callers_rng_alone(compile):
    target = tiny_llama(vocab_size=56, num_hidden_layers=3, seed=45 + compile)
    xpress = tiny_xpress(target, refiner="markov", block_size=4, num_hidden_layers=1, seed=47)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    xpress.spec_generate(target, prompt(5, 1), max_new_tokens=8, compile=compile, num_assistant_tokens=2)
    assert torch.equal(torch.rand(4), expected)


# --- 5: dtype changes ------------------------------------------------------------------------------------------------


def test_compiled_call_after_the_drafter_changes_dtype():
    target = tiny_llama(vocab_size=VOCAB, num_hidden_layers=2, seed=51)
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, num_hidden_layers=1, seed=52)
    ids = prompt(6, 2)
    expected = target_greedy(target, ids, 12)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=12, compile=True).sequences, expected)
    xpress.to(torch.bfloat16)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=12, compile=True).sequences, expected)


# --- 6: many sampling settings in one process ---------------------------------------------------------------------


def test_sampling_settings_are_graph_inputs_not_constants(pair):
    """Each new temperature / top-k / top-p value used to add compiled entries (and a new decoder), towards a
    recompile limit that then failed every call. Now only the first call of each kind (which warpers apply)
    compiles, and calls with other values reuse the graphs."""
    target, xpress = pair
    ids = prompt(5, 3)
    settings = [dict(temperature=t, top_k=k, top_p=p) for t in (0.5, 0.9, 1.3) for k in (None, 3, 7)
                for p in (None, 0.8)]  # fmt: skip
    seen_kinds = set()
    for i, setting in enumerate(settings):
        kind = (setting["temperature"] != 1.0, setting["top_k"] is not None, setting["top_p"] is not None)
        generator = torch.Generator().manual_seed(i)
        out = xpress.spec_generate(target, ids, max_new_tokens=10, compile=True, generator=generator, **setting)
        eager = xpress.spec_generate(target, ids, max_new_tokens=10, compile=False,
                                     generator=torch.Generator().manual_seed(i), **setting)  # fmt: skip
        assert torch.equal(out.sequences, eager.sequences), setting  # compiled == eager, draw for draw
        if kind in seen_kinds:
            assert out.stats.time_compile == 0.0, f"{setting} compiled again"
        seen_kinds.add(kind)


@pytest.mark.parametrize("settings", [(0.7, None, None), (1.0, 5, None), (1.0, None, 0.9), (0.6, 3, 0.8),
                                      (1.3, 200, 0.5), (0.9, 1, 0.99)])
def test_graph_warpers_equal_transformers_warpers(settings):
    """The graphs' tensor-valued warpers compute transformers' processed logits bit for bit (ties included)."""
    temperature, top_k, top_p = settings
    scores = torch.randn(6, 97, generator=torch.Generator().manual_seed(0)) * 4
    scores[:, 10:20] = scores[:, 10:11]  # ties at the top-k / top-p boundary
    expected = processors.sampling_processors(temperature, top_k, top_p)(torch.zeros(6, 1, dtype=torch.long), scores.clone())
    warpers = processors.Warpers.of(temperature, top_k, top_p)
    got = processors.warp(scores.clone(), warpers, processors.warper_values(temperature, top_k, top_p, "cpu"))
    assert torch.equal(got, expected)
    assert (got == float("-inf")).any() or (top_k is None and top_p is None)  # not a no-op


def test_recompile_limit_covers_every_cache_length_bucket():
    """A process can meet every length bucket up to the target's context and every verification width: the limit
    the compiled calls run under must leave room for all of them, so it is never hit in normal use."""
    limit = compiled.recompile_limit(max_positions=32768, block_size=16)
    buckets = 32768 // compiled.LENGTH_BUCKET + 1
    assert limit >= buckets * len(compiled.verify_widths(16))


# --- 7: unclear errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(temperature=1e-45), "temperature"), (dict(temperature=1e-7), "temperature"),
     (dict(compile=True, max_cache_len=512.0), "max_cache_len must be an integer"),
     (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=10**6), "stop_token_ids")],
)  # fmt: skip
def test_bad_values_get_an_error_that_names_them(pair, kwargs, message):
    target, xpress = pair
    with pytest.raises(ValueError, match=message):
        xpress.spec_generate(target, prompt(4, 0), max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("acceptance", [[0.8, float("nan")], [0.5, 0.7], [0.9, 0.4, 0.6]])
def test_draft_acceptance_must_be_non_increasing_fractions(pair, acceptance):
    target, xpress = pair
    with pytest.raises(ValueError, match="draft_acceptance"):
        XPressConfig.from_target_config(target.config, block_size=4, num_hidden_layers=1, draft_acceptance=acceptance)
    with pytest.raises(ValueError, match="draft_acceptance"):
        xpress.choose_draft_cap(target, acceptance=acceptance)


# --- 8 and the maintainability issue: nothing process-global pins a model -------------------------------------------


@pytest.mark.parametrize("compile", [False, True])
def test_models_are_freed_after_del_without_release(compile):
    """Compiled decoders, packed weights and draft-cap choices are owned per model pair, not kept in process-global
    caches: deleting the models frees them, no `release_compiled_decoders()` needed."""
    target = tiny_llama(vocab_size=VOCAB, num_hidden_layers=2, seed=61)
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, num_hidden_layers=1, seed=62,
                         draft_acceptance=[0.6, 0.4, 0.2])  # fmt: skip
    xpress.spec_generate(target, prompt(5, 4), max_new_tokens=8, compile=compile, num_assistant_tokens="auto")
    target.generate(prompt(5, 4), assistant_model=xpress, max_new_tokens=8, do_sample=False)
    refs = [weakref.ref(target), weakref.ref(xpress), weakref.ref(target.lm_head.weight)]
    del target, xpress
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
