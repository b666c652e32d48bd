"""The refiner's structural properties (paper §4.1–4.2): causality, folding, Jacobi = sequential decode."""

import pytest
import torch

from modeling_xpress import XPressConfig, XPressModel, jacobi_refine, sequential_refine
from modeling_xpress.refinement import gumbel_noise
from modeling_xpress.modeling_xpress import XPressRefiner

VOCAB, HIDDEN, BLOCK = 50, 32, 9
N = BLOCK - 1


FORMS = ["release", "paper"]


@pytest.fixture(params=FORMS)
def form(request):
    return request.param


def make_refiner(seed: int = 0, std: float = 0.7, form: str = "release") -> XPressRefiner:
    config = XPressConfig(
        vocab_size=VOCAB, target_hidden_size=HIDDEN, hidden_size=HIDDEN, num_target_layers=4, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=BLOCK,
        refiner_rank=12, refiner_form=form,
    )  # fmt: skip
    torch.manual_seed(seed)
    refiner = XPressRefiner(config)
    with torch.no_grad():
        for p in refiner.parameters():
            p.normal_(std=std)  # strong, non-trivial mixing so that every dependency is exercised
    return refiner.eval()


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 agreement relative to the tensor's scale (logits here reach a few hundred)."""
    scale = expected[expected.isfinite()].abs().max().item()  # -inf outside a draft vocabulary must match exactly
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def block_inputs(b: int = 3, seed: int = 0):
    """A block's drafter states over its B slots (anchor first), base logits of its n draft positions, and its last
    two committed tokens (the token before the anchor, the anchor)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, BLOCK, HIDDEN, generator=g)
    base = torch.randn(b, N, VOCAB, generator=g)
    last = torch.randint(0, VOCAB, (b, 2), generator=g)
    return hidden, base, last


def test_delta_is_not_trivial(form):
    refiner = make_refiner(form=form)
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    delta = refiner(hidden, tokens)
    assert delta.shape == (3, N, VOCAB)
    assert delta.abs().mean() > 1.0  # the properties below would be vacuous for δ ≈ 0


@pytest.mark.parametrize("k", range(N))
def test_delta_k_depends_only_on_earlier_tokens(k, form):
    """Draft position k + 1 reads the previous tokens x_-1..x_k (previous[:, :k+2]); perturbing every later token
    leaves δ at positions ≤ k + 1 bit-identical, while later positions do see the change. The token before the
    anchor (previous[:, 0]) is read by the "release" form only."""
    refiner = make_refiner(form=form)
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    changed = tokens.clone()
    changed[:, k + 2 :] = (changed[:, k + 2 :] + 1 + torch.randint(0, VOCAB - 1, changed[:, k + 2 :].shape)) % VOCAB
    for forward in (lambda t: refiner(hidden, t), lambda t: refiner.delta_folded(refiner.prepare(hidden), t)):
        before, after = forward(tokens), forward(changed)
        assert torch.equal(before[:, : k + 1], after[:, : k + 1])
        if k + 1 < N:
            assert not torch.equal(before[:, k + 1 :], after[:, k + 1 :])
    before_anchor = tokens.clone()
    before_anchor[:, 0] = (before_anchor[:, 0] + 1) % VOCAB
    assert torch.equal(refiner(hidden, tokens), refiner(hidden, before_anchor)) == (form == "paper")


def test_the_anchor_slot_is_read_by_the_release_form_only(form):
    """The anchor's drafter state enters the release form (its own slot and the block mean), not the paper's."""
    refiner = make_refiner(form=form)
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    moved = hidden.clone()
    moved[:, 0] += 1.0
    assert torch.equal(refiner(hidden, tokens), refiner(moved, tokens)) == (form == "paper")


def test_folded_equals_unfolded(form):
    refiner = make_refiner(form=form)
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    unfolded = refiner(hidden, tokens)
    folded = refiner.delta_folded(refiner.prepare(hidden), tokens)
    assert_fp32_close(folded, unfolded)


def test_folded_cache_follows_parameter_updates():
    refiner = make_refiner()
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    first = refiner.delta_folded(refiner.prepare(hidden), tokens)
    with torch.no_grad():
        refiner.mix.add_(0.5)  # in-place update, as an optimizer step does
        refiner.token_embed.weight.mul_(2.0)
    second = refiner.delta_folded(refiner.prepare(hidden), tokens)
    assert not torch.allclose(first, second)
    assert_fp32_close(second, refiner(hidden, tokens))


@pytest.mark.parametrize("form", FORMS)
def test_mix_ignores_what_its_mask_leaves_out(form):
    """Only L's lower triangle acts — with its diagonal in the release form, strictly below it in the paper's:
    setting the rest to anything changes nothing, and the diagonal matters exactly where it is kept."""
    refiner = make_refiner(form=form)
    hidden, _, _ = block_inputs()
    tokens = torch.randint(0, VOCAB, (3, BLOCK))
    before = refiner(hidden, tokens)
    slots = refiner.mix.shape[-1]
    with torch.no_grad():
        refiner.mix.add_(torch.triu(torch.full((slots, slots), 5.0), diagonal=1))
    torch.testing.assert_close(refiner(hidden, tokens), before)
    with torch.no_grad():
        refiner.mix.add_(torch.eye(slots) * 5.0)
    assert torch.equal(refiner(hidden, tokens), before) == (form == "paper")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "fixed-noise"])
def test_jacobi_reaches_sequential_decode_from_any_seed(sampling, form):
    """Theorem 1: after j iterations the first j positions equal the sequential decode, from any seed; the fixed
    point is reached in at most n iterations and is the sequential decode."""
    refiner = make_refiner(form=form)
    hidden, base, anchor = block_inputs(b=4)
    noise = gumbel_noise(base.shape, generator=torch.Generator().manual_seed(3)) if sampling else None
    transform = (lambda x: x / 0.7) if sampling else None
    reference = sequential_refine(refiner, hidden, base, anchor, logits_transform=transform, noise=noise)
    seeds = [None] + [torch.randint(0, VOCAB, (4, N), generator=torch.Generator().manual_seed(s)) for s in range(5)]
    disagreements = 0
    for seed in seeds:
        for j in range(1, N + 1):
            result = jacobi_refine(
                refiner, hidden, base, anchor, max_iters=j, early_exit=False, logits_transform=transform,
                noise=noise, init_tokens=seed,
            )  # fmt: skip
            assert torch.equal(result.tokens[:, :j], reference.tokens[:, :j]), f"prefix {j} not pinned after {j} iters"
            disagreements += int((result.tokens != reference.tokens).sum())
        final = jacobi_refine(refiner, hidden, base, anchor, max_iters=N, early_exit=True, logits_transform=transform,
                              noise=noise, init_tokens=seed)  # fmt: skip
        assert torch.equal(final.tokens, reference.tokens)
        assert (final.iterations <= N).all()
        assert_fp32_close(final.logits, reference.logits)
    assert disagreements > 0  # the seeds really were wrong somewhere, so convergence was exercised


def test_early_exit_changes_only_the_iteration_count():
    refiner = make_refiner(std=0.3)
    hidden, base, anchor = block_inputs(b=6, seed=5)
    for k in (2, 4, N):
        full = jacobi_refine(refiner, hidden, base, anchor, max_iters=k, early_exit=False)
        early = jacobi_refine(refiner, hidden, base, anchor, max_iters=k, early_exit=True)
        assert torch.equal(full.tokens, early.tokens)
        torch.testing.assert_close(full.logits, early.logits)
        assert (early.iterations <= full.iterations).all()
    converged = jacobi_refine(refiner, hidden, base, anchor, max_iters=N, early_exit=True)
    assert (converged.iterations < N).any(), "expected some block to settle before n iterations"


def test_iterations_are_counted_per_block():
    refiner = make_refiner()
    hidden, base, anchor = block_inputs(b=2)
    reference = sequential_refine(refiner, hidden, base, anchor)
    # Block 0 starts at its fixed point (1 confirming pass); block 1 starts from a wrong seed.
    seed = reference.tokens.clone()
    seed[1] = (seed[1] + 1) % VOCAB
    result = jacobi_refine(refiner, hidden, base, anchor, max_iters=N, init_tokens=seed)
    assert result.iterations[0] == 1
    assert result.iterations[1] > 1


def test_refiner_adds_to_the_base_logits():
    """ℓ = s + δ: with a zero readout the refined block is exactly the drafter's own decode."""
    refiner = make_refiner()
    with torch.no_grad():
        refiner.readout.weight.zero_()
    hidden, base, anchor = block_inputs()
    result = jacobi_refine(refiner, hidden, base, anchor, max_iters=3)
    assert torch.equal(result.tokens, base.argmax(-1))
    torch.testing.assert_close(result.logits, base)
    # And with a non-zero readout, the logits are exactly base + δ at the last iteration's prefix.
    refiner = make_refiner()
    result = jacobi_refine(refiner, hidden, base, anchor, max_iters=N)
    prev = torch.cat([anchor, result.tokens[:, :-1]], dim=1)
    assert_fp32_close(result.logits, base + refiner(hidden, prev))


