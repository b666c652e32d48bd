"""examples/acceptance_diagnostic.py: the greedy acceptance of the drafts as decoding makes them (the head's) beside
the drafter's own argmax, on the same anchors of a cached row."""

import pytest
import torch

from modeling_xpress.refinement import previous_tokens
from modeling_xpress.training import draft_blocks
from modeling_xpress.training.signal_cache import cache_target_signals
from tests.builders import load_example, tiny_llama, tiny_xpress
from tests.test_training import random_rows


@pytest.fixture(scope="module")
def diagnostic():
    return load_example("acceptance_diagnostic")


@pytest.fixture(scope="module")
def target():
    return tiny_llama().eval()


def cached_row(target, model, tmp_path):
    cache = cache_target_signals(target, random_rows([40]), model.config.target_layer_ids, tmp_path, progress=False,
                                 top_k=4, dtype=torch.float32)  # fmt: skip
    return cache[0]


def sequential_drafts(model, target, row, anchors):
    """The head's greedy drafts decoded one position at a time (the fixed point Jacobi reaches), for each anchor."""
    ids = torch.as_tensor(row["input_ids"])
    features = torch.as_tensor(row["features"]).float().view(ids.shape[0], -1)
    a = torch.tensor(anchors)
    hidden = draft_blocks(model, target.get_input_embeddings(), features[None], a[None], ids[a][None])[0]
    base = model.base_logits(hidden, target.get_output_embeddings())  # (m, n, V), -inf outside a draft vocabulary
    last = torch.stack([ids[a - 1], ids[a]], dim=-1)
    tokens = torch.zeros(base.shape[:2], dtype=torch.long)
    for k in range(base.shape[1]):
        delta = model.refiner(hidden, previous_tokens(last, tokens))  # causal: position k reads tokens < k only
        tokens[:, k] = (base + model.to_vocabulary(delta))[:, k].argmax(-1)
    return tokens, base.argmax(-1)


@torch.no_grad()
def test_head_drafts_are_the_sequential_decode_and_a_zero_head_changes_nothing(diagnostic, target, tmp_path):
    model = tiny_xpress(target, refiner_form="release", jacobi_max_iters=8, jacobi_early_exit=False)
    row = cached_row(target, model, tmp_path / "a")
    acc = diagnostic.row_acceptance(model, target, row)
    anchors = (acc["offsets"] + 5).tolist()  # random_rows' prompt is 5 tokens
    drafts, argmax = sequential_drafts(model, target, row, anchors)
    full = len(row["input_ids"])
    top1 = torch.as_tensor(row["topk_ids"]).view(full, -1)[:, 0]
    n = model.config.block_size - 1
    pos = (torch.tensor(anchors)[:, None] + torch.arange(n)).clamp(max=full - 1)
    valid = (torch.tensor(anchors)[:, None] + 1 + torch.arange(n)) < full
    assert (drafts != argmax)[valid].any(), "the random head must change some drafts, or the test shows nothing"
    assert torch.equal(acc["greedy"].bool(), (drafts == top1[pos]) & valid)
    assert torch.equal(acc["greedy_head_off"].bool(), (argmax == top1[pos]) & valid)
    assert not torch.equal(acc["greedy"], acc["greedy_head_off"]), "matches the head changed, or the test shows nothing"

    fresh = tiny_xpress(target, refiner_form="release", randomize_head=False)  # δ = 0: the drafter's own argmax
    acc = diagnostic.row_acceptance(fresh, target, cached_row(target, fresh, tmp_path / "b"))
    assert torch.equal(acc["greedy"], acc["greedy_head_off"])


def test_chained_walk_starts_each_block_where_the_last_one_stopped(diagnostic):
    # A block at position t yields tau[t] tokens (its accepted drafts and the target's own token).
    assert diagnostic.chained([2, 1, 3, 1, 1, 1, 1]) == (7, 4, [0, 2, 5, 6])
    assert diagnostic.chained([4, 1, 1, 1, 2]) == (6, 2, [0, 4])  # the last block runs past the response: counted
    assert diagnostic.chained([]) == (0, 0, [])
