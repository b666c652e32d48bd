"""Training (paper §4.3, SPEC §4): collator, block layout, the objective against a block-by-block reference, learning,
LoRA export, and resume."""

import copy
import json
import math
import os
import sys

import datasets
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, TrainerCallback
from transformers.utils import logging as hf_logging

from modeling_xpress import XPressModel
from modeling_xpress.training import (
    PAPER_RECIPE,
    XPressDataCollator,
    XPressObjective,
    XPressTrainer,
    XPressTrainingArguments,
    anchor_weight,
    block_attention_mask,
    cross_entropy_l1,
    draft_blocks,
    position_weights,
)
from modeling_xpress.training.trainer import LORA_CHECKPOINT_DIR
from tests.builders import (
    branching_chain, load_example, markov_responses, markov_target, tiny_llama, tiny_qwen3, tiny_xpress,
)  # fmt: skip

hf_logging.set_verbosity_error()

BLOCK = 8
N = BLOCK - 1


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's barriers make each small
    matmul wait for a core (measured: a test 200× slower with 2 threads under load). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_rows(lengths, prompt: int = 5, vocab: int = 96, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist(), "loss_mask": [0] * prompt + [1] * (n - prompt)}
        for n in lengths
    ]


def training_args(tmp_path, **overrides) -> XPressTrainingArguments:
    fields = dict(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, anchors_per_sequence=4,
        report_to=[], disable_tqdm=True, save_strategy="no", logging_steps=2, seed=0,
    )  # fmt: skip
    return XPressTrainingArguments(**(fields | overrides))


# ---------------------------------------------------------------------------------------------------------------------
# Arguments, collator, layout
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("train_mode", "adapters"),
        ("anchors_per_sequence", 0),
        ("anchors_per_sequence", 2.5),  # integer fields take integers only: not floats ...
        ("anchors_per_sequence", True),  # ... and not bools
        ("loss_gamma", -1.0),
        ("consistency_weight", -0.1),
        ("anchor_weight_floor", 0.9),
        ("lora_r", 0),
        ("lora_r", 4.0),
        ("max_seq_length", 64.5),
        ("remove_unused_columns", True),
    ],
)
def test_arguments_reject_bad_values_by_name(tmp_path, field, value):
    with pytest.raises(ValueError, match=field) as error:
        XPressTrainingArguments(output_dir=str(tmp_path), report_to=[], **{field: value})
    assert str(value) in str(error.value)


def test_argument_defaults_are_the_authors_recipe(tmp_path):
    args = XPressTrainingArguments(output_dir=str(tmp_path), report_to=[])
    defaults = {name: getattr(args, name) for name in PAPER_RECIPE}
    assert defaults == {**PAPER_RECIPE, "loss_gamma": None}  # None: γ = 4 · B / 16, the authors' 4 at B = 16
    assert PAPER_RECIPE == {
        "train_mode": "full", "anchor_weight_start": 0.6, "anchor_weight_floor": 0.2, "consistency_rounds": 3,
        "consistency_weight": 0.3, "l1_weight": 0.9, "ce_weight": 0.1, "loss_gamma": 4.0, "learning_rate": 6e-4,
    }  # fmt: skip
    assert args.resolved_gamma(16) == 4.0 and XPressTrainingArguments(
        output_dir=str(tmp_path), report_to=[], loss_gamma=None
    ).resolved_gamma(8) == 2.0  # fmt: skip
    assert not args.remove_unused_columns
    spelled = XPressTrainingArguments.paper_recipe(str(tmp_path), report_to=[], consistency_rounds=1)
    assert spelled.consistency_rounds == 1 and spelled.l1_weight == 0.9
    assert anchor_weight(0, 100, 0.6, 0.2) == 0.6 and anchor_weight(100, 100, 0.6, 0.2) == pytest.approx(0.2)
    assert anchor_weight(50, 100, 0.6, 0.2) == pytest.approx(0.4)
    torch.testing.assert_close(position_weights(3, 7.0), torch.tensor([1.0, math.exp(-1 / 7), math.exp(-2 / 7)]))


def test_collator_samples_anchors_inside_responses_and_labels_block_tokens():
    rows = random_rows([30, 12, 40, 6])
    # Row 1: a response that stops before the end (a later non-response turn), row 3: no eligible anchor.
    rows[1]["loss_mask"] = [0] * 5 + [1] * 4 + [0] * 3
    rows[3]["loss_mask"] = [0] * 5 + [1]
    collate = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=6, seed=3)
    batch = collate(rows)
    assert batch["input_ids"].shape == (4, 40) and batch["labels"].shape == (4, 6, N)
    for i, row in enumerate(rows):
        ids, mask = row["input_ids"], row["loss_mask"]
        eligible = {t for t in range(len(ids) - 1) if mask[t] and mask[t + 1]}
        chosen = batch["anchors"][i][batch["anchor_mask"][i]].tolist()
        assert set(chosen) <= eligible and len(chosen) == min(6, len(eligible)) == len(set(chosen))
        for j, t in enumerate(chosen):
            for k in range(1, BLOCK):
                in_response = t + k < len(ids) and all(mask[t + 1 : t + k + 1])
                expected = ids[t + k] if in_response else -100
                assert batch["labels"][i, j, k - 1] == expected, (i, t, k)
        assert (batch["labels"][i][~batch["anchor_mask"][i]] == -100).all()
    assert not batch["anchor_mask"][3].any()
    assert batch["attention_mask"].sum(1).tolist() == [30, 12, 40, 6]
    # Reproducible from the seed, different for another seed.
    again = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=6, seed=3)(rows)
    other = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=6, seed=4)(rows)
    assert torch.equal(again["anchors"], batch["anchors"]) and not torch.equal(other["anchors"], batch["anchors"])