def test_markov_head_serial_decode_matches_definition():
    config = XPressConfig(
        vocab_size=VOCAB, target_hidden_size=HIDDEN, hidden_size=HIDDEN, num_target_layers=4, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=BLOCK,
        refiner="markov", refiner_rank=12,
    )  # fmt: skip
    model = XPressModel(config).eval()
    with torch.no_grad():
        for p in model.refiner.parameters():
            p.normal_(std=1.0)
    hidden, base, last = block_inputs()
    result = model.refiner.decode(hidden, base, last)
    previous = last[:, 1]
    for k in range(N):
        expected = (base[:, k] + model.refiner.bias(previous)).argmax(-1)
        assert torch.equal(result.tokens[:, k], expected)
        previous = expected
    assert not torch.equal(result.tokens, base.argmax(-1))  # the head really changed the decode


# --- one head interface --------------------------------------------------------------------------------------------


def test_every_config_refiner_has_a_head_and_every_head_one_interface():
    from modeling_xpress.configuration_xpress import REFINER_TYPES
    from modeling_xpress.modeling_xpress import HEADS, CorrectionHead

    assert set(HEADS) == set(REFINER_TYPES)
    hidden, base, anchor = block_inputs()
    previous = torch.randint(0, VOCAB, (3, BLOCK), generator=torch.Generator().manual_seed(5))
    for name in REFINER_TYPES:
        model = XPressModel(XPressConfig(
            vocab_size=VOCAB, target_hidden_size=HIDDEN, hidden_size=HIDDEN, num_target_layers=4, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, block_size=BLOCK,
            refiner_rank=12, refiner=name,
        ))  # fmt: skip
        head = model.refiner
        assert isinstance(head, HEADS[name]) and isinstance(head, CorrectionHead)
        # a fresh head adds nothing: its decode is the drafter's own argmax, whatever its kind
        delta = head(hidden, previous)
        assert delta.shape == (3, N, VOCAB) and torch.count_nonzero(delta) == 0
        result = model.refine(hidden, base, anchor)
        assert torch.equal(result.tokens, base.argmax(-1))
        assert head.corrects == (name != "none") and head.corrects == any(True for _ in head.parameters())


