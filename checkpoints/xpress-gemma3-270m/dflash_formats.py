"""What each dFlash checkpoint format means, both ways: its config as `XPressConfig` fields, its weight names, and
the config an xPress drafter is written with. `conversion` (`XPressModel.from_dflash`, the writers) uses these rules.

* **dFlash releases** (z-lab's, e.g. `z-lab/Qwen3-8B-DFlash-b16`; read by z-lab's `dflash/model.py` and vLLM's
  `qwen3_dflash.py`): a decoder config (Qwen3's) with `architectures: ["DFlashDraftModel"]`, `block_size`,
  `num_target_layers` and a nested `dflash_config: {mask_token_id, target_layer_ids}` (z-lab's code also reads them
  flat); weights `layers.*`, `norm.weight`, `fc.weight`, `hidden_norm.weight` (no embedding, no lm_head). A sliding
  layer (`layer_types`, `sliding_window`) sees the `sliding_window` positions up to its query's own, and is causal
  inside the block unless `is_causal: false`.
* **transformers' native dFlash assistant** (`model_type: "muse_glimmer_assistant"`): flat `block_size` /
  `mask_token_id` / `target_layer_ids`, weights `encoder.fc` / `encoder.output_norm_enc` for `fc` / `hidden_norm`
  (accepted in any format). Its sliding layers see the keys within `sliding_window` positions of the query, never
  causally; its config's defaults make every layer sliding, with a window of 2048.
* **speculators' DFlash format** (vLLM's training library: `speculators_model_type: "dflash"`): the decoder config as
  `transformer_layer_config`, `aux_hidden_state_layer_ids` (`hidden_states` indices: a target layer id + 1), an
  optional draft vocabulary (`draft_vocab_size`; `d2t` offsets, target id = draft id + d2t). Its sliding layers see
  the block and the `sliding_window` context tokens before the anchor, causally unless `sliding_window_non_causal`.

The decoder config is built by transformers' own config class for its `model_type`, as each of those codes builds it,
so a flat `rope_scaling` (transformers 4.x) becomes `rope_parameters`, and `sliding_window` means what that class
keeps of it (Qwen3's drops it unless `use_sliding_window`). Windows become `XPressConfig.attention_windows`, in one
convention (W positions ending at the query or at the anchor). What the xPress drafter does not compute (DFlash-2's
convolutions, logit soft-capping, vLLM-only switches, ...) is refused, naming the field; what a format's readers
would compute differently from the drafter is refused on the way out.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import torch
from transformers import AutoConfig

from .configuration_xpress import XPressConfig, decoder_layer_fields

_SLIDING, _FULL = "sliding_attention", "full_attention"

# --- reading a format's config -------------------------------------------------------------------------------------

# Settings of dFlash releases (in `dflash_config` or at the top level) that the xPress drafter does not compute, with
# the value that means "off". z-lab's code reads the first group, vLLM's the second.
_UNSUPPORTED_DFLASH_SETTINGS = {
    "input_embedding_scale": 1.0,  # z-lab: scales the block's input embeddings
    "output_multiplier": 1.0,  # z-lab: scales the drafter's logits
    "final_logit_softcapping": None,  # z-lab: tanh soft-capping of the logits
    "conv_kernel_size": None,  # z-lab's DFlash-2: grouped convolutions around attention and MLP
    "selector_rank": None,  # z-lab's DFlash-2: the candidate selector head
    "use_swa": False,  # vLLM: every layer sliding (z-lab's code ignores it)
    "swa_window_size": None,  # vLLM: the sliding window (z-lab's code ignores it)
    "attention_sink_bias": False,  # vLLM: per-head attention sinks
    "add_swa_attention_sink_bias": False,
    "attention_value_scale": None,  # vLLM: scales the values
    "is_neox_style": True,  # vLLM: False = interleaved RoPE
    "use_aux_hidden_state": True,  # vLLM: False = no fc on target features
    "sample_from_anchor": False,  # vLLM: the anchor slot drafts too (block_size drafts)
}


def source_format(raw: dict) -> str:
    """Which format a checkpoint config is in: "speculators", "native" (transformers' assistant), "dflash" or
    "xpress" (a saved xPress folder, not a dFlash one)."""
    if raw.get("model_type") == XPressConfig.model_type:
        return "xpress"
    if "speculators_model_type" in raw:
        return "speculators"
    if raw.get("model_type") == "muse_glimmer_assistant":
        return "native"
    return "dflash"


def decoder_config(fields: dict):
    """The decoder config as the format's own code builds it: transformers' config class for its `model_type`
    (z-lab's code, vLLM and speculators all build it that way), which standardises RoPE and the window fields."""
    model_type = fields.get("model_type") or "qwen3"
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    except ValueError as error:
        raise ValueError(
            f"The dFlash config's model_type {model_type!r} is not a model type transformers knows ({error}); the "
            "drafter's decoder config is read with transformers' config class for it"
        ) from error


def _decoder_fields(decoder, rope_parameters: dict) -> dict:
    """XPressConfig fields of the drafter's decoder layers (what the config leaves out keeps XPressConfig's default)."""
    fields = dict(decoder_layer_fields(decoder), num_hidden_layers=decoder.num_hidden_layers,
                  target_hidden_size=decoder.hidden_size, vocab_size=getattr(decoder, "vocab_size", None),
                  rope_parameters=rope_parameters)  # fmt: skip
    return {key: value for key, value in fields.items() if value is not None}


def _flat_rope(decoder, where: str) -> dict:
    rope = dict(decoder.rope_parameters or {})
    if set(rope) & {_SLIDING, _FULL}:
        raise ValueError(
            f"{where} has RoPE settings per layer type ({sorted(rope)}); the xPress drafter has one RoPE for all its "
            "layers. Convert a drafter whose layers share one rope_parameters."
        )
    return rope


def _sliding_windows(decoder, where: str, *, extra: int = 0, unset_means_full: bool = False) -> list | None:
    """`attention_windows` from the decoder's `layer_types` / `sliding_window` (None: every layer full). `extra`: what
    the format's window size lacks to count positions as `attention_windows` does."""
    layer_types = getattr(decoder, "layer_types", None) or []
    unknown = sorted(set(layer_types) - {_SLIDING, _FULL})
    if unknown:
        raise ValueError(f"{where}: layer_types {unknown} are not attention the xPress drafter computes (full or sliding)")
    if _SLIDING not in layer_types:
        return None
    window = getattr(decoder, "sliding_window", None)
    if window is None:
        if unset_means_full:
            return None
        raise ValueError(
            f"{where}: layer_types has sliding_attention layers but sliding_window is unset (Qwen3's config keeps it "
            "only with use_sliding_window=true): z-lab's code would run them causally without a window, vLLM refuses "
            "them. Set the window the drafter was trained with (and use_sliding_window=true) in its config.json."
        )
    return [window + extra if kind == _SLIDING else None for kind in layer_types]


def _refuse_unsupported_settings(raw: dict, decoder) -> None:
    nested = raw.get("dflash_config") or {}
    if "DFlash2DraftModel" in (raw.get("architectures") or []):
        raise ValueError(
            "architectures names DFlash2DraftModel (z-lab's DFlash-2: convolutions and a candidate selector around the "
            "dFlash layers), which the xPress drafter does not compute; convert a DFlashDraftModel release"
        )
    for name, off in _UNSUPPORTED_DFLASH_SETTINGS.items():
        for where, value in (("dflash_config." + name, nested.get(name)), (name, getattr(decoder, name, None))):
            if value is not None and value != off and not (off is None and value == 0):
                raise ValueError(
                    f"The dFlash config sets {where}={value!r}, which the xPress drafter does not compute (it would "
                    f"load into a different function). Convert a drafter without it (its neutral value: {off!r})."
                )


def _dflash_release_fields(raw: dict) -> dict:
    """z-lab's layout, as z-lab's `DFlashDraftModel` and vLLM read it."""
    decoder = decoder_config(raw)
    _refuse_unsupported_settings(raw, decoder)
    nested = raw.get("dflash_config") or {}
    windows = _sliding_windows(decoder, "The dFlash config")
    # A layer is causal inside the block if `is_causal` says so, else if it is a sliding layer (z-lab's and vLLM's
    # rule); vLLM also reads `dflash_config.causal` before the layer type, which z-lab's code ignores.
    is_causal = getattr(decoder, "is_causal", None)
    kinds = getattr(decoder, "layer_types", None) or [_FULL] * decoder.num_hidden_layers
    causal = [kind == _SLIDING if is_causal is None else bool(is_causal) for kind in kinds]
    if is_causal is None and nested.get("causal") is not None and any(c != bool(nested["causal"]) for c in causal):
        raise ValueError(
            f"The dFlash config sets dflash_config.causal={nested['causal']!r}, which vLLM applies to every layer and "
            f"z-lab's code ignores (its layers are causal exactly where layer_types says sliding_attention): the "
            "folder means two functions. Set is_causal instead, which both read."
        )
    if any(c and kind == _FULL for c, kind in zip(causal, kinds)):
        raise ValueError(
            "The dFlash config makes full-attention layers causal (is_causal=true); the xPress drafter's full-attention "
            "layers see the whole block. Convert a drafter trained with a bidirectional block."
        )
    fields = _decoder_fields(decoder, _flat_rope(decoder, "The dFlash config"))
    fields.update(
        mask_token_id=nested.get("mask_token_id", raw.get("mask_token_id")),
        target_layer_ids=nested.get("target_layer_ids", raw.get("target_layer_ids")),
        attention_windows=windows,
        window_causal=any(c for c, kind in zip(causal, kinds) if kind == _SLIDING) if windows else True,
    )
    # Fields only the dFlash layout carries; `qk_norm` is written by an older `write_dflash_checkpoint` for a drafter
    # without QK-norm (releases have QK-norm and no such field).
    fields.update({key: raw[key] for key in ("block_size", "num_target_layers", "qk_norm") if raw.get(key) is not None})
    if nested.get("block_size") is not None:
        fields["block_size"] = nested["block_size"]
    return fields


def _native_fields(raw: dict) -> dict:
    """transformers' `MuseGlimmerAssistantModel` layout: its sliding layers see |query - key| <= sliding_window, never
    causally, i.e. a window of sliding_window + 1 positions ending at the query (and as many after it)."""
    decoder = decoder_config(raw)
    windows = _sliding_windows(decoder, "The native dFlash assistant config", extra=1)
    fields = _decoder_fields(decoder, _flat_rope(decoder, "The native dFlash assistant config"))
    fields.update(attention_windows=windows, window_causal=False)
    fields.update({key: getattr(decoder, key) for key in ("block_size", "mask_token_id", "target_layer_ids")
                   if getattr(decoder, key, None) is not None})  # fmt: skip
    if raw.get("num_target_layers") is not None:
        fields["num_target_layers"] = raw["num_target_layers"]
    return fields


def _speculators_fields(raw: dict) -> dict:
    """speculators' `DFlashDraftModel` layout, as speculators trains it (`models/dflash/attention.py`): a sliding layer
    sees the `sliding_window` context tokens before the block's anchor and the block itself (causally unless
    `sliding_window_non_causal`): a window of sliding_window + 1 positions ending at the anchor. The verifier's layer
    count is not stored (`speculators_verifier`)."""
    kind = raw.get("speculators_model_type")
    if kind != "dflash":
        raise ValueError(
            f"speculators_model_type is {kind!r}: only speculators' 'dflash' drafters are the xPress drafter's function "
            "('dflash2' adds convolutions and a selector head, 'dspark' a Markov head, 'eagle3' is autoregressive)"
        )
    if raw.get("sample_from_anchor"):
        raise ValueError(
            "sample_from_anchor=true: this speculators drafter drafts at the anchor slot too (block_size drafts per "
            "block), the xPress drafter block_size - 1 after the anchor. Convert a drafter trained without it."
        )
    decoder = decoder_config(raw["transformer_layer_config"])
    rope = dict(decoder.rope_parameters or {})
    fields = _decoder_fields(decoder, rope.get(_SLIDING, rope))  # speculators' `flatten_rope_parameters`
    # speculators' window is None when the config leaves it unset: its sliding layers are then full ones
    windows = _sliding_windows(decoder, "The speculators transformer_layer_config", extra=1, unset_means_full=True)
    fields.update(attention_windows=windows, window_anchored=windows is not None,
                  window_causal=not raw.get("sliding_window_non_causal", False))  # fmt: skip
    aux = raw.get("aux_hidden_state_layer_ids")
    if aux is not None:
        fields["target_layer_ids"] = [i - 1 for i in aux]  # hidden_states[i] is the output of decoder layer i - 1
    fields.update({key: raw[key] for key in ("block_size", "mask_token_id", "target_hidden_size")
                   if raw.get(key) is not None})  # fmt: skip
    if raw.get("draft_vocab_size") not in (None, fields.get("vocab_size")):
        fields["draft_vocab_size"] = raw["draft_vocab_size"]
    return fields


def speculators_verifier(raw: dict) -> str | None:
    """The verifier (target) a speculators config names: its Hub id or folder."""
    return ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")


def xpress_fields(raw: dict) -> dict:
    """`XPressConfig` fields of a dFlash, native-assistant or speculators config dict, as their own code reads it."""
    layer = raw.get("transformer_layer_config") if "speculators_model_type" in raw else raw
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in (layer or {})]
    if missing:
        raise ValueError(f"dFlash config is missing {missing}; is this a dFlash drafter checkpoint?")
    reader = {"speculators": _speculators_fields, "native": _native_fields}.get(source_format(raw), _dflash_release_fields)
    return reader(raw)


# --- weight names ----------------------------------------------------------------------------------------------------

_RENAMES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))  # transformers' assistant → ours
# Tables the drafter borrows from the target (speculators stores copies of them, or the draft vocabulary's rows of the
# target's lm_head, frozen in its training), and speculators' target → draft mask (`d2t` says the same).
_NOT_THE_DRAFTERS = ("embed_tokens.", "lm_head.", "verifier_lm_head.", "verifier_norm.", "t2d")