def test_collator_anchors_depend_only_on_seed_epoch_and_row():
    """What makes resuming exact: on resume the Trainer skips the batches already trained (for a map-style dataset
    without collating them), so a row's anchors must not depend on what was collated before it (nor on its batch),
    only on the seed, epoch and row."""
    rows = random_rows([30, 40, 35, 28], seed=5)
    collate = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=4, seed=3)
    first = collate(rows)
    collate(random_rows([33, 31], seed=6))  # other batches in between ...
    later = collate([rows[2], rows[0]])  # ... and the rows again, in another batch
    assert first["anchor_mask"].all()  # every row has more eligible positions than anchors: they are drawn
    assert torch.equal(later["anchors"], first["anchors"][[2, 0]])
    collate.set_epoch(1)  # the same rows in the next epoch are trained on other blocks
    next_epoch = collate(rows)["anchors"]
    assert all(not torch.equal(a, b) for a, b in zip(next_epoch, first["anchors"]))
    collate.set_epoch(0)
    assert torch.equal(collate(rows)["anchors"], first["anchors"])


def test_collator_draws_anchors_in_proportion_to_anchor_weights():
    rows = random_rows([30, 30], seed=7)
    eligible = [t for t in range(29) if rows[0]["loss_mask"][t] and rows[0]["loss_mask"][t + 1]]
    favoured, other = eligible[2], eligible[5]
    weights = [0.0] * 30
    weights[favoured], weights[other] = 3.0, 1.0
    rows[0]["anchor_weights"] = weights  # row 1 has none: uniform, as before
    collate = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=4, seed=3)
    batch = collate(rows)
    # Only positions with a weight > 0 are anchors (2 of them, though 4 were asked for); the unweighted row is as
    # without the column.
    assert sorted(batch["anchors"][0][batch["anchor_mask"][0]].tolist()) == [favoured, other]
    plain = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=4, seed=3)([rows[1]])
    assert torch.equal(batch["anchors"][1], plain["anchors"][0])
    # One anchor per row: drawn in proportion 3 : 1 (over 400 epochs; the binomial sd of the share is 0.022).
    single = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=1, seed=3)
    draws = []
    for epoch in range(400):
        single.set_epoch(epoch)
        draws.append(single([rows[0]])["anchors"][0, 0].item())
    assert set(draws) == {favoured, other} and abs(draws.count(favoured) / 400 - 0.75) < 0.07
    for bad, message in [([1.0] * 29, "29 values but input_ids has 30 tokens"), ([-1.0] * 30, "finite and >= 0")]:
        with pytest.raises(ValueError, match=message):
            collate([{**rows[1], "anchor_weights": bad}])


def test_collator_rejects_batches_without_tokens_but_keeps_rows_without_anchors():
    collate = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=4)
    with pytest.raises(ValueError, match="empty batch"):
        collate([])
    with pytest.raises(ValueError, match="0 tokens.*Drop empty rows"):
        collate([{"input_ids": [], "loss_mask": []}] * 2)
    # Rows that are empty, one token long or without a response pair only contribute no anchor, next to real rows ...
    odd = [{"input_ids": [], "loss_mask": []}, {"input_ids": [7], "loss_mask": [1]}, *random_rows([9], prompt=8)]
    batch = collate(random_rows([20]) + odd)
    assert batch["anchor_mask"].sum(1).tolist() == [4, 0, 0, 0]
    assert batch["attention_mask"].sum(1).tolist() == [20, 0, 1, 9]
    # ... or alone: a batch without any anchor is still a batch.
    assert not collate(odd)["anchor_mask"].any()
    for name, value in [("anchors_per_sequence", 2.5), ("block_size", 8.0), ("max_length", True)]:
        with pytest.raises(ValueError, match=f"{name} must be an integer, got {value}"):
            XPressDataCollator(**{"block_size": BLOCK, name: value})


def test_block_attention_mask_layout():
    mask = block_attention_mask(torch.tensor([[2, 5]]), context_len=6, block_size=3)[0, 0]  # (6, 6 + 6)
    context, blocks = mask[:, :6], mask[:, 6:]
    assert context[:3].tolist() == [[True, True, False, False, False, False]] * 3  # strictly before anchor 2
    assert context[3:].tolist() == [[True] * 5 + [False]] * 3  # strictly before anchor 5
    expected = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    assert torch.equal(blocks, expected)  # bidirectional inside a block, never across blocks


