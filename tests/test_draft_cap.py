"""Drafts per block chosen on the machine (`num_assistant_tokens="auto"`, `draft_cap.py`).

The choice weighs the checkpoint's measured acceptance s_k against timed verification products. The tests pin: s
estimated from decoded blocks by hand and from a perfect drafter; the decision rule on numbers whose answer is known
(including the two CPUs this project measured); that the timed costs go where the rule reads them (a stand-in cost
with a known optimum); greedy output identical to the target's through the eager and compiled loops with the chosen
cap; and the errors a user sees.
"""

import pytest
import torch

import modeling_xpress.cpu_layouts as layouts
from modeling_xpress.policy import linear_weights
from modeling_xpress import XPressConfig
from modeling_xpress.draft_cap import (
    acceptance_from_blocks, best_cap, candidate_caps, choose_draft_cap, expected_tokens,
)  # fmt: skip
from tests.builders import perfect_head, permutation_target, tiny_llama, tiny_xpress

IDS = torch.tensor([[3, 7, 1, 12]])


def test_acceptance_from_blocks_by_hand():
    # Four blocks: 3 drafts verified, 0 accepted; 3, 1; 3, 3; 2 (cut by the end of generation), 2.
    s = acceptance_from_blocks([1, 2, 4, 3], [3, 3, 3, 2], block_size=6)
    assert s == [3 / 4, 2 / 4, 1 / 3, 0.0, 0.0]
    assert expected_tokens(s, 2) == 1 + 3 / 4 + 2 / 4
    with pytest.raises(ValueError, match="one acceptance length per drafted block"):
        acceptance_from_blocks([1, 2], [3], block_size=6)


def test_acceptance_of_a_perfect_drafter_predicts_its_tau():
    """A drafter that always drafts the target's tokens: s = 1 everywhere, and a block verifying c drafts commits
    E(c) = c + 1 tokens, as decoding measures."""
    target, perm = permutation_target(32, seed=0)
    xpress = tiny_xpress(target, refiner="xpress", refiner_rank=32, block_size=8, jacobi_max_iters=7,
                         randomize_head=False)  # fmt: skip
    perfect_head(xpress, perm)
    stats = xpress.spec_generate(target, IDS, max_new_tokens=70, stop_token_ids=[]).stats
    s = acceptance_from_blocks(stats.acceptance_lengths, stats.draft_lengths, block_size=8)
    assert s == [1.0] * 7
    capped = xpress.spec_generate(target, IDS, max_new_tokens=60, stop_token_ids=[], num_assistant_tokens=3).stats
    assert capped.acceptance_lengths[:-1] == [expected_tokens(s, 3)] * (len(capped.acceptance_lengths) - 1)


def test_best_cap_on_known_costs():
    s = [0.477, 0.203, 0.103, 0.050, 0.024]  # the v8 checkpoint's held-out acceptance (bundled before v9)
    # The width costs nothing: 5 drafts are the fastest, 4 only 1.3% slower (E 1.833 vs 1.857: within MIN_ADVANTAGE,
    # so the fewer drafts), 3 drafts 4.1% slower (beyond it).
    assert best_cap(s, 0.008, [0.030] * 5) == 4
    assert best_cap(s, 0.008, [0.030 * (c + 1) for c in range(1, 6)]) == 1  # each token costs a full step: 1 draft
    assert best_cap([1.0, 0.0, 0.0], 0.0, [1.0, 1.0, 1.0]) == 1  # a tie: the shorter cap
    # The compiled fp32 SmolLM2 verification measured on two CPUs (README), drafter step ~8 ms: 2-core Intel Xeon
    # (MKL's 4-row cliff) 38.2 / 44.3 / 56.7 ms at 2 / 3 / 4 tokens: 2 drafts estimated 0.5% faster than 1, which the
    # products-only estimate cannot tell apart, so 1; AMD EPYC (weight-major) about flat up to 4 tokens and then
    # dearer: 3 drafts 3.4% faster than 2, where 3 measured best on held-out prompts.
    assert best_cap(s[:3], 0.008, [0.0382, 0.0443, 0.0567]) == 1
    assert best_cap(s[:4], 0.008, [0.030, 0.030, 0.031, 0.045]) == 3


