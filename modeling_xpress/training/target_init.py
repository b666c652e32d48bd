"""A drafter that starts from its target: copy target decoder layers into an xPress drafter instead of random weights.

    from modeling_xpress.training.target_init import drafter_from_target
    xpress = drafter_from_target(target, num_hidden_layers=2, refiner="none")   # the target's last 2 layers

or, for a drafter built some other way (its config from `XPressConfig.from_target_config(target.config, ...)`):

    init_drafter_from_target(xpress, target, target_layers="last")               # or a list, e.g. [14, 29]

What is copied, and why:

* **Decoder layers** (q/k/v/o projections, MLP, both layernorms, and the q/k norms of a Qwen3 target): by default the
  target's **last n** layers, in order. The drafter's output goes through its final norm into the target's own
  lm_head, and the target's last layers are exactly the computation that turns its residual stream into states that
  lm_head reads; so with them (and the target's final norm, copied too) the drafter starts with the target's own
  readout rather than learning one from noise. dFlash's context rule also lines up with them: its deepest context
  feature is the output of target layer L−3 (`default_target_layer_ids`), which is the input of layer L−2, the first of
  the last two. A list of layer indices picks any others (one per drafter layer).
* **Final norm**: the target's, so `norm → lm_head` is the target's readout.
* **Context projection** `fc` ((k·H) → H over the k target features at `target_layer_ids`) starts as a selection of
  one of them: the target layer whose output is the input of the first copied layer (layer `first − 1`), or the
  nearest listed one (ties: the deeper). The context reaches the drafter's keys/values through `hidden_norm` instead
  of a layer's `input_layernorm` (dFlash norms it once for all layers), so **`hidden_norm`** gets the first copied
  layer's `input_layernorm` weight. When layer `first − 1` is among `target_layer_ids` (the default with 2 drafter
  layers: SmolLM2 reads layers [1, 27] and copies 28, 29), the first drafter layer's context keys/values are exactly
  the keys/values the target computed there. Later drafter layers share that one context, one or more layers shallower
  than their own input in the target. The other feature slots of `fc` start at zero (still trained).

What cannot be copied, and is what training has to close: the drafter's block input is the anchor's embedding and the
mask vector, not the deep residual stream its first copied layer read in the target, and the block attends to itself
bidirectionally where the target was causal. The correction head is untouched (a fresh head adds δ = 0). Measured
on SmolLM2 (a short pilot, `benchmarks/results/smollm2-target-init-vs-scratch-pilot.json`): the copied start is worse
than a random one on the first few batches, then ahead at every logged step, by ~0.7 nats of loss at 250 steps.

Families: `TARGET_QK_NORM` in `configuration_xpress` (Llama, Mistral, Qwen3), whose decoder layers are the drafter's
own layer with or without QK-norm. A copied layer computes exactly what it computed in the target (same inputs, same
RoPE, same causal mask: tests/test_target_init.py) as long as the drafter's config came from the target's
(`XPressConfig.from_target_config`); a config that differs (width, activation, eps, RoPE, QK-norm) is refused.

Not a file that travels with checkpoints: a saved drafter is an ordinary xPress checkpoint.
"""

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
from transformers import PreTrainedModel

from ..configuration_xpress import TARGET_QK_NORM, XPressConfig, is_integer
from ..modeling_xpress import XPressModel

SUPPORTED_MODEL_TYPES = tuple(sorted(TARGET_QK_NORM))


def default_copied_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target's last `num_draft_layers` layers, in order (see the module docstring for why)."""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(
            f"cannot copy {num_draft_layers} layers from a target with {num_target_layers}: the drafter needs "
            f"1..{num_target_layers} layers to start from the target's last ones"
        )
    return list(range(num_target_layers - num_draft_layers, num_target_layers))


