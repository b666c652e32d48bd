"""dFlash drafters in and out. `load_dflash` (`XPressModel.from_dflash`) builds an xPress model from a released
dFlash drafter, given as a local folder or a Hub repo id; the correction head starts fresh. `write_dflash_checkpoint`
and `write_speculators_checkpoint` write an xPress drafter in the formats other code reads.

Three formats are read, each as its own code reads it (the rules are in `dflash_formats`): z-lab's dFlash releases
(`z-lab/Qwen3-8B-DFlash-b16`; z-lab's `dflash` package and vLLM read them), transformers' native dFlash assistant
(`model_type: "muse_glimmer_assistant"`) and speculators' DFlash format (vLLM's training library). RoPE scaling
(a 4.x flat `rope_scaling` too) and sliding-window layers are honoured; what the xPress drafter does not compute is
refused, naming the field, so a drafter never loads into a function other than the one its authors trained. The
writers refuse a drafter that their readers would compute differently, and say what to do instead.

The xPress authors' release format (their vLLM serving folders, e.g. `UIUC-SSAIL/Qwen3-8B-XPress-b16`) is z-lab's
dFlash layout plus the head: `architectures: ["Qwen3XPressModel"]`, `xpress_rank`, `xpress_mlp_hidden`,
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


def _check_drafter_state(model, state: dict[str, torch.Tensor], path) -> None:
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
            f"{path} does not match the dFlash layout implied by its config ("
            + " | ".join(lines)
            + "). Check that config.json belongs to these weights."
        )


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
    _check_drafter_state(model, state, path)
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


# --- the xPress authors' release format ----------------------------------------------------------------------------

# The architecture of their serving folders, and the head's tensor names (theirs → this package's `refiner.` names).
RELEASE_ARCHITECTURE = "Qwen3XPressModel"
RELEASE_HEAD_PREFIX = "xpress_head."
RELEASE_HEAD_NAMES = {
    "w1.weight": "token_embed.weight",
    "down_h.weight": "hidden_proj.weight",
    "down_g.weight": "global_proj.weight",
    "in_proj.weight": "fuse.weight",
    "mix.L": "mix",  # raw L (unmasked, unfolded), as trained
    "mlp.gate_proj.weight": "gate.weight",
    "mlp.up_proj.weight": "up.weight",
    "mlp.down_proj.weight": "down.weight",
    "w2.weight": "readout.weight",
}


def is_release_config(raw: dict) -> bool:
    """Whether a config dict is an xPress release serving folder's (`RELEASE_ARCHITECTURE`)."""
    return RELEASE_ARCHITECTURE in (raw.get("architectures") or ())


def release_config_to_xpress(raw: dict, hub: dict | None = None, **overrides) -> XPressConfig:
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
    return dflash_config_to_xpress(raw, hub, **{**head, **overrides})


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


def _release_model(cls, raw: dict, state: dict[str, torch.Tensor], where, dtype=None, hub=None, **overrides):
    """An `XPressModel` from a release config and its tensors (drafter under dFlash names, head under
    `xpress_head.*`), every tensor checked."""
    head = release_head_state(state)
    drafter = drafter_state({k: v for k, v in state.items() if not k.startswith(RELEASE_HEAD_PREFIX)})
    config = release_config_to_xpress(raw, hub, **overrides)
    model = cls._from_config(config, dtype=_checkpoint_dtype(dtype, raw, drafter))
    _check_drafter_state(model, drafter, where)
    expected = {k: v.shape for k, v in model.state_dict().items() if k.startswith("refiner.")}
    misshapen = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k])}" for k, v in head.items() if v.shape != expected[k]]
    if misshapen:
        raise ValueError(f"{where}: head tensors of the wrong shape for its config: {misshapen}")
    model.load_state_dict({**drafter, **head}, strict=True)
    return model


def load_xpress_release(cls, path: str | os.PathLike, *, dtype=None, **overrides):
    """Instantiate `cls` (an `XPressModel`) from an xPress release serving folder or Hub repo id: its drafter and its
    head, the function the authors trained (`refiner_form="release"`). `dtype` and the Hub arguments as in
    `load_dflash`; other keywords override config fields."""
    hub = {key: overrides.pop(key) for key in HUB_ARGUMENTS if key in overrides}
    raw, files = checkpoint_files(path, **hub)
    if not is_release_config(raw):
        raise ValueError(f"{path} is not an xPress release folder (config.json architectures lack {RELEASE_ARCHITECTURE!r})")
    state = {}
    for file in files:
        state.update(load_state_dict(file))
    return _release_model(cls, raw, state, path, dtype, hub, **overrides)


