"""A draft vocabulary: the most frequent response tokens of the training data (`frequency_ranked_vocabulary`), and a
model whose heads read out only those tokens (`with_draft_vocabulary`; `XPressModel.set_draft_vocabulary` stores it)."""

import collections
import copy

import torch

from ..modeling_xpress import XPressModel


def frequency_ranked_vocabulary(dataset, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent response tokens (`loss_mask == 1`) of a `{"input_ids", "loss_mask"}` dataset, most
    frequent first, with the ids in `always` (e.g. EOS) included: what `XPressModel.set_draft_vocabulary` stores.
    Ties break by token id, so the result is deterministic."""
    counts: collections.Counter = collections.Counter()
    for row in dataset:
        counts.update(t for t, m in zip(row["input_ids"], row["loss_mask"]) if m)
    forced = list(dict.fromkeys(int(t) for t in always))
    ranked = [t for t, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])) if t not in forced]
    if size < len(forced) or size > len(forced) + len(ranked):
        raise ValueError(
            f"size must be between {len(forced)} (the ids always included) and {len(forced) + len(ranked)} (the "
            f"distinct response tokens), got {size}; a larger draft vocabulary than the data covers cannot be ranked"
        )
    return torch.tensor(forced + ranked[: size - len(forced)], dtype=torch.long)


def with_draft_vocabulary(model: XPressModel, token_ids) -> XPressModel:
    """A new `XPressModel` with `model`'s weights restricted to the draft vocabulary `token_ids` (target ids, e.g.
    `frequency_ranked_vocabulary(...)`): the head keeps its readout rows of those tokens, the drafter is unchanged.

    Restricting a trained model is exact on the kept rows; training with the restriction (what the heads then read
    out) is what makes the most of it."""
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    config = copy.deepcopy(model.config)
    config.draft_vocab_size = int(ids.shape[0])
    config.validate_xpress()
    restricted = XPressModel(config).to(model.device, model.dtype)
    state = dict(model.state_dict())
    if model.draft_token_ids is not None:
        raise ValueError("this model already has a draft vocabulary; restrict the full-vocabulary model instead")
    for name in [k for k in state if k.endswith("readout.weight")]:
        state[name] = state[name][ids.to(state[name].device)]
    missing, unexpected = restricted.load_state_dict(state, strict=False)
    if missing != ["draft_token_ids"] or unexpected:
        raise ValueError(f"weights do not fit the restricted model: missing {missing}, unexpected {unexpected}")
    restricted.set_draft_vocabulary(ids)
    return restricted
