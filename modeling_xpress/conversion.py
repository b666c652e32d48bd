"""Build an xPress model from a released dFlash drafter checkpoint; the correction head starts fresh.
`write_dflash_checkpoint` writes an xPress drafter back in the released layout, e.g. a small folder for any target
to try `from_dflash` on.

Two source layouts are read:

* dFlash releases (e.g. `z-lab/Qwen3-8B-DFlash-b16`): a Qwen3 config with `architectures: ["DFlashDraftModel"]`,
  `block_size`, `num_target_layers` and a nested `dflash_config: {mask_token_id, target_layer_ids}`; weights
  `layers.*`, `norm.weight`, `fc.weight`, `hidden_norm.weight` (no embedding, no lm_head).
* transformers' native dFlash assistant: flat `block_size`/`mask_token_id`/`target_layer_ids` config fields and
  `encoder.fc` / `encoder.output_norm_enc` weight names.

The xPress authors' release format (their vLLM serving folders, e.g. `UIUC-SSAIL/Qwen3-8B-XPress-b16`) is the dFlash
layout plus the head: `architectures: ["Qwen3XPressModel"]`, `xpress_rank`, `xpress_mlp_hidden`,
`xpress_block_size`, `xpress_num_passes`, `sample_from_anchor`, and `xpress_head.*` tensors (`RELEASE_HEAD_NAMES`).
`load_xpress_release` reads it (`XPressModel.from_pretrained` does, for a folder or a Hub id); `write_xpress_release`
writes an xPress model in it. Their training pickle goes through `convert_release_pickle` only.

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
# The authors' release: architecture name and head tensor names (release name → this package's `refiner.` name).
RELEASE_ARCHITECTURE = "Qwen3XPressModel"
RELEASE_HEAD_PREFIX = "xpress_head."
RELEASE_HEAD_NAMES = {
    "w1.weight": "token_embed.weight",
    "down_h.weight": "hidden_proj.weight",
    "down_g.weight": "global_proj.weight",
    "in_proj.weight": "fuse.weight",
    "mix.L": "mix",  # raw (unfolded, unmasked) L, as trained
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "down.weight",
    "w2.weight": "readout.weight",
}
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
    _check_drafter_state(model, state, folder)
    model.load_state_dict(state, strict=False)
    return model


def _check_drafter_state(model, state: dict[str, torch.Tensor], folder: Path) -> None:
    """A ValueError naming every drafter tensor that is missing, misshapen or unexpected in `state`."""
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


# --- the xPress authors' release format ---------------------------------------------------------------------------


def is_release_config(raw: dict) -> bool:
    """Whether a config dict is an xPress release serving folder's (`RELEASE_ARCHITECTURE`)."""
    return RELEASE_ARCHITECTURE in (raw.get("architectures") or ())


def release_config_to_xpress(raw: dict, **overrides) -> XPressConfig:
    """An xPress release config (a dFlash config plus `xpress_*` fields) → `XPressConfig` with the release head."""
    missing = [k for k in ("xpress_rank", "xpress_mlp_hidden") if k not in raw]
    if missing:
        raise ValueError(f"The xPress release config has no {missing}: it does not say the head's shape")
    if raw.get("sample_from_anchor", False):
        raise ValueError(
            "The xPress release config has sample_from_anchor=true: a block layout that samples the anchor's slot, "
            "which this package does not implement (releases use the fill-in layout, sample_from_anchor=false)"
        )
    block = raw.get("block_size")
    if raw.get("xpress_block_size", block) != block:
        raise ValueError(
            f"The xPress release config's xpress_block_size ({raw.get('xpress_block_size')}) differs from its drafter's "
            f"block_size ({block}): the head runs over the drafter's blocks, so they must be equal"
        )
    head = dict(refiner="xpress", refiner_form="release", refiner_rank=raw["xpress_rank"],
                refiner_mlp_hidden=raw["xpress_mlp_hidden"])  # fmt: skip
    if raw.get("xpress_num_passes") is not None:
        head["jacobi_max_iters"] = raw["xpress_num_passes"]
    return dflash_config_to_xpress(raw, **{**head, **overrides})


