"""The target's training signals cached once (issue 10 item 2, `modeling_xpress.training.signal_cache`): the cache
gives the objective what the live target gives it (CE exactly, L1 within the tail bound), a Trainer trains from it
without a single target forward and resumes bitwise, and the writer resumes its shards and refuses another run's
folder."""

import math

import datasets
import pytest
import torch
from transformers.utils import logging as hf_logging

from modeling_xpress.training.signal_cache import (
    SignalCacheCollator,
    cache_target_signals,
    load_signal_cache,
    signal_cache_settings,
)
from modeling_xpress.training import XPressDataCollator, XPressObjective, XPressTrainer, with_draft_vocabulary
from tests.builders import tiny_llama, tiny_xpress
from tests.test_training import RecordStart, assert_same_optimizer_state, random_rows, training_args

hf_logging.set_verbosity_error()

BLOCK = 8
VOCAB = 96  # tiny_llama's
SHARED_KEYS = ("input_ids", "attention_mask", "anchors", "anchor_mask", "labels")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class RecordingObjective(XPressObjective):
    """Keeps every distribution's per-position loss, its logits and its teacher: what the two paths must agree on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.terms = []

    def _loss(self, logits, targets, weights):
        term = super()._loss(logits, targets, weights)
        self.terms.append((term, logits.detach(), targets))
        return term


def live_and_cached(tmp_path, target, model, rows, **cache_kwargs):
    """The same rows collated live and from a fresh cache: (live batch, cached batch)."""
    cache = cache_target_signals(
        target, rows, model.config.target_layer_ids, tmp_path / "cache", progress=False, shard_size=3, **cache_kwargs
    )
    collate = dict(block_size=BLOCK, anchors_per_sequence=5, seed=0)
    live = XPressDataCollator(**collate)(rows)
    cached = SignalCacheCollator(**collate)([cache[i] for i in range(len(rows))])
    for key in SHARED_KEYS:  # the same blocks: anchors drawn from the row alone, whatever it was loaded from
        assert torch.equal(live[key], cached[key]), key
    return live, cached


def run_objective(model, target, batch, **kwargs):
    objective = RecordingObjective(model, target, gamma=3.0, ce_weight=0.7, l1_weight=1.3)
    out = objective(**batch, anchor_weight=0.45, **kwargs)
    return objective, out


def test_collator_cuts_cached_rows_as_it_cuts_live_ones(tmp_path):
    """`max_length`: the same anchors and labels as live rows cut alike, and the features of the kept tokens only."""
    target = tiny_llama()
    rows = random_rows([30, 14, 40], seed=1)
    cache = cache_target_signals(target, rows, [1, 3], tmp_path, top_k=8, dtype=torch.float32, progress=False)
    collate = dict(block_size=BLOCK, anchors_per_sequence=5, max_length=20)
    live = XPressDataCollator(**collate)(rows)
    cached = SignalCacheCollator(**collate)(list(cache))
    assert cached["input_ids"].shape == (3, 20)
    for key in SHARED_KEYS:
        assert torch.equal(live[key], cached[key]), key
    for i, row in enumerate(cache):
        length = min(20, len(row["input_ids"]))
        assert torch.equal(cached["features"][i, :length], row["features"].view(len(row["input_ids"]), -1)[:length])
        assert not cached["features"][i, length:].any()


# ---------------------------------------------------------------------------------------------------------------------
# The objective from the cache against the live target
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_vocabulary", [False, True])
def test_cache_gives_the_live_cross_entropy_and_an_l1_within_twice_the_tail(tmp_path, draft_vocabulary):
    """Features cached in float32 and p^t as its top 8 of 96 probabilities. Per position of every distribution (p^b,
    p^r, each round's p̂^r_i): CE is the live CE; L1 exceeds the live L1 by exactly 2 Σ_M min(p_i, q_i), M = the draft vocabulary
    outside the top k, so by at most 2 × the stored tail (the derivation is in docs/training.md)."""
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    if draft_vocabulary:  # 60 of the 96 tokens are draftable: top-k entries outside it join the tail
        model = with_draft_vocabulary(model, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:60])
    rows = random_rows([30, 14, 40, 6, 25], seed=1)
    live, cached = live_and_cached(tmp_path, target, model, rows, top_k=8, dtype=torch.float32)
    live_run, _ = run_objective(model, target, live)
    cache_run, _ = run_objective(model, target, cached)
    assert len(live_run.terms) == len(cache_run.terms) == 2 + live_run.consistency_rounds  # p^b, p^r, each p̂^r_i

    anchor_mask = cached["anchor_mask"]
    ids, tail = cached["teacher_ids"][anchor_mask], cached["teacher_tail"][anchor_mask]  # (N, n, k), (N, n)
    held = torch.zeros(*ids.shape[:-1], VOCAB, dtype=torch.bool).scatter_(-1, ids, True)  # in the top k
    if model.draft_token_ids is not None:
        held = held[..., model.draft_token_ids]
    for (live_term, live_logits, live_targets), (cache_term, cache_logits, _) in zip(live_run.terms, cache_run.terms):
        valid = live_term.valid
        assert valid.sum() > 40 and torch.equal(valid, cache_term.valid)
        assert torch.equal(live_term.ce_valid, cache_term.ce_valid)
        if draft_vocabulary:
            assert (valid & ~live_term.ce_valid).any()  # some labels lie outside the draft vocabulary
        # The same drafter outputs and CE, up to float32 noise: the cache ran the target on other batches (padding).
        torch.testing.assert_close(cache_logits, live_logits, rtol=1e-4, atol=1e-5 * live_logits.abs().max().item())
        torch.testing.assert_close(cache_term.ce, live_term.ce, rtol=1e-5, atol=1e-4)

        excess = (cache_term.l1 - live_term.l1)[valid]
        p, q = live_logits.softmax(-1), live_targets.probs  # drafter and live teacher over the draft vocabulary
        expected = 2 * (torch.minimum(p, q) * ~held).sum(-1)[valid]
        assert excess.max() > 1e-3  # the truncation is not a no-op here ...
        torch.testing.assert_close(excess, expected, rtol=1e-4, atol=2e-6)  # ... and costs exactly this
        assert excess.min() >= -2e-6 and (excess <= 2 * tail[valid] + 2e-6).all()


def test_the_whole_vocabulary_as_top_k_gives_the_live_loss_and_gradients(tmp_path):
    """top_k = V: the tail is 0 and the cached objective is the live one, loss, metrics and gradients."""
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    live, cached = live_and_cached(tmp_path, target, model, random_rows([30, 14, 40, 6], seed=1), top_k=VOCAB,
                                   dtype=torch.float32)  # fmt: skip
    assert cached["teacher_tail"].max() < 1e-6
    grads = {}
    for name, batch in (("live", live), ("cached", cached)):
        _, out = run_objective(model, target, batch)
        out.loss.backward()
        grads[name] = ({n: p.grad.clone() for n, p in model.named_parameters()}, out)
        model.zero_grad()
    (live_grads, live_out), (cache_grads, cache_out) = grads["live"], grads["cached"]
    torch.testing.assert_close(cache_out.loss, live_out.loss, rtol=1e-5, atol=1e-6)
    for key, value in live_out.metrics.items():
        torch.testing.assert_close(cache_out.metrics[key], value, rtol=1e-5, atol=1e-5, msg=key)
    for name, grad in live_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(cache_grads[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item(), msg=name)


def test_bfloat16_features_cost_a_bounded_difference_and_none_under_bf16_autocast(tmp_path):
    """bf16 features (the default) round the drafter's context: a small CE difference in float32 training, and none
    at all under bf16 autocast, where the drafter's first op on them (fc) rounds float32 features to bf16 anyway."""
    target = tiny_llama()
    model = tiny_xpress(target, block_size=BLOCK)
    rows = random_rows([30, 14, 40, 6], seed=1)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _, exact = live_and_cached(tmp_path / "a", target, model, rows, top_k=VOCAB, dtype=torch.float32)
    _, rounded = live_and_cached(tmp_path / "b", target, model, rows, top_k=VOCAB, dtype=torch.bfloat16)
    assert rounded["features"].dtype == torch.bfloat16
    torch.testing.assert_close(rounded["features"], exact["features"].bfloat16(), rtol=0, atol=0)  # stored bit-exact

    ce = []
    for batch in (exact, rounded):
        objective, _ = run_objective(model, target, batch)
        term = objective.terms[0][0]  # p^b
        ce.append(term.ce[term.ce_valid])
    relative = ((ce[1] - ce[0]).abs() / ce[0]).max().item()
    assert 0 < relative < 1e-2, relative

    losses = []
    for batch in (exact, rounded):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses.append(run_objective(model, target, batch)[1].loss)
    assert torch.equal(losses[0], losses[1])


# ---------------------------------------------------------------------------------------------------------------------
# Training from the cache
# ---------------------------------------------------------------------------------------------------------------------


def refuse_forward(*args, **kwargs):
    raise AssertionError("the target ran a forward while training from the signal cache")


def test_trainer_trains_from_the_cache_without_a_single_target_forward(tmp_path):
    target = tiny_llama()
    rows = random_rows([30, 26, 34, 28], prompt=4, seed=2)
    model = tiny_xpress(target, block_size=BLOCK, randomize_head=False)
    cache = cache_target_signals(target, rows, model.config.target_layer_ids, tmp_path / "cache", progress=False)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    target.forward = refuse_forward  # the whole target, and its decoder stack, would raise if run
    target.model.forward = refuse_forward
    trainer = XPressTrainer(model=model, target=target, args=training_args(tmp_path / "run", max_steps=3),
                            train_dataset=cache)  # fmt: skip
    assert isinstance(trainer.data_collator, SignalCacheCollator)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses)
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    assert "fc.weight" in changed and any(name.startswith("refiner.") for name in changed)  # drafter and head trained
    # The embedding table and lm_head it still uses are the target's, frozen.
    assert not any(p.requires_grad for p in target.parameters())