def resolve_target_layers(
    target_layers: str | Sequence[int], num_target_layers: int, num_draft_layers: int
) -> list[int]:
    """`"last"` or one target layer index (0-based) per drafter layer → the validated list of indices."""
    if isinstance(target_layers, str):
        if target_layers != "last":
            raise ValueError(f"target_layers must be 'last' or a list of target layer indices, got {target_layers!r}")
        return default_copied_layers(num_target_layers, num_draft_layers)
    layers = list(target_layers)
    not_int = [i for i in layers if not is_integer(i)]
    if not_int:
        raise ValueError(f"target_layers must be integer layer indices, got {not_int} in {layers}")
    if len(layers) != num_draft_layers:
        raise ValueError(
            f"target_layers names {len(layers)} layers ({layers}) for a drafter with {num_draft_layers}: give one "
            "target layer per drafter layer"
        )
    bad = [i for i in layers if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(
            f"target_layers {bad} are out of range for a target with {num_target_layers} layers "
            f"(valid: 0..{num_target_layers - 1})"
        )
    return layers


def context_slot(first_copied: int, target_layer_ids: Sequence[int]) -> int:
    """Index into `target_layer_ids` of the feature `fc` starts by selecting: the output of layer `first_copied − 1`
    (the input of the first copied layer), or the nearest listed layer, the deeper on a tie."""
    wanted = first_copied - 1
    return min(range(len(target_layer_ids)), key=lambda k: (abs(target_layer_ids[k] - wanted), -target_layer_ids[k]))


def _decoder(target: PreTrainedModel) -> nn.Module:
    """The target's decoder stack (`.layers`, `.norm`): `model` of a `*ForCausalLM`, or a base model itself."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    if not (hasattr(decoder, "layers") and hasattr(decoder, "norm")):
        raise ValueError(f"{type(target).__name__} has no decoder stack with `.layers` and `.norm` to copy from")
    return decoder


def _mismatches(config: XPressConfig, text, has_qk_norm: bool) -> list[str]:
    """Drafter config fields that would make a copied layer compute something other than it did in the target."""
    heads = text.num_attention_heads
    target = {
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "hidden_act": text.hidden_act,
        "attention_bias": bool(getattr(text, "attention_bias", False)),
        "qk_norm": has_qk_norm,
        "rope_parameters": dict(text.rope_parameters or {}),
    }
    drafter = {name: getattr(config, name) for name in target}
    drafter["rope_parameters"] = dict(config.rope_parameters or {})
    problems = [
        f"{name} {drafter[name]!r} != target's {value!r}" for name, value in target.items() if drafter[name] != value
    ]
    if not math.isclose(config.rms_norm_eps, text.rms_norm_eps, rel_tol=1e-6):
        problems.append(f"rms_norm_eps {config.rms_norm_eps!r} != target's {text.rms_norm_eps!r}")
    if getattr(text, "mlp_bias", False):
        problems.append("the target's MLP has biases (mlp_bias=True), the drafter's SwiGLU MLP has none")
    return problems


@torch.no_grad()
def init_drafter_from_target(
    xpress: XPressModel, target: PreTrainedModel, target_layers: str | Sequence[int] = "last"
) -> XPressModel:
    """Overwrite `xpress`'s decoder layers, final norm, `fc` and `hidden_norm` with the target's (module docstring);
    returns `xpress`. `target_layers`: `"last"` (the target's last n layers) or one 0-based target layer index per
    drafter layer. Weights are cast to the drafter's dtype and device; the head and the mask vector are left as they
    are. Raises a `ValueError` for a family that is not supported, a layer index out of range, or a drafter whose
    shape or settings differ from the target's (build its config with `XPressConfig.from_target_config`)."""
    text = target.config.get_text_config(decoder=True)
    model_type = getattr(text, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"cannot start a drafter from a {model_type!r} target: copying decoder layers is supported for "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} targets (their layers are the drafter's own). Train this drafter "
            "from its random initialisation instead."
        )
    config = xpress.config
    config.check_target(target.config)
    decoder = _decoder(target)
    layers = resolve_target_layers(target_layers, len(decoder.layers), config.num_hidden_layers)
    problems = _mismatches(config, text, has_qk_norm=getattr(decoder.layers[0].self_attn, "q_norm", None) is not None)
    if problems:
        raise ValueError(
            "the drafter cannot hold the target's layers: " + "; ".join(problems) + ". Build it with "
            "XPressConfig.from_target_config(target.config, num_hidden_layers=...) without overriding these fields."
        )

    for drafter_layer, index in zip(xpress.layers, layers):
        source, own = decoder.layers[index].state_dict(), drafter_layer.state_dict()
        if set(source) != set(own) or any(source[k].shape != own[k].shape for k in own):
            raise ValueError(
                f"target layer {index} ({type(decoder.layers[index]).__name__}) does not have the drafter layer's "
                f"tensors: target {sorted((k, tuple(v.shape)) for k, v in source.items())} vs drafter "
                f"{sorted((k, tuple(v.shape)) for k, v in own.items())}"
            )
        drafter_layer.load_state_dict(source)  # copy_ casts to the drafter's dtype and device
    xpress.norm.load_state_dict(decoder.norm.state_dict())

    # fc selects one target feature (an identity block, zeros elsewhere); hidden_norm plays the input_layernorm the
    # context skips, so the first drafter layer's context K/V are the target's own when that feature is layer first-1.
    width = config.target_hidden_size
    slot = context_slot(layers[0], config.target_layer_ids)
    fc = torch.zeros_like(xpress.fc.weight)  # (H, k·H)
    fc[:, slot * width : (slot + 1) * width] = torch.eye(width, dtype=fc.dtype, device=fc.device)
    xpress.fc.weight.copy_(fc)
    xpress.hidden_norm.weight.copy_(decoder.layers[layers[0]].input_layernorm.weight)
    return xpress


def drafter_from_target(
    target: PreTrainedModel,
    num_hidden_layers: int | None = None,
    target_layers: str | Sequence[int] = "last",
    **config_overrides,
) -> XPressModel:
    """A new xPress drafter for `target` whose layers start as the target's (`init_drafter_from_target`).

    `num_hidden_layers` defaults to the length of a `target_layers` list, else `XPressConfig`'s default;
    `config_overrides` set the other drafter/head fields (`refiner`, `block_size`, `mask_token_id`, ...) as in
    `XPressConfig.from_target_config`. The model is built in float32 on the CPU; move or cast it afterwards.
    """
    if num_hidden_layers is None:
        num_hidden_layers = XPressConfig.num_hidden_layers if isinstance(target_layers, str) else len(target_layers)
    config = XPressConfig.from_target_config(target.config, num_hidden_layers=num_hidden_layers, **config_overrides)
    return init_drafter_from_target(XPressModel(config), target, target_layers)


@torch.no_grad()
def read_more_target_layers(xpress: XPressModel, target_layer_ids: Sequence[int]) -> XPressModel:
    """A copy of a trained drafter that reads the target at `target_layer_ids`, a list holding every layer it reads
    now plus others, and computes exactly what it computed: the columns of `fc` for the layers it read keep their
    weights and move to those layers' new slots (the slots of a layer read twice, as dFlash's rule gives small
    targets, are summed into one), the new layers' columns start at zero (then `fc` sums the same terms, and
    `hidden_norm` sees the same input). Training goes on from there and learns what the new context adds (dFlash
    reads 5 layers of a 36-layer target; EAGLE-3 fuses low, middle and high ones), where a fresh drafter would start
    over. Raises a `ValueError` for a list that drops a layer, repeats one or leaves the target's range."""
    old, new = list(xpress.config.target_layer_ids), list(target_layer_ids)
    dropped = [i for i in old if i not in new]
    if dropped or len(set(new)) != len(new):
        raise ValueError(
            f"target_layer_ids {new} must hold every layer the drafter reads now ({old}) once, plus the layers to add; "
            f"{'it drops ' + str(dropped) if dropped else 'it repeats a layer'}. To read fewer layers, train a new "
            "drafter."
        )
    widened = copy.deepcopy(xpress)
    widened.config.target_layer_ids = new
    widened.config.validate_xpress()  # the new indices are integers inside the target
    width = xpress.config.target_hidden_size
    weight = xpress.fc.weight
    fc = torch.zeros(weight.shape[0], len(new) * width, dtype=weight.dtype, device=weight.device)
    for slot, layer in enumerate(old):
        at = new.index(layer)
        fc[:, at * width : (at + 1) * width] += weight[:, slot * width : (slot + 1) * width]  # a repeated layer: summed
    widened.fc = nn.Linear(fc.shape[1], fc.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    widened.fc.weight.copy_(fc)
    widened.fc.weight.requires_grad_(weight.requires_grad)
    return widened


__all__ = [
    "SUPPORTED_MODEL_TYPES", "context_slot", "default_copied_layers", "drafter_from_target", "init_drafter_from_target",
    "read_more_target_layers", "resolve_target_layers",
]  # fmt: skip