def release_folder(cls, name_or_path, kwargs: dict):
    """For `cls.from_pretrained(name_or_path, **kwargs)` (`cls` an `XPressModel`): the loaded model when `name_or_path`
    (a folder or a Hub repo id) is an xPress release serving folder, else None (nothing fetched but its config.json,
    which `from_pretrained` reads anyway)."""
    hub = {k: kwargs[k] for k in HUB_ARGUMENTS if kwargs.get(k) is not None}
    try:
        config_file = _fetch(str(name_or_path), "config.json", hub)
    except OSError:
        return None  # from_pretrained says what is wrong with it
    if config_file is None or not is_release_config(json.loads(Path(config_file).read_text())):
        return None
    overrides = {k: v for k, v in kwargs.items() if k not in HUB_ARGUMENTS}
    dtype = overrides.pop("dtype", None) or overrides.pop("torch_dtype", None)
    unsupported = [k for k in overrides if k not in XPressConfig().to_dict()]
    if unsupported:
        raise ValueError(
            f"{name_or_path} is an xPress release folder; from_pretrained takes dtype, Hub arguments and config fields "
            f"for it, not {unsupported}"
        )
    return load_xpress_release(cls, name_or_path, dtype=dtype, **hub, **overrides).eval()


def write_xpress_release(model, path: str | os.PathLike, *, num_passes: int | None = None) -> Path:
    """Write `model` (an `XPressModel` with the release-form xPress head) as an xPress release serving folder, the
    format the authors' vLLM method serves: `write_dflash_checkpoint`'s folder plus the `xpress_*` config fields and
    the `xpress_head.*` tensors. `num_passes`: the Jacobi iterations it asks for (default `config.jacobi_max_iters`).

    Only what the format expresses is written: a head of another kind or form is refused, and so is what
    `write_dflash_checkpoint` refuses (a learned mask vector, no QK-norm, a draft vocabulary: the release reads the
    whole vocabulary out, so q would no longer be 0 outside it)."""
    config = model.config
    if config.refiner != "xpress" or config.refiner_form != "release":
        raise ValueError(
            f"The release format holds the authors' xPress head; this model has refiner={config.refiner!r}, "
            f"refiner_form={config.refiner_form!r}. Write its drafter alone with write_dflash_checkpoint."
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
    ours = {v: k for k, v in RELEASE_HEAD_NAMES.items()}
    state = _drafter_state(model)
    state.update({RELEASE_HEAD_PREFIX + ours[k]: v for k, v in model.refiner.state_dict().items()})
    return _save(folder, raw, state)


def convert_release_pickle(cls, pickle_path: str | os.PathLike, base_config: str | os.PathLike, *,
                           trust_pickle: bool = False, **overrides):  # fmt: skip
    """The authors' training pickle (`refiner_cotrain.pt`: `draft_state_dict`, `refiner_state_dict`, `args`) and
    the dFlash config it was trained from (a folder holding config.json, or that file) → `cls` (an `XPressModel`).

    A pickle can run code when it is loaded: it is read with `weights_only=True` first, and only with
    `trust_pickle=True` as a full pickle (the authors' files hold an argparse Namespace, which needs it)."""
    try:
        saved = torch.load(pickle_path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 -- an UnpicklingError, or others, for any non-tensor object
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
    raw = json.loads((config_path / "config.json" if config_path.is_dir() else config_path).read_text())
    head = saved["refiner_state_dict"]
    release = {
        "architectures": [RELEASE_ARCHITECTURE],
        "xpress_rank": int(head["w1.weight"].shape[1]) if "w1.weight" in head else None,
        "xpress_mlp_hidden": int(head["mlp.gate_proj.weight"].shape[0]) if "mlp.gate_proj.weight" in head else None,
        "xpress_block_size": raw.get("block_size"),
    }
    state = {**saved["draft_state_dict"], **{RELEASE_HEAD_PREFIX + k: v for k, v in head.items()}}
    return _release_model(cls, {**raw, **release}, state, pickle_path, dtype=torch.float32, **overrides)


__all__ = [
    "HUB_ARGUMENTS", "RELEASE_ARCHITECTURE", "RELEASE_HEAD_NAMES", "checkpoint_files", "convert_release_pickle",
    "dflash_config_to_xpress", "is_release_config", "load_dflash", "load_xpress_release", "release_config_to_xpress",
    "release_folder", "write_dflash_checkpoint", "write_speculators_checkpoint", "write_xpress_release",
]  # fmt: skip