def test_trainer_refuses_a_cache_of_other_layers_or_another_target(tmp_path):
    target = tiny_llama()
    rows = random_rows([30, 26], prompt=4, seed=2)
    model = tiny_xpress(target, block_size=BLOCK)
    cache = cache_target_signals(target, rows, model.config.target_layer_ids, tmp_path / "cache", progress=False)
    assert signal_cache_settings(cache)["layer_ids"] == model.config.target_layer_ids
    other_layers = tiny_xpress(target, block_size=BLOCK, target_layer_ids=[0, 2])
    with pytest.raises(ValueError, match="target layers"):
        XPressTrainer(model=other_layers, target=target, args=training_args(tmp_path), train_dataset=cache)
    with pytest.raises(ValueError, match="another target"):
        XPressTrainer(model=model, target=tiny_llama(seed=5), args=training_args(tmp_path), train_dataset=cache)
    stripped = datasets.Dataset(cache.data)  # the cache's rows without its settings
    with pytest.raises(ValueError, match="load_signal_cache"):
        XPressTrainer(model=model, target=target, args=training_args(tmp_path), train_dataset=stripped)


class RecordingTrainer(XPressTrainer):
    """Keeps every batch it trains on, the cached features and teacher rows included."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            self.batches.append({k: v.clone() for k, v in inputs.items()})
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def test_resume_from_the_cache_reads_the_same_shards_and_ends_bitwise_where_the_uninterrupted_run_does(tmp_path):
    """The resume test of test_training, from the cache: 6 steps over 2 epochs interrupted at step 4 (mid epoch 1);
    each run loads the cache folder anew and gets the same batches (features and teacher rows included), and ends
    with bitwise the same weights and optimizer state."""
    target = tiny_llama()
    rows = random_rows([30, 26, 34, 28, 24, 32], prompt=4, seed=2)
    folder = tmp_path / "cache"
    model = tiny_xpress(target, block_size=BLOCK, randomize_head=False)
    cache_target_signals(target, rows, model.config.target_layer_ids, folder, top_k=16, shard_size=4, progress=False)
    args = dict(max_steps=6, per_device_train_batch_size=2, anchors_per_sequence=4, save_strategy="steps", save_steps=2,
                learning_rate=1e-2)  # fmt: skip
    target.forward = refuse_forward

    def run(output_dir, resume=None):
        start = RecordStart()
        trainer = RecordingTrainer(
            model=tiny_xpress(target, block_size=BLOCK, randomize_head=False), target=target,
            args=training_args(output_dir, **args), train_dataset=load_signal_cache(folder), callbacks=[start],
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer, start

    straight, _ = run(tmp_path / "straight")
    assert len(straight.batches) == 6 and straight.state.epoch == 2.0
    assert {"features", "teacher_ids", "teacher_probs", "teacher_tail"} <= straight.batches[0].keys()
    checkpoint = tmp_path / "straight" / "checkpoint-4"
    resumed, start = run(tmp_path / "resumed", resume=str(checkpoint))
    assert start.step == 4 and resumed.state.global_step == 6
    assert len(resumed.batches) == 2
    for got, expected in zip(resumed.batches, straight.batches[4:]):
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert_same_optimizer_state(resumed.optimizer.state_dict(), straight.optimizer.state_dict())
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), f"{name}: max |Δ| {(a - b).abs().max().item():.3g}"


# ---------------------------------------------------------------------------------------------------------------------
# The writer
# ---------------------------------------------------------------------------------------------------------------------


def test_writer_resumes_finished_shards_and_refuses_another_runs_folder(tmp_path):
    target = tiny_llama()
    rows = random_rows([30, 14, 40, 6, 25, 19, 33], seed=1) + [{"input_ids": [], "loss_mask": []}]  # 3 shards of 3
    layers, folder = [1, 3], tmp_path / "cache"
    first = cache_target_signals(target, rows, layers, folder, top_k=8, shard_size=3, progress=False)
    assert len(first) == len(rows) and [len(r["input_ids"]) for r in first] == [len(r["input_ids"]) for r in rows]
    row = first[0]  # teacher rows only where the next token is labelled
    labelled = torch.tensor(rows[0]["loss_mask"][1:] + [0], dtype=torch.bool)
    tail, probs = row["tail"], row["topk_probs"].view(len(labelled), -1)
    assert (probs[labelled] > 0).all() and (probs[~labelled] == 0).all() and (tail[~labelled] == 0).all()
    assert row["features"].view(len(labelled), -1).shape[1] == 2 * 64  # 2 layers of the 64-wide target
    torch.testing.assert_close(probs.sum(-1)[labelled] + tail[labelled], torch.ones(int(labelled.sum())))

    shards = sorted(folder.glob("shard-*.arrow"))
    assert len(shards) == 3
    stamps = {path.name: path.stat().st_mtime_ns for path in shards}
    shards[1].unlink()  # as if the run had been killed while writing the second shard
    with pytest.raises(ValueError, match="unfinished"):
        load_signal_cache(folder)
    seen = []
    forward = target.forward
    target.forward = lambda *args, **kwargs: seen.append(kwargs["input_ids"].shape[0]) or forward(*args, **kwargs)
    resumed = cache_target_signals(target, rows, layers, folder, top_k=8, shard_size=3, progress=False, batch_size=2)
    assert sum(seen) == 3  # only the missing shard's rows went through the target
    assert {p.name: p.stat().st_mtime_ns for p in shards if p != shards[1]} == {
        name: stamp for name, stamp in stamps.items() if name != shards[1].name
    }  # the finished shards were not rewritten
    for got, expected in zip(resumed, first, strict=True):
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-6)  # other batches: float noise

    for change in (dict(top_k=4), dict(layer_ids=[0, 3]), dict(rows=rows[:-2]), dict(target=tiny_llama(seed=5)),
                   dict(dtype=torch.float32)):  # fmt: skip
        call = dict(target=target, rows=rows, layer_ids=layers, top_k=8) | change
        with pytest.raises(ValueError, match="different run"):
            cache_target_signals(call["target"], call["rows"], call["layer_ids"], folder, top_k=call["top_k"],
                                 shard_size=3, dtype=change.get("dtype", torch.bfloat16), progress=False)  # fmt: skip


def test_example_script_builds_the_cache_once_and_trains_two_stages_from_it(tmp_path, monkeypatch):
    from tests.test_training import run_example

    folder = tmp_path / "signals"
    common = ["--target", "tiny-random", "--signal_cache", str(folder), "--signal_cache_top_k", "16",
              "--max_steps", "2", "--per_device_train_batch_size", "2", "--refiner_rank", "8"]  # fmt: skip
    run_example(monkeypatch, *common, "--refiner", "none", "--num_draft_layers", "1", "--block_size", "4",
                "--output_dir", str(tmp_path / "drafter"))  # fmt: skip
    stamps = {path: path.stat().st_mtime_ns for path in folder.glob("shard-*.arrow")}
    assert stamps and signal_cache_settings(load_signal_cache(folder))["top_k"] == 16
    # The head stage on the trained drafter reads the same cache: nothing is written again.
    run_example(monkeypatch, *common, "--init_from", str(tmp_path / "drafter"), "--refiner", "xpress",
                "--train_mode", "refiner", "--output_dir", str(tmp_path / "head"))  # fmt: skip
    assert {path: path.stat().st_mtime_ns for path in folder.glob("shard-*.arrow")} == stamps
    assert (tmp_path / "head" / "model.safetensors").is_file()
