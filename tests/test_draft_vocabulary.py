"""A frequency-ranked draft vocabulary (FR-Spec / EAGLE-3): the drafter and its head read out only `draft_vocab_size`
rows; tokens outside are never drafted (q = 0 there) and verification, unchanged, stays lossless."""

import copy

import pytest
import torch
from transformers import LogitsProcessorList

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.processors import sampling_processors
from modeling_xpress.training import (
    distribution_loss,
    frequency_ranked_vocabulary,
    restrict_to_draft_vocabulary,
    with_draft_vocabulary,
)
from tests.builders import tiny_llama, tiny_xpress
from tests.test_generation import prompts
from tests.test_sampling import ALPHA, PROMPT, chi_square_pvalue, draw_with_spec_generate, exact_distribution

REFINERS = ["xpress", "markov", "none"]


def with_vocabulary(xpress: XPressModel, token_ids) -> XPressModel:
    """The same drafter restricted to `token_ids`; each head keeps its readout rows of those tokens."""
    restricted = with_draft_vocabulary(xpress, token_ids).eval()
    if xpress.refiner.corrects:
        assert torch.equal(restricted.refiner.readout.weight, xpress.refiner.readout.weight[torch.as_tensor(token_ids)])
    return restricted


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def drafted_tokens(xpress, target, ids, **kwargs) -> set[int]:
    """Every token the drafter proposed in one spec_generate call."""
    seen: set[int] = set()
    original = xpress.refine

    def spy(*args, **kw):
        result = original(*args, **kw)
        seen.update(result.tokens.flatten().tolist())
        return result

    xpress.refine = spy
    try:
        xpress.spec_generate(target, ids, **kwargs)
    finally:
        del xpress.refine
    return seen


@pytest.mark.parametrize("refiner", REFINERS)
def test_greedy_identity_and_drafts_only_from_the_draft_vocabulary(target, refiner):
    ids = prompts(target.config.vocab_size)[0]
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)
    # The subset leaves out the target's most likely next tokens on this run, so drafts are often wrong.
    excluded = set(expected[0, ids.shape[1] :].tolist())
    vocabulary = [t for t in range(target.config.vocab_size) if t not in excluded][:40]
    xpress = with_vocabulary(tiny_xpress(target, refiner=refiner), vocabulary)
    assert torch.equal(target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=xpress), expected)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=30).sequences, expected)
    drafted = drafted_tokens(xpress, target, ids, max_new_tokens=30)
    assert drafted and drafted <= set(vocabulary)  # never a token outside, in particular never the target's argmax
    assert max(xpress.generation_stats.acceptance_lengths) == 1  # so no draft was ever accepted


def test_q_is_zero_outside_the_draft_vocabulary(target):
    xpress = with_vocabulary(tiny_xpress(target), list(range(0, 96, 3)))
    hidden = torch.randn(1, xpress.config.block_size, 64)
    logits = xpress.base_logits(hidden, target.get_output_embeddings())
    inside = torch.zeros(96, dtype=torch.bool)
    inside[xpress.draft_token_ids] = True
    assert torch.isinf(logits[..., ~inside]).all() and torch.isfinite(logits[..., inside]).all()
    # on its rows, the same as the whole lm_head
    torch.testing.assert_close(logits[..., inside], target.lm_head(hidden[:, 1:])[..., inside])


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("refiner", REFINERS)
def test_decoding_over_the_draft_vocabulary_equals_decoding_over_the_whole_one(target, refiner, sampling):
    """`refine` given the drafter's logits over its draft vocabulary (the fast path: every Jacobi iteration works on
    V_d-wide logits) returns the tokens and the whole-vocabulary q of `refine` given them over the whole vocabulary,
    greedy and sampling (temperature, top-k, top-p; the same Gumbel draws on the draft vocabulary's ids)."""
    from modeling_xpress.processors import processors_transform

    torch.manual_seed(3)
    vocabulary = torch.randperm(96)[:40].tolist()  # not sorted: draft indices are not target ids
    xpress = with_vocabulary(tiny_xpress(target, refiner=refiner), vocabulary)
    lm_head = target.get_output_embeddings()
    ids = torch.tensor(vocabulary)
    anchor = torch.tensor([[3, vocabulary[7]], [vocabulary[2], 50], [90, 11]])  # [before, anchor]: any target ids
    hidden = torch.randn(3, xpress.config.block_size, 64)
    whole, draft = xpress.base_logits(hidden, lm_head), xpress.draft_logits(hidden, lm_head)
    assert draft.shape[-1] == 40 and torch.equal(whole[..., ids], draft)
    kwargs = {}
    if sampling:
        noise = torch.distributions.Gumbel(0.0, 1.0).sample(whole.shape)
        transform = processors_transform(sampling_processors(0.7, 20, 0.9), anchor)
        kwargs = {"logits_transform": transform}
        full = xpress.refine(hidden, whole, anchor, noise=noise, **kwargs)
        fast = xpress.refine(hidden, draft, anchor, noise=noise[..., ids].contiguous(), **kwargs)
    else:
        full = xpress.refine(hidden, whole, anchor)
        fast = xpress.refine(hidden, draft, anchor)
    assert torch.equal(fast.tokens, full.tokens) and torch.equal(fast.iterations, full.iterations)
    assert set(fast.tokens.flatten().tolist()) <= set(vocabulary)
    outside = ~torch.isin(torch.arange(96), ids)
    assert fast.logits.shape == full.logits.shape and torch.isinf(fast.logits[..., outside]).all()
    torch.testing.assert_close(fast.logits, full.logits)
    if refiner != "none":
        assert len(set(fast.tokens[0].tolist())) > 1  # really decoding, not a constant block
    with pytest.raises(ValueError, match=r"whole vocabulary \(96\) or the draft vocabulary \(40\), got 39"):
        xpress.refine(hidden, draft[..., :39], anchor)


