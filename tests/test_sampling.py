"""Speculative sampling with xPress is lossless: generated sequences follow the target's own distribution.

The test: on a target with a 3-token vocabulary, enumerate every continuation of length L and compute its exact
probability under the target (after the same temperature/top-k processing). Draw N continuations with xPress and
run a Pearson χ² goodness-of-fit test against those exact probabilities (bins with expected count < 5 pooled).

Sample size and false-alarm rate: N = 2000 draws per case; reject when the χ² p-value < 1e-3, so a correct
implementation fails with probability 0.1% for a random seed. Seeds are fixed, so each run is deterministic.
Power: the same test, run with a deliberately wrong q (the seed iteration's logits instead of the last iteration's),
must reject — `test_the_test_detects_a_wrong_q`.
"""

import itertools

import pytest
import torch
from transformers import LogitsProcessorList

import modeling_xpress.heads as heads
from modeling_xpress.processors import sampling_processors
from modeling_xpress.refinement import decode, jacobi_refine
from tests.builders import tiny_llama, tiny_xpress

VOCAB, LENGTH, DRAWS, ALPHA = 3, 5, 2000, 1e-3
PROMPT = torch.tensor([[0, 2, 1, 1]])


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(vocab_size=VOCAB, seed=11)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # a peaked, position-dependent target: uniform-ish ones test little
    return model


def exact_distribution(target, processors: LogitsProcessorList) -> dict[tuple[int, ...], float]:
    """Probability of every length-L continuation of PROMPT under the (processed) target."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=LENGTH)))  # (S, L)
    inputs = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        logits = target(inputs).logits[:, PROMPT.shape[1] - 1 : -1].float()  # (S, L, V) predicting each new token
    s, l, v = logits.shape
    if processors:  # temperature / top-k / top-p ignore the prefix
        logits = processors(inputs[:1].expand(s * l, -1), logits.reshape(s * l, v)).reshape(s, l, v)
    logp = logits.log_softmax(-1).gather(-1, seqs.unsqueeze(-1)).squeeze(-1).sum(-1)
    return {tuple(seq.tolist()): float(p) for seq, p in zip(seqs, logp.exp())}


def chi_square_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson χ² goodness of fit, pooling bins whose expected count is below 5; returns the p-value."""
    n = len(samples)
    counts = {key: 0 for key in exact}
    for sample in samples:
        counts[sample] += 1
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for key in sorted(exact, key=exact.get, reverse=True):
        e = exact[key] * n
        if e >= 5:
            observed.append(counts[key])
            expected.append(e)
        else:
            pool_o, pool_e = pool_o + counts[key], pool_e + e
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw_with_spec_generate(xpress, target, temperature=1.0, top_k=None, top_p=None, seed=0) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(DRAWS):
        seq = xpress.spec_generate(target, PROMPT, max_new_tokens=LENGTH, temperature=temperature, top_k=top_k,
                                   top_p=top_p, stop_token_ids=[], generator=generator).sequences  # fmt: skip
        out.append(tuple(seq[0, PROMPT.shape[1] :].tolist()))
    return out


def make_xpress(target, refiner):
    # block 4: after the prefill token, drafts of 3 tokens cover the rest of the continuation.
    return tiny_xpress(target, refiner=refiner, block_size=4, jacobi_max_iters=2, seed=5)


@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
def test_spec_generate_sampling_is_lossless(target, refiner):
    xpress = make_xpress(target, refiner)
    samples = draw_with_spec_generate(xpress, target)
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > ALPHA
    assert xpress.generation_stats is not None


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_lossless_with_temperature_and_top_k(target, refiner):
    xpress = make_xpress(target, refiner)
    samples = draw_with_spec_generate(xpress, target, temperature=0.7, top_k=2, seed=1)
    exact = exact_distribution(target, sampling_processors(0.7, 2, None))
    assert chi_square_pvalue(samples, exact) > ALPHA


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_lossless_with_top_p(target, refiner):
    """top-p cuts a support that depends on each position's distribution; q and p are cut by the same warper."""
    xpress = make_xpress(target, refiner)
    processors = sampling_processors(1.0, None, 0.8)
    exact = exact_distribution(target, processors)
    assert sum(p == 0 for p in exact.values()) > 0  # the cut is not a no-op: some continuations become impossible
    samples = draw_with_spec_generate(xpress, target, top_p=0.8, seed=3)
    assert all(exact[s] > 0 for s in samples)
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_lossless_with_a_draft_cap(target):
    """Two drafts verified per block of three: only they are read out and decoded (`draft_block(positions=)`)."""
    xpress = make_xpress(target, "xpress")
    xpress.config.num_assistant_tokens = 2
    samples = draw_with_spec_generate(xpress, target, seed=6)
    assert max(xpress.generation_stats.draft_lengths) == 2
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > ALPHA


def test_generate_sampling_is_lossless(target):
    """Through target.generate(do_sample=True, assistant_model=xpress): transformers' rejection sampling with our q."""
    xpress = make_xpress(target, "xpress")
    torch.manual_seed(0)
    samples = []
    for _ in range(DRAWS):
        seq = target.generate(PROMPT, do_sample=True, max_new_tokens=LENGTH, assistant_model=xpress, top_k=None)
        samples.append(tuple(seq[0, PROMPT.shape[1] :].tolist()))
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > ALPHA


def test_the_test_detects_a_wrong_q(target, monkeypatch):
    """Power: report the seed iteration's logits as q (tokens still come from the last iteration) → rejected."""

    def wrong_q(refiner, hidden, base_logits, anchor_ids, *, logits_transform=None, noise=None, **kwargs):
        result = jacobi_refine(refiner, hidden, base_logits, anchor_ids, logits_transform=logits_transform,
                               noise=noise, **kwargs)  # fmt: skip
        result.logits, _ = decode(base_logits, logits_transform, noise)
        return result

    xpress = make_xpress(target, "xpress")
    honest = draw_with_spec_generate(xpress, target, seed=2)
    monkeypatch.setattr(heads, "jacobi_refine", wrong_q)
    broken = draw_with_spec_generate(xpress, target, seed=2)
    exact = exact_distribution(target, LogitsProcessorList())
    assert chi_square_pvalue(honest, exact) > ALPHA
    assert chi_square_pvalue(broken, exact) < ALPHA
