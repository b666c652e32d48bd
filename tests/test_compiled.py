"""spec_generate(compile=True): static caches, fixed shapes, torch.compile — and the same results as the eager loop.

On CPU the graphs compile with inductor (tiny models, one thread). Compiled state is kept per (target, drafter,
length bucket, decoding settings), so the models are module-scoped and every test of one pair reuses its graphs.
"""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

import modeling_xpress.compiled as compiled
import modeling_xpress.cpu_layouts as layouts
from modeling_xpress.policy import linear_weights
from modeling_xpress.compiled import (
    CompiledDecoder, CompiledGenerationStats, compiled_decoder, jacobi_fixed_iterations, release_compiled_decoders,
)  # fmt: skip
from modeling_xpress.processors import sampling_processors
from modeling_xpress.refinement import decode, gumbel_noise, jacobi_refine
from tests.builders import perfect_head, permutation_target, tiny_llama, tiny_qwen3, tiny_xpress
from tests.test_sampling import DRAWS, LENGTH, PROMPT, VOCAB, chi_square_pvalue, exact_distribution

REFINERS = ["none", "markov", "xpress"]
TARGETS = {"llama": tiny_llama, "qwen3": tiny_qwen3}
PROMPT_LENGTHS = [3, 8, 19]  # shorter than a block (B = 8), one block, longer (the drafter's uncompiled prefill)


@pytest.fixture(scope="module", autouse=True)
def _release():
    yield
    release_compiled_decoders()


@pytest.fixture(scope="module")
def targets():
    return {name: build() for name, build in TARGETS.items()}


@pytest.fixture(scope="module")
def drafters(targets):
    """One drafter per (target, head), built on first use and shared by every test (and so are its graphs)."""
    built = {}

    def get(target_name: str, refiner: str):
        if (target_name, refiner) not in built:
            built[target_name, refiner] = tiny_xpress(targets[target_name], refiner=refiner)
        return targets[target_name], built[target_name, refiner]

    return get


def prompt(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def assert_same_run(compiled_out, eager_out):
    """Compiled and eager loops: same tokens, same verification steps, same drafts and Jacobi iterations."""
    assert torch.equal(compiled_out.sequences, eager_out.sequences)
    for name in ("acceptance_lengths", "draft_lengths", "jacobi_iterations", "new_tokens"):
        assert getattr(compiled_out.stats, name) == getattr(eager_out.stats, name), name


# --- greedy identity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target_name", list(TARGETS))
@pytest.mark.parametrize("refiner", REFINERS)
def test_compiled_greedy_equals_target_greedy_and_eager(drafters, target_name, refiner):
    target, xpress = drafters(target_name, refiner)
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = prompt(target.config.vocab_size, length, seed=i)
        expected = target.generate(ids, max_new_tokens=29, do_sample=False)
        out = xpress.spec_generate(target, ids, max_new_tokens=29, compile=True)
        assert torch.equal(out.sequences, expected)
        assert isinstance(out.stats, CompiledGenerationStats) and out.stats is xpress.generation_stats
        assert out.stats.acceptance_lengths and out.stats.time_drafter > 0 and out.stats.time_verify > 0
        assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=29))


def corrupted_perfect_pair(refiner: str, wrong_tokens: list[int], block: int = 8):
    """(target, perm, xpress) on a permutation target whose head is right after every token except `wrong_tokens`:
    blocks are accepted up to the first draft after a wrong token, so τ takes many values (whole blocks included)."""
    target, perm = permutation_target(vocab_size=32)
    xpress = tiny_xpress(target, refiner=refiner, refiner_rank=32, randomize_head=False, block_size=block,
                         jacobi_max_iters=block - 1)  # fmt: skip
    perfect_head(xpress, perm)
    with torch.no_grad():
        readout = xpress.refiner.readout.weight  # (V, r): column x votes for the token after x
        for x in wrong_tokens:
            right = int(perm[x])
            readout[:, x] = 0.0
            readout[(right + 1) % 32, x] = 100.0
    return target, perm, xpress


@pytest.fixture(scope="module", params=["markov", "xpress"])
def constructed(request):
    return corrupted_perfect_pair(request.param, wrong_tokens=[3, 7, 11, 19, 23, 29])


def test_constructed_pair_accepts_every_block_length(constructed):
    """Not a no-op: the constructed drafter's τ spans short and whole blocks, and compiled == eager step for step."""
    target, _, xpress = constructed
    ids = torch.tensor([[5, 9]])
    out = xpress.spec_generate(target, ids, max_new_tokens=90, stop_token_ids=[], compile=True)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=90, do_sample=False))
    taus = set(out.stats.acceptance_lengths)
    assert xpress.config.block_size in taus and len(taus) >= 4, taus
    assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=90, stop_token_ids=[]))


