"""xPress speculative greedy decoding == the target's own greedy decoding, through every entry point."""

import pytest
import torch
from transformers import GenerationMixin, pipeline
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.streamers import BaseStreamer

import modeling_xpress.generation as xgen
from modeling_xpress import XPressCandidateGenerator, XPressConfig, XPressModel, install_generation_hook
from tests.builders import perfect_head, permutation_target, tiny_llama, tiny_qwen3, tiny_tokenizer, tiny_xpress

REFINERS = ["xpress", "markov", "none"]
TARGETS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


def prompts(vocab: int, n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, int(torch.randint(3, 20, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("refiner", REFINERS)
def test_generate_greedy_equals_target_greedy(target, refiner):
    xpress = tiny_xpress(target, refiner=refiner)
    for ids in prompts(target.config.vocab_size):
        expected = target.generate(ids, max_new_tokens=37, do_sample=False)
        got = target.generate(ids, max_new_tokens=37, do_sample=False, assistant_model=xpress)
        assert torch.equal(got, expected)
        stats = xpress.generation_stats
        assert stats.acceptance_lengths and all(1 <= t <= xpress.config.block_size for t in stats.acceptance_lengths)
        assert len(stats.jacobi_iterations) == len(stats.acceptance_lengths)


@pytest.mark.parametrize("refiner", REFINERS)
def test_spec_generate_greedy_equals_target_greedy(target, refiner):
    xpress = tiny_xpress(target, refiner=refiner)
    for ids in prompts(target.config.vocab_size, seed=1):
        expected = target.generate(ids, max_new_tokens=41, do_sample=False)
        out = xpress.spec_generate(target, ids, max_new_tokens=41)
        assert torch.equal(out.sequences, expected)
        assert out.stats is xpress.generation_stats
        assert out.stats.new_tokens == 41
        assert out.stats.time_drafter > 0 and out.stats.time_verify > 0 and out.stats.time_refiner > 0


def test_random_drafter_is_mostly_rejected_yet_exact(target):
    """A useless assistant: nearly every draft is rejected, output is still the target's."""
    xpress = tiny_xpress(target)
    ids = prompts(target.config.vocab_size)[0]
    out = xpress.spec_generate(target, ids, max_new_tokens=40)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert out.stats.mean_tau < 1.3


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_perfect_head_accepts_whole_blocks(refiner):
    """A perfect assistant (constructed, not trained): every block is accepted whole, τ = block_size."""
    target, perm = permutation_target(vocab_size=32)
    block = 8
    xpress = tiny_xpress(target, refiner=refiner, refiner_rank=32, randomize_head=False, block_size=block,
                         jacobi_max_iters=block - 1)  # fmt: skip
    perfect_head(xpress, perm)
    ids = torch.tensor([[5, 9]])
    expected = target.generate(ids, max_new_tokens=1 + 4 * block, do_sample=False)
    got = target.generate(ids, max_new_tokens=1 + 4 * block, do_sample=False, assistant_model=xpress)
    assert torch.equal(got, expected)
    assert xpress.generation_stats.acceptance_lengths == [block] * 4
    out = xpress.spec_generate(target, ids, max_new_tokens=1 + 4 * block)
    assert torch.equal(out.sequences, expected)
    assert out.stats.acceptance_lengths == [block] * 4


def test_jacobi_iterations_reported_and_bounded():
    target, perm = permutation_target(vocab_size=32)
    xpress = tiny_xpress(target, refiner="xpress", refiner_rank=32, randomize_head=False, block_size=8, jacobi_max_iters=3)
    perfect_head(xpress, perm)
    out = xpress.spec_generate(target, torch.tensor([[1]]), max_new_tokens=30)
    assert out.stats.jacobi_iterations and max(out.stats.jacobi_iterations) <= 3
    # With only 3 iterations from a wrong seed, at least the first 3 positions are right: τ ≥ 4 every step.
    assert min(out.stats.acceptance_lengths[:-1]) >= 4


def test_eos_and_max_new_tokens_are_respected():
    target = tiny_llama()
    ids = prompts(target.config.vocab_size)[1]
    free_run = target.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :]
    eos = int(free_run[7])  # a token the target really emits mid-way
    target.generation_config.eos_token_id = eos
    try:
        xpress = tiny_xpress(target)
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert expected.shape[1] < ids.shape[1] + 30  # EOS really stopped it early
        assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=xpress), expected)
        assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=30).sequences, expected)
    finally:
        target.generation_config.eos_token_id = None
    out = xpress.spec_generate(target, ids, max_new_tokens=30, stop_token_ids=[])
    assert out.sequences.shape[1] == ids.shape[1] + 30


