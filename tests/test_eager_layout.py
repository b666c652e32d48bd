"""The eager loops verify in the CPU's faster layout (their `layout_policy.decoder_policy(compiled=False)`):
`spec_generate(compile=False)` and `generate(assistant_model=xpress)` run the target's few-row verification
weight-major where that pays, as the compiled graphs do. The tests pin: the greedy output is the target's either way;
the layout really changes (torch.mm with a weight as left operand); in `generate` only the verification forwards are
changed, and no hook outlives the call. Their drafter runs in the compiled drafter graph's layout: MKL-packed weights
where those pay, with the same outputs; their verification uses oneDNN-reordered weights (one reorder for every
width) where those pay, with the same outputs."""

import pytest
import torch

import modeling_xpress.cpu_layouts as layouts
from modeling_xpress.policy import linear_weights
from tests.builders import tiny_llama, tiny_xpress

IDS = torch.tensor([[3, 7, 1, 12]])


@pytest.fixture
def weight_products(monkeypatch):
    """The row counts of every torch.mm whose left operand is one of the target's weights (the weight-major form)."""
    seen, mm = [], torch.mm
    weights = {}

    def counting_mm(a, b):
        if id(a) in weights:
            seen.append(b.shape[1])
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", counting_mm)
    return seen, weights


def pair():
    target = tiny_llama()
    return target, tiny_xpress(target, block_size=8)


@pytest.mark.parametrize("layout", ["weight_major", "input_major"])
def test_spec_generate_eager_verification_layout(layout, weight_products):
    seen, weights = weight_products
    target, xpress = pair()
    weights.update({id(w): w for w in linear_weights(target)})
    reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
    seen.clear()
    out = xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[], linear_layout=layout)
    assert torch.equal(out.sequences, reference)
    if layout == "weight_major":  # every verification: its anchor + drafts as the product's columns
        widths = {n + 1 for n in out.stats.draft_lengths}
        assert seen and set(seen) <= widths | {1}
    else:
        assert seen == []


@pytest.mark.parametrize("pays", [True, False])
def test_generate_verifies_in_the_layout_that_pays_and_leaves_no_hook(pays, weight_products, monkeypatch):
    seen, weights = weight_products
    target, xpress = pair()
    weights.update({id(w): w for w in linear_weights(target)})
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: pays)
    monkeypatch.setattr(layouts, "onednn_pays", lambda weights, rows, repeats=3: False)
    reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
    assert seen == []  # plain generate: never
    out = target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress)
    assert torch.equal(out, reference)
    widths = {n + 1 for n in xpress.generation_stats.draft_lengths}
    assert (set(seen) == widths if pays else seen == [])  # the verifications, and nothing else (not the prefill)
    assert not target._forward_pre_hooks and not target._forward_hooks  # nothing outlives the call
    seen.clear()
    target(input_ids=IDS)
    assert seen == []


def test_a_failed_verification_leaves_no_mode_behind(weight_products, monkeypatch):
    """An exception inside the verification forward: the post-hook still leaves the mode and removes the hooks."""
    seen, weights = weight_products
    target, xpress = pair()
    weights.update({id(w): w for w in linear_weights(target)})
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: True)
    monkeypatch.setattr(layouts, "onednn_pays", lambda weights, rows, repeats=3: False)
    calls = {"n": 0}
    forward = target.model.forward

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # prefill, first verification, then fail
            raise RuntimeError("boom")
        return forward(*args, **kwargs)

    monkeypatch.setattr(target.model, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="boom"):
        target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress)
    assert not target._forward_pre_hooks and not target._forward_hooks
    seen.clear()
    torch.nn.functional.linear(torch.randn(2, 64), target.lm_head.weight)
    assert seen == []  # no WeightMajorLinear left active


def test_a_forward_that_is_not_the_verification_only_disarms(weight_products, monkeypatch):
    """Hooks armed for a verification of n tokens, then another forward comes first (transformers raised between the
    draft and its verification, and the caller runs the target itself): that forward runs as it would without them,
    and they are gone."""
    seen, weights = weight_products
    target, xpress = pair()
    weights.update({id(w): w for w in linear_weights(target)})
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: True)
    monkeypatch.setattr(layouts, "onednn_pays", lambda weights, rows, repeats=3: False)
    from modeling_xpress.generation import XPressCandidateGenerator
    from modeling_xpress.layout_policy import decoder_policy

    generator = XPressCandidateGenerator.__new__(XPressCandidateGenerator)  # only the hook bookkeeping is exercised
    generator.target, generator._hooks = target, []
    generator.policy = decoder_policy("auto", target, xpress, compiled=False)
    generator._arm_verification(4)
    assert target._forward_pre_hooks and target._forward_hooks
    reference = target(input_ids=IDS[:, :3]).logits  # 3 tokens, not the armed 4 (the mode would take them too)
    assert seen == [] and not target._forward_pre_hooks and not target._forward_hooks
    generator._arm_verification(3)
    armed = target(input_ids=IDS[:, :3]).logits  # a 3-token verification: weight-major, the same logits up to rounding
    assert seen and set(seen) == {3} and not target._forward_pre_hooks and not target._forward_hooks
    torch.testing.assert_close(armed, reference)