@pytest.mark.parametrize("max_new_tokens", [1, 2, 9, 10, 12, 23, 41])
def test_last_block_cut_by_max_new_tokens(constructed, max_new_tokens):
    """The token budget cuts the last draft (down to a step where the target alone emits the last token)."""
    target, _, xpress = constructed
    ids = torch.tensor([[1, 2, 4]])
    out = xpress.spec_generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=[], compile=True)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False))
    assert out.stats.new_tokens == max_new_tokens
    assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=max_new_tokens, stop_token_ids=[]))


def test_eos_mid_block(constructed):
    """A stop token inside an accepted block ends generation right after it, as in the target's own decode."""
    target, _, xpress = constructed
    ids = torch.tensor([[5, 9]])
    full = xpress.spec_generate(target, ids, max_new_tokens=60, stop_token_ids=[], compile=True)
    new = full.sequences[0, 2:].tolist()
    # a token first emitted inside a verification step that accepted several (not the step's last token)
    ends, total = set(), 1
    for tau in full.stats.acceptance_lengths:
        total += tau
        ends.add(total - 1)
    index = next(i for i, t in enumerate(new) if i > 1 and i not in ends and t not in new[:i])
    stop = new[index]
    out = xpress.spec_generate(target, ids, max_new_tokens=60, stop_token_ids=stop, compile=True)
    assert out.sequences[0, 2:].tolist() == new[: index + 1]
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=60, do_sample=False, eos_token_id=stop))
    assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=60, stop_token_ids=stop))


def test_verify_width_buckets():
    assert compiled.verify_widths(16) == [2, 4, 8, 16] and compiled.verify_widths(8) == [2, 4, 8]
    assert compiled.verify_widths(6) == [2, 4, 6] and compiled.verify_widths(2) == [2]
    assert [compiled.verify_width(16, t) for t in (1, 2, 3, 4, 5, 9, 16)] == [2, 2, 4, 4, 8, 16, 16]
    assert [compiled.verify_width(6, t) for t in (1, 3, 5, 6)] == [2, 4, 6, 6]


@pytest.mark.parametrize("cap", [1, 2, 3, 7])
def test_draft_length_cap_is_applied_as_in_eager(constructed, cap):
    """A cap on drafts per block verifies the anchor and the cap's drafts, one graph for the whole call (the last,
    shorter blocks included): same tokens, τ and steps as the eager loop, which verifies exactly the cap."""
    target, _, xpress = constructed
    ids = torch.tensor([[5, 9]])
    out = xpress.spec_generate(target, ids, max_new_tokens=40, stop_token_ids=[], compile=True,
                               num_assistant_tokens=cap)  # fmt: skip
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=40, do_sample=False))
    assert max(out.stats.draft_lengths) == cap and max(out.stats.acceptance_lengths) == cap + 1
    assert set(out.stats.verify_widths) == {cap + 1}
    eager = xpress.spec_generate(target, ids, max_new_tokens=40, stop_token_ids=[], num_assistant_tokens=cap)
    assert_same_run(out, eager)
    uncapped = xpress.spec_generate(target, ids, max_new_tokens=40, stop_token_ids=[], compile=True)
    assert set(uncapped.stats.verify_widths) == {xpress.config.block_size}


@pytest.mark.parametrize("refiner", ["markov", "xpress"])
def test_draft_confidence_threshold_is_applied_as_in_eager(drafters, refiner):
    target, xpress = drafters("llama", refiner)
    ids = prompt(96, 7, seed=5)
    threshold = {"markov": 0.05, "xpress": 0.5}[refiner]  # cuts that leave blocks of several lengths (random drafters)
    out = xpress.spec_generate(target, ids, max_new_tokens=29, compile=True, assistant_confidence_threshold=threshold)
    assert torch.equal(out.sequences, target.generate(ids, max_new_tokens=29, do_sample=False))
    assert min(out.stats.draft_lengths) < xpress.config.block_size - 1  # the threshold cuts
    # each block goes through the smallest width that holds its drafts, and several widths are used
    steps = out.stats.verify_widths[: len(out.stats.draft_lengths)]  # a last step without a draft comes after them
    assert steps == [compiled.verify_width(xpress.config.block_size, m + 1) for m in out.stats.draft_lengths]
    capped = xpress.spec_generate(target, ids, max_new_tokens=29, compile=True,
                                  assistant_confidence_threshold=threshold, num_assistant_tokens=5)  # fmt: skip
    assert set(capped.stats.verify_widths) <= {2, 4, 6}
    assert len(set(out.stats.verify_widths)) > 1
    assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=29, assistant_confidence_threshold=threshold))
    # every width was compiled before the first step: a call that uses other widths compiles nothing
    again = xpress.spec_generate(target, prompt(96, 7, seed=6), max_new_tokens=29, compile=True,
                                 assistant_confidence_threshold=0.3)  # fmt: skip
    assert again.stats.time_compile == 0.0


