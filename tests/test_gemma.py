"""Gemma-3 targets on every route: sliding-window layers (five local to one global), a window shorter than the prompts,
tied embeddings scaled by √H inside the model, RoPE per layer type.

Every identity below would fail if a route ignored the window: `test_the_window_is_exercised` first shows that the
same weights attending to everything decode differently, on every prompt of these tests.
"""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, pipeline

from modeling_xpress import XPressConfig
from modeling_xpress.attention_masks import LayerKinds
from modeling_xpress.compiled import release_compiled_decoders
from modeling_xpress.trees import build_tree, verify_tree
from tests.builders import tiny_gemma3, tiny_tokenizer, tiny_xpress
from tests.test_sampling import (
    ALPHA, DRAWS, LENGTH, PROMPT, VOCAB, chi_square_pvalue, draw_with_spec_generate, exact_distribution,
)  # fmt: skip
from tests.test_tree_decoding import draw as draw_with_trees

WINDOW = 6  # shorter than the prompts and than a block (B = 8): a deep tree node sees fewer than all its ancestors
MAX_NEW = 29
PROMPT_LENGTHS = (3, 9, 19)  # shorter than the window, longer, and longer than two blocks


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3(sliding_window=WINDOW)


@pytest.fixture(scope="module")
def cases(gemma):
    """(prompt, the target's own greedy decode) per prompt length."""
    out = []
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = torch.randint(0, gemma.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(i))
        out.append((ids, gemma.generate(ids, max_new_tokens=MAX_NEW, do_sample=False)))
    return out


@pytest.fixture(scope="module", autouse=True)
def _release():
    yield
    release_compiled_decoders()


def test_the_window_is_exercised(gemma, cases):
    assert LayerKinds.of(gemma.config).windows == {"sliding_attention": WINDOW, "full_attention": None}
    wide = tiny_gemma3(sliding_window=4096)
    wide.load_state_dict(gemma.state_dict())  # the same weights, every layer seeing the whole context
    for ids, expected in cases[1:]:  # (the shortest prompt may stay inside the window for a while)
        assert not torch.equal(wide.generate(ids, max_new_tokens=MAX_NEW, do_sample=False), expected)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_tree_verification_gives_each_node_its_branch_logits(attention):
    """Each row of one tree forward over a dynamic cache (sliding layers keep W - 1 committed tokens) equals the
    target run on the committed tokens and that node's own path, for nodes deeper than the window too; "eager"
    attention adds its mask, so it gets an additive one."""
    target = tiny_gemma3(sliding_window=4, attn_implementation=attention)
    xpress = tiny_xpress(target)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(5))
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=ids[:, :-1], cache=cache)
    cache.activate_past_recording()
    hidden = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(6))
    base = torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(7)) * 3
    tree = build_tree(xpress, hidden, base, ids[:, -2:], 12, use_head=False)
    assert int(tree.depths.max()) >= 4  # deeper than the window
    out = verify_tree(target, cache, int(ids[0, -1]), tree)
    for node in range(len(tree)):
        path = tree.tokens[tree.path(node)]
        alone = target(torch.cat([ids[0], path]).view(1, -1)).logits[0, -1]
        torch.testing.assert_close(out.logits[0, node + 1], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("refiner", ["xpress", "none"])
def test_greedy_identity_eager_trees_and_generate(gemma, cases, refiner):
    xpress = tiny_xpress(gemma, refiner=refiner)
    for ids, expected in cases:
        assert torch.equal(xpress.spec_generate(gemma, ids, max_new_tokens=MAX_NEW).sequences, expected)
        for nodes in (1, 6):
            tree = xpress.spec_generate(gemma, ids, max_new_tokens=MAX_NEW, tree_nodes=nodes)
            assert torch.equal(tree.sequences, expected), nodes
        assert max(tree.stats.draft_lengths) == 6
        got = gemma.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=xpress)
        assert torch.equal(got, expected)


def test_greedy_identity_through_a_pipeline(gemma):
    tokenizer = tiny_tokenizer(gemma.config.vocab_size)
    text = " ".join(f"t{i}" for i in (5, 17, 3, 44, 9, 61, 2, 30, 11, 7, 50))  # longer than the window
    plain = pipeline("text-generation", model=gemma, tokenizer=tokenizer)
    expected = plain(text, max_new_tokens=MAX_NEW, do_sample=False)[0]["generated_text"]
    xpress = tiny_xpress(gemma)
    assisted = pipeline("text-generation", model=gemma, tokenizer=tokenizer, assistant_model=xpress)
    assert assisted(text, max_new_tokens=MAX_NEW, do_sample=False)[0]["generated_text"] == expected
    assert xpress.generation_stats.acceptance_lengths


