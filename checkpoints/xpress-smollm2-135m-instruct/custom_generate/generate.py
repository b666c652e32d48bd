"""xPress speculative decoding as a transformers `custom_generate` recipe.

    target.generate(**inputs, custom_generate="path/to/xpress-checkpoint", trust_remote_code=True)

transformers does not pass `assistant_model` (or the recipe's own folder) to a custom generate function, so the
xPress checkpoint to load is written into `XPRESS_CHECKPOINT` when the folder is saved with
`XPressModel.save_pretrained`. After moving the folder or pushing it to the Hub, pass `xpress_checkpoint=` (a path or
repo id) or an already loaded `xpress_model=` instead.
"""

import torch
from transformers import AutoModel

XPRESS_CHECKPOINT: str | None = None

_loaded: dict[tuple, torch.nn.Module] = {}


def _load(checkpoint: str, target) -> torch.nn.Module:
    key = (checkpoint, str(target.device), target.dtype)
    if key not in _loaded:
        model = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=target.dtype)
        _loaded[key] = model.to(target.device).eval()
    return _loaded[key]


def generate(model, *args, xpress_model=None, xpress_checkpoint: str | None = None, **kwargs):
    """Run `model.generate` with the xPress drafter of this checkpoint as its assistant."""
    kwargs.pop("assistant_model", None)  # always None for a custom_generate recipe
    if xpress_model is None:
        checkpoint = xpress_checkpoint or XPRESS_CHECKPOINT
        if checkpoint is None:
            raise ValueError(
                "This custom_generate recipe does not know which xPress checkpoint to load: pass "
                "xpress_checkpoint='<folder or repo id>' or xpress_model=<loaded XPressModel> to generate()."
            )
        xpress_model = _load(checkpoint, model)
    return model.generate(*args, assistant_model=xpress_model, **kwargs)