def test_blocks_see_neither_their_anchor_features_nor_later_context_nor_other_blocks():
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    context = torch.randn(1, 24, model.fc.in_features, generator=g)
    anchors, anchor_ids = torch.tensor([[6, 15]]), torch.tensor([[11, 42]])
    embed = target.get_input_embeddings()
    with torch.no_grad():
        hidden = draft_blocks(model, embed, context, anchors, anchor_ids)
        later = context.clone()
        later[:, 6:] += torch.randn(later[:, 6:].shape, generator=g)  # at and after block 0's anchor
        moved = draft_blocks(model, embed, later, anchors, anchor_ids)
        other = draft_blocks(model, embed, context, anchors, torch.tensor([[11, 7]]))  # block 1's anchor token
        earlier = context.clone()
        earlier[:, 5] += 1.0  # just before block 0's anchor: must be seen (the checks above are not vacuous)
        seen = draft_blocks(model, embed, earlier, anchors, anchor_ids)
    torch.testing.assert_close(moved[:, 0], hidden[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(other[:, 0], hidden[:, 0], rtol=0, atol=1e-6)
    assert not torch.allclose(other[:, 1], hidden[:, 1], atol=1e-3)
    assert not torch.allclose(moved[:, 1], hidden[:, 1], atol=1e-3)
    assert not torch.allclose(seen[:, 0], hidden[:, 0], atol=1e-3)


def test_training_blocks_equal_the_blocks_drafted_at_decode_time():
    """What the loss trains is what decoding runs: `draft_blocks` (all blocks of a sequence at once, training) gives
    the drafter logits that `generation.draft_block` (one block on the drafter's KV cache, decoding) gives for the
    same anchor, with the context fed in one piece or in two increments as decoding does."""
    from transformers import DynamicCache

    from modeling_xpress.drafting import draft_block

    target = tiny_llama()
    model = tiny_xpress(target, refiner="none", block_size=BLOCK)
    ids = torch.randint(0, target.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(3))
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        context = torch.cat([out.hidden_states[i + 1] for i in model.config.target_layer_ids], dim=-1)
        anchors = torch.tensor([[9, 21]])
        trained = model.base_logits(draft_blocks(model, embed, context, anchors, ids.gather(1, anchors))[0], lm_head)
        for j, t in enumerate(anchors[0].tolist()):
            whole = draft_block(model, embed, lm_head, ids[:, t - 1 : t + 1], context[:, :t], 0, DynamicCache()).logits
            cache = DynamicCache()
            draft_block(model, embed, lm_head, ids[:, 4:6], context[:, :5], 0, cache)  # an earlier block, then more
            pieces = draft_block(model, embed, lm_head, ids[:, t - 1 : t + 1], context[:, 5:t], 5, cache).logits
            torch.testing.assert_close(whole[0], trained[j], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(pieces[0], trained[j], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# The objective against a naive block-by-block reference
# ---------------------------------------------------------------------------------------------------------------------


def reference_losses(model, target, batch, gamma, ce_weight, l1_weight, rounds) -> dict[str, torch.Tensor]:
    """Each block run alone: its sequence through the target, the drafter on that block with only the context before
    its anchor (no attention mask needed), then eq. (14) position by position with plain autograd. The head reads
    every slot of the block, slot 0 the anchor's, with the previous tokens [token before the anchor, anchor, ...]:
    the gold ones (teacher forcing), then `rounds` free-running rounds, each fed the argmax of the one before (the
    first, the drafter's own), their losses averaged."""
    config = model.config
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    names = ["base", "refined", *(f"round{r}" for r in range(rounds))]
    terms = {name: [] for name in names}  # (w_k, α_ce·CE + α_l1·L1) per labelled position
    for i in range(batch["input_ids"].shape[0]):
        length = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i : i + 1, :length]
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
        features = torch.cat([out.hidden_states[j + 1] for j in config.target_layer_ids], dim=-1)
        p_target = out.logits[0].softmax(dim=-1)  # (length, V): distribution of the token after each position
        for j in torch.nonzero(batch["anchor_mask"][i]).flatten().tolist():
            t = int(batch["anchors"][i, j])
            hidden = model(
                noise_embeds=model.embed_blocks(ids[:, t : t + 1], embed),
                context_hidden_states=features[:, :t],
                position_ids=torch.arange(t + BLOCK).unsqueeze(0),
            ).last_hidden_state  # (1, B, H): every slot, the anchor's first
            base = lm_head(hidden[:, 1:])[0]  # (n, V)
            logits = {"base": base}
            if model.refiner.corrects:
                before = ids[0, t - 1 : t]  # the token before the anchor
                gold = ids[0, t : t + N]  # [anchor, x*_1..x*_{n-1}] (past the sequence end: unused filler)
                gold = torch.cat([before, gold, torch.zeros(N - len(gold), dtype=torch.long)])

                def refined(previous):
                    if config.refiner == "markov":
                        return base + model.refiner.bias(previous[1:][None])[0]  # a bias per previous token
                    return base + model.refiner(hidden, previous[None])[0]

                logits["refined"] = refined(gold)
                tokens = base.argmax(-1)
                for r in range(rounds):
                    logits[f"round{r}"] = refined(torch.cat([before, ids[0, t : t + 1], tokens[:-1]]))
                    tokens = logits[f"round{r}"].argmax(-1)
            for k in range(1, BLOCK):
                label = int(batch["labels"][i, j, k - 1])
                if label == -100:
                    continue
                for name, values in logits.items():
                    log_p = values[k - 1].log_softmax(-1)
                    l1 = (log_p.exp() - p_target[t + k - 1]).abs().sum()
                    terms[name].append((math.exp(-(k - 1) / gamma), ce_weight * -log_p[label] + l1_weight * l1))
    losses = {name: sum(w * v for w, v in rows) / sum(w for w, _ in rows) for name, rows in terms.items() if rows}
    if model.refiner.corrects and rounds:
        losses["consistency"] = sum(losses.pop(f"round{r}") for r in range(rounds)) / rounds
    return losses


@pytest.mark.parametrize(
    "refiner,rounds", [("xpress", 3), ("xpress", 1), ("xpress-paper", 2), ("markov", 2), ("none", 3)]
)
def test_batched_loss_and_gradients_equal_block_by_block_reference(refiner, rounds):
    torch.manual_seed(0)
    target = tiny_llama().requires_grad_(False)
    form = "paper" if refiner == "xpress-paper" else "release"
    model = tiny_xpress(target, refiner=refiner.removesuffix("-paper"), block_size=BLOCK, refiner_form=form)
    rows = random_rows([30, 14, 40, 6], seed=1)
    batch = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=5, seed=0)(rows)
    assert batch["anchor_mask"].sum() >= 10 and not batch["anchor_mask"].all()  # padding slots are exercised
    assert int(batch["anchors"][batch["anchor_mask"]].min()) >= 1  # every block has a token before its anchor
    gamma, ce_weight, l1_weight, consistency, lam = 3.0, 0.7, 1.3, 0.3, 0.45
    objective = XPressObjective(
        model, target, gamma=gamma, ce_weight=ce_weight, l1_weight=l1_weight, consistency_weight=consistency,
        consistency_rounds=rounds,
    )  # fmt: skip
    out = objective(**batch, anchor_weight=lam)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()

    expected = reference_losses(model, target, batch, gamma, ce_weight, l1_weight, rounds)
    got = {name.removeprefix("loss_"): value[0].item() for name, value in out.metrics.items() if name.startswith("loss_")}
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == pytest.approx(expected[name].item(), rel=1e-5), name
    total = expected["base"]
    if refiner != "none":
        total = expected["refined"] + lam * expected["base"] + consistency * expected["consistency"]
        if rounds > 1:  # the rounds really were fed different drafts: their average is not the first round's
            first_only = reference_losses(model, target, batch, gamma, ce_weight, l1_weight, 1)["consistency"]
            assert abs(first_only.item() - expected["consistency"].item()) > 1e-6
    assert out.loss.item() == pytest.approx(total.item(), rel=1e-5)
    total.backward()
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        assert scale > 0, name  # every parameter is trained by the objective
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_consistency_round_k_is_fed_round_k_minus_1s_argmax():
    """What each free-running round reads: round 1 the drafter's own argmax, round k the argmax of round k - 1's
    refined logits (base + δ), always after the two known tokens (the one before the anchor, the anchor)."""
    torch.manual_seed(0)
    target = tiny_llama().requires_grad_(False)
    model = tiny_xpress(target, block_size=BLOCK)
    batch = XPressDataCollator(block_size=BLOCK, anchors_per_sequence=3, seed=0)(random_rows([30, 24], seed=2))
    calls = []  # (hidden, previous, δ) of every head call: teacher forcing first, then the rounds
    forward = model.refiner.forward

    def recording(hidden, previous):
        delta = forward(hidden, previous)
        calls.append((hidden.detach(), previous.detach().clone(), delta.detach()))
        return delta

    model.refiner.forward = recording
    XPressObjective(model, target, gamma=4.0, consistency_rounds=3)(**batch)
    assert len(calls) == 4
    mask = batch["anchor_mask"]
    anchors = torch.gather(batch["input_ids"], 1, batch["anchors"])[mask]
    before = torch.gather(batch["input_ids"], 1, batch["anchors"] - 1)[mask]
    hidden = calls[0][0]
    base = model.draft_logits(hidden, target.get_output_embeddings()).detach()
    fed = base.argmax(-1)  # what round 1 reads: the drafter's own drafts
    changed = 0
    for _, previous, delta in calls[1:]:
        assert torch.equal(previous[:, 0], before) and torch.equal(previous[:, 1], anchors)
        assert torch.equal(previous[:, 2:], fed[:, :-1])
        next_fed = (base + delta).argmax(-1)
        changed += int((next_fed != fed).sum())
        fed = next_fed
    assert changed > 0  # the rounds read different drafts, so the test would see a round fed the wrong ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cross_entropy_l1_matches_autograd(dtype):
    """The hand-written backward against autograd, with arbitrary (not unit) upstream gradients on both outputs."""
    g = torch.Generator().manual_seed(0)
    vocab = 5000  # several rows per chunk and several chunks
    logits = (torch.randn(300, vocab, generator=g) * 3).to(dtype).requires_grad_()
    target_probs = torch.randn(300, vocab, generator=g).softmax(-1)
    labels = torch.randint(0, vocab, (300,), generator=g)
    upstream_ce, upstream_l1 = torch.randn(300, generator=g), torch.randn(300, generator=g)
    ce, l1 = cross_entropy_l1(logits, target_probs, labels)
    (ce * upstream_ce + l1 * upstream_l1).sum().backward()
    fused = logits.grad.clone()
    logits.grad = None
    log_p = logits.float().log_softmax(-1)
    ce_ref = -log_p.gather(-1, labels[:, None]).squeeze(-1)
    l1_ref = (log_p.exp() - target_probs).abs().sum(-1)
    (ce_ref * upstream_ce + l1_ref * upstream_l1).sum().backward()
    torch.testing.assert_close(ce, ce_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1, l1_ref, rtol=1e-5, atol=1e-5)
    assert fused.dtype == dtype
    torch.testing.assert_close(fused.float(), logits.grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-6)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Learning: the refiner's causality is what makes the block right
# ---------------------------------------------------------------------------------------------------------------------

# Generation stays within the trained sequence length (the drafter never saw RoPE positions beyond it).
PROMPTS = ([0], [0, 1, 2, 3], [0, 4, 5, 6], [0, 4], [0, 1], [5, 6], [2, 3], [0, 1, 2, 3, 0, 4])


def mean_tau(model, target) -> float:
    """τ of sampled (T = 1) speculative decoding over fixed prompts with a fixed generator."""
    g = torch.Generator().manual_seed(0)
    steps = []
    for prompt in PROMPTS:
        out = model.spec_generate(target, torch.tensor([prompt]), max_new_tokens=64, temperature=1.0, generator=g)
        steps += out.stats.acceptance_lengths
    return sum(steps) / len(steps)


def heldout_acceptance(model, target, batch) -> float:
    """Mean 1 − TV(p, p^t) on held-out blocks, of the distribution drafts are drawn from (p^r, or p^b without head)."""
    with torch.no_grad():
        metrics = XPressObjective(model, target, gamma=3.5)(**batch).metrics
    total, count = metrics["accept_refined" if model.refiner.corrects else "accept_base"]
    return (total / count).item()


def assert_clearly_beats(tau: float, acceptance: float, baseline_tau: float, baseline_acceptance: float) -> None:
    assert tau >= baseline_tau + 1.0, f"τ {tau:.2f} does not clearly beat the drafter-only {baseline_tau:.2f}"
    assert acceptance >= baseline_acceptance + 0.1, (
        f"held-out acceptance {acceptance:.3f} does not clearly beat the drafter-only {baseline_acceptance:.3f}"
    )


def test_refiner_learns_what_per_position_marginals_cannot(tmp_path):
    """After 0 the chain flips a coin between two branches whose later tokens are certain given the branch token: a
    drafter's per-position marginals are coin flips there, a causal head conditioned on the drafted prefix is not.
    Same data, steps, seed and recipe for the drafter-only baseline and xPress; the gain must vanish with δ = 0."""
    log_probs = branching_chain()
    target = markov_target(log_probs)
    data = markov_responses(log_probs, num_sequences=64, length=100, seed=0)
    heldout = XPressDataCollator(BLOCK, 8, seed=123)(list(markov_responses(log_probs, 32, length=40, seed=1000)))
    trained = {}
    for refiner in ("none", "xpress"):
        model = tiny_xpress(target, refiner=refiner, seed=1, randomize_head=False, block_size=BLOCK, jacobi_max_iters=N)
        args = training_args(
            tmp_path / refiner, max_steps=400, per_device_train_batch_size=8, anchors_per_sequence=8,
            learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=400,
        )  # fmt: skip
        XPressTrainer(model=model, target=target, args=args, train_dataset=data).train()
        trained[refiner] = model.eval()
    baseline, xpress = trained["none"], trained["xpress"]
    baseline_scores = mean_tau(baseline, target), heldout_acceptance(baseline, target, heldout)
    xpress_scores = mean_tau(xpress, target), heldout_acceptance(xpress, target, heldout)
    print("drafter only: τ %.2f, acceptance %.3f; xPress: τ %.2f, acceptance %.3f" % (*baseline_scores, *xpress_scores))
    assert_clearly_beats(*xpress_scores, *baseline_scores)

    with torch.no_grad():
        xpress.refiner.readout.weight.zero_()  # δ = 0: the co-trained drafter alone
    without_refiner = mean_tau(xpress, target), heldout_acceptance(xpress, target, heldout)
    print("xPress with δ = 0: τ %.2f, acceptance %.3f" % without_refiner)
    with pytest.raises(AssertionError):
        assert_clearly_beats(*without_refiner, *baseline_scores)


# ---------------------------------------------------------------------------------------------------------------------
# What is trained, what is saved
# ---------------------------------------------------------------------------------------------------------------------


def probe(model, target) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter hidden states and head correction on a fixed input: what a checkpoint must reproduce."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, target.config.vocab_size, (1, 20), generator=g)
    anchors = torch.tensor([[7, 13]])
    out = target(input_ids=ids, output_hidden_states=True)
    context = torch.cat([out.hidden_states[i + 1] for i in model.config.target_layer_ids], dim=-1)
    with torch.no_grad():
        hidden = draft_blocks(model, target.get_input_embeddings(), context, anchors, ids.gather(1, anchors))
        drafts = hidden[0, :, 1:]  # (2, n, H)
        delta = model.refiner(drafts, torch.randint(0, target.config.vocab_size, (2, N), generator=g))
    return hidden, delta


def safetensors_keys(folder) -> set[str]:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("train_mode", ["full", "lora"])
def test_drafter_lr_scale_gives_the_drafter_its_own_rate(tmp_path, train_mode):
    """drafter_lr_scale: the head's parameters at learning_rate, every other trained parameter at that times the
    scale, both following the schedule; every trained parameter in exactly one group."""
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    args = training_args(tmp_path, train_mode=train_mode, learning_rate=1e-3, drafter_lr_scale=0.1, max_steps=6,
                         warmup_steps=2)  # fmt: skip
    trainer = XPressTrainer(model=model, target=target, args=args, train_dataset=random_rows([30, 25, 40, 33] * 2))
    trainer.create_optimizer_and_scheduler(num_training_steps=6)
    names = {id(p): n for n, p in trainer.model.named_parameters() if p.requires_grad}
    seen = [id(p) for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sorted(seen) == sorted(names) and len(seen) == len(set(seen))
    for group in trainer.optimizer.param_groups:
        heads = {"refiner." in names[id(p)] for p in group["params"]}
        assert len(heads) == 1  # a group is all head or all drafter
        assert group["initial_lr"] == pytest.approx(1e-3 if heads.pop() else 1e-4)
    assert any("refiner." not in n for n in names.values())  # the drafter is trained in this mode
    trainer.lr_scheduler.step()
    rates = sorted({round(group["lr"] / group["initial_lr"], 9) for group in trainer.optimizer.param_groups})
    assert len(rates) == 1 and 0 < rates[0] < 1  # one schedule for both, in its warm-up
    with pytest.raises(ValueError, match="drafter_lr_scale"):
        training_args(tmp_path, drafter_lr_scale=0.0)


def test_refiner_mode_trains_only_the_head_and_never_the_target(tmp_path):
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    drafter_before = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("refiner.")}
    head_before = model.refiner.readout.weight.clone()
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    args = training_args(tmp_path, train_mode="refiner", learning_rate=1e-2)
    trainer = XPressTrainer(model=model, target=target, args=args, train_dataset=random_rows([30, 25, 40, 33] * 2))
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.refiner.parameters()}
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in drafter_before.items())
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in target_before.items())
    assert not torch.equal(head_before, model.refiner.readout.weight)
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    expected = {"loss_refined", "loss_base", "loss_consistency", "anchor_weight", "tau_estimate"}
    expected |= {f"{kind}_{name}" for kind in ("ce", "l1", "accept") for name in ("refined", "base", "consistency")}
    expected |= {f"accept_k{k}" for k in range(1, BLOCK)}
    assert expected <= logged.keys()
    trainer.save_model(str(tmp_path / "final"))
    keys = safetensors_keys(tmp_path / "final")
    assert keys == set(model.state_dict()) and not any("embed_tokens" in k or "lm_head" in k for k in keys)


