"""xPress speculative decoding as a transformers `custom_generate` recipe.

    target.generate(**inputs, custom_generate="path/to/xpress-checkpoint", trust_remote_code=True)
    target.generate(**inputs, custom_generate="org/xpress-checkpoint", trust_remote_code=True)
    target.generate(**inputs, custom_generate="path/to/xpress-checkpoint", trust_remote_code=True, tree_nodes=8)

The recipe loads the xPress drafter of the folder or Hub repo it was itself loaded from. transformers passes neither
that name nor `assistant_model` to a recipe, and it runs a copy of this file from its modules cache, so `__file__`
does not tell either: the name is read from the `custom_generate` argument of the `GenerationMixin.generate` call
that is running this recipe. Called some other way, pass `xpress_checkpoint=` (a folder or repo id) or an already
loaded `xpress_model=`.

transformers' assisted decoding verifies one line of drafts. With `tree_nodes=N` the recipe runs xPress's own loop
instead (`spec_generate(tree_nodes=N)`: a draft tree verified in one forward), with the call's and the target's
generation settings (max_new_tokens, do_sample, temperature, top_k, top_p, eos_token_id), and returns the sequences
as `generate` does; settings a tree cannot honour are named in a ValueError.
"""

import inspect

import torch
from transformers import AutoModel
from transformers.generation.utils import GenerationMixin

_GENERATE_CODE = inspect.unwrap(GenerationMixin.generate).__code__

_loaded: dict[tuple, torch.nn.Module] = {}


def calling_checkpoint() -> str | None:
    """The `custom_generate` string of the innermost transformers `generate` call on the stack (None: no such call)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is _GENERATE_CODE:
                name = frame.f_locals.get("custom_generate")
                if isinstance(name, str):
                    return name
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame held in a local keeps every caller's locals alive


def _load(checkpoint: str, target) -> torch.nn.Module:
    """The drafter of `checkpoint` (folder or repo id) on the target's device, in the target's dtype; loaded once."""
    key = (checkpoint, str(target.device), target.dtype)
    if key not in _loaded:
        model = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=target.dtype)
        _loaded[key] = model.to(target.device).eval()
    return _loaded[key]


# What the tree route reads from a generate call; anything else it cannot honour.
TREE_SETTINGS = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id",
                 "generation_config", "attention_mask", "use_cache", "generator"}  # fmt: skip


def tree_generate(model, xpress_model, input_ids, tree_nodes, **kwargs):
    """`spec_generate(tree_nodes=...)` with a generate call's settings over the target's generation config."""
    # transformers passes its own defaults along (None, False, empty lists): only settings really given count.
    given = {name for name, value in kwargs.items()
             if value is not None and value is not False and not (isinstance(value, (list, tuple, dict)) and not value)}  # fmt: skip
    unknown = sorted(given - TREE_SETTINGS)
    if unknown:
        raise ValueError(
            f"tree_nodes runs xPress's own tree loop, which does not take {unknown}. Drop them, or drop tree_nodes "
            "to decode through transformers' assisted generation (linear blocks)."
        )
    config = kwargs.pop("generation_config", None) or model.generation_config
    setting = {name: kwargs.get(name, getattr(config, name, None)) for name in
               ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id")}  # fmt: skip
    sample = bool(setting["do_sample"])
    out = xpress_model.spec_generate(
        model, input_ids, attention_mask=kwargs.get("attention_mask"), tree_nodes=tree_nodes,
        max_new_tokens=20 if setting["max_new_tokens"] is None else setting["max_new_tokens"],  # transformers' default
        temperature=(setting["temperature"] or 1.0) if sample else 0.0,
        top_k=setting["top_k"] if sample else None, top_p=setting["top_p"] if sample else None,
        stop_token_ids=setting["eos_token_id"], generator=kwargs.get("generator"),
    )  # fmt: skip
    return out.sequences


def generate(model, *args, xpress_model=None, xpress_checkpoint: str | None = None, tree_nodes=None, **kwargs):
    """Run `model.generate` with the xPress drafter of this checkpoint as its assistant (with `tree_nodes`: the
    drafter's own tree loop)."""
    kwargs.pop("assistant_model", None)  # always None for a custom_generate recipe
    if xpress_model is None:
        checkpoint = xpress_checkpoint or calling_checkpoint()
        if checkpoint is None:
            raise ValueError(
                "This custom_generate recipe does not know which xPress checkpoint to load: it was not called through "
                "target.generate(..., custom_generate='<folder or repo id>', trust_remote_code=True). Pass "
                "xpress_checkpoint='<folder or repo id>' or xpress_model=<loaded XPressModel> to generate()."
            )
        xpress_model = _load(checkpoint, model)
    if tree_nodes is not None:
        input_ids = args[0] if args else kwargs.pop("input_ids", kwargs.pop("inputs", None))
        return tree_generate(model, xpress_model, input_ids, tree_nodes, **kwargs)
    return model.generate(*args, assistant_model=xpress_model, **kwargs)