# --- sampling ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sampling_pair():
    target = tiny_llama(vocab_size=VOCAB, seed=11)
    with torch.no_grad():
        target.lm_head.weight.mul_(60.0)  # peaked and position-dependent, as in test_sampling
    xpress = tiny_xpress(target, refiner="xpress", block_size=4, jacobi_max_iters=2, seed=5)
    return target, xpress


def draw(xpress, target, compile: bool, seed: int, draws: int = DRAWS, **kwargs) -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        seq = xpress.spec_generate(target, PROMPT, max_new_tokens=LENGTH, stop_token_ids=[], generator=generator,
                                   compile=compile, **kwargs).sequences  # fmt: skip
        out.append(tuple(seq[0, PROMPT.shape[1] :].tolist()))
    return out


def test_compiled_sampling_is_lossless(sampling_pair):
    """χ² goodness of fit at T=1 against the exact distribution of every continuation (see test_sampling)."""
    target, xpress = sampling_pair
    samples = draw(xpress, target, compile=True, seed=0, temperature=1.0)
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) > 1e-3


def test_the_compiled_test_detects_a_wrong_q(sampling_pair, monkeypatch):
    """Power: a compiled refiner that reports the seed iteration's logits as q is rejected by the same test."""
    target, xpress = sampling_pair
    honest = jacobi_fixed_iterations

    def wrong_q(refiner, folded, hidden, base_logits, anchor_ids, *, logits_transform=None, noise=None, **kwargs):
        result = honest(refiner, folded, hidden, base_logits, anchor_ids, logits_transform=logits_transform,
                        noise=noise, **kwargs)  # fmt: skip
        result.logits, _ = decode(base_logits, logits_transform, noise)
        return result

    monkeypatch.setattr(compiled, "jacobi_fixed_iterations", wrong_q)
    release_compiled_decoders(xpress)  # a fresh decoder traces `wrong_q`
    samples = draw(xpress, target, compile=True, seed=2, temperature=1.0)
    assert chi_square_pvalue(samples, exact_distribution(target, LogitsProcessorList())) < 1e-3


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 2},
                                      {"temperature": 1.0, "assistant_confidence_threshold": 0.6},
                                      {"temperature": 1.0, "num_assistant_tokens": 2}])
def test_compiled_sampling_equals_eager_draw_for_draw(sampling_pair, settings):
    """Same generator, same random draws in the same order: the same samples as the eager loop."""
    target, xpress = sampling_pair
    compiled_samples = draw(xpress, target, compile=True, seed=7, draws=25, **settings)
    assert compiled_samples == draw(xpress, target, compile=False, seed=7, draws=25, **settings)
    assert len(set(compiled_samples)) > 3  # really sampling


# --- compiled state --------------------------------------------------------------------------------------------


def test_compiled_state_is_kept_across_calls():
    """Only the first call with new shapes compiles: later calls of the same (target, drafter, length bucket) reuse
    the decoder, and dynamo reuses the graphs for other models of the same shapes (their weights are graph inputs)."""
    target = tiny_llama(vocab_size=40, num_hidden_layers=2, seed=3)  # shapes no other test compiles
    xpress = tiny_xpress(target, refiner="markov", block_size=4, num_hidden_layers=1, seed=4)
    first = xpress.spec_generate(target, prompt(40, 5), max_new_tokens=12, compile=True)
    second = xpress.spec_generate(target, prompt(40, 11, seed=1), max_new_tokens=20, compile=True)
    assert first.stats.time_compile > 0 and first.stats.as_dict()["time_compile"] == first.stats.time_compile
    assert second.stats.time_compile == 0.0
    decoder = compiled_decoder(xpress, target, compiled.LENGTH_BUCKET, 0.0, None, None)
    assert compiled_decoder(xpress, target, compiled.LENGTH_BUCKET, 0.0, 50, 0.9) is decoder  # greedy ignores top-k/p
    assert compiled_decoder(xpress, target, 2 * compiled.LENGTH_BUCKET, 0.0, None, None) is not decoder
    other_target, other = tiny_llama(vocab_size=40, num_hidden_layers=2, seed=5), tiny_xpress(
        target, refiner="markov", block_size=4, num_hidden_layers=1, seed=6
    )
    ids = prompt(40, 7, seed=2)
    out = other.spec_generate(other_target, ids, max_new_tokens=15, compile=True)
    assert out.stats.time_compile == 0.0
    assert torch.equal(out.sequences, other_target.generate(ids, max_new_tokens=15, do_sample=False))