def test_streamer_receives_every_token(target):
    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.chunks.append("end")

    xpress = tiny_xpress(target)
    ids = prompts(target.config.vocab_size)[2]
    streamer = Collect()
    out = target.generate(ids, max_new_tokens=25, do_sample=False, assistant_model=xpress, streamer=streamer)
    streamed = [t for chunk in streamer.chunks[:-1] for t in chunk]
    assert streamer.chunks[-1] == "end"
    assert streamed == out[0].tolist()  # the prompt first, then every new token once


def test_pipeline_with_xpress_assistant():
    target = tiny_llama()
    tokenizer = tiny_tokenizer(target.config.vocab_size)
    text = "t5 t17 t3 t44 t9"
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    expected = plain(text, max_new_tokens=30, do_sample=False)[0]["generated_text"]
    for refiner in REFINERS:
        xpress = tiny_xpress(target, refiner=refiner)
        assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=xpress)
        assert assisted(text, max_new_tokens=30, do_sample=False)[0]["generated_text"] == expected
        assert xpress.generation_stats.acceptance_lengths


@pytest.mark.parametrize("refiner", REFINERS)
def test_native_dflash_generator_runs_our_drafter(target, refiner):
    """speculation_type="dflash" uses transformers' own dFlash generator on the drafter (refiner bypassed)."""
    ids = prompts(target.config.vocab_size)[0]
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    for mask_token_id in (None, 3):
        xpress = tiny_xpress(target, refiner=refiner, mask_token_id=mask_token_id)
        got = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=xpress, speculation_type="dflash")
        assert torch.equal(got, expected)
        assert xpress.config.mask_token_id == mask_token_id  # the placeholder id was restored


def test_native_dflash_drafts_equal_our_drafter_without_refiner():
    """Both generators see the same drafter, so with refiner="none" their τ sequences agree step for step."""
    target, perm = permutation_target(vocab_size=32)
    xpress = tiny_xpress(target, refiner="none", block_size=6)
    ids = torch.tensor([[4, 8, 15]])
    target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=xpress)
    ours = list(xpress.generation_stats.acceptance_lengths)
    recorded = []
    original = xgen.DFlashTokenCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        recorded.append(int(num_matches) + 1)
        return original(self, input_ids, scores, num_matches)

    xgen.DFlashTokenCandidateGenerator.update_candidate_strategy = record
    try:
        target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=xpress, speculation_type="dflash")
    finally:
        xgen.DFlashTokenCandidateGenerator.update_candidate_strategy = original
    assert recorded[1 : 1 + len(ours)] == ours  # recorded[0] is the prefill step


# --- the hook ------------------------------------------------------------------------------------------------------


def test_hook_is_idempotent_and_marked():
    first = GenerationMixin._get_candidate_generator
    install_generation_hook()
    install_generation_hook()
    assert GenerationMixin._get_candidate_generator is first
    assert getattr(first, "_xpress_hook", False)


def test_hook_leaves_other_assistants_untouched():
    target = tiny_llama()
    assistant = tiny_llama(seed=7)
    ids = prompts(target.config.vocab_size)[0]
    seen = []
    original = AssistedCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        seen.append(type(self))
        original(self, *args, **kwargs)

    AssistedCandidateGenerator.__init__ = spy
    try:
        got = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=assistant)
    finally:
        AssistedCandidateGenerator.__init__ = original
    assert seen == [AssistedCandidateGenerator]
    assert torch.equal(got, target.generate(ids, max_new_tokens=20, do_sample=False))


def test_hook_routes_xpress_to_its_generator():
    target = tiny_llama()
    xpress = tiny_xpress(target)
    made = []
    original = XPressCandidateGenerator.__init__

    def spy(self, *args, **kwargs):
        made.append(True)
        original(self, *args, **kwargs)

    XPressCandidateGenerator.__init__ = spy
    try:
        target.generate(prompts(96)[0], max_new_tokens=5, do_sample=False, assistant_model=xpress)
    finally:
        XPressCandidateGenerator.__init__ = original
    assert made == [True]