def test_only_id_blind_processors_decode_over_the_draft_vocabulary(target):
    """Temperature/top-k/top-p read values only; a repetition penalty reads ids, so its drafts are decoded over the
    whole vocabulary, and greedy decoding with it is still the target's own."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from modeling_xpress.processors import vocabulary_local

    assert vocabulary_local(None) and vocabulary_local(LogitsProcessorList())
    assert vocabulary_local(sampling_processors(0.7, 5, 0.9))
    assert not vocabulary_local(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]))
    xpress = with_vocabulary(tiny_xpress(target), list(range(0, 96, 2)))
    widths = []
    original = xpress.refine

    def spy(hidden, base_logits, *args, **kwargs):
        widths.append(base_logits.shape[-1])
        return original(hidden, base_logits, *args, **kwargs)

    xpress.refine = spy
    ids = prompts(96)[0]
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=20, repetition_penalty=1.3).sequences, expected)
    assert set(widths) == {96}
    widths.clear()
    xpress.spec_generate(target, ids, max_new_tokens=20)
    assert set(widths) == {48}


@pytest.mark.parametrize("top_p", [None, 0.8])
@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_lossless_when_the_draft_vocabulary_misses_a_likely_token(refiner, top_p):
    """Vocabulary {0, 1} of {0, 1, 2}: the drafter can never propose token 2, yet samples follow the target."""
    from tests.test_sampling import make_xpress
    from tests.test_sampling import target as sampling_target

    model = sampling_target.__wrapped__()
    exact = exact_distribution(model, sampling_processors(1.0, None, top_p) if top_p else LogitsProcessorList())
    assert sum(p for seq, p in exact.items() if 2 in seq) > 0.02  # token 2 matters (≥ 40 of the 2000 draws expected)
    xpress = with_vocabulary(make_xpress(model, refiner), [0, 1])
    samples = draw_with_spec_generate(xpress, model, top_p=top_p, seed=4)
    assert any(2 in s for s in samples)  # the target's own tokens outside the vocabulary still appear
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_draft_vocabulary_round_trips_and_refuses_bad_ids(target, tmp_path):
    xpress = with_vocabulary(tiny_xpress(target), [5, 9, 2, 77])
    xpress.save_pretrained(tmp_path / "x")
    loaded = XPressModel.from_pretrained(tmp_path / "x")
    assert loaded.config.draft_vocab_size == 4 and loaded.draft_token_ids.tolist() == [5, 9, 2, 77]
    with pytest.raises(ValueError, match="need 4 distinct token ids"):
        loaded.set_draft_vocabulary([1, 1, 2, 3])
    with pytest.raises(ValueError, match=r"ids \[96\] are outside the target vocabulary \(0..95\)"):
        loaded.set_draft_vocabulary([1, 2, 3, 96])
    with pytest.raises(ValueError, match="draft_vocab_size must be None .* or an integer in 1..96, got 97"):
        XPressConfig.from_target_config(target.config, draft_vocab_size=97)
    with pytest.raises(ValueError, match="has no draft vocabulary"):
        tiny_xpress(target).set_draft_vocabulary([1])


def test_frequency_ranked_vocabulary_counts_response_tokens_only():
    rows = [
        {"input_ids": [7, 7, 7, 1, 1, 2], "loss_mask": [0, 0, 0, 1, 1, 1]},  # 7 only in the prompt
        {"input_ids": [3, 1, 2, 2, 9], "loss_mask": [0, 1, 1, 1, 1]},
    ]
    assert frequency_ranked_vocabulary(rows, 3).tolist() == [1, 2, 9]  # counts 3, 3 (tie → smaller id first), 1
    assert frequency_ranked_vocabulary(rows, 3, always=(7,)).tolist() == [7, 1, 2]
    with pytest.raises(ValueError, match="size must be between 1 .* and 4"):
        frequency_ranked_vocabulary(rows, 5, always=(7,))


def test_loss_over_the_draft_vocabulary_equals_the_whole_vocabulary_loss():
    """CE and ‖p − p^t‖₁ of a drafter that puts p = 0 outside its vocabulary, computed on V_d (+ the tail mass),
    equal the same quantities written out over the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 30, 5
    token_ids = torch.randperm(vocab, generator=g)[:12]
    logits = torch.randn(4, n, 12, generator=g, requires_grad=True)
    target_probs = torch.randn(4, n, vocab, generator=g).softmax(-1)
    labels = torch.randint(0, vocab, (4, n), generator=g)
    labels[0, 3:] = -100
    labels[1, 0] = int(token_ids[2])  # at least one label inside, one certainly outside
    labels[1, 1] = int([t for t in range(vocab) if t not in token_ids.tolist()][0])
    targets = restrict_to_draft_vocabulary(target_probs, labels, token_ids)
    weights = torch.ones(n)
    got = distribution_loss(logits, targets.probs, targets.labels, weights, 1.0, 1.0, tail=targets.tail)

    p = torch.zeros(4, n, vocab).index_copy(-1, token_ids, logits.softmax(-1))  # p over the whole vocabulary
    l1 = (p - target_probs).abs().sum(-1)
    inside = torch.isin(labels, token_ids)
    ce = -p.clamp(min=1e-30).log().gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    valid = labels != -100
    torch.testing.assert_close(got.l1, l1 * valid)
    torch.testing.assert_close(got.ce, ce * inside * valid)
    assert bool(inside[1, 0]) and not bool(inside[1, 1]) and bool(got.ce_valid[1, 0]) and not bool(got.ce_valid[1, 1])
    expected_loss = ((ce * inside * valid) + l1 * valid).sum() / valid.sum()
    torch.testing.assert_close(got.loss, expected_loss)
    got.loss.backward()  # the fused loss differentiates through the restricted logits
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_trainer_trains_a_drafter_with_a_draft_vocabulary(target, tmp_path):
    import datasets

    from modeling_xpress.training import XPressTrainer, XPressTrainingArguments
    from tests.test_training import random_rows

    rows = random_rows([30, 25, 40, 33])
    vocabulary = frequency_ranked_vocabulary(rows, 48)
    xpress = with_vocabulary(tiny_xpress(target), vocabulary.tolist()).train()
    head_before = xpress.refiner.readout.weight.clone()
    args = XPressTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, anchors_per_sequence=4, report_to=[],
        disable_tqdm=True, save_strategy="no", logging_steps=1, seed=0,
    )  # fmt: skip
    trainer = XPressTrainer(model=xpress, target=target, args=args, train_dataset=datasets.Dataset.from_list(rows))
    logs = trainer.train()
    assert torch.isfinite(torch.tensor(logs.training_loss))
    assert xpress.refiner.readout.weight.shape == (48, 16) and not torch.equal(head_before, xpress.refiner.readout.weight)
    trainer.save_model(str(tmp_path / "saved"))
    assert XPressModel.from_pretrained(tmp_path / "saved").draft_token_ids.tolist() == vocabulary.tolist()


