"""Edge cases of decoding, trees first, each exact or refused with a clear error: τ when the target alone emits
every token (max_new_tokens of 1 or 2)."""

import pytest
import torch

from modeling_xpress.compiled import release_compiled_decoders
from tests.builders import tiny_llama, tiny_xpress

IDS = torch.tensor([[3, 7, 1, 12, 5]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama()
    return target, tiny_xpress(target)


@pytest.fixture(scope="module", autouse=True)
def _release_graphs():
    yield
    release_compiled_decoders()


# --- τ ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["linear", "tree", "compiled tree", "generate"])
@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_tau_is_one_when_the_target_emits_every_token(pair, route, max_new_tokens):
    """With 1 or 2 new tokens no step has room for a draft (the prefill emits the first, the target alone the
    second): the tokens are the target's and τ is 1, not 0 (tokens committed per target step)."""
    target, xpress = pair
    expected = target.generate(IDS, max_new_tokens=max_new_tokens, do_sample=False)
    if route == "generate":
        out = target.generate(IDS, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=xpress)
        stats = xpress.generation_stats
    else:
        tree = None if route == "linear" else 64
        result = xpress.spec_generate(target, IDS, max_new_tokens=max_new_tokens, tree_nodes=tree,
                                      compile=route == "compiled tree")  # fmt: skip
        out, stats = result.sequences, result.stats
    assert torch.equal(out, expected)
    assert stats.new_tokens == max_new_tokens and stats.acceptance_lengths == []
    assert stats.mean_tau == 1.0 and stats.as_dict()["mean_tau"] == 1.0


def test_tau_is_zero_only_when_nothing_was_committed():
    from modeling_xpress.stats import XPressGenerationStats

    assert XPressGenerationStats().mean_tau == 0.0
    assert XPressGenerationStats(acceptance_lengths=[3, 1], new_tokens=5).mean_tau == 2.0
