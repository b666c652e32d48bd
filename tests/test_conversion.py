"""`XPressModel.from_dflash` against an independent reference forward of the released dFlash layout (SPEC §2)."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from modeling_xpress import XPressModel
from tests.builders import tiny_qwen3

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


def dflash_config(vocab_size: int) -> dict:
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "rms_norm_eps": EPS, "rope_theta": THETA, "max_position_embeddings": 512,
        "vocab_size": vocab_size, "block_size": BLOCK, "num_target_layers": 5,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS},
    }  # fmt: skip


def write_checkpoint(folder, weights, config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, str(folder / "model.safetensors"))
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


def test_from_dflash_matches_reference_forward(tmp_path, target):
    weights = dflash_weights()
    folder = write_checkpoint(tmp_path / "dflash", weights, dflash_config(target.config.vocab_size))
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


def test_from_dflash_reads_transformers_native_layout(tmp_path, target):
    weights = dflash_weights(seed=1)
    native = {k.replace("fc.", "encoder.fc.", 1) if k.startswith("fc.") else k: v for k, v in weights.items()}
    native["encoder.output_norm_enc.weight"] = native.pop("hidden_norm.weight")
    config = dflash_config(target.config.vocab_size)
    nested = config.pop("dflash_config")
    config.update(nested)  # flat mask_token_id / target_layer_ids fields
    folder = write_checkpoint(tmp_path / "native", native, config)
    model = XPressModel.from_dflash(folder, refiner="markov").eval()
    assert model.config.refiner == "markov"
    prompt = torch.randint(0, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(our_block_logits(model, target, prompt, 3), reference_block_logits(weights, target, prompt, 3),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_converted_drafter_generates_exactly(tmp_path, target):
    folder = write_checkpoint(tmp_path / "d", dflash_weights(), dflash_config(target.config.vocab_size))
    model = XPressModel.from_dflash(folder).eval()
    ids = torch.randint(0, target.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=model), expected)


def test_missing_and_misshapen_tensors_are_named(tmp_path, target):
    config = dflash_config(target.config.vocab_size)
    weights = dflash_weights()
    del weights["layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors: \['layers.1.mlp.up_proj.weight'\]"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "a", weights, config))
    weights = dflash_weights()
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()
    with pytest.raises(ValueError, match=r"misshapen tensors: fc.weight: checkpoint \(64, 64\) vs expected \(64, 128\)"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "b", weights, config))


def test_missing_files_and_fields_are_explained(tmp_path, target):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        XPressModel.from_dflash(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        XPressModel.from_dflash(tmp_path / "empty")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(dflash_config(96)))
    with pytest.raises(FileNotFoundError, match="has no weights"):
        XPressModel.from_dflash(tmp_path / "noweights")
    config = dflash_config(target.config.vocab_size)
    config["dflash_config"].pop("mask_token_id")
    with pytest.raises(ValueError, match="has no mask_token_id"):
        XPressModel.from_dflash(write_checkpoint(tmp_path / "nomask", dflash_weights(), config))
    # ...and the fix the message suggests works.
    model = XPressModel.from_dflash(tmp_path / "nomask", mask_token_id=MASK_ID)
    assert model.config.mask_token_id == MASK_ID