def test_greedy_identity_through_custom_generate(gemma, cases, tmp_path):
    """A saved drafter's recipe (its trust_remote_code copy: the masks' file travels with it), linear and trees."""
    tiny_xpress(gemma).save_pretrained(tmp_path / "xpress")
    for ids, expected in cases:
        for extra in ({}, {"tree_nodes": 5}):
            got = gemma.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, custom_generate=str(tmp_path / "xpress"),
                                 trust_remote_code=True, **extra)  # fmt: skip
            assert torch.equal(got, expected), extra
    assert (tmp_path / "xpress" / "attention_masks.py").is_file()


@pytest.mark.parametrize("tree_nodes", [None, 6])
def test_compiled_equals_eager_and_target_greedy(gemma, cases, tree_nodes):
    """Static caches keep a slot per position in the sliding layers too: the window is a mask (the target's own for a
    linear block, ours for a tree); a rejected draft is rolled back by writing over it, a tree's path is moved."""
    xpress = tiny_xpress(gemma)
    for ids, expected in cases:
        compiled = xpress.spec_generate(gemma, ids, max_new_tokens=MAX_NEW, compile=True, tree_nodes=tree_nodes)
        eager = xpress.spec_generate(gemma, ids, max_new_tokens=MAX_NEW, tree_nodes=tree_nodes)
        assert torch.equal(compiled.sequences, expected) and torch.equal(eager.sequences, expected)
        assert compiled.stats.acceptance_lengths == eager.stats.acceptance_lengths
        assert compiled.stats.draft_lengths == eager.stats.draft_lengths
    assert all(type(layer).__name__ == "StaticLayer" for decoder in xpress._compiled_decoders.decoders.values()
               for layer in decoder.target_cache.layers)  # fmt: skip


def oracle_trees(monkeypatch, expected: list[int], decoy_margin: float = 0.04):
    """Every tree the loops build (eager and compiled) drafts from marginals with ~0.48 on the target's true next
    token and ~0.52 on a decoy (test_tree_decoding's oracle): a tree of 6 nodes accepts a path of two drafts per step,
    so accepted paths move through the sliding layers' caches (`keep_path`, `keep_path_static`)."""
    import math

    import modeling_xpress.compiled_loop as compiled_loop
    import modeling_xpress.decoding as decoding
    import modeling_xpress.trees as trees

    anchor = {}
    for cls in (decoding.EagerSteps, compiled_loop.CompiledSteps):
        def draft(self, sequence, *args, _real=cls.draft, **kwargs):
            anchor["index"] = sequence.shape[1] - 1
            return _real(self, sequence, *args, **kwargs)

        monkeypatch.setattr(cls, "draft", draft)

    def build(xpress, hidden, base, last, budget, **kwargs):
        base = torch.full_like(base, -1e4)
        for k in range(base.shape[1]):
            position = anchor["index"] + 1 + k
            truth = expected[position] if position < len(expected) else 0
            base[0, k, truth] = math.log(0.5 - decoy_margin / 2)
            base[0, k, (truth + 1) % base.shape[-1]] = math.log(0.5 + decoy_margin / 2)
        return trees.build_tree(xpress, hidden, base, last, budget, **kwargs)

    monkeypatch.setattr(decoding, "build_tree", build)
    monkeypatch.setattr(compiled_loop, "build_tree", build)


@pytest.mark.parametrize("compile", [False, True])
def test_accepted_tree_paths_through_the_window(gemma, monkeypatch, compile):
    ids = torch.randint(0, gemma.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(8))
    expected = gemma.generate(ids, max_new_tokens=40, do_sample=False)
    oracle_trees(monkeypatch, expected[0].tolist())
    out = tiny_xpress(gemma, refiner="none").spec_generate(gemma, ids, max_new_tokens=40, tree_nodes=6, compile=compile)
    assert torch.equal(out.sequences, expected)
    assert set(out.stats.acceptance_lengths[:-1]) == {3}  # two drafts and the bonus, every full step


