"""dFlash drafters in and out. `load_dflash` (`XPressModel.from_dflash`) builds an xPress model from a released
dFlash drafter, given as a local folder or a Hub repo id; the correction head starts fresh. `write_dflash_checkpoint`
and `write_speculators_checkpoint` write an xPress drafter in the formats other code reads.

Three formats are read, each as its own code reads it (the rules are in `dflash_formats`): z-lab's dFlash releases
(`z-lab/Qwen3-8B-DFlash-b16`; z-lab's `dflash` package and vLLM read them), transformers' native dFlash assistant
(`model_type: "muse_glimmer_assistant"`) and speculators' DFlash format (vLLM's training library). RoPE scaling
(a 4.x flat `rope_scaling` too) and sliding-window layers are honoured; what the xPress drafter does not compute is
refused, naming the field, so a drafter never loads into a function other than the one its authors trained. The
writers refuse a drafter that their readers would compute differently, and say what to do instead.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import json
import os
from pathlib import Path

import torch
from transformers.modeling_utils import load_state_dict, safe_save_file
from transformers.utils.hub import cached_file

from .configuration_xpress import XPressConfig
from .dflash_formats import (
    decoder_config, dflash_layout_config, drafter_state, native_name, source_format, speculators_config,
    speculators_verifier, xpress_fields,
)  # fmt: skip

# --- where a checkpoint's files are: a local folder, or a Hub repo id resolved as `from_pretrained` does -----------

# Keyword arguments of `load_dflash` that go to the Hub download (transformers' `cached_file`), as in `from_pretrained`.
HUB_ARGUMENTS = ("revision", "cache_dir", "token", "local_files_only", "force_download", "subfolder")
# A checkpoint's weights, in the order `from_pretrained` looks for them.
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin")


def _looks_like_a_path(source: str) -> bool:
    """A Hub repo id is `name` or `owner/name`; anything else is meant as a local folder."""
    return os.path.isabs(source) or source.startswith((".", "~")) or source.count("/") > 1


def _fetch(source: str, filename: str, hub: dict) -> str | None:
    """The local path of one file of `source` (downloaded into the Hub cache if needed), or None if it has none."""
    try:
        return cached_file(source, filename, _raise_exceptions_for_missing_entries=False, **hub)
    except (OSError, ValueError) as error:  # not found on the Hub, no connection and not cached, invalid id
        raise OSError(
            f"Could not get {filename} of {source!r} from the Hugging Face Hub: {error}. Pass a local folder, or a repo "
            "id that the Hub serves (or that is in the local cache: HF_HUB_OFFLINE=1 reads only the cache)."
        ) from error


def checkpoint_files(source: str | os.PathLike, **hub) -> tuple[dict, list[str]]:
    """The config (a dict) and the weight files (local paths) of a checkpoint folder or Hub repo id."""
    source = str(source)
    if not os.path.isdir(source) and _looks_like_a_path(source):
        raise FileNotFoundError(f"dFlash checkpoint folder {source} does not exist")
    config_file = _fetch(source, "config.json", hub)
    if config_file is None and not os.path.isdir(source):
        raise OSError(
            f"Could not get config.json of {source!r}: it is not a local folder, and the Hugging Face Hub (or, offline, "
            "the local Hub cache) has no such file for that repo id. Check the id and `revision`, or pass a folder."
        )
    if config_file is None:
        raise FileNotFoundError(f"{source} has no config.json; expected a dFlash checkpoint (config + weights)")
    raw = json.loads(Path(config_file).read_text())
    for name in _WEIGHT_FILES:
        found = _fetch(source, name, hub)
        if found is None:
            continue
        if name.endswith(".index.json"):
            shards = sorted(set(json.loads(Path(found).read_text())["weight_map"].values()))
            return raw, [_fetch(source, shard, hub) for shard in shards]
        return raw, [found]
    raise FileNotFoundError(
        f"{source} has no weights: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin"
    )


def _verifier_layers(verifier: str, hub: dict) -> int | None:
    """The decoder layer count of a speculators drafter's verifier, where its config can be read."""
    try:
        found = _fetch(verifier, "config.json", {k: v for k, v in hub.items() if k != "subfolder"})
    except OSError:
        return None
    if found is None:
        return None
    return decoder_config(json.loads(Path(found).read_text())).get_text_config(decoder=True).num_hidden_layers


