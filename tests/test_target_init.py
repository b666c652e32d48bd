"""A drafter that starts from its target (`modeling_xpress.training.target_init`) and the `qk_norm` switch it needs
for Llama.

The core claim: a copied layer computes exactly what it computed in the target, given the same inputs, the same RoPE
and the same causal mask — first asserted not to hold before copying, so the test cannot pass on a no-op.
"""


import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.training.target_init import (
    context_slot, drafter_from_target, init_drafter_from_target, read_more_target_layers,
)  # fmt: skip
from tests.builders import tiny_llama, tiny_qwen3

SEQ = 12


def tiny_mistral(seed: int = 0) -> MistralForCausalLM:
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=None, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


TARGETS = {
    "llama": tiny_llama,
    # a Llama whose attention has biases and whose MLP is not SiLU: both must be carried over, not assumed
    "llama-bias-gelu": lambda: tiny_llama(attention_bias=True, hidden_act="gelu_pytorch_tanh"),
    "mistral": tiny_mistral,
    "qwen3": tiny_qwen3,
}


def fresh_drafter(target, **overrides) -> XPressModel:
    torch.manual_seed(1)
    fields = dict(num_hidden_layers=2, refiner="none") | overrides
    return XPressModel(XPressConfig.from_target_config(target.config, **fields)).eval()