def release_head_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The `xpress_head.*` tensors of a release state dict as this package's `refiner.*` ones, or a ValueError naming
    any tensor that is missing or unknown."""
    head = {k.removeprefix(RELEASE_HEAD_PREFIX): v for k, v in state.items() if k.startswith(RELEASE_HEAD_PREFIX)}
    missing = sorted(set(RELEASE_HEAD_NAMES) - set(head))
    unknown = sorted(set(head) - set(RELEASE_HEAD_NAMES))
    if missing or unknown:
        raise ValueError(
            f"The release's xpress_head tensors do not match the authors' head: missing "
            f"{[RELEASE_HEAD_PREFIX + k for k in missing]}, unknown {[RELEASE_HEAD_PREFIX + k for k in unknown]}. "
            "Only their released head (SwiGLU Trans, mixer with its diagonal) is supported."
        )
    return {"refiner." + RELEASE_HEAD_NAMES[k]: v for k, v in head.items()}


def load_xpress_release(cls, path: str | os.PathLike, dtype: torch.dtype | None = None, **overrides):
    """Instantiate `cls` (an `XPressModel`) from an xPress release serving folder: its drafter and its head, the
    function the authors trained (`refiner_form="release"`), in `dtype` (None: the dtype its weights are stored in).
    `overrides` set config fields, as in `load_dflash`."""
    folder = Path(path)
    raw = _read_config(folder)
    if not is_release_config(raw):
        raise ValueError(f"{folder} is not an xPress release folder (config.json architectures lack {RELEASE_ARCHITECTURE!r})")
    model = cls(release_config_to_xpress(raw, **overrides))
    state = _normalise_names(_read_weights(folder))
    head = release_head_state(state)
    drafter = {k: v for k, v in state.items() if not k.startswith(RELEASE_HEAD_PREFIX)}
    _check_drafter_state(model, drafter, folder)
    expected = {k: v.shape for k, v in model.state_dict().items() if k.startswith("refiner.")}
    misshapen = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k])}" for k, v in head.items() if v.shape != expected[k]]
    if misshapen:
        raise ValueError(f"{folder}: head tensors of the wrong shape for its config: {misshapen}")
    model.load_state_dict({**drafter, **head}, strict=True)
    return model.to(dtype or state["fc.weight"].dtype)


# Arguments of `from_pretrained` that say where and how to fetch files, passed on to transformers' `cached_file`.
_HUB_ARGUMENTS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def release_folder(name_or_path, kwargs: dict):
    """For `XPressModel.from_pretrained(name_or_path, **kwargs)`: the loaded model when `name_or_path` (a folder or a
    Hub repo id) is an xPress release serving folder, else None (nothing is downloaded but its config.json)."""
    from transformers.utils import cached_file

    from .modeling_xpress import XPressModel

    hub = {k: kwargs[k] for k in _HUB_ARGUMENTS if kwargs.get(k) is not None}
    config_file = cached_file(name_or_path, "config.json", _raise_exceptions_for_missing_entries=False,
                              _raise_exceptions_for_connection_errors=False, **hub)  # fmt: skip
    if config_file is None or not is_release_config(json.loads(Path(config_file).read_text())):
        return None
    index = cached_file(name_or_path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False, **hub)
    names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values())) if index else ["model.safetensors"]
    for name in names:  # fetched next to config.json (one snapshot folder)
        cached_file(name_or_path, name, **hub)
    overrides = {k: v for k, v in kwargs.items() if k not in _HUB_ARGUMENTS}
    dtype = overrides.pop("dtype", None) or overrides.pop("torch_dtype", None)
    unsupported = [k for k in overrides if k not in XPressConfig().to_dict()]
    if unsupported:
        raise ValueError(
            f"{name_or_path} is an xPress release folder; from_pretrained takes dtype, Hub arguments and config fields "
            f"for it, not {unsupported}"
        )
    if dtype == "auto":
        dtype = None  # the stored dtype
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return load_xpress_release(XPressModel, Path(config_file).parent, dtype=dtype, **overrides).eval()


def write_xpress_release(model, path: str | os.PathLike, *, num_passes: int | None = None) -> Path:
    """Write `model` (an `XPressModel` with the release-form xPress head, no draft vocabulary) as an xPress release
    serving folder, the format the authors' vLLM method serves: the dFlash folder of `write_dflash_checkpoint` plus
    the `xpress_*` config fields and the `xpress_head.*` tensors. `num_passes`: the Jacobi iterations it asks for
    (default: `config.jacobi_max_iters`).

    Only what the format expresses is written: a head of another kind or form, or a drafter with a draft vocabulary
    (the release reads the whole vocabulary out; q would no longer be 0 outside it), is refused."""
    config = model.config
    if config.refiner != "xpress" or config.refiner_form != "release":
        raise ValueError(
            f"The release format holds the authors' xPress head; this model has refiner={config.refiner!r}, "
            f"refiner_form={config.refiner_form!r}. Write its drafter alone with write_dflash_checkpoint."
        )
    if config.draft_vocab_size is not None:
        raise ValueError(
            f"This drafter reads out a draft vocabulary of {config.draft_vocab_size} tokens; the release format reads "
            "out the whole vocabulary, a different drafter. Train one without draft_vocab_size to write this format."
        )
    folder = write_dflash_checkpoint(model, path)
    raw = json.loads((folder / "config.json").read_text())
    raw.update({
        "architectures": [RELEASE_ARCHITECTURE],
        "xpress_rank": config.refiner_rank,
        "xpress_mlp_hidden": config.refiner_mlp_width,
        "xpress_block_size": config.block_size,
        "xpress_num_passes": int(num_passes if num_passes is not None else config.jacobi_max_iters),
        "sample_from_anchor": False,
    })  # fmt: skip
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    ours = {v: k for k, v in RELEASE_HEAD_NAMES.items()}
    state = {name: tensor.detach().contiguous() for name, tensor in _drafter_state(model).items()}
    for name, tensor in model.refiner.state_dict().items():
        state[RELEASE_HEAD_PREFIX + ours[name]] = tensor.detach().contiguous()
    safe_save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def convert_release_pickle(pickle_path: str | os.PathLike, base_config: str | os.PathLike, *,
                           trust_pickle: bool = False, **overrides):  # fmt: skip
    """The authors' training pickle (`refiner_cotrain.pt`: `draft_state_dict`, `refiner_state_dict`, `args`) and
    the dFlash config it was trained from (a folder holding config.json, or that file) → an `XPressModel`.

    A pickle can run code when it is loaded: it is read with `weights_only=True` first, and only with
    `trust_pickle=True` as a full pickle (the authors' files hold an argparse Namespace, which needs it)."""
    from .modeling_xpress import XPressModel

    try:
        saved = torch.load(pickle_path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- torch raises UnpicklingError or others for a non-tensor object
        if not trust_pickle:
            raise ValueError(
                f"{pickle_path} holds more than tensors ({type(error).__name__}: {str(error).splitlines()[0]}). Loading "
                "it in full runs whatever code the pickle names: pass trust_pickle=True (--trust-pickle) only for a "
                "file from a source you trust."
            ) from error
        saved = torch.load(pickle_path, map_location="cpu", weights_only=False)
    for key in ("draft_state_dict", "refiner_state_dict"):
        if key not in saved:
            raise ValueError(f"{pickle_path} has no {key!r}: not an xPress co-training pickle")
    config_path = Path(base_config)
    raw = _read_config(config_path) if config_path.is_dir() else json.loads(config_path.read_text())
    head = saved["refiner_state_dict"]
    release = {
        "xpress_rank": int(head["w1.weight"].shape[1]) if "w1.weight" in head else None,
        "xpress_mlp_hidden": int(head["mlp.gate_proj.weight"].shape[0]) if "mlp.gate_proj.weight" in head else None,
        "xpress_block_size": raw.get("block_size"),
        "architectures": [RELEASE_ARCHITECTURE],
    }
    model = XPressModel(release_config_to_xpress({**raw, **release}, **overrides))
    state = _normalise_names(dict(saved["draft_state_dict"]))
    state.update(release_head_state({RELEASE_HEAD_PREFIX + k: v for k, v in head.items()}))
    _check_drafter_state(model, {k: v for k, v in state.items() if not k.startswith("refiner.")}, Path(pickle_path))
    model.load_state_dict(state, strict=True)
    return model


__all__ = [
    "RELEASE_ARCHITECTURE", "RELEASE_HEAD_NAMES", "convert_release_pickle", "dflash_config_to_xpress", "is_release_config",
    "load_dflash", "load_xpress_release", "release_config_to_xpress", "release_folder", "write_dflash_checkpoint",
    "write_xpress_release",
]