# --- reading ---------------------------------------------------------------------------------------------------------


def dflash_config_to_xpress(raw: dict, hub: dict | None = None, **overrides) -> XPressConfig:
    """Map a dFlash, native-assistant or speculators config dict onto `XPressConfig`; `overrides` win. `hub`: download
    arguments for a speculators drafter's verifier config (its layer count)."""
    fields = xpress_fields(raw)
    verifier = speculators_verifier(raw) if source_format(raw) == "speculators" else None
    if verifier and "num_target_layers" not in overrides:
        layers = _verifier_layers(verifier, hub or {})
        if layers is not None:
            fields["num_target_layers"] = layers
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


def _drafter_state(model) -> dict[str, torch.Tensor]:
    """The tensors a dFlash checkpoint holds: the drafter's, without the correction head or a learned mask vector."""
    return {k: v for k, v in model.state_dict().items() if not k.startswith("refiner.") and k != "mask_embedding"}


def _checkpoint_dtype(dtype, raw: dict, state: dict[str, torch.Tensor]) -> torch.dtype:
    """`from_pretrained`'s rule (transformers 5): None or "auto" → the dtype the config records (`dtype`, or the older
    `torch_dtype`), else the weights' floating dtype; a name ("bfloat16") or a `torch.dtype` as given."""
    if dtype is None or dtype == "auto":
        dtype = raw.get("dtype") or raw.get("torch_dtype")
        if dtype is None:
            floating = [t.dtype for t in state.values() if t.is_floating_point()]
            dtype = floating[0] if floating else torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be 'auto', None or a floating torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    return dtype


def load_dflash(cls, path: str | os.PathLike, *, dtype=None, **overrides):
    """Instantiate `cls` (an `XPressModel`) with a dFlash checkpoint's drafter weights and a fresh head.

    `path`: a local folder or a Hub repo id (downloaded into the Hub cache as `from_pretrained` does; `revision`,
    `cache_dir`, `token`, `local_files_only`, `force_download`, `subfolder` are passed to the download). `dtype`: as in
    `from_pretrained` (default "auto": the dtype the folder records, else its weights'). Other keywords override
    config fields.
    """
    hub = {key: overrides.pop(key) for key in HUB_ARGUMENTS if key in overrides}
    raw, files = checkpoint_files(path, **hub)
    if source_format(raw) == "xpress":
        raise ValueError(
            f"{path} is an xPress checkpoint (config.json has model_type 'xpress'), not a dFlash drafter: load it "
            f"with AutoModel.from_pretrained({str(path)!r}, trust_remote_code=True) or "
            f"XPressModel.from_pretrained({str(path)!r})"
        )
    config = dflash_config_to_xpress(raw, hub, **overrides)
    state = {}
    for file in files:
        state.update(load_state_dict(file))
    state = drafter_state(state)
    model = cls._from_config(config, dtype=_checkpoint_dtype(dtype, raw, state))
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
            f"{path} does not match the dFlash layout implied by its config ("
            + " | ".join(lines)
            + "). Check that config.json belongs to these weights."
        )
    model.load_state_dict(state, strict=False)
    if model.draft_token_ids is not None:
        model.set_draft_vocabulary(state["draft_token_ids"])  # checks the ids
    return model


# --- writing ---------------------------------------------------------------------------------------------------------


def _save(folder: Path, raw: dict, state: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    safe_save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
                   metadata={"format": "pt"})  # fmt: skip
    return folder


