"""xPress speculative decoding as a transformers `custom_generate` recipe.

    target.generate(**inputs, custom_generate="path/to/xpress-checkpoint", trust_remote_code=True)
    target.generate(**inputs, custom_generate="org/xpress-checkpoint", trust_remote_code=True)

The recipe loads the xPress drafter of the folder or Hub repo it was itself loaded from. transformers passes neither
that name nor `assistant_model` to a recipe, and it runs a copy of this file from its modules cache, so `__file__`
does not tell either: the name is read from the `custom_generate` argument of the `GenerationMixin.generate` call
that is running this recipe. Called some other way, pass `xpress_checkpoint=` (a folder or repo id) or an already
loaded `xpress_model=`.
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


def generate(model, *args, xpress_model=None, xpress_checkpoint: str | None = None, **kwargs):
    """Run `model.generate` with the xPress drafter of this checkpoint as its assistant."""
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
    return model.generate(*args, assistant_model=xpress_model, **kwargs)