# --- static caches without crop (uncompiled: the reasoning, not the compiler) -------------------------------------


def fill_with_garbage(cache):
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys.normal_(std=10.0)
            layer.values.normal_(std=10.0)


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_target_static_cache_needs_no_crop(drafters, target_name):
    """Verify a block, "reject" all but its first drafts by moving on: the next block's logits and features equal
    a fresh forward over the committed tokens, although the cache still holds the rejected drafts and, beyond them,
    garbage (stale slots are never cleared; the causal mask by position hides them)."""
    target, xpress = drafters(target_name, "none")
    decoder = CompiledDecoder(xpress, target, 64, None)
    ids = prompt(96, 6, seed=3)
    decoder.prefill(ids)
    fill_with_garbage(decoder.target_cache)  # the prompt's slots too: prefill them again
    decoder.prefill(ids)
    first = torch.randint(0, 96, (1, 8))
    decoder._verify(first, torch.tensor(6), None)  # writes slots 6..13
    second = torch.randint(0, 96, (1, 8))
    logits, features = decoder._verify(second, torch.tensor(9), None)  # keeps first[:3]; slots 14.. hold garbage
    committed = torch.cat([ids, first[:, :3], second], dim=1)
    reference = target(committed, output_hidden_states=True)
    assert torch.allclose(logits, reference.logits[0, 9:].float(), atol=1e-4)
    expected = torch.cat([reference.hidden_states[i + 1][:, 9:] for i in xpress.config.target_layer_ids], dim=-1)
    assert torch.allclose(features, expected, atol=1e-4)
    keys = decoder.target_cache.layers[0].keys[0, :, 17:]  # after the second block: garbage, never cleared
    assert keys.abs().mean() > 1.0


@pytest.mark.parametrize("windows", [{}, dict(attention_windows=[None, 5]), dict(attention_windows=[5, 9], window_anchored=True),
                                     dict(attention_windows=[9, None], window_causal=False)], ids=str)  # fmt: skip
def test_drafter_static_cache_needs_no_crop(drafters, windows):
    """The drafter on a static cache with padded context: the block's hidden states equal the eager drafter's on a
    dynamic cache cropped after every step, with rejected blocks, padding rows and garbage left in the slots; also
    with sliding-window drafter layers, whose windows the static slots' positions must measure right."""
    target, xpress = drafters("llama", "xpress")
    if windows:
        xpress = tiny_xpress(target, refiner="xpress", **windows)
    decoder = CompiledDecoder(xpress, target, 64, None)
    fill_with_garbage(decoder.draft_cache)
    features = torch.randn(1, 30, xpress.fc.in_features)
    embed = target.get_input_embeddings()
    reference_cache = DynamicCache(config=xpress.config)
    context_len = 0
    for count, anchor in ((11, 4), (3, 17), (8, 2), (1, 40)):  # the prompt (11 > B: unpadded), then 1..B rows
        context = features[:, context_len : context_len + count]
        anchor_ids = torch.tensor([[anchor]])
        padded = context if count > 8 else compiled._pad_rows(context, 8)
        hidden = decoder._draft(anchor_ids, padded, torch.tensor(context_len), torch.tensor(count))
        position_ids = torch.arange(context_len, context_len + count + 8).unsqueeze(0)
        expected = xpress(noise_embeds=xpress.embed_blocks(anchor_ids, embed), context_hidden_states=context,
                          position_ids=position_ids, cache=reference_cache).last_hidden_state  # fmt: skip
        reference_cache.crop(-8)
        assert torch.allclose(hidden, expected, atol=1e-5), count
        context_len += count


# --- the fixed-iteration Jacobi graph against the reference ------------------------------------------------------


