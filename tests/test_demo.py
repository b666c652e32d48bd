"""`make demo`'s measurement (`modeling_xpress.bench.demo`): the three decoders it compares give the target's greedy
output, and the summary reports what the rows hold."""

import pytest
import torch

from modeling_xpress.bench.demo import compare_greedy, summary
from modeling_xpress.training.synthetic import constructed_permutation_pair


def test_compare_greedy_with_the_compiled_decoder_is_exact_and_summarised():
    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    prompts = [torch.randint(0, target.config.vocab_size, (1, n)) for n in (3, 6, 11)]  # lengths differ: one cache
    rows = compare_greedy(target, xpress, prompts, max_new_tokens=40, compiled=True)
    assert len(rows) == 3
    for row in rows:
        assert row.identical and row.compiled_identical
        assert row.new_tokens == row.compiled_new_tokens == 40
        assert row.compiled_tau == pytest.approx(row.mean_tau)  # one loop, two entry points
        assert row.compiled_tau > 4  # the constructed head knows the target: long blocks are accepted
        assert row.compiled_compile_seconds == 0  # one cache length for every prompt: the warm-up compiled it all
        assert row.compiled_seconds > 0 and row.compiled_speedup == pytest.approx(row.plain_seconds / row.compiled_seconds)
    s = summary(rows)
    assert s["identical"] == s["compiled_identical"] == 3
    assert s["compiled_tokens_per_s"] == pytest.approx(120 / sum(r.compiled_seconds for r in rows))
    assert s["compiled_speedup_vs_plain"] == pytest.approx(sum(r.plain_seconds for r in rows)
                                                           / sum(r.compiled_seconds for r in rows))


def test_compare_greedy_without_the_compiled_decoder_reports_no_compiled_figures():
    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    rows = compare_greedy(target, xpress, [torch.randint(0, target.config.vocab_size, (1, 4))], max_new_tokens=16)
    assert rows[0].identical and rows[0].compiled_seconds is None and rows[0].compiled_speedup is None
    assert "compiled_speedup_vs_plain" not in summary(rows)


def test_compare_greedy_passes_the_draft_cap_to_both_xpress_decoders():
    """`make demo`'s cap (chosen on the machine, `xpress.choose_draft_cap`) reaches `generate(assistant_model=)` and
    the compiled decoder: at most 2 drafts + the bonus token per step, still the target's own output."""
    torch.manual_seed(0)
    target, xpress = constructed_permutation_pair()
    prompts = [torch.randint(0, target.config.vocab_size, (1, 5))]
    rows = compare_greedy(target, xpress, prompts, max_new_tokens=30, compiled=True, num_assistant_tokens=2)
    assert rows[0].identical and rows[0].compiled_identical
    assert 2 < rows[0].mean_tau <= 3 and rows[0].compiled_tau == pytest.approx(rows[0].mean_tau)
    assert rows[0].compiled_compile_seconds == 0  # the warm-up compiled the capped width too
