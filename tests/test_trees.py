"""Draft trees (`trees.py`, groundwork, greedy): the verification against per-branch references, the construction
against the head's own sequential decode, and a tree decode loop against the target's greedy output."""

import pytest
import torch
from transformers import DynamicCache

from modeling_xpress.refinement import sequential_refine
from modeling_xpress.trees import (
    DraftTree, accept_tree_greedy, build_tree, keep_path, tree_attention_mask, verify_tree,
)  # fmt: skip
from tests.builders import tiny_llama, tiny_xpress

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, num_hidden_layers=2, seed=71)


def random_tree(n: int, seed: int) -> DraftTree:
    """Node j's parent is one of the nodes before it (or the anchor)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(-1, j, (1,), generator=g)) for j in range(1, n)]
    depths = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(tokens=torch.randint(0, VOCAB, (n,), generator=g), parents=torch.tensor(parents),
                     depths=torch.tensor(depths), distributions=torch.zeros(1, VOCAB),
                     source=torch.zeros(n, dtype=torch.long))  # fmt: skip


def test_mask_sees_ancestors_only():
    tree = random_tree(7, seed=0)
    mask = tree_attention_mask(tree.parents)
    for j in range(len(tree)):
        seen = {i - 1 for i in mask[j + 1].nonzero()[:, 0].tolist()}
        assert seen == {-1, *tree.path(j)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_logits_equal_each_branch_verified_alone(target, seed):
    """Row j + 1 of one tree forward is the target's next-token logits after the prompt and node j's path, as a plain
    forward of that sequence gives them; row 0 the anchor's."""
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed))
    tree = random_tree(9, seed=seed + 10)
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt[:, :-1], cache=cache)
    logits = verify_tree(target, cache, int(prompt[0, -1]), tree).logits[0]
    torch.testing.assert_close(logits[0], target(prompt).logits[0, -1], atol=1e-4, rtol=1e-4)
    for j in range(len(tree)):
        branch = torch.cat([prompt, tree.tokens[tree.path(j)].view(1, -1)], dim=1)
        torch.testing.assert_close(logits[j + 1], target(branch).logits[0, -1], atol=1e-4, rtol=1e-4)


def test_keep_path_leaves_the_cache_of_the_accepted_path(target):
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    tree = random_tree(8, seed=4)
    leaf = max(tree.leaves(), key=lambda j: len(tree.path(j)))
    path = tree.path(leaf)
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt[:, :-1], cache=cache)
    verify_tree(target, cache, int(prompt[0, -1]), tree)
    keep_path(cache, len(tree) + 1, path)
    assert cache.get_seq_length() == prompt.shape[1] + len(path)
    after = torch.tensor([[5]])
    sequence = torch.cat([prompt, tree.tokens[path].view(1, -1), after], dim=1)
    out = target(input_ids=after, cache=cache).logits[0, -1]
    torch.testing.assert_close(out, target(sequence).logits[0, -1], atol=1e-4, rtol=1e-4)


def drafter_outputs(xpress, seed: int):
    g = torch.Generator().manual_seed(seed)
    block = xpress.config.block_size
    hidden = torch.randn(1, block, xpress.config.hidden_size, generator=g)  # every slot, the anchor's first
    return hidden, torch.randn(1, block - 1, VOCAB, generator=g) * 3


@pytest.mark.parametrize("refiner", ["xpress", "markov"])
def test_children_are_conditioned_on_their_own_path(target, refiner):
    """Following the most probable child from the anchor walks the head's sequential (left-to-right) decode: each
    child's distribution is the head's correction for its own parent path."""
    xpress = tiny_xpress(target, refiner=refiner, block_size=8)
    hidden, base = drafter_outputs(xpress, seed=5)
    last = torch.tensor([[3, 7]])  # the token before the anchor, the anchor
    tree = build_tree(xpress, hidden, base, last, budget=40)
    reference = sequential_refine(xpress.refiner, hidden, base, last).tokens[0].tolist()
    node, chain = -1, []
    while True:
        kids = [j for j in range(len(tree)) if int(tree.parents[j]) == node]
        if not kids:
            break
        best = int(tree.logits[kids[0]].argmax())  # a node's children share their parent path's distribution
        match = [j for j in kids if int(tree.tokens[j]) == best]
        if not match:
            break
        node = match[0]
        chain.append(best)
    assert len(chain) >= 3 and chain == reference[: len(chain)]
    off = build_tree(xpress, hidden, base, last, budget=40, use_head=False)
    for j in range(len(off)):  # head off: every node chosen from the drafter's marginals at its depth
        torch.testing.assert_close(off.logits[j], base[0, int(off.depths[j]) - 1])
    assert not all(torch.equal(tree.logits[j], base[0, int(tree.depths[j]) - 1]) for j in range(len(tree)))


@pytest.mark.parametrize("budget", [1, 4, 12])
def test_greedy_tree_decoding_is_the_targets_greedy_output(target, budget):
    """A tree decode loop (an oracle drafter: its marginals favour the target's own next tokens, with noise, so trees
    accept paths of every length and prune siblings) commits exactly the target's greedy output."""
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    xpress = tiny_xpress(target, refiner="none", block_size=6)
    g = torch.Generator().manual_seed(9)
    cache = DynamicCache(config=target.config)
    target(input_ids=prompt[:, :-1], cache=cache)
    committed, anchor, out, accepted_counts = prompt.shape[1] - 1, int(prompt[0, -1]), [], []
    before = int(prompt[0, -2])
    while len(out) < 30:
        n = xpress.config.block_size - 1
        base = torch.randn(1, n, VOCAB, generator=g)
        for k, token in enumerate(expected[len(out) : len(out) + n]):  # the truth, often but not always on top
            base[0, k, token] += 3.0 if torch.rand(1, generator=g) < 0.7 else -3.0
        tree = build_tree(xpress, torch.zeros(1, n + 1, xpress.config.hidden_size), base,
                          torch.tensor([[before, anchor]]), budget)  # fmt: skip
        logits = verify_tree(target, cache, anchor, tree).logits[0]
        accepted, bonus = accept_tree_greedy(tree, logits)
        keep_path(cache, len(tree) + 1, accepted)
        out += tree.tokens[accepted].tolist() + [bonus]
        before = int(tree.tokens[accepted[-1]]) if accepted else anchor
        committed, anchor = committed + 1 + len(accepted), bonus
        accepted_counts.append(len(accepted))
    assert out[:30] == expected
    if budget > 1:
        assert max(accepted_counts) >= 2  # paths longer than one node were accepted