@pytest.mark.parametrize("sample", [False, True])
def test_fixed_iterations_equal_jacobi_refine(drafters, sample):
    """Tokens, logits and iteration counts of the fixed-K form equal `jacobi_refine` with and without early exit."""
    _, xpress = drafters("qwen3", "xpress")
    refiner = xpress.refiner
    torch.manual_seed(0)
    hidden, base = torch.randn(3, 8, 64), torch.randn(3, 7, 96) * 3  # hidden: every slot, the anchor's first
    anchors = torch.tensor([[4, 1], [3, 50], [60, 95]])  # the token before the anchor, the anchor
    noise = gumbel_noise(base.shape, generator=torch.Generator().manual_seed(1)) if sample else None
    processors = sampling_processors(0.8, 20, None)
    transform = (lambda x: processors(None, x.reshape(-1, 96)).reshape(x.shape)) if sample else None
    iteration_counts = set()
    for k in (1, 2, 4, 7, 9):
        fixed = jacobi_fixed_iterations(refiner, refiner.folded(), hidden, base, anchors, iterations=k,
                                        logits_transform=transform, noise=noise)  # fmt: skip
        for early_exit in (True, False):
            ref = jacobi_refine(refiner, hidden, base, anchors, max_iters=k, early_exit=early_exit,
                                logits_transform=transform, noise=noise)  # fmt: skip
            assert torch.equal(fixed.tokens, ref.tokens) and torch.equal(fixed.iterations, ref.iterations)
            scale = ref.logits.abs().max().item()  # fp32 rounding relative to logits in the thousands
            torch.testing.assert_close(fixed.logits, ref.logits, rtol=1e-5, atol=1e-6 * scale)
        iteration_counts.update(fixed.iterations.tolist())
        for m in (1, 4):  # the first m drafts only (a draft cap): the eager form's decode of them
            part = jacobi_fixed_iterations(refiner, refiner.folded(), hidden, base[:, :m], anchors, iterations=k,
                                           logits_transform=transform, noise=None if noise is None else noise[:, :m])
            ref = jacobi_refine(refiner, hidden, base[:, :m], anchors, max_iters=k, logits_transform=transform,
                                noise=None if noise is None else noise[:, :m])  # fmt: skip
            assert torch.equal(part.tokens, ref.tokens) and torch.equal(part.iterations, ref.iterations)
            assert torch.equal(part.tokens, fixed.tokens[:, :m])
            torch.testing.assert_close(part.logits, ref.logits, rtol=1e-5, atol=1e-6 * ref.logits.abs().max().item())
    assert len(iteration_counts) > 2  # blocks settle after different numbers of iterations: early exit matters


# --- what compile=True refuses ---------------------------------------------------------------------------------


def test_unsupported_options_raise(drafters):
    target, xpress = drafters("llama", "xpress")
    ids = prompt(96, 4)
    for kwargs, name in (({"repetition_penalty": 1.3}, "repetition_penalty"),
                         ({"no_repeat_ngram_size": 2}, "no_repeat_ngram_size"),
                         ({"logits_processor": sampling_processors(0.5, None, None)}, "logits_processor")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"compile=True\) does not support {name}"):
            xpress.spec_generate(target, ids, max_new_tokens=4, compile=True, **kwargs)
    with pytest.raises(ValueError, match="compile must be True or False"):
        xpress.spec_generate(target, ids, max_new_tokens=4, compile="yes")


def test_a_target_with_only_sliding_layers_compiles_exactly():
    """Qwen3 with every layer sliding (a window of 4, shorter than the prompt): one slot per position in the static
    cache, the target's own window masks."""
    target = tiny_qwen3(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                        layer_types=["sliding_attention"] * 5)  # fmt: skip
    xpress = tiny_xpress(target)
    ids = prompt(96, 11)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=20, compile=True).sequences, expected)


def test_generate_with_a_static_cache_points_to_compile(drafters):
    target, xpress = drafters("llama", "none")
    with pytest.raises(ValueError, match=r"spec_generate\(target, input_ids, compile=True\)"):
        target.generate(prompt(96, 4), max_new_tokens=5, assistant_model=xpress, cache_implementation="static")


# --- the GPU check script, on CPU with small shapes ------------------------------------------------------------


@pytest.mark.slow  # about a minute and a half on one CPU thread: it compiles plain, xPress and four refiner graphs
def test_gpu_check_runs_tiny(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "examples/gpu_check.py", "--tiny", "--threads", "1", "--no-profile", "--out", str(out)]
    subprocess.run(command, check=True, env=env, cwd=root)
    report = json.loads(out.read_text())
    assert report["plain"]["eager_tokens_per_s"] > 0 and report["plain"]["compiled_tokens_per_s"] > 0
    steps = report["xpress"]
    assert steps["spec_generate_compiled_first_call"]["compile_s"] > 0
    assert steps["spec_generate_compiled"]["compile_s"] == 0.0  # compiled once, then reused
    for name in ("assisted_generate_eager", "spec_generate_eager", "spec_generate_compiled"):
        assert steps[name]["step_ms"] > 0 and steps[name]["verify_ms"] > 0
    assert set(report["refiner_latency"]) == {"K=1", "K=2", "K=4", "K=8"}
    assert set(report["trees"]) == {"tree_4", "tree_8"}
    for row in report["trees"].values():
        assert row["step_ms"] > 0 and row["verify_ms"] > 0 and "first_difference" in row


