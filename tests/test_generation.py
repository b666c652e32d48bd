"""xPress speculative greedy decoding == the target's own greedy decoding, through every entry point."""

import pytest
import torch
from transformers import DynamicCache, GenerationMixin, pipeline
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.streamers import BaseStreamer

import modeling_xpress.generation as xgen
from modeling_xpress import XPressCandidateGenerator, XPressConfig, install_generation_hook
from tests.builders import (
    oracle_drafter, perfect_head, permutation_target, tiny_llama, tiny_qwen3, tiny_tokenizer, tiny_xpress,
)  # fmt: skip

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


# --- a drafter right up to a random position: every acceptance length, known in advance ---------------------------
#
# `oracle_drafter` makes the drafter propose the permutation target's own continuation, wrong from a seeded position
# k ∈ 1..B on (k = B: the whole block is right), so under greedy verification τ = k for every uncut block. Token 0
# lies on a cycle of 63 distinct tokens of the 64-token permutation, so no token repeats in the runs below and the
# EOS token chosen from the chain occurs exactly once.

ORACLE_BLOCK = 6
ORACLE_PROMPT = torch.tensor([[7, 0]])
ORACLE_MAX_NEW = 57  # the last block is cut: 2 tokens are left when a block that would accept 4 is verified


def oracle_pair(refiner: str, randomize_head: bool = False):
    """(target, xpress, first_wrong): heads at δ = 0 unless `randomize_head`, so the drafts are the designed ones."""
    target, perm = permutation_target(vocab_size=64)
    xpress = tiny_xpress(target, refiner=refiner, randomize_head=randomize_head, block_size=ORACLE_BLOCK)
    return target, xpress, oracle_drafter(xpress, target, perm)


def implied_steps(first_wrong, greedy: torch.Tensor, prompt_len: int, max_new_tokens: int, eos: int | None = None):
    """(anchor position, τ) of every verification of a draft, as the construction implies: the slow reference of the
    accept / roll back / stop rules. `greedy` is the target's greedy decode without EOS, at least max_new_tokens long.

    After the prefill's token, each step drafts min(B - 1, tokens left - 1) tokens after the last committed one (none
    when one token is left: the target emits it alone and no τ is recorded); drafts 1..k-1 match, so τ = min(k, drafts
    + 1), then cut after an EOS.
    """
    new = greedy[0, prompt_len:].tolist()
    steps, done = [], 1
    while done < max_new_tokens and new[done - 1] != eos:
        drafts = min(ORACLE_BLOCK - 1, max_new_tokens - done - 1)
        if drafts == 0:
            break
        position = prompt_len + done - 1  # the anchor: the last committed token
        committed = new[done : done + min(first_wrong(position), drafts + 1)]
        if eos in committed:
            committed = committed[: committed.index(eos) + 1]
        steps.append((position, len(committed)))
        done += len(committed)
    return steps


def run_entry(entry: str, target, xpress, ids: torch.Tensor, max_new_tokens: int):
    """Greedy output and recorded τ of one entry point (spec_generate stops at the target's EOS by default)."""
    if entry == "generate":
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=xpress)
    else:
        out = xpress.spec_generate(target, ids, max_new_tokens=max_new_tokens).sequences
    return out, list(xpress.generation_stats.acceptance_lengths)


def test_oracle_drafter_drafts_the_chain_until_its_first_wrong_position():
    """The construction itself, block by block through `draft_block`: drafts 1..k-1 are the target's continuation,
    draft k is not, for k = first_wrong(block position), which takes every value 1..B over the positions used below."""
    target, xpress, first_wrong = oracle_pair("none")
    _, perm = permutation_target(vocab_size=64)
    positions = range(ORACLE_PROMPT.shape[1], ORACLE_PROMPT.shape[1] + ORACLE_MAX_NEW)
    assert {first_wrong(p) for p in positions} == set(range(1, ORACLE_BLOCK + 1))
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    features = torch.randn(1, 1, xpress.fc.in_features, generator=torch.Generator().manual_seed(0))
    anchors = torch.randint(0, 64, (len(positions),), generator=torch.Generator().manual_seed(1)).tolist()
    for position, anchor in zip(positions, anchors):
        with torch.no_grad():  # one context token at position - 1, then the block [anchor, masks] from `position` on
            drafts = xgen.draft_block(xpress, embed, lm_head, torch.tensor([[0, anchor]]), features, position - 1,
                                      DynamicCache(config=xpress.config)).tokens[0].tolist()  # fmt: skip
        chain = [anchor]
        for _ in range(ORACLE_BLOCK - 1):
            chain.append(int(perm[chain[-1]]))
        k = first_wrong(position)
        assert drafts[: k - 1] == chain[1:k], (position, drafts, chain)
        assert k == ORACLE_BLOCK or drafts[k - 1] != chain[k], (position, drafts, chain)


