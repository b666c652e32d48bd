"""The drafter's products in bfloat16 (`cpu_layouts.Bfloat16Linear`), where "auto" finds them faster on a CPU.

The drafter's products choose drafts; the target verifies them in its own precision. So they, and only they, may run
in bfloat16: the tests pin that the mode computes the product of the bfloat16-rounded operands (not a no-op), that
only the drafter group is ever given it and only by "auto" where its timing pays, and that every loop with a bfloat16
drafter returns the target's greedy output and samples losslessly (χ² with the power test of test_sampling)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LogitsProcessorList

import modeling_xpress.cpu_layouts as layouts
from modeling_xpress.compiled import release_compiled_decoders
from modeling_xpress.layout_policy import decoder_policy
from modeling_xpress.policy import linear_weights
from tests.builders import tiny_gemma3, tiny_llama, tiny_xpress
from tests.test_sampling import DRAWS, LENGTH, PROMPT, VOCAB, chi_square_pvalue, exact_distribution

pytestmark = pytest.mark.skipif(not layouts.bfloat16_products_available(),
                                reason="no oneDNN bfloat16 products here")  # fmt: skip
IDS = torch.tensor([[3, 7, 1, 12, 5, 9, 30, 2, 17, 4, 11]])


@pytest.fixture
def bfloat16_drafter(monkeypatch):
    """"auto" made to find bfloat16 faster for every group it may approximate; yields the weights whose bfloat16
    reorder a product read (in the eager loops and inside the compiled graphs alike)."""
    read, current = [], layouts._current_pack

    def reading(weight, rows):
        pack = current(weight, rows)
        if rows == layouts.BF16_ROWS and pack is not None:
            read.append(weight)
        return pack

    monkeypatch.setattr(layouts, "_current_pack", reading)
    monkeypatch.setattr(layouts, "bfloat16_pays", lambda weights, rows, against, repeats=3: True)
    layouts.release_packed_weights()
    release_compiled_decoders()
    yield read
    release_compiled_decoders()
    layouts.release_packed_weights()


def test_the_mode_computes_the_product_of_rounded_operands():
    """`Bfloat16Linear` is x·Wᵀ (+ b) over x and W rounded to bfloat16 (its result rounded too), in x's dtype, for
    2-D and 3-D inputs; a weight without a reorder and larger inputs go through F.linear bit for bit; a weight changed
    in place is reordered again."""
    generator = torch.Generator().manual_seed(0)
    weight, bias, other = (torch.randn(96, 40, generator=generator), torch.randn(96, generator=generator),
                           torch.randn(96, 40, generator=generator))  # fmt: skip
    layouts.release_packed_weights()
    assert layouts.pack_weights([weight], layouts.BF16_ROWS) == [weight]

    def rounded(x, w, b=None):
        return F.linear(x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float(), b)

    mode = layouts.Bfloat16Linear(max_rows=16)
    for x in (torch.randn(3, 40, generator=generator), torch.randn(1, 16, 40, generator=generator)):
        with mode:
            out, with_bias = F.linear(x, weight), F.linear(x, weight, bias)
        assert out.dtype == torch.float32 and out.shape == (*x.shape[:-1], 96)
        torch.testing.assert_close(out, rounded(x, weight), rtol=8e-3, atol=1e-2)
        torch.testing.assert_close(with_bias, rounded(x, weight, bias), rtol=8e-3, atol=1e-2)
        assert (out - F.linear(x, weight)).abs().max() > 1e-3  # not the float32 product
    x = torch.randn(4, 40, generator=generator)
    with mode:
        unreordered, larger = F.linear(x, other), F.linear(torch.randn(17, 40, generator=generator), weight)
    assert torch.equal(unreordered, F.linear(x, other)) and larger.shape == (17, 96)
    with torch.no_grad():
        weight.mul_(-2.0)
    with mode:
        torch.testing.assert_close(F.linear(x, weight), rounded(x, weight), rtol=8e-3, atol=1e-2)
    del weight
    assert layouts._PACKS == {}


def test_only_the_drafter_and_only_auto_get_bfloat16(monkeypatch):
    """With bfloat16 faster for every group, the drafter takes it (compiled and eager, timed against the float32
    layout it would have had); the verification and the readout never do, nor any group under a forced layout."""
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8)
    asked = []

    def pays(weights, rows, against, repeats=3):
        asked.append((rows, against))
        return True

    monkeypatch.setattr(layouts, "bfloat16_pays", pays)
    monkeypatch.setattr(layouts, "packed_pays", lambda weights, rows, repeats=3: False)
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: False)
    for compiled in (False, True):
        policy = decoder_policy("auto", target, xpress, compiled=compiled)
        kinds = [policy.kind(group, rows) for group, rows in (("drafter", 8), ("verify", 4), ("head", 3))]
        assert kinds == ["bfloat16", "input_major", "input_major"]
    assert asked == [(8, "input_major")] * 2
    for layout in ("input_major", "weight_major", "packed"):
        assert decoder_policy(layout, target, xpress, compiled=True).kind("drafter", 8) != "bfloat16"


def test_bfloat16_pays_only_where_it_saves_time(monkeypatch):
    """Not for weights that are not float32 on a CPU; not for products that take microseconds (a tiny model's, timed
    here); and by the timing rule: faster by the margin, float32 at least `BFLOAT16_MIN_SECONDS`."""
    weights = linear_weights(tiny_xpress(tiny_llama(), block_size=8))
    assert not layouts.bfloat16_pays([w.to(torch.bfloat16) for w in weights], 8, "input_major")
    assert not layouts.bfloat16_pays(weights, 8, "input_major")  # timed: far below a millisecond
    timings = {}
    monkeypatch.setattr(layouts, "_BF16_TIMINGS", timings)
    key = ("input_major", tuple((tuple(w.shape), w.dtype) for w in weights), 8, torch.get_num_threads())
    for bfloat16, float32, pays in ((1e-3, 2e-3, True), (1.7e-3, 2e-3, False), (0.4e-3, 0.9e-3, False)):
        timings[key] = (bfloat16, float32)
        assert layouts.bfloat16_pays(weights, 8, "input_major") is pays


@pytest.mark.parametrize("build", [tiny_llama, tiny_gemma3])
def test_every_loop_with_a_bfloat16_drafter_returns_the_target_greedy(bfloat16_drafter, build):
    """Eager and compiled `spec_generate` and `generate(assistant_model=)`, drafter in bfloat16: the target's greedy
    output, and the drafter's products read their bfloat16 reorders."""
    target = build()
    xpress = tiny_xpress(target, refiner="xpress", block_size=8)
    drafter = {id(w) for w in linear_weights(xpress)}
    expected = target.generate(IDS, max_new_tokens=24, do_sample=False)
    for run in (lambda: xpress.spec_generate(target, IDS, max_new_tokens=24, stop_token_ids=[]).sequences,
                lambda: xpress.spec_generate(target, IDS, max_new_tokens=24, stop_token_ids=[], compile=True).sequences,
                lambda: target.generate(IDS, max_new_tokens=24, do_sample=False, assistant_model=xpress)):
        bfloat16_drafter.clear()
        assert torch.equal(run(), expected)
        assert bfloat16_drafter and {id(w) for w in bfloat16_drafter} <= drafter


@pytest.mark.parametrize("compile", [False, True])
def test_sampling_with_a_bfloat16_drafter_is_lossless(bfloat16_drafter, compile):
    """χ² goodness of fit at T=1 against the exact distribution of every continuation (test_sampling's setting)."""
    target = tiny_llama(vocab_size=VOCAB, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(60.0)
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, jacobi_max_iters=2, seed=5)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(DRAWS):
        seq = xpress.spec_generate(target, PROMPT, max_new_tokens=LENGTH, stop_token_ids=[], generator=generator,
                                   temperature=1.0, compile=compile).sequences  # fmt: skip
        samples.append(tuple(seq[0, PROMPT.shape[1] :].tolist()))
    assert bfloat16_drafter
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > 1e-3