@pytest.mark.parametrize("refiner", REFINERS)
def test_compiled_with_a_draft_vocabulary_equals_eager_and_target_greedy(targets, refiner):
    """A drafter reading out a draft vocabulary (its rows of the lm_head are cached eagerly and fed to the graph):
    compiled == eager == the target's greedy output, with a subset that includes the target's likely tokens and one
    that leaves most of them out."""
    from modeling_xpress.training import with_draft_vocabulary

    target = targets["llama"]
    vocab = target.config.vocab_size
    full = tiny_xpress(target, refiner=refiner)
    for ids_of_subset in (torch.arange(0, vocab, 2), torch.arange(vocab // 2)):
        xpress = with_draft_vocabulary(full, ids_of_subset).eval()
        ids = prompt(vocab, 8, seed=3)
        expected = target.generate(ids, max_new_tokens=25, do_sample=False)
        out = xpress.spec_generate(target, ids, max_new_tokens=25, compile=True)
        assert torch.equal(out.sequences, expected)
        assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=25))


# --- the F.linear layout of the graphs (`linear_layout`) ----------------------------------------------------------


def test_weight_major_linear_computes_f_linear():
    """The mode computes F.linear as (W @ xᵀ)ᵀ (+ b) for 2-D and 3-D inputs, positional or keyword bias, and leaves
    larger inputs and other functions alone."""
    torch.manual_seed(0)
    weight, bias = torch.randn(50, 12), torch.randn(50)
    mode = layouts.WeightMajorLinear(max_rows=6)
    for x in (torch.randn(3, 12), torch.randn(1, 5, 12), torch.randn(2, 3, 12)):
        for args, kwargs in (((x, weight), {}), ((x, weight, bias), {}), ((x, weight), {"bias": bias})):
            expected = torch.nn.functional.linear(*args, **kwargs)
            with mode:
                out = torch.nn.functional.linear(*args, **kwargs)
            assert out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)
    x = torch.randn(7, 12)  # more rows than max_rows: F.linear itself, bit for bit
    with mode:
        out = torch.nn.functional.linear(x, weight, bias)
    assert torch.equal(out, torch.nn.functional.linear(x, weight, bias))


def test_weight_major_linear_is_used_for_small_inputs_only(monkeypatch):
    """The product goes through torch.mm with the weight as the left operand, for small inputs only."""
    seen, mm = [], torch.mm

    def counting_mm(a, b):
        seen.append(tuple(a.shape))
        return mm(a, b)

    monkeypatch.setattr(torch, "mm", counting_mm)
    weight = torch.randn(50, 12)
    with layouts.WeightMajorLinear(max_rows=6):
        torch.nn.functional.linear(torch.randn(7, 12), weight)
        assert seen == []
        torch.nn.functional.linear(torch.randn(1, 4, 12), weight)
    assert seen == [(50, 12)]


def every_graph(block: int) -> set:
    return {*(("verify", w) for w in range(1, block + 1)), ("drafter", block), *(("head", m) for m in range(1, block))}


def prepare_every_graph(decoder) -> None:
    for graph, rows in every_graph(decoder.block):
        decoder.prepare(graph, rows)


def test_linear_layout_choice(drafters, monkeypatch):
    """input_major: no graph weight-major; weight_major: every graph; auto: the graphs whose timing says it pays
    (here stubbed to verification widths 3 and 5), each decided when it is prepared, and only then: building the
    decoder decides the drafter alone (the one graph every call runs)."""
    target, xpress = drafters("llama", "xpress")
    block = xpress.config.block_size
    for layout, expected in (("input_major", frozenset()), ("weight_major", every_graph(block))):
        decoder = CompiledDecoder(xpress, target, 64, None, layout)
        prepare_every_graph(decoder)
        assert decoder.weight_major == expected
    asked = []

    def stub(weights, rows, repeats=5):
        asked.append((len(weights), rows))
        return len(weights) > 1 and rows in (3, 5)

    monkeypatch.setattr(layouts, "weight_major_pays", stub)
    monkeypatch.setattr(layouts, "packed_pays", lambda weights, rows, repeats=5: False)
    decoder = CompiledDecoder(xpress, target, 64, None, "auto")
    n_target, n_drafter = len(linear_weights(target)), len(linear_weights(xpress))
    assert asked == [(n_drafter, block)] and set(decoder.layouts) == {("drafter", block)}
    decoder.prepare("verify", 3)
    decoder.prepare("verify", 3)  # decided once
    assert asked[1:] == [(n_target, 3)] and decoder.weight_major == {("verify", 3)}
    prepare_every_graph(decoder)
    assert decoder.weight_major == {("verify", 3), ("verify", 5)}
    assert (1, block - 1) in asked  # the readout's one matrix
    assert len(asked) == len(every_graph(block))