def test_native_dflash_and_our_generator_agree_step_for_step():
    """Both generators see the same drafter, so with refiner="none" their τ sequences agree step for step, over a run
    whose τ takes every value 1..B."""
    target, xpress, first_wrong = oracle_pair("none")
    expected = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False)
    ours = [tau for _, tau in implied_steps(first_wrong, expected, ORACLE_PROMPT.shape[1], ORACLE_MAX_NEW)]
    assert set(ours) == set(range(1, ORACLE_BLOCK + 1))  # not a run of τ = 1: every acceptance length occurs
    got, recorded_ours = run_entry("generate", target, xpress, ORACLE_PROMPT, ORACLE_MAX_NEW)
    assert torch.equal(got, expected) and recorded_ours == ours
    recorded = []
    original = xgen.DFlashTokenCandidateGenerator.update_candidate_strategy

    def record(self, input_ids, scores, num_matches):
        recorded.append(int(num_matches) + 1)
        return original(self, input_ids, scores, num_matches)

    xgen.DFlashTokenCandidateGenerator.update_candidate_strategy = record
    try:
        native = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False, assistant_model=xpress,
                                 speculation_type="dflash")  # fmt: skip
    finally:
        xgen.DFlashTokenCandidateGenerator.update_candidate_strategy = original
    assert torch.equal(native, expected)
    assert recorded == [1] + ours  # recorded[0] is the prefill step


@pytest.mark.parametrize("entry", ["generate", "spec_generate"])
@pytest.mark.parametrize("refiner", REFINERS)
def test_every_head_records_the_acceptance_lengths_the_construction_implies(refiner, entry):
    """Partial blocks roll back, whole blocks are accepted, a max_new_tokens that cuts the last block and an EOS inside
    a block end generation where the target's greedy decode does, and τ is exactly what the construction implies."""
    target, xpress, first_wrong = oracle_pair(refiner)
    prompt_len = ORACLE_PROMPT.shape[1]
    greedy = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False)
    steps = implied_steps(first_wrong, greedy, prompt_len, ORACLE_MAX_NEW)
    taus = [tau for _, tau in steps]
    assert set(taus) == set(range(1, ORACLE_BLOCK + 1))  # rolled-back blocks of every length and whole ones

    got, recorded = run_entry(entry, target, xpress, ORACLE_PROMPT, ORACLE_MAX_NEW)
    assert torch.equal(got, greedy)
    assert recorded == taus
    last_position, last_tau = steps[-1]
    assert 1 + sum(taus) == ORACLE_MAX_NEW and last_tau < first_wrong(last_position)  # the last block was cut

    # EOS = the 2nd token of the first later block that would accept ≥ 3: a draft, inside the block, that ends it.
    step = next(j for j, (_, tau) in enumerate(steps) if j >= 2 and tau >= 3)
    position = steps[step][0]
    eos = int(greedy[0, position + 2])
    target.generation_config.eos_token_id = eos
    expected = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False)
    eos_steps = implied_steps(first_wrong, greedy, prompt_len, ORACLE_MAX_NEW, eos=eos)
    assert expected.shape[1] == position + 3 < prompt_len + ORACLE_MAX_NEW  # EOS stopped the target early
    assert eos_steps[-1] == (position, 2) and first_wrong(position) >= 3  # the block was cut by its EOS
    got, recorded = run_entry(entry, target, xpress, ORACLE_PROMPT, ORACLE_MAX_NEW)
    assert torch.equal(got, expected)
    assert recorded == [tau for _, tau in eos_steps]


@pytest.mark.parametrize("refiner", REFINERS)
def test_random_heads_on_the_oracle_drafter_stay_exact(refiner):
    """Heads whose δ moves some of the designed drafts: τ departs from the construction, the output does not, through
    every entry point (the native dFlash generator bypasses the head)."""
    target, xpress, first_wrong = oracle_pair(refiner, randomize_head=True)
    if refiner != "none":
        with torch.no_grad():  # δ of the order of the designed logit margin (20): some drafts move, some survive
            xpress.refiner.readout.weight.mul_({"xpress": 0.1, "markov": 10.0}[refiner])
    greedy = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False)
    implied = [tau for _, tau in implied_steps(first_wrong, greedy, ORACLE_PROMPT.shape[1], ORACLE_MAX_NEW)]
    for entry in ("generate", "spec_generate"):
        got, recorded = run_entry(entry, target, xpress, ORACLE_PROMPT, ORACLE_MAX_NEW)
        assert torch.equal(got, greedy), entry
        assert (recorded != implied) == (refiner != "none") and max(recorded) > 1, (entry, recorded)
    native = target.generate(ORACLE_PROMPT, max_new_tokens=ORACLE_MAX_NEW, do_sample=False, assistant_model=xpress,
                             speculation_type="dflash")  # fmt: skip
    assert torch.equal(native, greedy)


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

    fields = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    target = MistralForCausalLM(MistralConfig(sliding_window=8, **fields)).eval()
    full_attention = MistralForCausalLM(MistralConfig(sliding_window=None, **fields)).eval()
    full_attention.load_state_dict(target.state_dict())  # the same weights, attending to everything
    cases = [(ids, target.generate(ids, max_new_tokens=40, do_sample=False)) for ids in prompts(96, n=2, seed=3)]
    for ids, expected in cases:  # the window was really passed: it changes the target's own decode
        assert not torch.equal(full_attention.generate(ids, max_new_tokens=40, do_sample=False), expected)
    for refiner in REFINERS:
        xpress = tiny_xpress(target, refiner=refiner)
        for ids, expected in cases:
            assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=40).sequences, expected)
            assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=xpress), expected)


def test_bfloat16_drafter_serves_float32_target(llama):
    """The drafter computes in its own dtype: a bf16 checkpoint next to an fp32 target works through every entry."""
    ids = prompts(llama.config.vocab_size)[1]
    expected = llama.generate(ids, max_new_tokens=30, do_sample=False)
    for refiner in REFINERS:
        xpress = tiny_xpress(llama, refiner=refiner).to(torch.bfloat16)
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
