"""A draft length that pays (issue 10 item 4): only the confident head of each block is verified.

The rule (`draft_cap.draft_length`): verify drafts up to and including the first whose cumulative confidence
prod_{j<=k} q_j(x_j) falls below the threshold, at most `num_assistant_tokens`. The tests pin: greedy identity through
both entry points with the cut on; the lengths follow the rule block by block on a pair whose confidences are
designed, and respect the cap; which setting wins (call over xPress config); sampling stays lossless (χ²); and
`jacobi_max_iters=0` drafts exactly what `refiner="none"` drafts from the same drafter weights.
"""

import math

import pytest
import torch
from transformers import LogitsProcessorList

from modeling_xpress import XPressConfig, decoding
from modeling_xpress.draft_cap import draft_length, draft_length_rule
from modeling_xpress.generation import generation_config_draft_settings
from modeling_xpress.refinement import gumbel_noise, jacobi_refine, plain_decode
from tests.builders import perfect_head, permutation_target, tiny_llama, tiny_xpress
from tests.test_sampling import (  # noqa: F401 (`target` is the χ² test's fixture)
    ALPHA, chi_square_pvalue, draw_with_spec_generate, exact_distribution, make_xpress, target,
)  # fmt: skip

VOCAB, BLOCK = 32, 8
IDS = torch.tensor([[3, 7, 1, 12]])


def designed_pair(wrong_fraction: float = 0.0, seed: int = 0):
    """(target, xpress, guess, confidence): a permutation target and a drafter whose draft after token x is always
    guess[x], drawn with probability exactly confidence[x] (in [0.55, 0.99]); guess = the target's own next token
    except for a `wrong_fraction` of tokens. So every block's confidences, and hence its verified length, are known.

    The drafter's output is zeroed (base logits 0) and the xPress head is `perfect_head` with its readout rescaled:
    δ_k = s_x · onehot(guess[x]) with s_x = log(c (V-1) / (1 - c)), whose softmax puts c on guess[x].
    """
    target, perm = permutation_target(VOCAB, seed=seed)
    xpress = tiny_xpress(target, refiner="xpress", refiner_rank=VOCAB, block_size=BLOCK, jacobi_max_iters=BLOCK - 1,
                         randomize_head=False, seed=seed)  # fmt: skip
    perfect_head(xpress, perm)
    g = torch.Generator().manual_seed(seed)
    confidence = 0.55 + 0.44 * torch.rand(VOCAB, generator=g, dtype=torch.float64)
    guess = perm.clone()
    wrong = torch.rand(VOCAB, generator=g) < wrong_fraction
    guess[wrong] = (perm[wrong] + 1) % VOCAB
    readout = torch.zeros(VOCAB, VOCAB)
    readout[guess, torch.arange(VOCAB)] = (confidence * (VOCAB - 1) / (1 - confidence)).log().float()
    with torch.no_grad():
        xpress.refiner.readout.weight.copy_(readout)
        xpress.norm.weight.zero_()
    return target, xpress, guess, confidence


def expected_length(anchor: int, guess, confidence, threshold: float, budget: int) -> int:
    """The rule, walked by hand: drafts follow guess; stop after the first whose cumulative confidence < threshold."""
    cumulative, token = 1.0, anchor
    for k in range(1, budget + 1):
        cumulative *= float(confidence[token])
        token = int(guess[token])
        if cumulative < threshold:
            return k
    return budget


def anchors_of(sequence: torch.Tensor, acceptance_lengths: list[int]) -> list[int]:
    """The anchor of every verified block: the last committed token before each verification step."""
    position, anchors = IDS.shape[1], []  # the prefill emits the first token (position IDS.shape[1])
    for tau in acceptance_lengths:
        anchors.append(int(sequence[0, position]))
        position += tau
    return anchors


# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["spec_generate", "generate"])
def test_lengths_follow_the_rule_and_respect_the_cap(entry):
    target, xpress, guess, confidence = designed_pair()
    threshold, cap, new = 0.5, 5, 40
    xpress.config.draft_confidence_threshold, xpress.config.num_assistant_tokens = threshold, cap
    reference = target.generate(IDS, max_new_tokens=new, do_sample=False)
    if entry == "spec_generate":
        out = xpress.spec_generate(target, IDS, max_new_tokens=new, stop_token_ids=[]).sequences
    else:
        out = target.generate(IDS, max_new_tokens=new, do_sample=False, assistant_model=xpress)
    stats = xpress.generation_stats
    assert torch.equal(out, reference)
    lengths = stats.draft_lengths
    assert len(set(lengths)) >= 3 and max(lengths) <= cap  # the cut really varies the length, and the cap holds
    assert min(lengths[:-2]) < cap  # (the last blocks may be shortened by max_new_tokens instead)
    assert stats.acceptance_lengths == [n + 1 for n in lengths]  # all drafts right: every verified draft accepted
    produced = IDS.shape[1] + 1
    for anchor, length, tau in zip(anchors_of(out, stats.acceptance_lengths), lengths, stats.acceptance_lengths):
        budget = min(cap, IDS.shape[1] + new - produced - 1)
        assert length == expected_length(anchor, guess, confidence, threshold, budget)
        produced += tau