def test_auto_prefers_packed_where_it_pays(drafters, monkeypatch):
    """auto: packed where its timing says so (here the verification at 4 tokens), weight-major where that pays and
    packing does not, input-major elsewhere; a packed graph's weights are packed when it is prepared, again after a
    release, and no other graph's."""
    target, xpress = drafters("llama", "none")
    monkeypatch.setattr(layouts, "weight_major_pays", lambda weights, rows, repeats=5: len(weights) > 1 and rows < 6)
    monkeypatch.setattr(layouts, "packed_pays", lambda weights, rows, repeats=5: len(weights) > 1 and rows == 4)
    layouts.release_packed_weights()
    decoder = CompiledDecoder(xpress, target, 64, None, "auto")
    assert not layouts._PACKS  # the drafter is not a packed graph here
    decoder.prepare("verify", 3)  # weight-major: nothing packed
    assert not layouts._PACKS
    decoder.prepare("verify", 4)
    target_packs = {(w.data_ptr(), 4) for w in linear_weights(target)}
    assert target_packs == set(layouts._PACKS)
    layouts.release_packed_weights()
    decoder.prepare("verify", 4)  # released by hand: packed again at the next preparation
    assert target_packs == set(layouts._PACKS)
    prepare_every_graph(decoder)
    assert decoder.packed == {("verify", 4)}
    assert decoder.weight_major == {("verify", w) for w in (1, 2, 3, 5)}
    layouts.release_packed_weights()


def test_weight_major_pays_times_real_weights():
    """The timing itself runs on any weights and returns a decision; each (shape, dtype, rows, threads) is timed once."""
    weights = [torch.randn(64, 16), torch.randn(64, 16), torch.randn(16, 64)]
    layouts._LAYOUT_TIMINGS.clear()
    assert layouts.weight_major_pays(weights, rows=3, repeats=3) in (True, False)
    assert len(layouts._LAYOUT_TIMINGS) == 2  # two distinct shapes


@pytest.mark.parametrize("target_name", list(TARGETS))
def test_weight_major_graphs_equal_target_greedy_and_eager(drafters, target_name):
    """Every graph weight-major (the layout "auto" picks on CPUs where it pays): the target's greedy output, and the
    eager loop's run, with the short, one-block and longer prompts; the stats name the weight-major graphs."""
    target, xpress = drafters(target_name, "xpress")
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = prompt(target.config.vocab_size, length, seed=10 + i)
        expected = target.generate(ids, max_new_tokens=21, do_sample=False)
        out = xpress.spec_generate(target, ids, max_new_tokens=21, compile=True, linear_layout="weight_major")
        assert torch.equal(out.sequences, expected)
        assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=21))
        assert "verify:8" in out.stats.weight_major_graphs and "drafter:8" in out.stats.as_dict()["weight_major_graphs"]


def test_weight_major_sampling_equals_eager_draw_for_draw(sampling_pair):
    target, xpress = sampling_pair
    samples = draw(xpress, target, compile=True, seed=9, draws=25, temperature=1.0, linear_layout="weight_major")
    assert samples == draw(xpress, target, compile=False, seed=9, draws=25, temperature=1.0)


needs_packing = pytest.mark.skipif(not layouts.mkl_packing_available(), reason="no MKL packed GEMM in this build")


@needs_packing
def test_packed_linear_computes_f_linear():
    """The mode computes F.linear with the weight's MKL pack for 2-D and 3-D inputs (bias positional or keyword); an
    unpacked weight, a larger input and other functions are left to F.linear bit for bit; a weight changed in place
    is repacked at its next use, so the product follows it."""
    torch.manual_seed(0)
    weight, bias, other = torch.randn(50, 12), torch.randn(50), torch.randn(50, 12)
    layouts.release_packed_weights()
    for rows in (1, 3, 4, 5):
        layouts.pack_weights([weight], rows)
    mode = layouts.PackedLinear(max_rows=6)
    for x in (torch.randn(3, 12), torch.randn(1, 5, 12), torch.randn(4, 1, 12), torch.randn(1, 12)):
        for args, kwargs in (((x, weight), {}), ((x, weight, bias), {}), ((x, weight), {"bias": bias})):
            expected = torch.nn.functional.linear(*args, **kwargs)
            with mode:
                out = torch.nn.functional.linear(*args, **kwargs)
            assert out.shape == expected.shape and torch.allclose(out, expected, atol=1e-5)
    x = torch.randn(4, 12)
    with mode:
        packed = torch.nn.functional.linear(x, weight)
        unpacked = torch.nn.functional.linear(x, other)
        no_pack_for_rows = torch.nn.functional.linear(x[:2], weight)
        larger = torch.nn.functional.linear(torch.randn(7, 12), weight)
    assert torch.allclose(packed, torch.nn.functional.linear(x, weight), atol=1e-5)
    assert torch.equal(unpacked, torch.nn.functional.linear(x, other))
    assert torch.equal(no_pack_for_rows, torch.nn.functional.linear(x[:2], weight))
    assert larger.shape == (7, 50)
    # Not a no-op: the product reads the kept pack for its rows (here, deliberately, another weight's).
    layouts._PACKS[weight.data_ptr(), 4] = (weight.shape, weight.stride(), weight._version, layouts._pack(other, 4))
    with mode:
        assert torch.allclose(torch.nn.functional.linear(x, weight), torch.nn.functional.linear(x, other), atol=1e-5)
    with torch.no_grad():
        weight.mul_(-2.0)  # in place: its version counter moves, so the next use repacks
    with mode:
        out = torch.nn.functional.linear(x, weight)
    assert torch.allclose(out, torch.nn.functional.linear(x, weight), atol=1e-5)
    assert layouts.pack_weights([weight], 4) == [] and layouts.pack_weights([weight], 2) == [weight]
    layouts.release_packed_weights([weight], 2)
    assert (weight.data_ptr(), 2) not in layouts._PACKS and (weight.data_ptr(), 4) in layouts._PACKS
    layouts.release_packed_weights()
    assert not layouts._PACKS