def test_the_timed_costs_go_where_the_rule_reads_them(monkeypatch):
    """With a stand-in cost (seconds = rows · width of the weights, so the verification grows with its tokens), the
    choice and its table are what the rule gives on those costs computed by hand."""
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8, draft_acceptance=[0.9, 0.8, 0.7, 0.6, 0.3, 0.2, 0.1])
    calls = []

    def cost(jobs, rounds=5):
        calls.append(len(jobs))
        return [[1e-6 * rows * sum(w.shape[0] for w in weights)] * rounds for weights, rows, _ in jobs]

    monkeypatch.setattr(layouts, "products_samples", cost)
    choice = choose_draft_cap(xpress, target, compiled=False)
    # E(7) adds 2.2% to E(6): within MIN_ADVANTAGE, so 7 drafts are not even timed (`candidate_caps`)
    assert choice.caps == candidate_caps(xpress.config.draft_acceptance, 7) == [1, 2, 3, 4, 5, 6]
    target_rows = sum(w.shape[0] for w in linear_weights(target))
    drafter_rows = sum(w.shape[0] for w in linear_weights(xpress))
    readout_rows = target.get_output_embeddings().weight.shape[0]
    verify = [1e-6 * ((c + 1) * target_rows + c * readout_rows) for c in range(1, 7)]
    draft = 1e-6 * 8 * drafter_rows
    assert choice.verify_seconds == pytest.approx(verify) and choice.draft_seconds == pytest.approx(draft)
    assert choice.cap == best_cap(xpress.config.draft_acceptance, draft, verify)
    assert 1 < choice.cap < 6  # an interior optimum: the rule really traded acceptance against cost
    assert choice.expected_tokens == pytest.approx([expected_tokens(xpress.config.draft_acceptance, c)
                                                    for c in range(1, 7)])  # fmt: skip
    assert "<- chosen" in choice.table().splitlines()[choice.caps.index(choice.cap) + 1]
    # Timed once per (models, setting): a second call reuses the choice; max_cap limits the candidates.
    n = len(calls)
    assert choose_draft_cap(xpress, target, compiled=False) is choice and len(calls) == n
    assert len(choose_draft_cap(xpress, target, compiled=False, max_cap=2).verify_seconds) == 2


@pytest.mark.skipif(not layouts.mkl_packing_available(), reason="no MKL packed GEMM in this build")
def test_packed_products_are_timed_with_packs_and_leave_none(monkeypatch):
    """A packed job is timed with its weights packed for its rows, and the packs it made are dropped afterwards
    (packs a decoder made before stay)."""
    weights = [torch.randn(64, 16), torch.randn(16, 64)]
    layouts.release_packed_weights()
    layouts.pack_weights(weights[:1], 3)
    seen = []
    real = layouts._packed_linear

    def spy(x, weight):
        seen.append((weight.data_ptr(), x.shape[0]) in layouts._PACKS)
        return real(x, weight)

    seconds = layouts.products_seconds([(weights, 3, "packed"), (weights, 2, "input_major")], repeats=2)
    assert len(seconds) == 2 and all(t > 0 for t in seconds)
    assert set(layouts._PACKS) == {(weights[0].data_ptr(), 3)}
    monkeypatch.setattr(layouts, "packed_linear", spy)  # the operator's kernel, watched through a stand-in
    layouts.products_seconds([(weights, 3, "packed")], repeats=1)
    assert seen and all(seen)
    layouts.release_packed_weights()


@pytest.mark.skipif(not layouts.onednn_reorder_available(), reason="no oneDNN reordered linear here")
def test_reordered_products_are_timed_with_reorders_and_leave_none(monkeypatch):
    """A "onednn" job is timed on its weights' oneDNN reorders (one for every row count), and the reorders it made
    are dropped afterwards (one a decoder made before stays)."""
    weights = [torch.randn(64, 16), torch.randn(16, 64)]
    layouts.release_packed_weights()
    layouts.pack_weights(weights[:1], layouts.ANY_ROWS)
    seen = []
    real = layouts.onednn_linear

    def spy(x, weight):
        seen.append((weight.data_ptr(), layouts.ANY_ROWS) in layouts._PACKS)
        return real(x, weight)

    monkeypatch.setattr(layouts, "onednn_linear", spy)
    seconds = layouts.products_seconds([(weights, 3, "onednn"), (weights, 5, "onednn"), (weights, 2, "input_major")],
                                       repeats=2)  # fmt: skip
    assert len(seconds) == 3 and all(t > 0 for t in seconds) and seen and all(seen)
    assert set(layouts._PACKS) == {(weights[0].data_ptr(), layouts.ANY_ROWS)}
    layouts.release_packed_weights()


def test_a_record_names_the_layouts_its_loop_could_choose():
    """A machine's record of timed caps is keyed by the kinds of layout the loop's policy chooses from: a record
    timed by a version that could not reorder the verification is not read by one that can."""
    from modeling_xpress.draft_cap import _record_key
    from modeling_xpress.layout_policy import decoder_policy

    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8)
    policy = decoder_policy("auto", target, xpress, compiled=False)
    key = _record_key(xpress, target, False, policy, [("verify", 4)])
    assert key["layout_kinds"] == ["input_major", "weight_major", "packed", "onednn", "bfloat16"]
    assert key["linear_layout"] == "auto"