def target_states(target, seed: int = 0):
    """The target's hidden states on a random sequence: hs[i] is the input of decoder layer i."""
    ids = torch.randint(0, target.config.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ids, target(ids, output_hidden_states=True).hidden_states


def causal_mask(q: int) -> torch.Tensor:
    return torch.ones(q, q, dtype=torch.bool).tril()[None, None]  # (1, 1, q, q), True = attend


@torch.no_grad()
def layer_outputs(xpress, target, pairs, hidden):
    """(drafter layer j, target layer t) → both layers' outputs on `hidden`, same RoPE, causal, no context."""
    decoder = target.get_decoder()
    cos, sin = decoder.rotary_emb(hidden, torch.arange(SEQ)[None])
    out = []
    for j, t in pairs:
        mine = xpress.layers[j](hidden, None, cos, sin, causal_mask(SEQ), None)
        theirs = decoder.layers[t](hidden, attention_mask=None, position_embeddings=(cos, sin))
        out.append((mine, theirs))
    return out


@pytest.mark.parametrize("family", list(TARGETS))
def test_a_copied_layer_computes_what_it_computed_in_the_target(family):
    target = TARGETS[family]()
    xpress = fresh_drafter(target)
    assert xpress.config.qk_norm is (family == "qwen3")
    bias = getattr(target.config, "attention_bias", False)  # (Mistral's config has no such field: no biases)
    assert (xpress.config.hidden_act, xpress.config.attention_bias) == (target.config.hidden_act, bias)
    _, hs = target_states(target)
    layers = target.config.num_hidden_layers
    pairs = [(0, layers - 2), (1, layers - 1)]  # the default: the target's last two layers
    for mine, theirs in layer_outputs(xpress, target, pairs, hs[1]):
        assert (mine - theirs).abs().max() > 1e-2  # not a no-op: a random drafter layer computes something else

    init_drafter_from_target(xpress, target)
    for mine, theirs in layer_outputs(xpress, target, pairs, hs[1]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # The drafter's own RoPE is the target's, so its forward uses the same cos/sin as well.
    cos, sin = target.get_decoder().rotary_emb(hs[0], torch.arange(SEQ)[None])
    own_cos, own_sin = xpress.rotary_emb(hs[0], torch.arange(SEQ)[None])
    torch.testing.assert_close((own_cos, own_sin), (cos, sin), rtol=0, atol=0)
    # Chained with the final norm and the target's lm_head: the target's last layers' logits, exactly.
    with torch.no_grad():
        hidden = hs[layers - 2]
        for j in range(2):
            hidden = xpress.layers[j](hidden, None, cos, sin, causal_mask(SEQ), None)
        logits = target.lm_head(xpress.norm(hidden))
        torch.testing.assert_close(logits, target.lm_head(hs[layers]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_first_copied_layer_reads_the_targets_own_keys_and_values_as_context(family):
    """`fc` selects the output of layer first − 1 and `hidden_norm` is layer first's input_layernorm, so the first
    drafter layer, given the target's context features and the next token's target state as a one-token block,
    reproduces the target's layer output at that token (attention over [context ; block] = the target's causal row)."""
    target = TARGETS[family]()
    xpress = init_drafter_from_target(fresh_drafter(target), target)
    first = target.config.num_hidden_layers - 2
    assert first - 1 in xpress.config.target_layer_ids  # dFlash's rule lines up with the last two layers
    ids, hs = target_states(target)
    c = SEQ - 1  # context tokens 0..c-1, the block is token c alone
    features = torch.cat([hs[i + 1] for i in xpress.config.target_layer_ids], dim=-1)
    cos, sin = target.get_decoder().rotary_emb(hs[0], torch.arange(SEQ)[None])
    with torch.no_grad():
        context = xpress.project_context(features[:, :c])
        out = xpress.layers[0](hs[first][:, c:], context, cos, sin, None, None)
    torch.testing.assert_close(out, hs[first + 1][:, c:], rtol=1e-5, atol=1e-5)


def test_context_slot_picks_the_input_of_the_first_copied_layer_or_the_nearest():
    assert context_slot(28, [1, 27]) == 1  # SmolLM2, 2 drafter layers: exactly the input of layer 28
    assert context_slot(31, [1, 9, 17, 25, 33]) == 4  # Qwen3-8B, last 5: 33 is nearer to 30 than 25
    assert context_slot(0, [1, 9]) == 0  # the first layers: the shallowest feature
    assert context_slot(10, [7, 11]) == 1  # a tie (both 2 away from 9): the deeper


def test_from_target_config_follows_the_targets_attention():
    assert XPressConfig.from_target_config(tiny_qwen3().config).qk_norm is True
    assert XPressConfig.from_target_config(tiny_llama().config).qk_norm is False
    assert XPressConfig.from_target_config(tiny_mistral().config).qk_norm is False
    # a family without an entry keeps dFlash's layout
    qwen2 = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert XPressConfig.from_target_config(qwen2).qk_norm is True
    assert XPressConfig.from_target_config(tiny_llama().config, qk_norm=True).qk_norm is True  # an override wins
    config = XPressConfig.from_target_config(tiny_llama(attention_bias=True, hidden_act="gelu").config)
    assert (config.attention_bias, config.hidden_act) == (True, "gelu")


def test_a_drafter_without_qk_norm_has_no_such_tensors_and_round_trips(tmp_path):
    target = tiny_llama()
    xpress = drafter_from_target(target, num_hidden_layers=2, refiner="xpress", refiner_rank=8, block_size=6)
    names = list(xpress.state_dict())
    assert not [n for n in names if "q_norm" in n or "k_norm" in n]
    assert xpress.layers[0].self_attn.q_norm is None and xpress.layers[0].self_attn.k_norm is None
    assert any("q_norm" in n for n in fresh_drafter(tiny_qwen3()).state_dict())  # and a Qwen3 drafter has them

    xpress.save_pretrained(tmp_path / "x")
    loaded, info = XPressModel.from_pretrained(tmp_path / "x", output_loading_info=True)
    assert loaded.config.qk_norm is False and not any(info.values())
    _, hs = target_states(target)
    embeds = target.get_input_embeddings()(torch.randint(0, 96, (1, 6)))
    with torch.no_grad():
        expected = xpress(embeds, hs[2][:, :5].repeat(1, 1, 2)).last_hidden_state
        torch.testing.assert_close(loaded(embeds, hs[2][:, :5].repeat(1, 1, 2)).last_hidden_state, expected)


def test_a_checkpoint_saved_before_the_qk_norm_field_still_builds_a_qk_norm_drafter(tmp_path):
    """Folders saved before `qk_norm` existed (the first bundled checkpoint was one) have no such field and a drafter
    with QK-norm: they load as that, every tensor used."""
    import json

    saved = fresh_drafter(tiny_qwen3())
    assert saved.config.qk_norm is True
    saved.save_pretrained(tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["qk_norm"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    model, info = XPressModel.from_pretrained(tmp_path / "old", output_loading_info=True)
    assert model.config.qk_norm is True and not any(info.values())  # every tensor loaded, none left over
    assert "layers.0.self_attn.q_norm.weight" in model.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("refiner", ["none", "xpress"])
def test_greedy_generate_with_a_target_initialised_drafter_is_the_targets_own(family, refiner):
    target = TARGETS[family]()
    xpress = drafter_from_target(target, num_hidden_layers=2, refiner=refiner, refiner_rank=8, block_size=6).eval()
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(5))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = target.generate(ids, **kwargs)
    assisted = target.generate(ids, assistant_model=xpress, **kwargs)
    assert torch.equal(assisted, plain)
    assert xpress.generation_stats.mean_tau >= 1.0


def test_errors_name_what_is_wrong():
    llama = tiny_llama()
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()  # fmt: skip
    with pytest.raises(ValueError, match=r"'qwen2' target.*supported for llama, mistral, qwen3"):
        drafter_from_target(qwen2, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"target_layers \[4\] are out of range .* \(valid: 0\.\.3\)"):
        drafter_from_target(llama, target_layers=[1, 4])
    with pytest.raises(ValueError, match=r"names 1 layers \(\[3\]\) for a drafter with 2"):
        drafter_from_target(llama, num_hidden_layers=2, target_layers=[3])
    with pytest.raises(ValueError, match=r"cannot copy 5 layers from a target with 4"):
        drafter_from_target(llama, num_hidden_layers=5)
    with pytest.raises(ValueError, match=r"'last' or a list"):
        drafter_from_target(llama, num_hidden_layers=2, target_layers="first")
    with pytest.raises(ValueError, match=r"intermediate_size 96 != target's 128"):
        drafter_from_target(llama, num_hidden_layers=2, intermediate_size=96)
    with pytest.raises(ValueError, match=r"qk_norm True != target's False"):
        drafter_from_target(llama, num_hidden_layers=2, qk_norm=True)
    narrow = fresh_drafter(tiny_llama(hidden_size=32, intermediate_size=64, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"hidden_size 64 != drafter's target_hidden_size 32"):
        init_drafter_from_target(narrow, llama)
    with pytest.raises(ValueError, match=r"qk_norm must be True or False, got 'yes'"):
        XPressConfig.from_target_config(llama.config, qk_norm="yes")


def test_example_script_starts_the_drafter_from_the_target(tmp_path, monkeypatch):
    import datasets

    from tests.test_training import random_rows, run_example

    target = tiny_llama()
    target.save_pretrained(tmp_path / "target")
    datasets.Dataset.from_list(random_rows([30, 25, 40, 33])).to_parquet(str(tmp_path / "data.parquet"))
    common = ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.parquet"), "--refiner", "none",
              "--num_draft_layers", "2", "--block_size", "6", "--per_device_train_batch_size", "2"]  # fmt: skip
    # learning rate 0: the saved drafter is the initialisation itself
    run_example(monkeypatch, *common, "--init_from_target_layers", "1,3", "--output_dir", str(tmp_path / "a"),
                "--max_steps", "1", "--learning_rate", "0")  # fmt: skip
    drafter = XPressModel.from_pretrained(tmp_path / "a")
    assert drafter.config.qk_norm is False
    for j, t in enumerate([1, 3]):
        for name, tensor in target.model.layers[t].state_dict().items():
            torch.testing.assert_close(drafter.layers[j].state_dict()[name], tensor, rtol=0, atol=0)
    torch.testing.assert_close(drafter.norm.weight, target.model.norm.weight, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass one of them"):
        run_example(monkeypatch, *common, "--init_from_target_layers", "last", "--init_from", str(tmp_path / "a"),
                    "--output_dir", str(tmp_path / "b"), "--max_steps", "1")  # fmt: skip
    with pytest.raises(ValueError, match=r"'last' or comma-separated integers, got 'deep'"):
        run_example(monkeypatch, *common, "--init_from_target_layers", "deep", "--output_dir", str(tmp_path / "c"),
                    "--max_steps", "1")  # fmt: skip
    # --target_layer_ids: a deeper drafter reading the layers another drafter's signal cache holds
    run_example(monkeypatch, *common[:-4], "--num_draft_layers", "3", "--target_layer_ids", "0,2", "--block_size",
                "6", "--per_device_train_batch_size", "2", "--init_from_target_layers", "last", "--output_dir",
                str(tmp_path / "d"), "--max_steps", "1", "--learning_rate", "0")  # fmt: skip
    deeper = XPressModel.from_pretrained(tmp_path / "d")
    assert deeper.config.num_hidden_layers == 3 and deeper.config.target_layer_ids == [0, 2]
    assert deeper.fc.weight.shape[1] == 2 * target.config.hidden_size
    with pytest.raises(ValueError, match=r"--target_layer_ids must be comma-separated integers, got 'a,b'"):
        run_example(monkeypatch, *common, "--target_layer_ids", "a,b", "--output_dir", str(tmp_path / "e"),
                    "--max_steps", "1")  # fmt: skip
    # --target_layer_ids with --init_from: the checkpoint's drafter reading more target layers, the same function
    run_example(monkeypatch, *common, "--target_layer_ids", "0,1,2,3", "--init_from", str(tmp_path / "d"),
                "--output_dir", str(tmp_path / "f"), "--max_steps", "1", "--learning_rate", "0")  # fmt: skip
    widened = XPressModel.from_pretrained(tmp_path / "f")
    width = target.config.hidden_size
    assert widened.config.target_layer_ids == [0, 1, 2, 3] and widened.fc.weight.shape[1] == 4 * width
    torch.testing.assert_close(widened.fc.weight[:, :width], deeper.fc.weight[:, :width], rtol=0, atol=0)  # layer 0
    torch.testing.assert_close(widened.fc.weight[:, 2 * width : 3 * width], deeper.fc.weight[:, width:], rtol=0, atol=0)
    assert not widened.fc.weight[:, width : 2 * width].any() and not widened.fc.weight[:, 3 * width :].any()
    with pytest.raises(ValueError, match=r"must hold every layer the drafter reads now"):
        run_example(monkeypatch, *common, "--target_layer_ids", "0", "--init_from", str(tmp_path / "d"),
                    "--output_dir", str(tmp_path / "g"), "--max_steps", "1")  # fmt: skip


def test_a_drafter_reading_more_target_layers_computes_what_it_computed():
    """read_more_target_layers: whatever the new layers' features are, the widened drafter's output is the original's
    (their fc columns start at zero); the old layers' columns follow their layers to the new slots; the original is
    untouched; a list that drops or repeats a layer, or leaves the target, is refused."""
    target = tiny_llama()
    original = fresh_drafter(target, target_layer_ids=[1, 3])
    torch.nn.init.normal_(original.fc.weight)
    widened = read_more_target_layers(original, [0, 1, 2, 3])
    assert original.config.target_layer_ids == [1, 3] and original.fc.in_features == 2 * 64
    width, block = target.config.hidden_size, original.config.block_size
    features = {layer: torch.randn(1, 5, width) for layer in range(4)}
    noise = torch.randn(1, block, width)
    with torch.no_grad():
        before = original(noise, torch.cat([features[1], features[3]], -1)).last_hidden_state
        after = widened(noise, torch.cat([features[i] for i in range(4)], -1)).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)
    for bad, message in [([0, 1], "drops"), ([1, 3, 3], "repeats"), ([1, 3, 4], "out of range")]:
        with pytest.raises(ValueError, match=message):
            read_more_target_layers(original, bad)
    doubled = fresh_drafter(target, target_layer_ids=[1, 1])  # dFlash's rule for a small target can repeat a layer
    torch.nn.init.normal_(doubled.fc.weight)
    merged = read_more_target_layers(doubled, [1, 2])
    with torch.no_grad():
        before = doubled(noise, torch.cat([features[1], features[1]], -1)).last_hidden_state
        after = merged(noise, torch.cat([features[1], features[2]], -1)).last_hidden_state
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