@needs_packing
@pytest.mark.parametrize("target_name", list(TARGETS))
def test_packed_graphs_equal_target_greedy_and_eager(drafters, target_name):
    """Every graph with MKL-packed weights (what "auto" picks where packing is fastest): the target's greedy output and
    the eager loop's run, for the short, one-block and longer prompts; the stats name the packed graphs."""
    target, xpress = drafters(target_name, "xpress")
    for i, length in enumerate(PROMPT_LENGTHS):
        ids = prompt(target.config.vocab_size, length, seed=20 + i)
        expected = target.generate(ids, max_new_tokens=21, do_sample=False)
        out = xpress.spec_generate(target, ids, max_new_tokens=21, compile=True, linear_layout="packed")
        assert torch.equal(out.sequences, expected)
        assert_same_run(out, xpress.spec_generate(target, ids, max_new_tokens=21))
        assert "verify:8" in out.stats.packed_graphs and "drafter:8" in out.stats.as_dict()["packed_graphs"]
        assert out.stats.weight_major_graphs == []
        # the verification's width and the drafter's rows have packs, which the graphs read
        assert all((w.data_ptr(), 8) in layouts._PACKS for w in linear_weights(target, xpress))


@needs_packing
def test_packed_sampling_equals_eager_draw_for_draw(sampling_pair):
    target, xpress = sampling_pair
    samples = draw(xpress, target, compile=True, seed=9, draws=25, temperature=1.0, linear_layout="packed")
    assert samples == draw(xpress, target, compile=False, seed=9, draws=25, temperature=1.0)


def test_packed_layout_errors(drafters, monkeypatch):
    """packed: the compiled loop only, float32 weights on a CPU, and a build with MKL's packed GEMM."""
    target, xpress = drafters("llama", "none")
    ids = prompt(96, 4)
    with pytest.raises(ValueError, match="packed.*compile=True"):
        xpress.spec_generate(target, ids, max_new_tokens=4, linear_layout="packed")
    if layouts.mkl_packing_available():
        bf16_target = tiny_llama().to(torch.bfloat16)
        bf16_xpress = tiny_xpress(bf16_target, refiner="none")
        with pytest.raises(ValueError, match="packs float32 weights.*torch.bfloat16"):
            bf16_xpress.spec_generate(bf16_target, ids, max_new_tokens=4, compile=True, linear_layout="packed")
    monkeypatch.setattr(layouts, "_PACKING_WORKS", [False])
    with pytest.raises(ValueError, match="MKL's packed GEMM"):
        CompiledDecoder(xpress, target, 64, None, "packed")
    assert not layouts.packed_pays(linear_weights(target), 4)  # auto never picks it then


def test_linear_layout_errors(drafters):
    target, xpress = drafters("llama", "none")
    ids = prompt(96, 4)
    with pytest.raises(ValueError, match="linear_layout must be one of 'auto', 'input_major', 'weight_major'"):
        xpress.spec_generate(target, ids, max_new_tokens=4, compile=True, linear_layout="transposed")
    with pytest.raises(ValueError, match="linear_layout must be one of"):
        xpress.spec_generate(target, ids, max_new_tokens=4, linear_layout="transposed")  # the eager loop checks too


@needs_packing
def test_inference_tensor_weights_pack():
    """A weight made under torch.inference_mode (no version counter; the draft readout's rows cut there) packs and
    multiplies like any other."""
    with torch.inference_mode():
        weight, x = torch.randn(24, 16), torch.randn(4, 16)
        layouts.pack_weights([weight], 4)
        with layouts.PackedLinear(max_rows=4):
            out = torch.nn.functional.linear(x, weight)
    assert (weight.data_ptr(), 4) in layouts._PACKS
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight))
    layouts.release_packed_weights()
