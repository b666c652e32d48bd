"""`XPressModel.from_dflash` against an independent reference forward of the released dFlash layout (SPEC §2)."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_xpress import XPressConfig, XPressModel
from modeling_xpress.conversion import write_dflash_checkpoint
from tests.builders import tiny_llama, tiny_qwen3, tiny_xpress

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, BLOCK, MASK_ID = 2, 64, 4, 2, 16, 96, 6, 7
TARGET_LAYER_IDS = [1, 3]
THETA = 10000.0
EPS = 1e-6


def dflash_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with exactly the tensor names and shapes of a released dFlash checkpoint."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm_weight(n):
        return 1.0 + rand(n, std=0.1)

    w = {"fc.weight": rand(HIDDEN, len(TARGET_LAYER_IDS) * HIDDEN), "hidden_norm.weight": norm_weight(HIDDEN),
         "norm.weight": norm_weight(HIDDEN)}  # fmt: skip
    for i in range(LAYERS):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        w[p + "self_attn.q_norm.weight"] = norm_weight(HEAD_DIM)
        w[p + "self_attn.k_norm.weight"] = norm_weight(HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        w[p + "input_layernorm.weight"] = norm_weight(HIDDEN)
        w[p + "post_attention_layernorm.weight"] = norm_weight(HIDDEN)
    return w


def dflash_drafter(target, seed: int = 0) -> XPressModel:
    """An xPress model for `target` with the geometry above whose drafter tensors are `dflash_weights(seed)`."""
    config = XPressConfig.from_target_config(
        target.config, num_hidden_layers=LAYERS, intermediate_size=FFN, block_size=BLOCK, mask_token_id=MASK_ID,
        target_layer_ids=TARGET_LAYER_IDS, rms_norm_eps=EPS, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )  # fmt: skip
    model = XPressModel(config)
    missing, unexpected = model.load_state_dict(dflash_weights(seed), strict=False)
    assert not unexpected and all(k.startswith("refiner.") for k in missing)
    return model


def write_checkpoint(folder, target, seed: int = 0, edit_weights=None, edit_config=None):
    """A dFlash folder written by `write_dflash_checkpoint`, then (for the error tests) edited in place."""
    write_dflash_checkpoint(dflash_drafter(target, seed), folder)
    if edit_weights is not None:
        weights = load_file(folder / "model.safetensors")
        save_file(edit_weights(weights) or weights, str(folder / "model.safetensors"))
    if edit_config is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(edit_config(config) or config))
    return folder


# --- the reference: SPEC §2 written out with plain tensor ops -------------------------------------------------------


def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotate(x, positions):
    """RoPE, rotate-half convention: x (heads, t, d), positions (t,)."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = positions.float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    half = HEAD_DIM // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def reference_block_logits(w, target, prompt_ids, anchor_id):
    """Drafter logits for block positions 1..B-1 after `prompt_ids`, with `anchor_id` as the block's anchor."""
    with torch.no_grad():
        hs = target(prompt_ids, output_hidden_states=True).hidden_states
        embed = target.get_input_embeddings().weight
        lm_head = target.get_output_embeddings().weight
    c = prompt_ids.shape[1]
    context = torch.cat([hs[i + 1][0] for i in TARGET_LAYER_IDS], -1)  # (c, 2H)
    context = rms(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = torch.stack([embed[anchor_id]] + [embed[MASK_ID]] * (BLOCK - 1))  # (B, H)
    q_pos, kv_pos = torch.arange(c, c + BLOCK), torch.arange(c + BLOCK)
    for i in range(LAYERS):
        p = f"layers.{i}.self_attn."
        x = rms(h, w[f"layers.{i}.input_layernorm.weight"])
        kv_in = torch.cat([context, x])  # queries from the block, keys/values from [context ; block]
        q = (x @ w[p + "q_proj.weight"].T).view(BLOCK, HEADS, HEAD_DIM).transpose(0, 1)
        k = (kv_in @ w[p + "k_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v = (kv_in @ w[p + "v_proj.weight"].T).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        q, k = rotate(rms(q, w[p + "q_norm.weight"]), q_pos), rotate(rms(k, w[p + "k_norm.weight"]), kv_pos)
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
        attn = ((q @ k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)).softmax(-1) @ v  # no mask: bidirectional
        h = h + attn.transpose(0, 1).reshape(BLOCK, -1) @ w[p + "o_proj.weight"].T
        m = f"layers.{i}.mlp."
        x = rms(h, w[f"layers.{i}.post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(x @ w[m + "gate_proj.weight"].T)
        h = h + (gate * (x @ w[m + "up_proj.weight"].T)) @ w[m + "down_proj.weight"].T
    return rms(h, w["norm.weight"])[1:] @ lm_head.T  # (B-1, V)


def our_block_logits(model, target, prompt_ids, anchor_id):
    with torch.no_grad():
        hs = target(prompt_ids, output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in model.config.target_layer_ids], -1)
        embeds = model.embed_blocks(torch.tensor([[anchor_id]]), target.get_input_embeddings())
        out = model(noise_embeds=embeds, context_hidden_states=context)
        return model.base_logits(out.last_hidden_state, target.get_output_embeddings())[0]


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3()  # 5 layers, hidden 64: the drafter below reads layers 1 and 3


def test_write_dflash_checkpoint_writes_the_released_layout(tmp_path, target):
    folder = write_checkpoint(tmp_path / "dflash", target)
    weights = load_file(folder / "model.safetensors")
    expected = dflash_weights()
    assert sorted(weights) == sorted(expected)  # exactly the released tensor names: no head, no embedding, no lm_head
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS}
    assert (config["block_size"], config["num_target_layers"], config["rope_theta"]) == (BLOCK, 5, THETA)
    assert (config["hidden_size"], config["num_key_value_heads"], config["head_dim"]) == (HIDDEN, KV_HEADS, HEAD_DIM)


def test_write_dflash_checkpoint_round_trips_any_target(tmp_path):
    """The docstring's recipe for a target with no dFlash release: written, read back, the same drafter (with QK-norm,
    which every dFlash reader computes; a Llama target's drafter follows the target without it by default)."""
    target = tiny_llama()
    xpress = tiny_xpress(target, refiner="none", mask_token_id=0, qk_norm=True)
    folder = write_dflash_checkpoint(xpress, tmp_path / "tiny-dflash")
    loaded = XPressModel.from_dflash(folder, refiner="xpress")
    assert loaded.config.refiner == "xpress" and torch.count_nonzero(loaded.refiner.readout.weight) == 0
    for name, tensor in xpress.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    for field in ("block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "rope_parameters"):
        assert getattr(loaded.config, field) == getattr(xpress.config, field), field
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(xpress.spec_generate(target, ids, max_new_tokens=12).sequences,
                       loaded.spec_generate(target, ids, max_new_tokens=12).sequences)  # fmt: skip


def test_write_dflash_checkpoint_needs_a_mask_token(tmp_path):
    xpress = tiny_xpress(tiny_llama(), refiner="none", mask_token_id=None)
    with pytest.raises(ValueError, match=r"learns its own mask vector \(mask_token_id=None\)"):
        write_dflash_checkpoint(xpress, tmp_path / "d")


def test_from_dflash_matches_reference_forward(tmp_path, target):
    weights = dflash_weights()
    folder = write_checkpoint(tmp_path / "dflash", target)
    model = XPressModel.from_dflash(folder).eval()
    assert model.config.target_layer_ids == TARGET_LAYER_IDS and model.config.mask_token_id == MASK_ID
    assert model.config.block_size == BLOCK and model.config.refiner == "xpress"
    prompt = torch.randint(0, target.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(0))
    ref = reference_block_logits(weights, target, prompt, anchor_id=42)
    ours = our_block_logits(model, target, prompt, anchor_id=42)
    assert ref.std() > 0.1  # a non-degenerate comparison
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # Fresh head: δ = 0, so the converted model drafts exactly as the dFlash drafter would.
    assert torch.count_nonzero(model.refiner.readout.weight) == 0


def to_native_names(weights):
    weights["encoder.fc.weight"] = weights.pop("fc.weight")
    weights["encoder.output_norm_enc.weight"] = weights.pop("hidden_norm.weight")


def to_flat_fields(config):
    config.update(config.pop("dflash_config"))  # flat mask_token_id / target_layer_ids fields


def test_from_dflash_reads_transformers_native_layout(tmp_path, target):
    weights = dflash_weights(seed=1)
    folder = write_checkpoint(tmp_path / "native", target, seed=1, edit_weights=to_native_names,
                              edit_config=to_flat_fields)  # fmt: skip
    model = XPressModel.from_dflash(folder, refiner="markov").eval()
    assert model.config.refiner == "markov"
    prompt = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(our_block_logits(model, target, prompt, 3), reference_block_logits(weights, target, prompt, 3),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_converted_drafter_generates_exactly(tmp_path, target):
    model = XPressModel.from_dflash(write_checkpoint(tmp_path / "d", target)).eval()
    ids = torch.randint(0, target.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=model), expected)


def test_missing_and_misshapen_tensors_are_named(tmp_path, target):
    def drop_up_proj(weights):
        del weights["layers.1.mlp.up_proj.weight"]

    def narrow_fc(weights):
        weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()

    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "a", target, edit_weights=drop_up_proj))
    with pytest.raises(ValueError, match=r"misshapen tensors: fc.weight: checkpoint \(64, 64\) vs expected \(64, 128"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "b", target, edit_weights=narrow_fc))


def test_missing_files_and_fields_are_explained(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        XPressModel.from_dflash(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        XPressModel.from_dflash(tmp_path / "empty")
    folder = write_checkpoint(tmp_path / "noweights", target)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        XPressModel.from_dflash(folder)

    def drop_mask(config):
        config["dflash_config"].pop("mask_token_id")

    with pytest.raises(ValueError, match="has no mask_token_id"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "nomask", target, edit_config=drop_mask))
    # ...and the fix the message suggests works.
    model = XPressModel.from_dflash(tmp_path / "nomask", mask_token_id=MASK_ID)
    assert model.config.mask_token_id == MASK_ID


def test_an_xpress_checkpoint_is_not_read_as_dflash(tmp_path, target):
    tiny_xpress(target).save_pretrained(tmp_path / "xpress")
    with pytest.raises(ValueError, match="is an xPress checkpoint") as error:
        XPressModel.from_dflash(tmp_path / "xpress")
    assert f"AutoModel.from_pretrained({str(tmp_path / 'xpress')!r}, trust_remote_code=True)" in str(error.value)


def test_flat_rope_keywords_are_folded_in_as_transformers_does():
    """A transformers 4.x config's flat `rope_scaling` + `rope_theta` become `rope_parameters`: the scaling kept, the
    base kept (it fell back to transformers' 10000 when both were given), the default base Qwen3's."""
    fields = dict(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_target_layers=5, max_position_embeddings=512)
    config = XPressConfig(**fields, rope_scaling={"type": "yarn", "factor": 4.0}, rope_theta=5e5)
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["rope_theta"] == 5e5 and config.rope_parameters["original_max_position_embeddings"] == 512
    assert XPressConfig(**fields, rope_theta=123.0).rope_parameters == {"rope_type": "default", "rope_theta": 123.0}
    assert XPressConfig(**fields).rope_parameters == {"rope_type": "default", "rope_theta": 1_000_000.0}
