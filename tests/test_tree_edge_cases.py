"""Edge cases of decoding, trees first, each exact or refused with a clear error: τ when the target alone emits
every token (max_new_tokens of 1 or 2), max_new_tokens=0, sampled trees at the edges of the warpers (top-k = 1,
top-p = 1e-3, T = 5), seeds reproducing sampled trees on every route, a stop token inside an accepted path,
max_cache_len too small for a tree, and a compiled tree of 64 nodes."""

import pytest
import torch
from transformers import LogitsProcessorList

import modeling_xpress.decoding as decoding
from modeling_xpress.compiled import release_compiled_decoders
from modeling_xpress.custom_generate.generate import generate as recipe
from modeling_xpress.processors import sampling_processors
from tests.builders import perfect_head, permutation_target, tiny_llama, tiny_xpress
from tests.test_sampling import ALPHA, LENGTH, PROMPT, chi_square_pvalue, exact_distribution
from tests.test_sampling import target as sampling_target  # noqa: F401
from tests.test_tree_decoding import draw, make_xpress, oracle_run_drafter

IDS = torch.tensor([[3, 7, 1, 12, 5]])


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama()
    return target, tiny_xpress(target)


@pytest.fixture(scope="module", autouse=True)
def _release_graphs():
    yield
    release_compiled_decoders()


# --- τ and max_new_tokens ----------------------------------------------------------------------------------------


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
        tree = None if route == "linear" else 64  # (the compiled graphs of the 64-node test below: compiled once)
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


@pytest.mark.parametrize("settings", [dict(tree_nodes=4), dict(tree_nodes="auto"), dict(tree_nodes=4, compile=True),
                                      dict()])  # fmt: skip
def test_max_new_tokens_zero_is_refused(pair, settings):
    target, xpress = pair
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        xpress.spec_generate(target, IDS, max_new_tokens=0, **settings)


def test_max_new_tokens_zero_is_refused_by_the_tree_recipe(pair):
    """The custom_generate recipe's tree route passes 0 on (it used to read it as "unset" and decode 20 tokens), and
    an unset length is transformers' default, 20."""
    target, xpress = pair
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        recipe(target, IDS, xpress_model=xpress, tree_nodes=4, max_new_tokens=0)
    assert recipe(target, IDS, xpress_model=xpress, tree_nodes=4).shape[1] == IDS.shape[1] + 20


# --- sampled trees at the edges of the warpers -----------------------------------------------------------------


@pytest.mark.parametrize("warpers", [dict(top_k=1), dict(top_p=1e-3)])
@pytest.mark.parametrize("compile", [False, True])
def test_one_token_support_samples_the_greedy_tree(pair, warpers, compile):
    """top_k=1, or a top_p so small only the most likely token stays: every distribution (the target's p, each path's
    q) is one token, so a sampled tree is a chain of the drafter's argmax path and decodes exactly the greedy output,
    at any temperature: with a random drafter (nothing accepted) and with a perfect one (whole chains accepted)."""
    target, xpress = pair
    expected = target.generate(IDS, max_new_tokens=24, do_sample=False)
    out = xpress.spec_generate(target, IDS, max_new_tokens=24, tree_nodes=6, temperature=1.5, compile=compile,
                               generator=torch.Generator().manual_seed(0), **warpers)  # fmt: skip
    assert torch.equal(out.sequences, expected)
    target, perm = permutation_target(32, seed=0)
    xpress = tiny_xpress(target, block_size=8, jacobi_max_iters=7, refiner_rank=32, randomize_head=False)
    perfect_head(xpress, perm)
    expected = target.generate(IDS % 32, max_new_tokens=24, do_sample=False)
    out = xpress.spec_generate(target, IDS % 32, max_new_tokens=24, tree_nodes=6, temperature=1.5, compile=compile,
                               generator=torch.Generator().manual_seed(0), **warpers)  # fmt: skip
    assert torch.equal(out.sequences, expected)
    assert out.stats.acceptance_lengths[0] == 7  # the chain of 6 drafts and the bonus: q and p one token, equal


def test_tree_sampling_is_lossless_at_temperature_5(sampling_target):  # noqa: F811
    """T = 5 flattens the peaked target (and the drafts' q) towards uniform: still the target's distribution."""
    xpress = make_xpress(sampling_target, "xpress")
    samples = draw(xpress, sampling_target, nodes=6, seed=5, temperature=5.0)
    assert chi_square_pvalue(samples, exact_distribution(sampling_target, sampling_processors(5.0, None, None))) > ALPHA
    uniform = {s: 3.0**-LENGTH for s in exact_distribution(sampling_target, LogitsProcessorList())}
    assert chi_square_pvalue(samples, uniform) < ALPHA  # (and T = 5 is not simply uniform)


# --- seeds -----------------------------------------------------------------------------------------------------