@pytest.mark.parametrize("entry", ["spec_generate", "generate"])
@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
def test_greedy_identity_with_a_threshold(entry, refiner):
    """A cut never changes greedy output: a random drafter on a random target (mostly rejected), and the designed
    pair with wrong drafts mixed in (rejections deep inside blocks)."""
    random_target = tiny_llama()
    pairs = [(random_target, tiny_xpress(random_target, refiner=refiner, draft_confidence_threshold=0.9))]
    if refiner == "xpress":
        target, xpress, _, _ = designed_pair(wrong_fraction=0.3)
        xpress.config.draft_confidence_threshold = 0.4
        pairs.append((target, xpress))
    for target, xpress in pairs:
        reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
        if entry == "spec_generate":
            out = xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[]).sequences
        else:
            out = target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress)
        assert torch.equal(out, reference)
        assert min(xpress.generation_stats.draft_lengths) < BLOCK - 1  # the cut was active


def test_the_call_overrides_the_xpress_config():
    target, xpress, guess, confidence = designed_pair()
    xpress.config.draft_confidence_threshold, xpress.config.num_assistant_tokens = 0.9, None

    def lengths(**kwargs):
        target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress, **kwargs)
        from_generate = list(xpress.generation_stats.draft_lengths)
        xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[], **kwargs)
        assert xpress.generation_stats.draft_lengths == from_generate  # both entry points read the call alike
        return from_generate

    config_rule = lengths()
    assert max(config_rule) < BLOCK - 1  # 0.9 cuts every block short (every confidence is < 0.99)
    assert lengths(assistant_confidence_threshold=0.05) != config_rule
    assert max(lengths(assistant_confidence_threshold=0.0)) == BLOCK - 1  # 0 = no cut
    assert set(lengths(assistant_confidence_threshold=0.0, num_assistant_tokens=3)) <= {1, 2, 3}
    assert 3 in lengths(assistant_confidence_threshold=0.0, num_assistant_tokens=3)
    # transformers' global defaults (0.4, 20) are what every generate call carries when nobody set them: there they
    # leave the xPress config in charge (spec_generate's own arguments have no such default: 0.4 there is 0.4).
    target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress, assistant_confidence_threshold=0.4,
                    num_assistant_tokens=20)  # fmt: skip
    assert xpress.generation_stats.draft_lengths == config_rule
    xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[], assistant_confidence_threshold=0.4)
    assert xpress.generation_stats.draft_lengths != config_rule
    xpress.config.draft_confidence_threshold = None
    assert max(lengths()) == BLOCK - 1
    assert max(lengths(num_assistant_tokens=99)) == BLOCK - 1
    # The rule in isolation, and how a generate call's settings are read.
    assert draft_length_rule(xpress.config, 0.2, 40).cap == BLOCK - 1
    assert generation_config_draft_settings(target._prepare_generation_config(None)[0]) == (None, None)
    call = target._prepare_generation_config(None, assistant_confidence_threshold=0.25, num_assistant_tokens=4)[0]
    assert generation_config_draft_settings(call) == (0.25, 4)


def test_config_fields_round_trip(tmp_path):
    target = tiny_llama()
    config = XPressConfig.from_target_config(target.config, block_size=8, draft_confidence_threshold=0.25,
                                             num_assistant_tokens=5, jacobi_max_iters=0)  # fmt: skip
    config.save_pretrained(tmp_path)
    loaded = XPressConfig.from_pretrained(tmp_path)
    assert (loaded.draft_confidence_threshold, loaded.num_assistant_tokens, loaded.jacobi_max_iters) == (0.25, 5, 0)


def test_sampling_with_a_threshold_is_lossless(target, monkeypatch):  # noqa: F811 (the fixture)
    """χ² at T=1 (N=2000, α=1e-3, as tests/test_sampling.py) with a threshold that cuts blocks at varying lengths.
    (Why the first draft below the threshold must still be verified is argued exactly in `draft_length`; the bias of
    cutting before it is too small on this 3-token target for N=2000 to detect: p = 0.007-0.97 in four settings.)"""
    xpress = make_xpress(target, "xpress")
    with torch.no_grad():  # the target's lm_head is scaled up (peaked p): shrink the drafter's logits to a q whose
        xpress.norm.weight.mul_(0.03)  # per-draft confidence spreads over (1/3, 1), so the cut varies
        xpress.refiner.readout.weight.mul_(0.1)
    xpress.config.draft_confidence_threshold = 0.25
    calls = []  # (budget, verified) of every block

    def spy(result, threshold, budget):
        calls.append((budget, draft_length(result, threshold, budget)))
        return calls[-1][1]

    monkeypatch.setattr(decoding, "draft_length", spy)
    samples = draw_with_spec_generate(xpress, target, seed=4)
    cut = [verified for budget, verified in calls if verified < budget]
    assert len(cut) > len(calls) / 5 and len(set(cut)) >= 2  # the threshold really cut, at varying depths
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > ALPHA