def test_lora_cotraining_saves_a_merged_folder_that_loads_without_peft(tmp_path):
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK, randomize_head=False)
    hidden_before, delta_before = probe(model, target)
    args = training_args(tmp_path, train_mode="lora", lora_r=4, learning_rate=2e-2, max_steps=5)
    trainer = XPressTrainer(model=model, target=target, args=args, train_dataset=random_rows([30, 25, 40, 33] * 2))
    trainer.train()
    hidden_after, delta_after = probe(trainer.model.core, target)  # the live model, adapters unmerged
    assert not torch.allclose(hidden_after, hidden_before, atol=1e-4)  # LoRA moved the drafter itself ...
    assert not torch.allclose(delta_after, delta_before, atol=1e-4)  # ... and the head trained

    trainer.save_model(str(tmp_path / "final"))
    keys = safetensors_keys(tmp_path / "final")
    assert not any("lora_" in k or "modules_to_save" in k or "base_model" in k for k in keys)
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)
    for loaded in (
        XPressModel.from_pretrained(tmp_path / "final"),
        AutoModel.from_pretrained(tmp_path / "final", trust_remote_code=True),
    ):
        assert not hasattr(loaded, "peft_config")
        hidden, delta = probe(loaded.eval(), target)
        torch.testing.assert_close(hidden, hidden_after, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(delta, delta_after, rtol=1e-5, atol=1e-5)


class RecordStart(TrainerCallback):
    """Captures the step, optimizer state and weights the run starts from (after any checkpoint was restored)."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.step = state.global_step
        self.optimizer = copy.deepcopy(optimizer.state_dict())  # its tensors are updated in place as training goes on


def assert_same_optimizer_state(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys() and actual["state"]
    for key in expected["state"]:
        for name, value in expected["state"][key].items():
            torch.testing.assert_close(actual["state"][key][name], value, rtol=0, atol=0)


class RecordingTrainer(XPressTrainer):
    """Keeps every batch it trains on (the anchors drawn for it included): what a resumed run must repeat."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[dict[str, torch.Tensor]] = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.batches.append({k: inputs[k].clone() for k in ("input_ids", "attention_mask", "anchors")})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def eligible_anchors(row) -> int:
    mask = row["loss_mask"]
    return sum(1 for t in range(len(mask) - 1) if mask[t] and mask[t + 1])


def anchors_by_row(batches) -> dict[tuple, list[int]]:
    """Row tokens → the anchors drawn for that row, over a list of batches (each row once)."""
    drawn = {}
    for batch in batches:
        for ids, mask, anchors in zip(batch["input_ids"], batch["attention_mask"], batch["anchors"]):
            drawn[tuple(ids[mask.bool()].tolist())] = anchors.tolist()
    return drawn


@pytest.mark.parametrize("train_mode, resume_step", [("full", 2), ("full", 4), ("lora", 4)])
def test_resume_ends_exactly_where_the_uninterrupted_run_does(tmp_path, train_mode, resume_step):
    """6 steps over 2 epochs of rows long enough that anchors are really sampled, interrupted at `resume_step` (mid
    epoch 0, or mid epoch 1 after a row was seen twice) and resumed: the same step, optimizer state, batches and
    anchors, and bitwise the same final weights as the uninterrupted run."""
    target = tiny_llama()
    data = random_rows([30, 26, 34, 28, 24, 32], prompt=4, seed=2)
    args = dict(
        train_mode=train_mode, lora_r=4, max_steps=6, per_device_train_batch_size=2, anchors_per_sequence=4,
        save_strategy="steps", save_steps=2, learning_rate=1e-2,
    )  # fmt: skip
    assert all(eligible_anchors(row) > args["anchors_per_sequence"] for row in data)  # anchors are drawn, not all taken

    def run(output_dir, resume=None):
        model = tiny_xpress(target, block_size=BLOCK, randomize_head=False)
        start = RecordStart()
        trainer = RecordingTrainer(
            model=model, target=target, args=training_args(output_dir, **args), train_dataset=data, callbacks=[start]
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer, start

    straight, _ = run(tmp_path / "straight")
    assert len(straight.batches) == 6 and straight.state.epoch == 2.0
    epochs = anchors_by_row(straight.batches[:3]), anchors_by_row(straight.batches[3:])
    assert epochs[0].keys() == epochs[1].keys() and len(epochs[0]) == len(data)
    assert all(epochs[0][row] != epochs[1][row] for row in epochs[0])  # a row seen again gets new anchors

    checkpoint = tmp_path / "straight" / f"checkpoint-{resume_step}"
    resumed, start = run(tmp_path / "resumed", resume=str(checkpoint))
    assert start.step == resume_step and resumed.state.global_step == 6
    assert_same_optimizer_state(start.optimizer, torch.load(checkpoint / "optimizer.pt", weights_only=True))
    assert len(resumed.batches) == 6 - resume_step
    for got, expected in zip(resumed.batches, straight.batches[resume_step:]):
        assert all(torch.equal(got[k], expected[k]) for k in expected)  # the same rows, anchors included
    assert_same_optimizer_state(resumed.optimizer.state_dict(), straight.optimizer.state_dict())
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), f"{name}: max |Δ| {(a - b).abs().max().item():.3g}"
    if train_mode == "lora":
        assert (checkpoint / LORA_CHECKPOINT_DIR / "adapter_model.safetensors").is_file()
        with open(checkpoint / "config.json") as f:
            assert json.load(f)["model_type"] == "xpress"  # the checkpoint is a plain xPress folder too
        # An adapter only resumes on the base it was trained on.
        other = tiny_xpress(target, block_size=BLOCK, randomize_head=False, seed=7)
        other_args = training_args(tmp_path / "other", **args)
        with pytest.raises(ValueError, match="different base drafter"):
            XPressTrainer(model=other, target=target, args=other_args, train_dataset=data).train(
                resume_from_checkpoint=str(checkpoint)
            )


def test_dataloader_workers_train_on_the_anchors_of_the_main_process(tmp_path):
    """Workers collate with their own copies of the collator; each epoch's copy carries that epoch, so 2 epochs with
    workers train on exactly the batches (anchors included) of 2 epochs without. Persistent workers would keep the
    first epoch's copy: refused."""
    target = tiny_llama()
    data = random_rows([30, 26, 34, 28], prompt=4, seed=2)
    batches = {}
    for workers in (0, 2):
        model = tiny_xpress(target, block_size=BLOCK, randomize_head=False)
        args = training_args(tmp_path, max_steps=4, per_device_train_batch_size=2, dataloader_num_workers=workers)
        trainer = RecordingTrainer(model=model, target=target, args=args, train_dataset=data)
        trainer.train()
        batches[workers] = trainer.batches
    assert len(batches[0]) == 4 and anchors_by_row(batches[0][:2]) != anchors_by_row(batches[0][2:])
    for got, expected in zip(batches[2], batches[0], strict=True):
        assert all(torch.equal(got[k], expected[k]) for k in expected)
    args = training_args(tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True)
    with pytest.raises(ValueError, match="dataloader_persistent_workers=True"):
        XPressTrainer(model=tiny_xpress(target, block_size=BLOCK), target=target, args=args, train_dataset=data)


# ---------------------------------------------------------------------------------------------------------------------
# The example script, in-process
# ---------------------------------------------------------------------------------------------------------------------


def run_example(monkeypatch, *argv: str) -> None:
    script = load_example("train_refiner")
    monkeypatch.setattr(sys, "argv", ["train_refiner.py", *argv, "--report_to", "none", "--disable_tqdm", "true"])
    script.main()


def test_example_script_converts_a_dflash_checkpoint_then_continues_from_its_own_output(tmp_path, monkeypatch):
    from tests.test_conversion import write_checkpoint

    target = tiny_qwen3()
    target.save_pretrained(tmp_path / "target")
    write_checkpoint(tmp_path / "dflash", target)
    datasets.Dataset.from_list(random_rows([30, 25, 40, 33])).to_parquet(str(tmp_path / "data.parquet"))
    common = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.parquet"), "--refiner_rank", "8"]

    run_example(monkeypatch, *common, "--init_from", str(tmp_path / "dflash"), "--output_dir", str(tmp_path / "a"),
                "--train_mode", "lora", "--lora_r", "4", "--max_steps", "2", "--per_device_train_batch_size", "2")  # fmt: skip
    converted = XPressModel.from_pretrained(tmp_path / "a")
    assert (converted.config.block_size, converted.config.mask_token_id, converted.config.refiner) == (6, 7, "xpress")
    assert converted.refiner.readout.weight.abs().sum() > 0  # the fresh head was trained

    run_example(monkeypatch, *common, "--init_from", str(tmp_path / "a"), "--output_dir", str(tmp_path / "b"),
                "--train_mode", "refiner", "--max_steps", "1")  # fmt: skip
    assert XPressModel.from_pretrained(tmp_path / "b").config.block_size == 6
    # Another head on the trained drafter: drafter weights carried over, the Markov head starts at δ = 0.
    run_example(monkeypatch, *common, "--init_from", str(tmp_path / "a"), "--output_dir", str(tmp_path / "c"),
                "--refiner", "markov", "--train_mode", "refiner", "--max_steps", "1")  # fmt: skip
    markov = XPressModel.from_pretrained(tmp_path / "c")
    assert markov.config.refiner == "markov"
    torch.testing.assert_close(markov.layers[0].mlp.up_proj.weight, converted.layers[0].mlp.up_proj.weight)


def test_example_script_trains_on_joined_sets_with_a_draft_vocabulary_and_stops_on_the_held_out_split(
    tmp_path, monkeypatch
):
    """Comma-separated --data folders: the held-out prompts are evaluated, never trained on; the draft vocabulary is
    ranked on the training rows only; early stopping on eval_tau_estimate keeps the best checkpoint."""
    from tests.test_data import write_response_set

    target = tiny_qwen3()
    target.save_pretrained(tmp_path / "target")
    rows = random_rows([30, 25, 40, 33, 28, 35])
    for name, (first, end) in {"a": (0, 3), "b": (3, 6)}.items():
        write_response_set(tmp_path / name, first, end)
        datasets.Dataset.from_list(rows[first:end]).to_parquet(str(tmp_path / name / "responses.parquet"))
    monkeypatch.setattr("modeling_xpress.training.regeneration.HELD_OUT_PROMPTS", range(4, 6))
    train_tokens = {t for row in rows[:4] for t, m in zip(row["input_ids"], row["loss_mask"]) if m}
    run_example(
        monkeypatch, "--target", str(tmp_path / "target"), "--data", f"{tmp_path / 'a'},{tmp_path / 'b'}",
        "--refiner", "none", "--num_draft_layers", "1", "--draft_vocab_size", "12", "--eval_held_out", "2",
        "--signal_cache", str(tmp_path / "signals"), "--output_dir", str(tmp_path / "run"), "--max_steps", "40",
        "--eval_strategy", "steps", "--eval_steps", "1", "--save_steps", "1", "--load_best_model_at_end", "true",
        "--metric_for_best_model", "eval_tau_estimate", "--greater_is_better", "true", "--early_stopping_patience", "2",
        "--per_device_train_batch_size", "2", "--learning_rate", "0",
    )  # fmt: skip
    model = XPressModel.from_pretrained(tmp_path / "run")
    assert model.config.draft_vocab_size == 12
    assert set(model.draft_token_ids.tolist()) <= train_tokens | {target.generation_config.eos_token_id}
    state = json.loads(sorted((tmp_path / "run").glob("checkpoint-*"))[-1].joinpath("trainer_state.json").read_text())
    evals = [entry for entry in state["log_history"] if "eval_tau_estimate" in entry]
    assert evals and state["global_step"] < 40  # learning rate 0: τ never improves, so patience 2 stops it early
    assert (tmp_path / "signals-held-out" / "manifest.json").is_file()


def test_example_script_trains_on_a_seeded_random_subset_of_joined_sets(tmp_path):
    """--max_train_samples N --train_rows_seed S: N rows drawn from every folder (not the first folder's first N), the
    same rows for the same seed (so head stages share one signal cache of them), others for another seed; the seed
    alone is refused, since it would silently train on every row."""
    from modeling_xpress.training.run import RunArguments, load_data
    from tests.test_data import write_response_set

    write_response_set(tmp_path / "a", 0, 20)
    write_response_set(tmp_path / "b", 20, 40)
    data = f"{tmp_path / 'a'},{tmp_path / 'b'}"

    def first_tokens(**subset):
        rows, _ = load_data(RunArguments(target="unused", data=data, **subset), None, 0)
        return [ids[0] for ids in rows["input_ids"]]

    assert first_tokens(max_train_samples=8) == list(range(8))  # the first N: folder a only
    chosen = first_tokens(max_train_samples=8, train_rows_seed=0)
    assert len(set(chosen)) == 8 and set(chosen) <= set(range(40))
    assert min(chosen) < 20 <= max(chosen)  # both folders
    assert first_tokens(max_train_samples=8, train_rows_seed=0) == chosen
    assert first_tokens(max_train_samples=8, train_rows_seed=1) != chosen
    with pytest.raises(ValueError, match="--max_train_samples"):
        first_tokens(train_rows_seed=0)


def test_logged_training_time_continues_across_a_resume(tmp_path, monkeypatch):
    """`train_seconds` in the logs is the training's wall time over every run: a resumed run (a new process, its clock
    starting from zero) continues from the interrupted run's last logged value instead of restarting at 0."""
    clock = [0.0]

    def fake_perf_counter():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr("modeling_xpress.training.trainer.time.perf_counter", fake_perf_counter)
    target = tiny_llama()
    data = random_rows([30, 26, 34, 28], prompt=4, seed=2)
    args = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2, logging_steps=1)

    def logged_seconds(output_dir, resume=None):
        trainer = XPressTrainer(
            model=tiny_xpress(target, block_size=BLOCK), target=target, args=training_args(output_dir, **args),
            train_dataset=data,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return {entry["step"]: entry["train_seconds"] for entry in trainer.state.log_history if "loss" in entry}

    straight = logged_seconds(tmp_path / "straight")
    assert list(straight) == [1, 2, 3, 4] and all(straight[s] < straight[s + 1] for s in (1, 2, 3))
    clock[0] = 0.0  # a new process
    resumed = logged_seconds(tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoint-2"))
    assert list(resumed) == [1, 2, 3, 4]  # the restored history, then its own steps
    assert resumed[3] > straight[2]


def test_a_snapshot_without_optimizer_state_continues_the_schedule_and_the_weights(tmp_path):
    """`snapshot_checkpoint` drops optimizer.pt (what makes a checkpoint too big to commit): resuming from it restores
    the weights, the step and the learning-rate schedule (the Trainer alone would restart the schedule), and the run
    ends at max_steps with the learning rates of the uninterrupted run at every step."""
    from modeling_xpress.training import snapshot_checkpoint

    target = tiny_llama()
    data = random_rows([30, 26, 34, 28], prompt=4, seed=2)
    args = dict(max_steps=6, per_device_train_batch_size=2, save_strategy="steps", save_steps=3, logging_steps=1,
                learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=2)  # fmt: skip

    def run(output_dir, resume=None):
        trainer = XPressTrainer(
            model=tiny_xpress(target, block_size=BLOCK), target=target, args=training_args(output_dir, **args),
            train_dataset=data,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    snapshot = snapshot_checkpoint(tmp_path / "straight" / "checkpoint-3", tmp_path / "snapshot")
    assert not (snapshot / "optimizer.pt").exists() and (tmp_path / "straight" / "checkpoint-3" / "optimizer.pt").exists()
    assert not list(snapshot.glob("*.py")) and not (snapshot / "custom_generate").exists()  # no stale code copies
    assert (snapshot / "scheduler.pt").is_file() and "step 3" in (snapshot / "SNAPSHOT.md").read_text()
    at_snapshot = XPressModel.from_pretrained(snapshot).state_dict()

    class FirstStepWeights(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.weights = {k: v.clone() for k, v in model.xpress.state_dict().items()}

    first = FirstStepWeights()
    resumed = XPressTrainer(
        model=tiny_xpress(target, block_size=BLOCK), target=target, args=training_args(tmp_path / "resumed", **args),
        train_dataset=data, callbacks=[first],
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(snapshot))
    assert resumed.state.global_step == 6
    assert all(torch.equal(first.weights[k], v) for k, v in at_snapshot.items())  # the run continued its weights
    rates = {e["step"]: e["learning_rate"] for e in straight.state.log_history if "learning_rate" in e}
    resumed_rates = {e["step"]: e["learning_rate"] for e in resumed.state.log_history if "learning_rate" in e}
    assert resumed_rates == rates  # steps 1-3 restored from the snapshot's logs, 4-6 from the continued schedule
    with pytest.raises(ValueError, match="not a training checkpoint"):
        snapshot_checkpoint(tmp_path / "straight", tmp_path / "nothing")
    # bf16 weights (a snapshot that must stay under the commit limit): the resumed run starts from them, rounded
    small = snapshot_checkpoint(tmp_path / "straight" / "checkpoint-3", tmp_path / "small", weights_dtype=torch.bfloat16)
    assert (small / "model.safetensors").stat().st_size < 0.6 * (snapshot / "model.safetensors").stat().st_size
    again = XPressTrainer(
        model=tiny_xpress(target, block_size=BLOCK), target=target, args=training_args(tmp_path / "again", **args),
        train_dataset=data, callbacks=[first],
    )  # fmt: skip
    again.train(resume_from_checkpoint=str(small))
    assert again.state.global_step == 6
    for k, v in at_snapshot.items():
        expected = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v
        assert torch.equal(first.weights[k], expected), k


def test_pipeline_snapshots_the_newest_checkpoint_and_keeps_the_best_one_loadable(tmp_path):
    """The pipeline's --write-snapshots: the newest checkpoint without optimizer state, and the best checkpoint's
    weights beside it when the best is another checkpoint, with the state pointing there."""
    from modeling_xpress.pipeline.stages import snapshot_stage

    target = tiny_llama()
    args = training_args(tmp_path / "runs" / "drafter", max_steps=4, per_device_train_batch_size=2,
                         save_strategy="steps", save_steps=2)  # fmt: skip
    XPressTrainer(model=tiny_xpress(target, block_size=BLOCK), target=target, args=args,
                  train_dataset=random_rows([30, 26, 34, 28])).train()  # fmt: skip
    state_file = tmp_path / "runs" / "drafter" / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["best_model_checkpoint"] = str(tmp_path / "runs" / "drafter" / "checkpoint-2")
    state_file.write_text(json.dumps(state))
    written = snapshot_stage("drafter", tmp_path / "runs", tmp_path / "snapshots")
    assert written == tmp_path / "snapshots" / "drafter" and not (written / "optimizer.pt").exists()
    saved = json.loads((written / "trainer_state.json").read_text())
    assert saved["global_step"] == 4 and saved["best_model_checkpoint"] == str(tmp_path / "snapshots" / "drafter-best")
    best = XPressModel.from_pretrained(tmp_path / "snapshots" / "drafter-best").state_dict()
    expected = XPressModel.from_pretrained(tmp_path / "runs" / "drafter" / "checkpoint-2").state_dict()
    assert all(torch.equal(best[k], v) for k, v in expected.items())
    assert snapshot_stage("markov", tmp_path / "runs", tmp_path / "snapshots") is None  # a stage that has not started