def drafter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under the xPress drafter's names: speculators' `d2t` offsets become `draft_token_ids`,
    the target's tables are dropped."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        for old, new in _RENAMES:
            if name.startswith(old):
                name = new + name[len(old) :]
        if name.startswith(_NOT_THE_DRAFTERS):
            continue
        if name == "d2t":  # speculators' draft → target offsets
            name, tensor = "draft_token_ids", tensor.long() + torch.arange(tensor.shape[0])
        out[name] = tensor
    return out


def native_name(name: str) -> str:
    """A drafter tensor's name in transformers' native assistant."""
    for native, ours in _RENAMES:
        if name.startswith(ours):
            return native + name[len(ours) :]
    return name


# --- writing: what each format's readers compute, as a config --------------------------------------------------------

# Layouts `write_dflash_checkpoint` writes: z-lab's release layout, or transformers' native assistant's.
LAYOUTS = ("dflash", "transformers")


def refuse_inexpressible(config: XPressConfig, where: str, *, draft_vocabulary: bool = False) -> None:
    """What no dFlash reader computes: a learned mask vector, attention without QK-norm, a draft vocabulary (but in
    speculators' format)."""
    if config.mask_token_id is None:
        raise ValueError(
            f"{where} marks masked positions with a target token id, but this drafter learns its own mask vector "
            "(mask_token_id=None). Build it with mask_token_id=<a token id of the target> to write it, or save it "
            "with save_pretrained."
        )
    if not config.qk_norm:
        raise ValueError(
            f"This drafter has no QK-norm (qk_norm=False, Llama-style attention), but every reader of {where} (z-lab's "
            "DFlashDraftModel, vLLM, transformers' dFlash assistant, speculators) RMS-normalises queries and keys "
            "(norms of weight 1 are not the identity), so they would compute a different function. Save it with "
            "save_pretrained (vLLM serves that through this project's vLLM plugin), or build the drafter with qk_norm=True."
        )
    if config.draft_vocab_size is not None and not draft_vocabulary:
        raise ValueError(
            f"This drafter drafts from a draft vocabulary of {config.draft_vocab_size} tokens, but {where} reads out "
            "the whole vocabulary. Write it with write_speculators_checkpoint (which stores a draft vocabulary) or "
            "save_pretrained."
        )