@pytest.mark.parametrize("compile", [False, True])
def test_auto_cap_keeps_greedy_output(compile):
    """spec_generate(num_assistant_tokens="auto") times the products on this machine, picks a cap among the measured
    positions, verifies at most that many drafts per block, and its output is the target's greedy output."""
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8, draft_acceptance=[0.8, 0.6, 0.4])
    reference = target.generate(IDS, max_new_tokens=30, do_sample=False)
    out = xpress.spec_generate(target, IDS, max_new_tokens=30, stop_token_ids=[], num_assistant_tokens="auto",
                               compile=compile)  # fmt: skip
    assert torch.equal(out.sequences, reference)
    choice = xpress.choose_draft_cap(target, compiled=compile)
    assert 1 <= choice.cap <= 3 and len(choice.verify_seconds) == 3
    assert all(t > 0 for t in choice.verify_seconds) and choice.draft_seconds > 0
    assert max(out.stats.draft_lengths) <= choice.cap
    assert choice.cap in out.stats.draft_lengths


def test_config_field_round_trips_and_bad_values_raise(tmp_path):
    target = tiny_llama()
    config = XPressConfig.from_target_config(target.config, block_size=8, draft_acceptance=[0.5, 0.25])
    config.save_pretrained(tmp_path)
    assert XPressConfig.from_pretrained(tmp_path).draft_acceptance == [0.5, 0.25]
    for value in [[], [1.5], [0.5] * 8, "0.5", [0.5, None]]:
        with pytest.raises(ValueError, match="draft_acceptance"):
            XPressConfig.from_target_config(target.config, block_size=8, draft_acceptance=value)


def test_auto_needs_a_measured_acceptance():
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8)
    with pytest.raises(ValueError, match="no draft_acceptance.*integer num_assistant_tokens"):
        xpress.spec_generate(target, IDS, max_new_tokens=4, num_assistant_tokens="auto")
    with pytest.raises(ValueError, match="'auto'"):
        xpress.spec_generate(target, IDS, max_new_tokens=4, num_assistant_tokens="fast")
    with pytest.raises(ValueError, match="max_cap"):
        xpress.choose_draft_cap(target, acceptance=[0.5], max_cap=0)
    with pytest.raises(ValueError, match="remeasure must be True.*got 'yes'"):
        xpress.choose_draft_cap(target, acceptance=[0.5], remeasure="yes")


# --- draft trees: tree_nodes="auto" ----------------------------------------------------------------------------------


def test_tree_acceptance_round_trips_and_bad_values_raise(tmp_path):
    target = tiny_llama()
    config = XPressConfig.from_target_config(target.config, block_size=8, tree_acceptance={8: 2.5, 4: 2.0})
    config.save_pretrained(tmp_path)  # JSON keys are strings; they come back as budgets
    assert XPressConfig.from_pretrained(tmp_path).tree_acceptance == {4: 2.0, 8: 2.5}
    for value in [{}, {0: 2.0}, {"x": 2.0}, {4.5: 2.0}, {4: 0.5}, {4: float("nan")}, {4: 3.0, 8: 2.0}, [2.0]]:
        with pytest.raises(ValueError, match="tree_acceptance"):
            XPressConfig.from_target_config(target.config, block_size=8, tree_acceptance=value)


@pytest.mark.parametrize("cost, expected", [("flat", 16), ("steep", None)])
def test_auto_tree_budget_follows_the_cost_of_width(monkeypatch, cost, expected):
    """Where verifying more tokens costs nothing extra (a GPU), the largest budget that raises τ wins; where every
    verified token costs a lot (fp32 on a small CPU), no tree beats the linear cap and "auto" keeps linear blocks.
    Either way greedy output is the target's."""
    from modeling_xpress.draft_cap import choose_draft_shape

    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8, draft_acceptance=[0.6, 0.3, 0.1, 0.05, 0.02, 0.01, 0.0],
                         tree_acceptance={4: 2.0, 8: 2.4, 16: 2.7})  # fmt: skip

    def seconds(jobs, rounds=5):  # a fixed 1 s per product sweep, or 1 s per row on top (the tree's construction
        # is really timed: its milliseconds, and their noise on a busy machine, barely count next to these)
        return [[1.0 + (1.0 * rows if cost == "steep" else 0.0)] * rounds for _, rows, _ in jobs]

    monkeypatch.setattr(layouts, "products_samples", seconds)
    choice = choose_draft_shape(xpress, target, compiled=False)
    assert choice.tree_nodes == expected
    assert set(choice.tree_rates) == {4, 8, 16} and "<- chosen" in choice.table()
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(0))
    out = xpress.spec_generate(target, ids, max_new_tokens=20, tree_nodes="auto")
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=20, do_sample=False))
    assert (max(out.stats.draft_lengths) > 7) == (expected is not None)  # a tree verifies more than a block's drafts


def test_auto_tree_needs_a_measured_tree_acceptance():
    target = tiny_llama()
    xpress = tiny_xpress(target, block_size=8, draft_acceptance=[0.5, 0.2])
    with pytest.raises(ValueError, match="no tree_acceptance"):
        xpress.spec_generate(target, IDS, max_new_tokens=4, tree_nodes="auto")
