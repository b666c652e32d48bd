"""What each layer of the target sees in a verification that brings its own mask (a draft tree, eager or compiled).

transformers' models build their causal masks from the cache and the positions. A tree's verification needs its own
structure instead (a node sees the committed context and its ancestors, not its siblings), passed as a 4-D mask. A
target with sliding-window layers (Gemma 2/3, gpt-oss, Mistral, Qwen with windows) needs that structure per kind of
layer: full-attention layers see everything the structure allows; sliding-window layers see it only within their
window, measured by token positions (key position p is seen from query position q iff q - W < p <= q, transformers'
`sliding_window_overlay`), so a tree node at depth d sees the committed tokens within the window of its own position
and those of its ancestors that are. A model whose layers are all of one kind takes one mask; a model that mixes kinds
(`layer_types`) takes a dict {layer type: mask} and hands each layer its own.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class LayerKinds:
    """The target's kinds of attention layer: for each kind, its window (None: the whole context) and its first layer
    (whose cache says which keys a forward's attention reads, `masks(cache=)`); `additive`: the target's attention
    adds its mask to the scores (transformers' "eager"), so masks are 0 / -inf-like floats instead of booleans."""

    windows: dict[str, int | None]
    first_layer: dict[str, int]
    additive: bool

    @classmethod
    def of(cls, target_config, use: str = "Draft trees (tree_nodes)",
           instead: str = "tree_nodes=None (linear blocks)") -> "LayerKinds":  # fmt: skip
        """The layer kinds of a target config (its text decoder's). A ValueError naming `use` and what to do
        (`instead`) for kinds other than full and sliding-window attention (chunked, linear-attention states, layers
        that share another's cache): no mask by token position expresses what they see."""
        text = target_config.get_text_config(decoder=True)
        types, kwargs = get_layer_types_and_kwargs(text)
        other = sorted(set(types) - {FULL, SLIDING})
        if other:
            raise ValueError(
                f"{use} works with targets whose attention layers are full or sliding-window attention; this one "
                f"has {other} layers, whose attention or cache a verification mask by token position does not "
                f"express. Use {instead} with it."
            )
        windows, first = {}, {}
        for index, (kind, extra) in enumerate(zip(types, kwargs)):
            windows.setdefault(kind, extra.get("sliding_window") if kind == SLIDING else None)
            first.setdefault(kind, index)
        additive = getattr(text, "_attn_implementation", None) == "eager"
        return cls(windows=windows, first_layer=first, additive=additive)

    @property
    def windowed(self) -> bool:
        """Whether some layer sees only a window of the context."""
        return any(window is not None for window in self.windows.values())

    def masks(self, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor, *,
              dtype: torch.dtype, cache=None):  # fmt: skip
        """The target's attention mask(s) for one forward.

        allowed (Q, S) bool: what each of the Q query rows may see by the forward's structure (committed context;
        causal or tree ancestors among the new tokens), over S key columns whose token positions are `key_positions`
        (S,) (any value where nothing is allowed); query_positions (Q,). `cache`: a dynamic cache whose sliding layers
        keep only their window (`DynamicSlidingWindowLayer`): each kind's mask keeps the columns its layers' keys are
        (the cache's `get_mask_sizes`, as transformers' own masks do); without one, all S columns (a static cache of
        one slot per position). Returns a (1, 1, Q, S') mask, or {layer type: mask} for a target that mixes kinds."""
        masks = {}
        for kind, window in self.windows.items():
            mask = allowed
            if window is not None:
                mask = mask & (query_positions[:, None] - key_positions[None, :] < window)
            if cache is not None:
                length, offset = cache.get_mask_sizes(allowed.shape[0], self.first_layer[kind])
                mask = mask[:, offset : offset + length]
            mask = mask[None, None]
            if self.additive:  # eager attention adds the mask to the scores
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
            masks[kind] = mask
        return next(iter(masks.values())) if len(masks) == 1 else masks


__all__ = ["FULL", "SLIDING", "LayerKinds"]