def test_hook_refuses_changed_transformers_internals(monkeypatch):
    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", lambda self, *a, **k: None)
    with pytest.raises(RuntimeError, match="cannot hook into transformers"):
        xgen._check_internals()

    def other_signature(self, config, ids):
        return None

    monkeypatch.setattr(GenerationMixin, "_validate_generation_mode", other_signature)
    with pytest.raises(RuntimeError, match="_validate_generation_mode lost the parameters"):
        xgen._check_internals()


# --- errors --------------------------------------------------------------------------------------------------------


def test_drafter_for_another_target_is_refused():
    target = tiny_llama()
    ids = prompts(96)[0]
    for other in (tiny_llama(vocab_size=80), tiny_llama(hidden_size=32, num_attention_heads=2), tiny_qwen3()):
        xpress = tiny_xpress(other)
        with pytest.raises(ValueError, match="built for a different target"):
            target.generate(ids, max_new_tokens=5, assistant_model=xpress)
        with pytest.raises(ValueError, match="built for a different target"):
            xpress.spec_generate(target, ids, max_new_tokens=5)


def test_bad_layer_ids_and_mask_token_are_refused():
    target = tiny_llama()
    with pytest.raises(ValueError, match=r"target_layer_ids \[4\] are out of range"):
        XPressConfig.from_target_config(target.config, num_hidden_layers=1, target_layer_ids=[1, 4])
    with pytest.raises(ValueError, match="mask_token_id=96 is outside the target vocabulary"):
        XPressConfig.from_target_config(target.config, mask_token_id=96)
    with pytest.raises(ValueError, match="refiner must be one of"):
        XPressConfig.from_target_config(target.config, refiner="gru")
    with pytest.raises(ValueError, match="hidden_size .* must equal target_hidden_size"):
        XPressConfig.from_target_config(target.config, hidden_size=32)


def test_batch_and_multiple_sequences_are_refused():
    target = tiny_llama()
    xpress = tiny_xpress(target)
    batch = torch.randint(0, 96, (2, 6))
    with pytest.raises(ValueError, match="one sequence at a time"):
        target.generate(batch, max_new_tokens=5, assistant_model=xpress)
    with pytest.raises(ValueError, match="one sequence at a time"):
        xpress.spec_generate(target, batch, max_new_tokens=5)
    with pytest.raises(ValueError, match="num_return_sequences=2 is not supported"):
        target.generate(batch[:1], max_new_tokens=5, assistant_model=xpress, do_sample=True, num_return_sequences=2)


def test_wrong_context_width_is_refused():
    target = tiny_llama()
    xpress = tiny_xpress(target)
    embeds = xpress.embed_blocks(torch.tensor([[1]]), target.get_input_embeddings())
    with pytest.raises(ValueError, match="context_hidden_states has 64 features but this drafter expects 128"):
        xpress(noise_embeds=embeds, context_hidden_states=torch.randn(1, 3, 64))


def test_default_target_layers_follow_dflash_rule():
    from modeling_xpress import default_target_layer_ids

    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(30, 1) == [15]
    assert XPressConfig.from_target_config(tiny_qwen3().config, num_hidden_layers=1).target_layer_ids == [2]


def test_model_never_stores_target_tables():
    target = tiny_llama()
    xpress = tiny_xpress(target)
    names = [n for n, _ in xpress.named_parameters()]
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert isinstance(xpress, XPressModel)


# --- logits processors, inputs and targets generate() accepts -------------------------------------------------------

# Every processor transformers applies in assisted decoding, alone and combined. Greedy cases must reproduce the
# target's own processed greedy output; sampled cases must run and honour what their processors guarantee.
PROCESSOR_CASES = {
    "temperature": dict(do_sample=True, temperature=0.7),
    "top_k": dict(do_sample=True, top_k=5),
    "top_p": dict(do_sample=True, top_p=0.8),
    "top_k_1": dict(do_sample=True, top_k=1),  # sampling from a one-token support: must equal greedy
    "repetition_penalty": dict(do_sample=False, repetition_penalty=1.3),
    "no_repeat_ngram_size": dict(do_sample=False, no_repeat_ngram_size=2),
    "combined": dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, no_repeat_ngram_size=3),
}