def test_seeds_reproduce_sampled_trees_on_every_route(sampling_target):  # noqa: F811
    """A sampled tree's output is a function of the seed: `torch.manual_seed` before the call (eager, compiled, the
    custom_generate recipe) or a `generator`, the first call included; compiled and eager draw alike."""
    xpress = make_xpress(sampling_target, "xpress")
    ids = torch.tensor([[0, 2, 1, 1, 0, 2]])
    settings = dict(max_new_tokens=16, temperature=1.0, tree_nodes=5, stop_token_ids=[])

    def seeded(seed, **route):
        torch.manual_seed(seed)
        return xpress.spec_generate(sampling_target, ids, **settings, **route).sequences

    runs = {route: [seeded(s, compile=route == "compiled") for s in (7, 7, 8)] for route in ("eager", "compiled")}
    for first, again, other in runs.values():
        assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(runs["eager"][0], runs["compiled"][0])
    by_generator = [xpress.spec_generate(sampling_target, ids, **settings, compile=True,
                                         generator=torch.Generator().manual_seed(3)).sequences for _ in range(2)]  # fmt: skip
    assert torch.equal(*by_generator)
    through_recipe = []
    for _ in range(2):
        torch.manual_seed(11)
        through_recipe.append(recipe(sampling_target, ids, xpress_model=xpress, tree_nodes=5, max_new_tokens=16,
                                     do_sample=True, temperature=1.0, eos_token_id=[]))  # fmt: skip
    assert torch.equal(*through_recipe)


# --- stop tokens, cache length, a large compiled tree ---------------------------------------------------------------


def test_a_stop_token_inside_an_accepted_path_ends_the_output_there(monkeypatch):
    """An oracle drafter whose trees hold the target's continuation (4 tokens per verification): the stop token is
    accepted in the middle of a path, and the output ends right after it, the rest of the path dropped."""
    target = tiny_llama(seed=3)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False)[0].tolist()
    monkeypatch.setattr(decoding, "run_drafter", oracle_run_drafter(expected))
    xpress = tiny_xpress(target, refiner="none")
    new = expected[ids.shape[1] :]  # new[0] comes from the prefill, new[4j-3 .. 4j] from verification j
    # a token's first occurrence that is the 2nd draft of a path (its 1st and 2nd drafts accepted, then it stops)
    k = next(k for k in range(5, len(new)) if (k - 1) % 4 == 1 and new.index(new[k]) == k)
    out = xpress.spec_generate(target, ids, max_new_tokens=40, tree_nodes=14, stop_token_ids=[new[k]])
    assert out.sequences[0].tolist() == expected[: ids.shape[1] + k + 1]
    assert out.stats.acceptance_lengths == [4] * ((k - 1) // 4) + [2] and out.stats.new_tokens == k + 1


def test_eos_in_a_tree_stops_both_loops(pair):
    """The target's own EOS (its generation config) emitted from inside a tree: eager and compiled trees stop where
    target.generate stops."""
    target, xpress = pair
    free = target.generate(IDS, max_new_tokens=30, do_sample=False)[0, IDS.shape[1] :].tolist()
    eos = free[11]
    expected = target.generate(IDS, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    for compile in (False, True):
        out = xpress.spec_generate(target, IDS, max_new_tokens=30, tree_nodes=6, stop_token_ids=[eos], compile=compile)
        assert torch.equal(out.sequences, expected), compile
        assert out.sequences[0, -1].item() == eos and out.stats.new_tokens == free.index(eos) + 1


def test_max_cache_len_too_small_for_a_tree_is_refused(pair):
    """A static cache must hold the prompt, the new tokens, a tree's N + 1 verified slots past them and two blocks:
    one slot less is refused with the number needed; exactly that many decodes the target's output."""
    target, xpress = pair
    nodes, new = 64, 171
    needed = IDS.shape[1] + new + nodes + 2 * xpress.config.block_size
    assert needed == 256  # one length bucket: the 64-node test's compiled decoder serves both
    with pytest.raises(ValueError, match=f"max_cache_len={needed - 1} cannot hold this call.*at least {needed} slots"):
        xpress.spec_generate(target, IDS, max_new_tokens=new, tree_nodes=nodes, compile=True, max_cache_len=needed - 1)
    out = xpress.spec_generate(target, IDS, max_new_tokens=new, tree_nodes=nodes, compile=True, max_cache_len=needed)
    assert torch.equal(out.sequences, target.generate(IDS, max_new_tokens=new, do_sample=False))
    with pytest.raises(ValueError, match="max_cache_len sizes the static caches of compile=True"):
        xpress.spec_generate(target, IDS, max_new_tokens=new, tree_nodes=nodes, max_cache_len=4096)


def test_a_compiled_tree_of_64_nodes_is_exact(pair):
    """N = 64: one verification graph of 65 tokens (compiled once; on two cores its compilation took as long as
    N = 8's, the width being a static shape, not more code), greedy output the target's, as eager."""
    target, xpress = pair
    expected = target.generate(IDS, max_new_tokens=40, do_sample=False)
    out = xpress.spec_generate(target, IDS, max_new_tokens=40, tree_nodes=64, compile=True)
    eager = xpress.spec_generate(target, IDS, max_new_tokens=40, tree_nodes=64)
    assert torch.equal(out.sequences, expected) and torch.equal(eager.sequences, expected)
    assert set(out.stats.verify_widths) == {65} and max(out.stats.draft_lengths) > 16  # really a wide tree
    assert out.stats.acceptance_lengths == eager.stats.acceptance_lengths