def test_drafter_layout_follows_the_compiled_drafter_rule(monkeypatch):
    """The eager drafter's layout is `linear_layout_kind` at B rows, decided once: packed where that pays, else
    weight-major where that pays, else input-major; forced layouts as asked. The eager readout is never tuned."""
    from modeling_xpress.layout_policy import decoder_policy

    target, xpress = pair()
    asked = []

    def packed_pays(weights, rows, repeats=3):
        asked.append(rows)
        return True

    def drafter_kind(linear_layout="auto"):
        return decoder_policy(linear_layout, target, xpress, compiled=False).kind("drafter", 8)

    monkeypatch.setattr(layouts, "packed_pays", packed_pays)
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: True)
    monkeypatch.setattr(layouts, "onednn_pays", lambda weights, rows, repeats=3: rows > 3)
    policy = decoder_policy("auto", target, xpress, compiled=False)
    assert (policy.kind("drafter", 8), policy.kind("drafter", 8)) == ("packed", "packed") and asked == [8]
    assert policy.kind("head", 3) == "input_major"
    # the eager verification never takes an MKL pack (one row count each): oneDNN reorders where they pay
    assert (policy.kind("verify", 3), policy.kind("verify", 4)) == ("weight_major", "onednn")
    monkeypatch.setattr(layouts, "packed_pays", lambda weights, rows, repeats=3: False)
    assert drafter_kind() == "weight_major"
    assert drafter_kind("input_major") == "input_major"
    assert drafter_kind("weight_major") == "weight_major"
    with pytest.raises(ValueError, match="linear_layout must be one of"):
        drafter_kind("transposed")


@pytest.fixture
def packed_products(monkeypatch):
    """Every product `PackedLinear` computes, as (weight, rows); "auto" made to pack (MKL's packs are exact up to
    rounding; the timing that decides it is tested in test_compiled)."""
    if not layouts.mkl_packing_available():
        pytest.skip("this torch build has no MKL packed GEMM")
    seen, product = [], layouts.PackedLinear.product

    def counting(self, x, weight):
        seen.append((weight, x.shape[0]))
        return product(self, x, weight)

    monkeypatch.setattr(layouts.PackedLinear, "product", counting)
    monkeypatch.setattr(layouts, "packed_pays", lambda weights, rows, repeats=3: True)
    layouts.release_packed_weights()
    yield seen
    layouts.release_packed_weights()


def packed_drafter_rows(seen, xpress) -> set[int]:
    """The row counts of the products over the drafter's weights that had a pack for that many rows."""
    drafter = {id(w) for w in linear_weights(xpress)}
    return {rows for weight, rows in seen if id(weight) in drafter and (weight.data_ptr(), rows) in layouts._PACKS}


def assert_auto_draws_as_input_major(target, xpress) -> None:
    """Sampling with the same seed draws the same tokens in the "auto" layouts as input-major."""
    sampled = {}
    for layout in ("auto", "input_major"):
        generator = torch.Generator().manual_seed(3)
        sampled[layout] = xpress.spec_generate(target, IDS, max_new_tokens=30, temperature=1.0, stop_token_ids=[],
                                               generator=generator, linear_layout=layout).sequences  # fmt: skip
    assert torch.equal(sampled["auto"], sampled["input_major"])


def test_eager_loops_draft_with_packed_weights_exactly(packed_products):
    """With the drafter packed, `spec_generate(compile=False)` and `generate(assistant_model=)` return the target's
    greedy output, and sampling draws what the input-major drafter draws; the block's products (B rows) used the packs."""
    target, xpress = pair()
    reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
    out = xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[])
    assert torch.equal(out.sequences, reference)
    assert packed_drafter_rows(packed_products, xpress) == {8}
    packed_products.clear()
    assert torch.equal(target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress), reference)
    assert packed_drafter_rows(packed_products, xpress) == {8}
    assert_auto_draws_as_input_major(target, xpress)