def spec_kwargs(case: dict) -> dict:
    """The same settings for spec_generate (temperature 0 = greedy)."""
    kwargs = {k: v for k, v in case.items() if k != "do_sample"}
    kwargs["temperature"] = case.get("temperature", 1.0) if case["do_sample"] else 0.0
    return kwargs


def has_repeated_ngram(tokens: list[int], n: int) -> bool:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(grams) != len(set(grams))


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.mark.parametrize("entry", ["generate", "spec_generate"])
@pytest.mark.parametrize("case", list(PROCESSOR_CASES))
@pytest.mark.parametrize("refiner", REFINERS)
def test_every_head_runs_every_logits_processor(llama, refiner, case, entry):
    settings = PROCESSOR_CASES[case]
    xpress = tiny_xpress(llama, refiner=refiner)
    ids = prompts(llama.config.vocab_size)[0]
    torch.manual_seed(0)
    if entry == "generate":
        # top_k=None: generate's default top_k=50 would add a processor the case does not name
        got = llama.generate(ids, max_new_tokens=30, assistant_model=xpress, **({"top_k": None} | settings))
    else:
        got = xpress.spec_generate(llama, ids, max_new_tokens=30, stop_token_ids=[], generator=torch.Generator().manual_seed(0),
                                   **spec_kwargs(settings)).sequences  # fmt: skip
    assert got.shape == (1, ids.shape[1] + 30) and int(got.max()) < llama.config.vocab_size
    assert xpress.generation_stats.acceptance_lengths
    greedy_settings = {k: v for k, v in settings.items() if k in ("repetition_penalty", "no_repeat_ngram_size")}
    if not settings["do_sample"] or case == "top_k_1":
        expected = llama.generate(ids, max_new_tokens=30, do_sample=False, **greedy_settings)
        assert torch.equal(got, expected)
    if "no_repeat_ngram_size" in settings:
        assert not has_repeated_ngram(got[0].tolist(), settings["no_repeat_ngram_size"])