@pytest.mark.parametrize("head", ["xpress", "markov"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_zero_jacobi_iterations_draft_the_drafters_own_marginals(temperature, head):
    """A head (xPress, or Markov's serial decode) with jacobi_max_iters=0 drafts what refiner="none" drafts from the
    same drafter weights: same tokens, same q, same lengths under the same draft-length rule, 0 refiner passes."""
    target = tiny_llama()
    xpress = tiny_xpress(target, refiner=head, jacobi_max_iters=0, draft_confidence_threshold=0.3)
    plain = tiny_xpress(target, refiner="none", draft_confidence_threshold=0.3)
    drafter = {k: v for k, v in xpress.state_dict().items() if not k.startswith("refiner.")}
    plain.load_state_dict(drafter)

    def run(model, max_iters=None):
        blocks, refine = [], model.refine
        model.refine = lambda *a, **kw: blocks.append(refine(*a, **kw)) or blocks[-1]
        if max_iters is not None:
            model.config.jacobi_max_iters = max_iters
        out = model.spec_generate(target, IDS, max_new_tokens=30, temperature=temperature, stop_token_ids=[],
                                  generator=torch.Generator().manual_seed(0))  # fmt: skip
        del model.refine
        return out, blocks

    (head_off, head_off_blocks), (none, none_blocks) = run(xpress), run(plain)
    assert torch.equal(head_off.sequences, none.sequences)
    assert head_off.stats.draft_lengths == none.stats.draft_lengths
    assert head_off.stats.acceptance_lengths == none.stats.acceptance_lengths
    assert set(head_off.stats.jacobi_iterations) == {0}
    assert len(head_off_blocks) == len(none_blocks) > 3
    for a, b in zip(head_off_blocks, none_blocks):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logits, b.logits)
    # Not a no-op: with its Jacobi passes the same head drafts something else.
    head_on, head_on_blocks = run(xpress, max_iters=4)
    assert any(not torch.equal(a.tokens, b.tokens) for a, b in zip(head_on_blocks, none_blocks))
    # The function itself: max_iters=0 is plain_decode, and never runs the refiner.
    hidden, base = torch.randn(2, BLOCK - 1, 64), torch.randn(2, BLOCK - 1, 96)
    noise = gumbel_noise(base.shape, generator=torch.Generator().manual_seed(1)) if temperature else None
    result = jacobi_refine(None, hidden, base, torch.tensor([1, 2]), max_iters=0, noise=noise)
    reference = plain_decode(base, noise=noise)
    assert torch.equal(result.tokens, reference.tokens) and torch.equal(result.logits, reference.logits)
    assert result.iterations.tolist() == [0, 0]


def test_bad_values_raise():
    target = tiny_llama()
    bad = {"draft_confidence_threshold": [-0.1, 1.5, "0.3", True, math.nan], "num_assistant_tokens": [0, 8, 2.0],
           "jacobi_max_iters": [-1]}  # fmt: skip
    for field, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=field):
                XPressConfig.from_target_config(target.config, block_size=8, **{field: value})
    xpress = tiny_xpress(target)
    for kwargs in [{"assistant_confidence_threshold": 2.0}, {"assistant_confidence_threshold": -1},
                   {"num_assistant_tokens": 0}, {"num_assistant_tokens": 1.5}]:  # fmt: skip
        name = next(iter(kwargs))
        with pytest.raises(ValueError, match=name):
            xpress.spec_generate(target, IDS, max_new_tokens=4, **kwargs)
        with pytest.raises(ValueError, match=name):
            target.generate(IDS, max_new_tokens=4, do_sample=False, assistant_model=xpress, **kwargs)
    base = torch.randn(1, BLOCK - 1, 96)
    with pytest.raises(ValueError, match="max_iters"):
        jacobi_refine(xpress.refiner, torch.randn(1, BLOCK - 1, 64), base, torch.tensor([1]), max_iters=-1)
    with pytest.raises(ValueError, match="init_tokens"):
        jacobi_refine(xpress.refiner, torch.randn(1, BLOCK - 1, 64), base, torch.tensor([1]), max_iters=0,
                      init_tokens=torch.zeros(1, BLOCK - 1, dtype=torch.long))  # fmt: skip
