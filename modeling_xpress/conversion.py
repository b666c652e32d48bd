"""Build an xPress model from a released dFlash drafter checkpoint; the correction head starts fresh.
`write_dflash_checkpoint` writes an xPress drafter back in the released layout, e.g. a small folder for any target
to try `from_dflash` on.

Two source layouts are read:

* dFlash releases (e.g. `z-lab/Qwen3-8B-DFlash-b16`): a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
  `block_size`, `num_target_layers` and a nested `dflash_config: {mask_token_id, target_layer_ids}`; weights
  `layers.*`, `norm.weight`, `fc.weight`, `hidden_norm.weight` (no embedding, no lm_head).
* transformers' native dFlash assistant: flat `block_size`/`mask_token_id`/`target_layer_ids` config fields and
  `encoder.fc` / `encoder.output_norm_enc` weight names.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import json
import os
from pathlib import Path

import torch
from transformers.modeling_utils import load_state_dict, safe_save_file
from transformers.utils import logging

from .configuration_xpress import XPressConfig

logger = logging.get_logger(__name__)

_RENAMES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_IGNORED_PREFIXES = ("embed_tokens.", "lm_head.")  # the drafter uses the target's own tables


def _drafter_state(model) -> dict[str, torch.Tensor]:
    """The tensors a dFlash checkpoint holds: the drafter's, without the correction head or a learned mask vector."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("refiner.") and k != "mask_embedding"}


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no config.json; expected a dFlash checkpoint folder (config + weights)")
    return json.loads(path.read_text())


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: model.safetensors, a sharded safetensors index, or pytorch_model.bin."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (folder / "pytorch_model.bin").is_file():
        files = ["pytorch_model.bin"]
    else:
        raise FileNotFoundError(
            f"{folder} has no weights: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
        )
    state = {}
    for name in files:
        state.update(load_state_dict(str(folder / name)))
    return state


def dflash_config_to_xpress(raw: dict, **overrides) -> XPressConfig:
    """Map a dFlash (or native transformers dFlash assistant) config dict onto `XPressConfig` fields."""
    nested = raw.get("dflash_config") or {}
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in raw]
    if missing:
        raise ValueError(f"dFlash config is missing {missing}; is this a dFlash drafter checkpoint?")
    fields = dict(
        hidden_size=raw["hidden_size"],
        target_hidden_size=raw.get("target_hidden_size", raw["hidden_size"]),
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        mask_token_id=nested.get("mask_token_id", raw.get("mask_token_id")),
        target_layer_ids=nested.get("target_layer_ids", raw.get("target_layer_ids")),
    )
    # Fields the dFlash config may leave out keep XPressConfig's own defaults (declared once, there); a flat
    # `rope_theta` is honoured by XPressConfig itself.
    optional = ("rms_norm_eps", "max_position_embeddings", "attention_bias", "hidden_act", "block_size",
                "rope_parameters", "rope_theta", "vocab_size", "num_target_layers", "bos_token_id", "eos_token_id",
                "pad_token_id", "qk_norm")  # fmt: skip
    fields.update({key: raw[key] for key in optional if raw.get(key) is not None})
    fields.update(overrides)
    if "num_target_layers" not in fields:
        raise ValueError(
            "The dFlash config has no num_target_layers; pass num_target_layers=<target's layer count> to from_dflash"
        )
    if fields.get("mask_token_id") is None:
        raise ValueError(
            "The dFlash config has no mask_token_id (dflash_config.mask_token_id). A released drafter was trained "
            "with a specific mask token; pass mask_token_id=<that id> to from_dflash. (A learned mask vector is only "
            "for drafters trained that way from scratch.)"
        )
    if fields.get("target_layer_ids") is None:
        raise ValueError("The dFlash config has no target_layer_ids; pass target_layer_ids=[...] to from_dflash")
    return XPressConfig(**fields)


def _normalise_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name.startswith(_IGNORED_PREFIXES):
            logger.warning(f"Ignoring {name}: xPress reads the target's own embedding table and lm_head")
            continue
        out[name] = tensor
    return out


def load_dflash(cls, path: str | os.PathLike, **overrides):
    """Instantiate `cls` (an `XPressModel`) with a dFlash checkpoint's drafter weights and a fresh head."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"dFlash checkpoint folder {folder} does not exist")
    raw = _read_config(folder)
    if raw.get("model_type") == XPressConfig.model_type:
        raise ValueError(
            f"{folder} is an xPress checkpoint (config.json has model_type 'xpress'), not a dFlash drafter: load it "
            f"with AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True) or "
            f"XPressModel.from_pretrained({str(folder)!r})"
        )
    model = cls(dflash_config_to_xpress(raw, **overrides))
    state = _normalise_names(_read_weights(folder))
    expected = {k: v.shape for k, v in _drafter_state(model).items()}
    missing = sorted(set(expected) - set(state))
    misshapen = [f"{k}: checkpoint {tuple(state[k].shape)} vs expected {tuple(s)}" for k, s in expected.items() if k in state and state[k].shape != s]
    unexpected = sorted(set(state) - set(expected))
    if missing or misshapen or unexpected:
        lines = []
        if missing:
            lines.append(f"missing tensors: {missing}")
        if misshapen:
            lines.append("misshapen tensors: " + "; ".join(misshapen))
        if unexpected:
            lines.append(f"unexpected tensors: {unexpected}")
        raise ValueError(
            f"{folder} does not match the dFlash layout implied by its config ("
            + " | ".join(lines)
            + "). Check that config.json belongs to these weights."
        )
    model.load_state_dict(state, strict=False)
    return model


def write_dflash_checkpoint(model, path: str | os.PathLike) -> Path:
    """Write `model`'s drafter (an `XPressModel`) as a dFlash checkpoint folder in the released layout.

    The folder holds a Qwen3-style `config.json` with `architectures: ["DFlashDraftModel"]`, `block_size`,
    `num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`, and `model.safetensors` with
    `layers.*`, `norm.weight`, `fc.weight`, `hidden_norm.weight`. The correction head is not part of that layout and is
    not written; `XPressModel.from_dflash(path)` reads the drafter back exactly, with a fresh head. A small folder for
    any target, to try `from_dflash` on:

        config = XPressConfig.from_target_config(target.config, num_hidden_layers=1, mask_token_id=0)
        write_dflash_checkpoint(XPressModel(config), "tiny-dflash")
        xpress = XPressModel.from_dflash("tiny-dflash", refiner="xpress")

    dFlash marks masked positions with a target token, so the model needs `config.mask_token_id`.
    """
    config = model.config
    if config.mask_token_id is None:
        raise ValueError(
            "The dFlash layout marks masked positions with a target token id, but this drafter learns its own mask "
            "vector (mask_token_id=None). Build it with mask_token_id=<a token id of the target> to write it as dFlash."
        )
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "qk_norm": config.qk_norm,  # releases have QK-norm and no such field; a Llama-style drafter (False) says so
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": config.rope_parameters.get("rope_theta"),  # older readers take the flat field
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "dtype": str(model.dtype).removeprefix("torch."),
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)},
    }
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    state = {name: tensor.detach().contiguous() for name, tensor in _drafter_state(model).items()}
    safe_save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


__all__ = ["load_dflash", "dflash_config_to_xpress", "write_dflash_checkpoint"]