needs_onednn = pytest.mark.skipif(not layouts.onednn_reorder_available(), reason="no oneDNN reordered linear here")


@needs_onednn
def test_one_reorder_computes_every_row_count_and_follows_its_weight():
    """`OnednnLinear` is `F.linear` (rows 1-17, a batch dimension, a bias) with one reorder per weight for every row
    count; a weight changed in place is reordered again at its next product; a freed weight takes its reorder along."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 40, generator=generator), torch.randn(96, generator=generator)
    layouts.release_packed_weights()
    assert layouts.pack_weights([weight], layouts.ANY_ROWS) == [weight]
    for rows in range(1, 18):
        x = torch.randn(1, rows, 40, generator=generator)
        with layouts.OnednnLinear(rows):
            out = torch.nn.functional.linear(x, weight, bias)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, bias))
    assert set(layouts._PACKS) == {(weight.data_ptr(), layouts.ANY_ROWS)}
    with torch.no_grad():
        weight.mul_(-2)
    x = torch.randn(3, 40, generator=generator)
    with layouts.OnednnLinear(3):
        torch.testing.assert_close(torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, weight))
    other = torch.randn(96, 40, generator=generator)  # never reordered: F.linear
    with layouts.OnednnLinear(3):
        torch.testing.assert_close(torch.nn.functional.linear(x, other), x @ other.T)
    del weight
    assert layouts._PACKS == {}


def test_reorders_pay_only_where_they_can_run(monkeypatch):
    """`onednn_pays` never says yes for weights that are not float32 on a CPU, or where oneDNN cannot reorder."""
    weights = [torch.randn(64, 16)]
    assert not layouts.onednn_pays([w.to(torch.bfloat16) for w in weights], 4)
    monkeypatch.setattr(layouts, "_ONEDNN_WORKS", [False])
    assert not layouts.onednn_pays(weights, 4)
    assert layouts.reordered_layout_kind("packed", weights, 4) == "input_major"


@pytest.fixture
def reordered_products(monkeypatch):
    """Every product `OnednnLinear` computes, as (weight, rows); "auto" made to reorder the verification past one
    row (the timing that decides it is `products_seconds`, tested in test_draft_cap)."""
    if not layouts.onednn_reorder_available():
        pytest.skip("no oneDNN reordered linear here")
    seen, product = [], layouts.OnednnLinear.product

    def counting(self, x, weight):  # whether the weight had its reorder when its product ran
        seen.append((weight, x.shape[0], (weight.data_ptr(), layouts.ANY_ROWS) in layouts._PACKS))
        return product(self, x, weight)

    monkeypatch.setattr(layouts.OnednnLinear, "product", counting)
    monkeypatch.setattr(layouts, "onednn_pays", lambda weights, rows, repeats=3: rows > 1)
    layouts.release_packed_weights()
    yield seen
    layouts.release_packed_weights()


def reordered_target_rows(seen, target) -> set[int]:
    """The row counts of the products over the target's weights, each of which ran on its weight's oneDNN reorder."""
    own = {id(w) for w in linear_weights(target)}
    products = [(rows, reordered) for weight, rows, reordered in seen if id(weight) in own]
    assert all(reordered for _, reordered in products)
    return {rows for rows, _ in products}


def test_eager_loops_verify_with_reordered_weights_exactly(reordered_products):
    """With the verification reordered, `spec_generate(compile=False)` and `generate(assistant_model=)` return the
    target's greedy output, sampling draws what the input-major loop draws, and every verification width (not the
    prefill, not a plain forward afterwards) ran on the reorders, one per weight."""
    target, xpress = pair()
    reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
    assert reordered_products == []
    assert torch.equal(target.generate(IDS, max_new_tokens=30, do_sample=False, assistant_model=xpress), reference)
    widths = {n + 1 for n in xpress.generation_stats.draft_lengths} - {1}
    assert widths and reordered_target_rows(reordered_products, target) == widths
    reordered_products.clear()
    layouts.release_packed_weights()  # the eager loop makes its own
    out = xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[])
    assert torch.equal(out.sequences, reference)
    widths = {n + 1 for n in out.stats.draft_lengths} - {1}
    assert widths and reordered_target_rows(reordered_products, target) == widths
    assert {rows for _, rows in layouts._PACKS} <= {layouts.ANY_ROWS, 8}  # the verification's reorders, drafter packs
    reordered_products.clear()
    target(input_ids=IDS)
    assert reordered_products == []
    assert_auto_draws_as_input_major(target, xpress)
