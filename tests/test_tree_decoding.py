"""Draft trees in the decode loop (`spec_generate(tree_nodes=N)`): greedy output is the target's, an oracle drafter
gives the τ its tree shape implies, sampling is lossless (χ², with a check that the test catches a wrong rule)."""

import math

import pytest
import torch
from transformers import LogitsProcessorList

import modeling_xpress.decoding as decoding
from modeling_xpress.processors import sampling_processors
from modeling_xpress.trees import DraftTree
from tests.builders import tiny_llama, tiny_qwen3, tiny_xpress
from tests.test_sampling import (
    ALPHA, DRAWS, LENGTH, PROMPT, chi_square_pvalue, exact_distribution, target as sampling_target,  # noqa: F401
)  # fmt: skip

TARGETS = {"llama": tiny_llama, "qwen3": tiny_qwen3}


@pytest.fixture(scope="module", params=list(TARGETS))
def target(request):
    return TARGETS[request.param]()


def prompts(vocab: int, n: int = 2, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, int(torch.randint(3, 20, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
def test_tree_greedy_equals_target_greedy(target, refiner):
    xpress = tiny_xpress(target, refiner=refiner)
    for ids in prompts(target.config.vocab_size):
        expected = target.generate(ids, max_new_tokens=33, do_sample=False)
        for nodes in (1, 4, 12):
            out = xpress.spec_generate(target, ids, max_new_tokens=33, tree_nodes=nodes)
            assert torch.equal(out.sequences, expected), (refiner, nodes)
            assert max(out.stats.draft_lengths) <= nodes


def test_a_sliding_window_target_decodes_trees_exactly():
    """Mistral: every layer sliding, one mask for all (a model of one layer kind takes a tensor, not a dict); the
    dynamic cache keeps only the window, so the tree's mask covers exactly those keys."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    target = MistralForCausalLM(MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=8,
    )).eval()  # fmt: skip
    xpress = tiny_xpress(target)
    for ids in prompts(96, seed=2):
        expected = target.generate(ids, max_new_tokens=30, do_sample=False)
        assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=30, tree_nodes=6).sequences, expected)


def test_tree_with_a_depth_limit_and_stop_tokens(target):
    xpress = tiny_xpress(target)
    ids = prompts(target.config.vocab_size, seed=4)[0]
    expected = target.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] :].tolist()
    stop = expected[12]
    out = xpress.spec_generate(target, ids, max_new_tokens=30, tree_nodes=6, num_assistant_tokens=2,
                               stop_token_ids=[stop]).sequences[0, ids.shape[1]:].tolist()  # fmt: skip
    assert out == expected[: expected.index(stop) + 1]
    assert max(xpress.generation_stats.acceptance_lengths) <= 3  # two drafts and the bonus at most


def oracle_run_drafter(expected: list[int], decoy_margin: float = 0.04):
    """A drafter whose marginals at every depth put ~0.52 on a decoy and ~0.48 on the target's true next token (and
    nothing elsewhere). Best-first then fills the tree level by level (every depth-d path outscores every deeper
    one), so the all-truth path is as deep as the tree's full levels: N = 2 + 4 + ... + 2^k nodes accept k drafts."""
    real = decoding.run_drafter

    def run_drafter(xpress, embed_tokens, lm_head, anchor, context, context_start, cache, **kwargs):
        hidden, base = real(xpress, embed_tokens, lm_head, anchor, context, context_start, cache, **kwargs)
        position = context_start + context.shape[1]  # the anchor's index in the sequence
        base = torch.full_like(base, -1e4)
        for k in range(base.shape[1]):
            truth = expected[position + 1 + k] if position + 1 + k < len(expected) else 0
            base[0, k, truth] = math.log(0.5 - decoy_margin / 2)
            base[0, k, (truth + 1) % base.shape[-1]] = math.log(0.5 + decoy_margin / 2)
        return hidden, base

    return run_drafter


@pytest.mark.parametrize("nodes, tau", [(1, 1), (2, 2), (5, 2), (6, 3), (14, 4), (30, 5)])
def test_an_oracle_drafter_gives_the_tau_of_its_tree(monkeypatch, nodes, tau):
    target = tiny_llama(seed=3)
    ids = prompts(96, seed=5)[0]
    expected = target.generate(ids, max_new_tokens=60, do_sample=False)[0].tolist()
    monkeypatch.setattr(decoding, "run_drafter", oracle_run_drafter(expected))
    xpress = tiny_xpress(target, refiner="none")
    out = xpress.spec_generate(target, ids, max_new_tokens=60, tree_nodes=nodes)
    assert out.sequences[0].tolist() == expected
    full_steps = out.stats.acceptance_lengths[:-1]  # the last may be cut by max_new_tokens
    assert len(full_steps) >= 10 and set(full_steps) == {tau}


def test_a_tree_beats_the_chain_that_follows_the_decoys(monkeypatch):
    """The same oracle, linear: the block follows the decoy at every position and accepts nothing."""
    target = tiny_llama(seed=3)
    ids = prompts(96, seed=5)[0]
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)[0].tolist()
    real = decoding.run_drafter

    def draft_block(xpress, embed_tokens, lm_head, last, context, context_start, cache, **kwargs):
        hidden, base = oracle_run_drafter(expected)(xpress, embed_tokens, lm_head, last[0, -1:], context,
                                                    context_start, cache, positions=kwargs.get("positions"))  # fmt: skip
        return xpress.refine(hidden, base, last)

    monkeypatch.setattr(decoding, "run_drafter", real)
    monkeypatch.setattr(decoding, "draft_block", draft_block)
    xpress = tiny_xpress(target, refiner="none")
    out = xpress.spec_generate(target, ids, max_new_tokens=20, num_assistant_tokens=4)
    assert out.sequences[0].tolist() == expected and set(out.stats.acceptance_lengths) == {1}


# --- sampling ------------------------------------------------------------------------------------------------------


ACCEPTED: list[int] = []  # acceptance lengths of every verification of the last `draw`


def draw(xpress, target, nodes: int, seed: int, **settings) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    ACCEPTED.clear()
    for _ in range(DRAWS):
        res = xpress.spec_generate(target, PROMPT, max_new_tokens=LENGTH, stop_token_ids=[], generator=generator,
                                   tree_nodes=nodes, **settings)  # fmt: skip
        out.append(tuple(res.sequences[0, PROMPT.shape[1] :].tolist()))
        ACCEPTED.extend(res.stats.acceptance_lengths)
    return out


def make_xpress(target, refiner):
    return tiny_xpress(target, refiner=refiner, block_size=4, jacobi_max_iters=2, seed=5)


@pytest.mark.parametrize("refiner", ["xpress", "none"])
def test_tree_sampling_is_lossless(sampling_target, refiner):  # noqa: F811
    xpress = make_xpress(sampling_target, refiner)
    samples = draw(xpress, sampling_target, nodes=6, seed=0, temperature=1.0)
    assert chi_square_pvalue(samples, exact_distribution(sampling_target, LogitsProcessorList())) > ALPHA
    assert max(xpress.generation_stats.draft_lengths) == 6
    assert max(ACCEPTED) >= 3  # paths of two drafts were accepted in some draw


def test_tree_sampling_is_lossless_with_top_p(sampling_target):  # noqa: F811
    xpress = make_xpress(sampling_target, "xpress")
    processors = sampling_processors(1.0, None, 0.8)
    exact = exact_distribution(sampling_target, processors)
    samples = draw(xpress, sampling_target, nodes=6, seed=3, temperature=1.0, top_p=0.8)
    assert all(exact[s] > 0 for s in samples)
    assert chi_square_pvalue(samples, exact) > ALPHA


def test_tree_sampling_with_temperature_and_top_k(sampling_target):  # noqa: F811
    xpress = make_xpress(sampling_target, "xpress")
    samples = draw(xpress, sampling_target, nodes=8, seed=1, temperature=0.7, top_k=2)
    assert chi_square_pvalue(samples, exact_distribution(sampling_target, sampling_processors(0.7, 2, None))) > ALPHA


def wrong_rule(update_p: bool, update_q: bool):
    """`accept_tree_sampling` with a step of the recursion left out."""

    def accept(tree: DraftTree, target_logits, generator=None):
        children = tree.children()
        p_rows = target_logits.float().softmax(dim=-1)
        accepted, node = [], -1
        while True:
            p, kids, chosen = p_rows[node + 1], children.get(node, []), None
            q = tree.distributions[int(tree.source[kids[0]])].float().softmax(dim=-1) if kids else None
            for kid in kids:
                token = int(tree.tokens[kid])
                if float(torch.rand((), generator=generator)) * float(q[token]) <= float(p[token]):
                    chosen = kid
                    break
                if update_p:
                    residual = (p - q).clamp(min=0)
                    p = residual / residual.sum() if residual.sum() > 0 else p
                if update_q:
                    q = q.clone()
                    q[token] = 0
                    q = q / q.sum()
            if chosen is None:
                return accepted, int(torch.multinomial(p, 1, generator=generator))
            accepted.append(chosen)
            node = chosen

    return accept


@pytest.mark.parametrize("update_p, update_q", [(False, False), (True, False)])
def test_the_tree_test_detects_a_wrong_rule(sampling_target, monkeypatch, update_p, update_q):  # noqa: F811
    """Power: siblings drawn without replacement but judged as if they were independent draws (no residual update of
    p; or p updated but q left whole, the with-replacement rule) — rejected by the same χ² test (measured p-values
    ~1e-11 for the second; the honest rule ~0.07 on the same seed)."""
    xpress = make_xpress(sampling_target, "none")
    exact = exact_distribution(sampling_target, LogitsProcessorList())
    monkeypatch.setattr(decoding, "accept_tree_sampling", wrong_rule(update_p, update_q))
    broken = draw(xpress, sampling_target, nodes=6, seed=0, temperature=1.0)
    assert chi_square_pvalue(broken, exact) < ALPHA


def test_tree_sampling_reproduces_with_a_seed(sampling_target):  # noqa: F811
    xpress = make_xpress(sampling_target, "xpress")
    ids = torch.tensor([[0, 2, 1, 1, 0, 2]])
    runs = [xpress.spec_generate(sampling_target, ids, max_new_tokens=20, temperature=1.0, tree_nodes=5,
                                 generator=torch.Generator().manual_seed(7)).sequences for _ in range(2)]  # fmt: skip
    assert torch.equal(*runs)


# --- compiled ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def _release_graphs():
    from modeling_xpress.compiled import release_compiled_decoders

    yield
    release_compiled_decoders()


@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
def test_compiled_tree_equals_eager_and_target_greedy(target, refiner, _release_graphs):
    """One graph of N + 1 tokens verifies every tree (smaller ones padded); the path moves in the static cache."""
    xpress = tiny_xpress(target, refiner=refiner)
    for i, length in enumerate((3, 8, 19)):  # shorter than a block, one block, longer (the drafter's prefill)
        ids = torch.randint(0, target.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(i))
        expected = target.generate(ids, max_new_tokens=29, do_sample=False)
        compiled = xpress.spec_generate(target, ids, max_new_tokens=29, tree_nodes=6, compile=True)
        eager = xpress.spec_generate(target, ids, max_new_tokens=29, tree_nodes=6)
        assert torch.equal(compiled.sequences, expected) and torch.equal(eager.sequences, expected)
        assert compiled.stats.acceptance_lengths == eager.stats.acceptance_lengths
        assert compiled.stats.draft_lengths == eager.stats.draft_lengths
        assert set(compiled.stats.verify_widths) == {7}


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 2}, {"top_p": 0.8}])
def test_compiled_tree_sampling_equals_eager_draw_for_draw(sampling_target, settings, _release_graphs):  # noqa: F811
    xpress = make_xpress(sampling_target, "xpress")
    generator = torch.Generator()
    runs = {}
    for compile in (True, False):
        generator.manual_seed(7)
        runs[compile] = [tuple(xpress.spec_generate(sampling_target, PROMPT, max_new_tokens=LENGTH, stop_token_ids=[],
                                                    generator=generator, tree_nodes=6, compile=compile,
                                                    **{"temperature": 1.0, **settings}).sequences[0].tolist())
                         for _ in range(25)]  # fmt: skip
    assert runs[True] == runs[False]
    assert len(set(runs[True])) > 3  # really sampling


# --- errors --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tree_nodes=0), "tree_nodes must be"),
        (dict(tree_nodes=2.5), "tree_nodes must be"),
        (dict(tree_nodes=4, assistant_confidence_threshold=0.5), "assistant_confidence_threshold"),
        (dict(tree_nodes=4, repetition_penalty=1.2), "prefix"),
        (dict(tree_nodes=4, no_repeat_ngram_size=2), "prefix"),
        (dict(tree_nodes=4, num_assistant_tokens="auto"), "depth limit"),
    ],
)
def test_tree_arguments_it_cannot_honour_are_named(kwargs, message):
    target = tiny_llama()
    xpress = tiny_xpress(target)
    with pytest.raises(ValueError, match=message):
        xpress.spec_generate(target, torch.tensor([[1, 2, 3]]), max_new_tokens=5, **kwargs)