def write_dflash_checkpoint(model, path: str | os.PathLike, layout: str = "dflash") -> Path:
    """Write `model`'s drafter (an `XPressModel`) as a dFlash checkpoint folder; the correction head is not written.

    `layout="dflash"` (default): z-lab's released layout, which z-lab's `DFlashDraftModel` and vLLM read (vLLM serves
    it as `--speculative-config '{"method": "dflash", "model": <folder>}'`): a Qwen3 `config.json` with
    `architectures: ["DFlashDraftModel"]`, `block_size`, `num_target_layers` and `dflash_config: {mask_token_id,
    target_layer_ids}`, and `model.safetensors` with `layers.*`, `norm.weight`, `fc.weight`, `hidden_norm.weight`.
    `layout="transformers"`: transformers' native dFlash assistant's (`model_type: "muse_glimmer_assistant"`, flat
    fields, `encoder.fc` / `encoder.output_norm_enc`), which `AutoModel.from_pretrained` loads as
    `MuseGlimmerAssistantModel` for `generate(..., assistant_model=, speculation_type="dflash")`.

    `XPressModel.from_dflash(path)` reads either back exactly, with a fresh head. A small folder for any target:

        config = XPressConfig.from_target_config(target.config, num_hidden_layers=1, mask_token_id=0, qk_norm=True)
        write_dflash_checkpoint(XPressModel(config), "tiny-dflash")
        xpress = XPressModel.from_dflash("tiny-dflash", refiner="xpress")

    Refused, because the readers would compute another function: a learned mask vector (dFlash marks masked slots with
    a token id), no QK-norm, a draft vocabulary, windows ending at the anchor or of several sizes; for
    `layout="transformers"` also attention biases and causal windows (its layers have neither).
    """
    raw = dflash_layout_config(model.config, model.dtype, layout)
    state = _drafter_state(model)
    if layout == "transformers":
        state = {native_name(name): tensor for name, tensor in state.items()}
    return _save(Path(path), raw, state)


def write_speculators_checkpoint(model, path: str | os.PathLike, target) -> Path:
    """Write `model`'s drafter (an `XPressModel`) in speculators' DFlash format, for `target` (its verifier).

    speculators (`DFlashDraftModel.from_pretrained`) reads it, and vLLM serves it as a dFlash drafter without this
    project's vLLM plugin (`vllm serve <folder>`: vLLM serves the verifier the folder names, with this drafter); the
    correction head is not written (vLLM then drafts the drafter's own tokens). The config records `target` as the
    verifier (its `name_or_path`, which speculators loads the embedding and lm_head from). A draft vocabulary is
    written as speculators stores one: `d2t` offsets, the `t2d` mask, and the target lm_head's rows as `lm_head.weight`.

    Refused, besides what `write_dflash_checkpoint` refuses but a draft vocabulary: sliding-window layers (speculators
    trains windows that end at the anchor, vLLM serves windows that end at each query: no speculators folder means one
    function to both) and a target layer id that is the target's last layer (vLLM's reader cannot feed it).
    """
    config = model.config
    config.check_target(target.config)
    verifier = target.config.name_or_path or config.target_model_name
    raw = speculators_config(config, model.dtype, verifier, list(target.config.architectures or []))
    state = _drafter_state(model)
    ids = state.pop("draft_token_ids", None)
    if ids is not None:  # speculators stores the draft vocabulary in ascending id order
        ids = ids.sort().values
        state["d2t"] = ids - torch.arange(ids.shape[0])
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
        rows = target.get_output_embeddings().weight.detach().index_select(0, ids.to(target.device))
        state["lm_head.weight"] = rows.to(model.dtype).cpu()
    return _save(Path(path), raw, state)


__all__ = [
    "HUB_ARGUMENTS", "checkpoint_files", "dflash_config_to_xpress", "load_dflash", "write_dflash_checkpoint",
    "write_speculators_checkpoint",
]  # fmt: skip