# --- lossless sampling on a windowed target ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_gemma():
    """A 3-token Gemma-3 whose window (3) is shorter than the prompt and its continuation (4 + 5 tokens), its lm_head
    scaled to a position-dependent target that is neither near-uniform nor near-deterministic (49 of the 243
    continuations expect ≥ 5 of the draws), untied so the embeddings stay as they are."""
    model = tiny_gemma3(vocab_size=VOCAB, seed=11, sliding_window=3, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    return model


def exact_gemma_distribution(target) -> dict[tuple[int, ...], float]:
    return exact_distribution(target, LogitsProcessorList())


def test_the_sampling_target_depends_on_the_window(sampling_gemma):
    wide = tiny_gemma3(vocab_size=VOCAB, seed=11, sliding_window=4096, tie_word_embeddings=False)
    wide.load_state_dict(sampling_gemma.state_dict())
    exact, wide_exact = exact_gemma_distribution(sampling_gemma), exact_gemma_distribution(wide)
    assert max(abs(exact[key] - wide_exact[key]) for key in exact) > 0.1
    assert sum(p * DRAWS >= 5 for p in exact.values()) > 20  # a spread the χ² tests can see


def test_spec_generate_sampling_is_lossless(sampling_gemma):
    xpress = tiny_xpress(sampling_gemma, block_size=4, jacobi_max_iters=2, seed=5)
    samples = draw_with_spec_generate(xpress, sampling_gemma, temperature=1.0, seed=0)
    assert len(samples) == DRAWS
    assert chi_square_pvalue(samples, exact_gemma_distribution(sampling_gemma)) > ALPHA


def test_tree_sampling_is_lossless(sampling_gemma):
    xpress = tiny_xpress(sampling_gemma, block_size=4, jacobi_max_iters=2, seed=5)
    samples = draw_with_trees(xpress, sampling_gemma, nodes=6, seed=0, temperature=1.0)
    assert chi_square_pvalue(samples, exact_gemma_distribution(sampling_gemma)) > ALPHA
    assert max(xpress.generation_stats.draft_lengths) == 6


def test_compiled_sampling_equals_eager_draw_for_draw(sampling_gemma):
    xpress = tiny_xpress(sampling_gemma, block_size=4, jacobi_max_iters=2, seed=5)
    generator, runs = torch.Generator(), {}
    for compile in (True, False):
        generator.manual_seed(7)
        runs[compile] = [tuple(xpress.spec_generate(sampling_gemma, PROMPT, max_new_tokens=LENGTH, stop_token_ids=[],
                                                    generator=generator, temperature=1.0, tree_nodes=4,
                                                    compile=compile).sequences[0].tolist())
                         for _ in range(25)]  # fmt: skip
    assert runs[True] == runs[False] and len(set(runs[True])) > 3


# --- the drafter's side of a Gemma-3 target --------------------------------------------------------------------------


def test_a_drafter_takes_the_global_layers_rope():
    """Gemma-3 gives each layer type its RoPE; the drafter's layers attend to the whole context, so they get the
    full-attention layers' (here a base no default shares), and the config carries no per-type keys (kept, they made
    transformers warn "Unrecognized keys" and fall back to its default base)."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 123456.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    target = tiny_gemma3(rope_parameters=rope)
    config = XPressConfig.from_target_config(target.config, num_hidden_layers=2, block_size=8)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 123456.0}
    xpress = tiny_xpress(target)
    head_dim = xpress.config.head_dim
    expected = 1.0 / 123456.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(xpress.rotary_emb.inv_freq, expected)


def test_the_drafter_embeds_blocks_with_the_scaled_embedding(gemma):
    """Gemma scales its embeddings by √H inside the embedding module: the drafter's block inputs are the target's own."""
    embed = gemma.get_input_embeddings()
    xpress = tiny_xpress(gemma, mask_token_id=4)
    blocks = xpress.embed_blocks(torch.tensor([[7]]), embed)  # (1, B, H)
    scale = gemma.config.hidden_size**0.5
    torch.testing.assert_close(blocks[0, 0], embed.weight[7] * scale)
    torch.testing.assert_close(blocks[0, 1], embed.weight[4] * scale)
    assert scale > 2  # (so the test tells the scaled module from its table)


def test_layer_kinds_the_masks_cannot_express_are_refused():
    from transformers import Llama4TextConfig

    chunked = Llama4TextConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=96)  # fmt: skip
    with pytest.raises(ValueError, match=r"chunked_attention.*compile=False"):
        LayerKinds.of(chunked, use="spec_generate(compile=True)", instead="compile=False")