@pytest.mark.parametrize("draft_vocabulary", [False, True])
@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
def test_decoding_the_first_drafts_only_gives_the_whole_blocks_first_drafts(refiner, sampling, draft_vocabulary):
    """The decoding loops read out and decode only the drafts a step can verify (`positions=m`, `m` = the cap): for
    every m, each head gives them the tokens and q (up to the last bits) of the whole block's decode restricted to
    them, and Jacobi iteration counts no larger — Jacobi with and without early exit, the Markov serial decode, the
    marginals, and the sequential reference — greedy and sampling, over the whole vocabulary and over a draft
    vocabulary. The heads are random and strong, so a position that read a later one (or a block summary of fewer
    positions) would show."""
    from modeling_xpress.processors import processors_transform, sampling_processors
    from modeling_xpress.training import with_draft_vocabulary
    from tests.builders import tiny_llama, tiny_xpress

    target = tiny_llama()
    lm_head = target.get_output_embeddings()
    xpress = tiny_xpress(target, refiner=refiner, block_size=9, jacobi_max_iters=8)
    if draft_vocabulary:
        xpress = with_draft_vocabulary(xpress, torch.randperm(96, generator=torch.Generator().manual_seed(2))[:40])
    xpress.eval()
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 9, 64, generator=g)
    anchor = torch.randint(0, 96, (3, 2), generator=g)
    read = xpress.draft_logits if draft_vocabulary else xpress.base_logits
    whole_logits = read(hidden, lm_head)
    kwargs = {}
    noise = None
    if sampling:
        noise = gumbel_noise(whole_logits.shape, generator=g)
        kwargs["logits_transform"] = processors_transform(sampling_processors(0.8, None, 0.95), anchor)
    settings = [{"early_exit": True}, {"early_exit": False}, {"max_iters": 2}]
    for setting in settings:
        whole = xpress.refine(hidden, whole_logits, anchor, noise=noise, **kwargs, **setting)
        if refiner != "none":
            assert len(set(whole.tokens[0].tolist())) > 2  # a real decode, not a constant block
        for m in (1, 3, 8):
            # the readout of m rows: the same values up to the last bits of a matrix product of another shape
            torch.testing.assert_close(read(hidden, lm_head, positions=m), whole_logits[:, :m])
            part_logits = whole_logits[:, :m]
            part_noise = None if noise is None else noise[:, :m]
            part = xpress.refine(hidden, part_logits, anchor, noise=part_noise, **kwargs, **setting)
            assert torch.equal(part.tokens, whole.tokens[:, :m])
            assert_fp32_close(part.logits, whole.logits[:, :m])  # products of another shape: the last bits differ
            if refiner == "xpress" and setting.get("max_iters") is None:  # both settle: counts stay within m
                assert bool((part.iterations <= whole.iterations).all()) and bool((part.iterations <= m + 1).all())
    if refiner == "xpress" and not draft_vocabulary:
        transform = kwargs.get("logits_transform")
        full = sequential_refine(xpress.refiner, hidden, whole_logits, anchor, logits_transform=transform,
                                 noise=noise)  # fmt: skip
        part = sequential_refine(xpress.refiner, hidden, whole_logits[:, :3], anchor,
                                 logits_transform=transform, noise=None if noise is None else noise[:, :3])  # fmt: skip
        assert torch.equal(part.tokens, full.tokens[:, :3])
        assert_fp32_close(part.logits, full.logits[:, :3])