# --- a head's token table over the draft vocabulary (config.refiner_token_vocab = "draft") ---------------------------


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_a_compacted_token_table_keeps_the_head_on_draft_tokens_and_shares_one_row_elsewhere(target, refiner):
    """`compact_token_table` keeps each draft token's row and maps every other token to one shared row, the mean of
    theirs: δ is unchanged wherever every previous token is a draft-vocabulary token (drafts always are), and
    elsewhere equals the full head's δ with that mean row in place of the token's."""
    torch.manual_seed(5)
    vocabulary = torch.randperm(96)[:40]
    full = with_vocabulary(tiny_xpress(target, refiner=refiner), vocabulary.tolist())
    compact = with_vocabulary(tiny_xpress(target, refiner=refiner), vocabulary.tolist())
    compact.compact_token_table()
    assert compact.config.refiner_token_vocab == "draft" and compact.refiner.token_embed.weight.shape == (41, 16)
    hidden = torch.randn(2, full.config.block_size, 64)
    inside = vocabulary[torch.randint(0, 40, (2, full.config.block_size))]
    torch.testing.assert_close(compact.refiner(hidden, inside), full.refiner(hidden, inside))
    outside_ids = torch.tensor([i for i in range(96) if i not in set(vocabulary.tolist())])
    previous = inside.clone()
    previous[:, 1] = outside_ids[:2]  # the anchor (slot 1's previous token) outside the draft vocabulary
    with torch.no_grad():
        full.refiner.token_embed.weight[outside_ids] = full.refiner.token_embed.weight[outside_ids].mean(dim=0)
    torch.testing.assert_close(compact.refiner(hidden, previous), full.refiner(hidden, previous))
    assert not torch.allclose(compact.refiner(hidden, previous), compact.refiner(hidden, inside))


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_a_draft_vocabulary_token_table_decodes_exactly_on_every_route(target, refiner, tmp_path):
    """Greedy identity through `generate(assistant_model=)`, `spec_generate` and a draft tree, and Jacobi over the
    folded table (`delta_folded`) equal to the teacher-forced head; the table's row map survives a save and load and
    a `load_state_dict` into a fresh model."""
    torch.manual_seed(6)
    vocabulary = torch.randperm(96)[:48].tolist()
    xpress = with_vocabulary(tiny_xpress(target, refiner=refiner), vocabulary)
    xpress.compact_token_table()
    ids = prompts(target.config.vocab_size)[0]
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=xpress), expected)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=24).sequences, expected)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=24, tree_nodes=6).sequences, expected)
    if refiner == "xpress":
        head = copy.deepcopy(xpress.refiner).double()  # float64: folding reassociates the products
        hidden = torch.randn(1, xpress.config.block_size, 64, dtype=torch.float64)
        outside = next(t for t in range(96) if t not in vocabulary)  # x_-1 outside: the shared row
        previous = torch.tensor([[outside] + vocabulary[1:2] + vocabulary[5:11]])
        torch.testing.assert_close(head.delta_folded(head.prepare(hidden), previous), head(hidden, previous))
    xpress.save_pretrained(tmp_path / "x")
    loaded = XPressModel.from_pretrained(tmp_path / "x").eval()
    assert loaded.config.refiner_token_vocab == "draft"
    assert torch.equal(loaded.refiner.token_embed.row_of, xpress.refiner.token_embed.row_of)
    fresh = XPressModel(loaded.config).eval()
    fresh.load_state_dict(xpress.state_dict())
    assert torch.equal(fresh.refiner.token_embed.row_of, xpress.refiner.token_embed.row_of)
    assert torch.equal(loaded.spec_generate(target, ids, max_new_tokens=24).sequences, expected)


def test_a_draft_vocabulary_token_table_refuses_what_it_cannot_be(target):
    with pytest.raises(ValueError, match='refiner_token_vocab="draft" .* no draft vocabulary: set draft_vocab_size'):
        XPressConfig.from_target_config(target.config, refiner_token_vocab="draft")
    with pytest.raises(ValueError, match="refiner_token_vocab must be one of"):
        XPressConfig.from_target_config(target.config, draft_vocab_size=8, refiner_token_vocab="small")
    with pytest.raises(ValueError, match="compact_token_table needs .* a draft vocabulary"):
        tiny_xpress(target).compact_token_table()
    with pytest.raises(ValueError, match="compact_token_table needs a head with a token table"):
        with_vocabulary(tiny_xpress(target, refiner="none"), list(range(8))).compact_token_table()