def _one_window(config: XPressConfig, where: str) -> int | None:
    """The window every windowed layer shares (these formats have one `sliding_window`), or None without windows."""
    sizes = sorted({w for w in config.attention_windows or [] if w is not None})
    if len(sizes) > 1:
        raise ValueError(f"{where} has one sliding_window for all layers, but attention_windows has {sizes}")
    if sizes and config.window_anchored:
        raise ValueError(
            f"This drafter's windows end at the block's anchor (window_anchored=True, speculators' training), but "
            f"{where}'s readers end them at each query; they would compute a different function. Save it with "
            "save_pretrained."
        )
    return sizes[0] if sizes else None


def _decoder_dict(config: XPressConfig, dtype: torch.dtype) -> dict:
    """The decoder config both layouts (and speculators' transformer_layer_config) share, in Qwen3's field names."""
    return {
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
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": config.rope_parameters.get("rope_theta"),  # older readers take the flat field
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def _layer_types(config: XPressConfig) -> list[str]:
    return [_FULL if w is None else _SLIDING for w in config.attention_windows or [None] * config.num_hidden_layers]


def dflash_layout_config(config: XPressConfig, dtype: torch.dtype, layout: str) -> dict:
    """The `config.json` of `write_dflash_checkpoint`'s `layout`, or a ValueError for what its readers would compute
    differently."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    where = "the dFlash layout" if layout == "dflash" else "transformers' dFlash assistant layout"
    refuse_inexpressible(config, where)
    window = _one_window(config, where)
    raw = _decoder_dict(config, dtype)
    dflash = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if layout == "dflash":
        raw.update(architectures=["DFlashDraftModel"], block_size=config.block_size,
                   num_target_layers=config.num_target_layers, dflash_config=dflash)  # fmt: skip
        if window is not None:  # Qwen3's config keeps sliding_window only with use_sliding_window
            raw.update(layer_types=_layer_types(config), sliding_window=window, use_sliding_window=True)
            if not config.window_causal:
                raw["is_causal"] = False  # both readers make sliding layers causal unless told otherwise
        return raw
    if config.attention_bias:
        raise ValueError(f"{where} has no attention biases; this drafter has them (attention_bias=True)")
    if window is not None and config.window_causal:
        raise ValueError(
            f"{where}'s sliding layers see the whole block, but this drafter's are causal (window_causal=True): "
            "write it with layout='dflash'"
        )
    raw.update(model_type="muse_glimmer_assistant", architectures=["MuseGlimmerAssistantModel"],
               block_size=config.block_size, num_target_layers=config.num_target_layers,
               layer_types=_layer_types(config), **dflash)  # fmt: skip
    del raw["attention_bias"]
    if window is not None:
        raw["sliding_window"] = window - 1  # it sees |query - key| <= sliding_window
    return raw


def speculators_config(config: XPressConfig, dtype: torch.dtype, verifier: str | None, architectures: list[str]) -> dict:
    """The `config.json` of `write_speculators_checkpoint` for the `verifier` (the target's Hub id or folder), or a
    ValueError for what speculators or vLLM would compute differently."""
    where = "speculators' DFlash format"
    refuse_inexpressible(config, where, draft_vocabulary=True)
    if any(w is not None for w in config.attention_windows or []):
        raise ValueError(
            f"This drafter has sliding-window layers (attention_windows={config.attention_windows}); speculators "
            "trains windows that end at the block's anchor and vLLM serves windows that end at each query, so "
            f"{where} cannot say which function this is. Write it with write_dflash_checkpoint (z-lab's layout, "
            "whose windows vLLM reads by z-lab's rule) or save_pretrained."
        )
    if config.num_target_layers - 1 in config.target_layer_ids:
        raise ValueError(
            f"target_layer_ids {config.target_layer_ids} include the target's last layer ({config.num_target_layers - 1}), "
            f"whose output vLLM's reader of {where} cannot feed the drafter; write it with write_dflash_checkpoint"
        )
    if not verifier:
        raise ValueError(
            f"{where} names the verifier (target) by its Hub id or folder, but this target has no name_or_path: load "
            "it with from_pretrained(<id or folder>), or save it and load it from there"
        )
    layer = _decoder_dict(config, dtype)
    return {
        "architectures": ["DFlashDraftModel"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": {k: v for k, v in layer.items() if k != "dtype"},
        "draft_vocab_size": config.draft_vocab_size or config.vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        # Full-attention layers see the whole block; speculators ignores this flag for them, vLLM (0.32) reads it for
        # every layer and makes them all causal without it.
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.num_draft_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": architectures},
        },
        "dtype": layer["dtype"],
        "tie_word_embeddings": False,
    }


__all__ = [
    "LAYOUTS", "decoder_config", "dflash_layout_config", "drafter_state", "native_name", "refuse_inexpressible",
    "source_format", "speculators_config", "speculators_verifier", "xpress_fields",
]  # fmt: skip