def test_sliding_window_target_greedy_identity():
    """A target whose cache keeps only a window must still be rolled back exactly past the window."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=8, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    target = MistralForCausalLM(config).eval()
    for refiner in REFINERS:
        xpress = tiny_xpress(target, refiner=refiner)
        for ids in prompts(96, n=2, seed=3):
            expected = target.generate(ids, max_new_tokens=40, do_sample=False)
            assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=40).sequences, expected)
            assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=xpress), expected)
            assert ids.shape[1] + 40 > 2 * config.sliding_window  # the window was really passed


def test_bfloat16_drafter_serves_float32_target(llama):
    """The drafter computes in its own dtype: a bf16 checkpoint next to an fp32 target works through every entry."""
    ids = prompts(llama.config.vocab_size)[1]
    expected = llama.generate(ids, max_new_tokens=30, do_sample=False)
    for refiner in REFINERS:
        xpress = tiny_xpress(llama, refiner=refiner).to(torch.bfloat16)
        assert xpress.dtype == torch.bfloat16 and llama.dtype == torch.float32
        assert torch.equal(llama.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=xpress), expected)
        assert torch.equal(
            llama.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=xpress, speculation_type="dflash"),
            expected,
        )
        assert torch.equal(xpress.spec_generate(llama, ids, max_new_tokens=30).sequences, expected)
        embeds = xpress.embed_blocks(ids[:, -1:], llama.get_input_embeddings())
        assert xpress(noise_embeds=embeds).last_hidden_state.dtype == torch.float32  # back in the target's dtype


def test_spec_generate_takes_a_tokenizer_output(llama):
    tokenizer = tiny_tokenizer(llama.config.vocab_size)
    inputs = tokenizer("t5 t17 t3 t44 t9", return_tensors="pt")
    xpress = tiny_xpress(llama)
    expected = llama.generate(**inputs, max_new_tokens=20, do_sample=False)
    assert torch.equal(xpress.spec_generate(llama, **inputs, max_new_tokens=20).sequences, expected)
    padded = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"].clone()}
    padded["attention_mask"][0, 0] = 0
    with pytest.raises(ValueError, match="must be all ones over input_ids"):
        xpress.spec_generate(llama, **padded, max_new_tokens=5)


def test_stop_token_ids_accept_tensors_and_numpy_integers(llama):
    import numpy as np

    ids = prompts(llama.config.vocab_size)[1]
    free_run = llama.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :]
    eos = int(free_run[5])
    xpress = tiny_xpress(llama)
    expected = xpress.spec_generate(llama, ids, max_new_tokens=30, stop_token_ids=eos).sequences
    assert expected.shape[1] < ids.shape[1] + 30  # the stop token really stopped it
    for stop in (torch.tensor(eos), np.int64(eos), torch.tensor([eos]), [eos], (eos,)):
        assert torch.equal(xpress.spec_generate(llama, ids, max_new_tokens=30, stop_token_ids=stop).sequences, expected)
    with pytest.raises(ValueError, match="stop_token_ids must be integer token ids"):
        xpress.spec_generate(llama, ids, max_new_tokens=5, stop_token_ids=[1.5])


def test_beam_search_with_an_xpress_assistant_is_refused(llama):
    xpress = tiny_xpress(llama)
    ids = prompts(llama.config.vocab_size)[0]
    with pytest.raises(ValueError, match="num_beams=2 is not supported with an xPress assistant"):
        llama.generate(ids, max_new_tokens=5, num_beams=2, assistant_model=xpress)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0.*-0.5"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0.*nan"),
        (dict(temperature=0.7, top_p=1.5), r"top_p must be None or a number in \(0, 1\].*1.5"),
        (dict(temperature=0.7, top_p=0.0), r"top_p must be None or a number in \(0, 1\].*0.0"),
        (dict(temperature=0.7, top_k=-1), "top_k must be None or an integer >= 0.*-1"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be None or a finite number > 0.*0.0"),
        (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size must be None or an integer >= 0.*-2"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1.*0"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 1.*2.5"),
    ],
)
def test_spec_generate_names_bad_values(llama, kwargs, message):
    xpress = tiny_xpress(llama)
    with pytest.raises(ValueError, match=message):
        xpress.spec_generate(llama, prompts(96)[0], **({"max_new_tokens": 5} | kwargs))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(target_layer_ids=[1.7, 2.2]), r"target_layer_ids must be integer layer indices, got \[1.7, 2.2\]"),
        (dict(mask_token_id=3.5), "mask_token_id must be an integer token id.*3.5"),
        (dict(mask_token_id=True), "mask_token_id must be an integer token id.*True"),
        (dict(block_size=8.0), "block_size must be an integer, got 8.0"),
        (dict(refiner_rank=True), "refiner_rank must be an integer, got True"),
    ],
)
def test_config_names_non_integer_values(llama, overrides, message):
    with pytest.raises(ValueError, match=message):
        XPressConfig.from_target_config(llama.config, num_hidden_layers=2, **overrides)


def test_timing_adds_no_device_synchronisation(llama, monkeypatch):
    """On a GPU, section times come from CUDA events read after generation: the loop itself never synchronises.
    Simulated on CPU with stand-in events: every mark is an event, and `torch.cuda.synchronize` is never called."""
    clock = iter(range(10**6))

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.time = None

        def record(self, stream=None):
            self.time = next(clock)  # one "millisecond" per mark

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return float(end.time - self.time)

    def forbidden():
        raise AssertionError("generation synchronised the device")

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    monkeypatch.setattr(xgen.SectionTimer, "__init__", lambda self, device: setattr(self, "cuda", True))
    xpress = tiny_xpress(llama)
    ids = prompts(llama.config.vocab_size)[0]
    for run in ("generate", "spec_generate"):
        if run == "generate":
            llama.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=xpress)
        else:
            xpress.spec_generate(llama, ids, max_new_tokens=20)
        stats = xpress.generation_stats
        blocks = len(stats.jacobi_iterations)
        # each drafted block has three consecutive marks one "ms" apart: drafter, lm_head, refiner
        assert stats.time_drafter == stats.time_lm_head == stats.time_refiner == pytest.approx(blocks * 1e-3)
        assert stats.time_verify > 0 and stats.time_total >= stats.time_drafter + stats.time_verify
