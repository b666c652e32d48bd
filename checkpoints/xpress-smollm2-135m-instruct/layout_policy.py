"""Which `policy.LinearPolicy` a decode loop gets: `decoder_policy` for its models, `linear_policy` for a device.

On a CPU, `cpu_layouts.CpuLinearPolicy` (imported only then: hardware tuning never loads on a GPU running "auto");
elsewhere the input-major `LinearPolicy`.

This file travels with every saved checkpoint; it imports only torch and its siblings.
"""

import torch

from .policy import LinearPolicy, check_linear_layout, linear_weights


def linear_policy(linear_layout: str, weights: dict[str, list[torch.Tensor]], *, packable=(), reorderable=(),
                  approximate=(), tuned=None, device: torch.device | None = None) -> LinearPolicy:  # fmt: skip
    """The policy for these weight groups on their device: `cpu_layouts.CpuLinearPolicy` on a CPU (or wherever a
    layout other than input-major is forced), which tunes the groups in `tuned` (default: all), may pack those in
    `packable` (MKL, per row count), reorder those in `reorderable` (oneDNN, for every row count) and compute those in
    `approximate` in bfloat16; `LinearPolicy` (input-major) on a GPU with "auto" or "input_major"."""
    check_linear_layout(linear_layout)
    device = device or next(iter(weights.values()))[0].device
    if device.type == "cpu" or linear_layout in ("weight_major", "packed"):
        from .cpu_layouts import CpuLinearPolicy  # hardware tuning: never imported on a GPU running "auto"

        return CpuLinearPolicy(linear_layout, weights, packable=packable, reorderable=reorderable,
                               approximate=approximate, tuned=tuned)  # fmt: skip
    return LinearPolicy(linear_layout, weights)


def decoder_policy(linear_layout: str, target, xpress, *, compiled: bool, readout=None) -> LinearPolicy:
    """The policy of a decode loop over these models, for three groups of products: "verify" (the target's weights),
    "drafter" (the drafter's) and "head" (the draft readout's one matrix: the draft vocabulary's lm_head rows,
    `readout`, or the whole lm_head). The compiled graphs tune every group and may pack any; the eager loops tune the
    verification (its width changes every step and an MKL pack serves one row count: oneDNN-reordered weights, which
    serve every count, or weight-major) and the drafter (B rows every block: packs pay), and read out input-major.
    Only the drafter's products may run in bfloat16 (where faster): they choose drafts, the verification decides."""
    lm_head = target.get_output_embeddings()
    readout = xpress.draft_readout(lm_head) if readout is None else readout
    weights = {"verify": linear_weights(target), "drafter": linear_weights(xpress),
               "head": [lm_head.weight if readout is None else readout[0]]}  # fmt: skip
    if compiled:
        if linear_layout == "packed":  # (a CPU's layout: an error before anything is traced if it cannot pack)
            from .cpu_layouts import check_packed_layout

            check_packed_layout(weights["verify"])
        return linear_policy(linear_layout, weights, packable=weights, approximate=("drafter",))
    return linear_policy(linear_layout, weights, packable=("drafter",), reorderable=("verify",),
                         approximate=("drafter",), tuned=("verify", "drafter"))  # fmt: skip


__all__ = ["decoder_policy", "linear_policy"]
