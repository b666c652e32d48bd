"""CPU tuning of the decode loops' few-row matrix products: `LinearPolicy` for a CPU (`policy.py`).

A verification multiplies a few rows (anchor + drafts) by every weight of the target, and a drafter block B rows by
every drafter weight. Some CPU BLAS builds run `F.linear(x, W)` = x·Wᵀ for 2–3 rows through a per-row path: on a 2-core
AMD EPYC (MKL, fp32) the SmolLM2 lm_head (49,152 × 576) took 6.8 ms for 1 row, 20 ms for 3 and 9.8 ms for 4, and a
3-token verification cost two plain decoding steps. The same product computed weight-major, (W·xᵀ)ᵀ, is one streaming
pass over W: 3.1 ms for 3 rows. And MKL can prepack a weight for its GEMM kernels once (`cblas_sgemm_pack`), after
which a few rows cost about one: on a 2-core Intel Xeon (Ice Lake, AVX-512) all of SmolLM2's products over 4 / 8 / 16
rows took 53 / 65 / 111 ms input-major and 30 / 31 / 41 ms packed. An MKL pack serves one row count; oneDNN can
reorder a weight once into a blocked layout that serves every row count (`OnednnLinear`), which the eager
verification, whose width changes every step, can use: on a 2-core Intel Xeon with AMX, Gemma-3's 262,144 × 640
lm_head took 60 / 92 ms over 4 / 8 rows input-major and 30 / 35 ms reordered. Which layout is fastest depends on the
CPU and its BLAS, so "auto" times them on the models' own weights (`weight_major_pays`, `packed_pays`,
`onednn_pays`), once per weight shapes, row count and thread count (the prepacked kinds' timings once per machine,
kept in its record).

Everything here is reached through a `CpuLinearPolicy` that a decoder owns: the layouts it decided, for its own
weight groups. What is kept across decoders pins no model: timings by weight shapes, and packs that die with their
weight (`_PACKS`).

This file travels with every saved checkpoint; it imports only torch and its siblings.
"""

import contextlib
import re
import statistics
import weakref
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .policy import LinearPolicy, product_sweeps, time_rounds, timing_input
from .stats import median_seconds
from .tuning import machine, recorded_rounds, tensors_digest

# Weight-major (or packed) is chosen only if the timed products are at least 1.25× faster that way: the microbenchmark
# leaves out what the layout changes around the product inside a graph. Measured on SmolLM2 (2-core AMD EPYC), whole
# compiled target forwards: fp32 at 3 rows 82 → 30 ms weight-major (products 2.6× faster), at 16 rows 75 → 66 ms
# (1.26×); bf16 at 16 rows 26.5 → 33.6 ms, slower, although its products timed 1.15× faster.
WEIGHT_MAJOR_MARGIN = 0.8


class _FewRowLinear(TorchFunctionMode):
    """Inside this mode `F.linear(x, W, b)` with at most `max_rows` rows of x (and a weight `applies` accepts) is
    computed as `product(x_2d, W)` (+ b): the same product, another kernel. Entered inside a compiled function, it is
    traced into the graph (no Python cost per call). Other functions, and larger inputs, are untouched."""

    def __init__(self, max_rows: int):
        super().__init__()
        self.max_rows = max_rows

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return weight.dim() == 2

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
            if self.applies(x, weight) and x.dim() >= 2 and 0 < rows <= self.max_rows:
                out = self.product(x.reshape(rows, x.shape[-1]), weight)
                if bias is not None:
                    out = out + bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


class WeightMajorLinear(_FewRowLinear):
    """`F.linear` over a few rows computed as `(W @ x_2dᵀ)ᵀ + b`: the same product, another operand order for the
    BLAS (`_FewRowLinear`)."""

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.mm(weight, x.t()).t()


_LAYOUT_TIMINGS: dict[tuple, tuple[float, float]] = {}  # by shapes: they decide the timing, and pin no model


@torch.no_grad()
def weight_major_pays(weights, rows: int, repeats: int = 5) -> bool:
    """Whether `F.linear` over `rows` input rows is faster weight-major than input-major on these weights: the sum of
    each distinct weight shape's median time, times how many weights have that shape, by at least
    `WEIGHT_MAJOR_MARGIN`. Timed on the weights themselves (their memory layout is what the BLAS reads); each (shape,
    dtype, rows, threads) is timed once per process."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for weight in weights:
        by_shape.setdefault((tuple(weight.shape), weight.dtype, weight.device.type), []).append(weight)
    input_major = weight_major = 0.0
    for key, group in by_shape.items():
        timing_key = (*key, rows, torch.get_num_threads())
        if timing_key not in _LAYOUT_TIMINGS:
            weight = group[0]
            x = timing_input(rows, weight)
            _LAYOUT_TIMINGS[timing_key] = (
                median_seconds(lambda: F.linear(x, weight), repeats),
                median_seconds(lambda: torch.mm(weight, x.t()).t(), repeats),
            )
        t_input, t_weight = _LAYOUT_TIMINGS[timing_key]
        input_major += len(group) * t_input
        weight_major += len(group) * t_weight
    return weight_major < WEIGHT_MAJOR_MARGIN * input_major


def weight_major_layout(linear_layout: str, weights, rows: int) -> bool:
    """Whether `linear_layout` computes `F.linear` over `rows` rows of these weights weight-major: "weight_major"
    always, "input_major" never, "auto" where `weight_major_pays` (never on a GPU). The one rule of the compiled
    graphs, the eager loops' verification and `draft_cap` (through their `CpuLinearPolicy`)."""
    if linear_layout != "auto":
        return linear_layout == "weight_major"
    return weights[0].device.type != "cuda" and weight_major_pays(weights, rows)


# --- MKL packed weights (CPU, fp32) ------------------------------------------------------------------------------
# MKL can prepack a GEMM operand into its kernels' own blocked layout once (`cblas_sgemm_pack`) and then multiply
# input rows by it (`cblas_sgemm_compute`); torch exposes both (`torch.ops.mkl._mkl_reorder_linear_weight` /
# `_mkl_linear`), and inductor's `freezing` uses them for fp32 linears. For the few rows of a verification this is the
# fastest product measured on the 2-core Intel Xeon (Ice Lake, AVX-512) of this project: all of SmolLM2's products
# over 4 / 8 / 16 rows took 53 / 65 / 111 ms input-major and 30 / 31 / 41 ms packed (one row: ~26 ms either way; 2-3
# rows: input-major is as fast). A pack is made for a row count: packed for 1 row and used for 4, the same products
# took 37 ms. So packs are kept per (weight, rows), each +1x that weight's memory, made only for the widths a decoder
# runs (`CpuLinearPolicy.prepare`), until the weight is freed or `release_packed_weights()`. The graphs call them
# through one operator with the weight as its
# input, so no weight is folded into a graph: a weight changed in place is repacked at its next use (its version
# counter moved), and a (weight, rows) that was never packed goes through `F.linear`.

# (data_ptr, rows) -> (shape, stride, version, pack); rows `ANY_ROWS` for a oneDNN reorder, which serves every row
# count, `BF16_ROWS` for a oneDNN reorder of the weight rounded to bfloat16 (`Bfloat16Linear`). The entry holds no
# reference to its weight: a finalizer drops it when the weight is freed, so a deleted model takes its packs with it
# (and a new tensor at the same address never finds a stale pack).
_PACKS: dict[tuple[int, int], tuple[torch.Size, tuple, int, torch.Tensor]] = {}
ANY_ROWS = 0
BF16_ROWS = -1
_REORDER_ROWS = {"onednn": ANY_ROWS, "bfloat16": BF16_ROWS}  # the kinds whose one reorder serves every row count
_PACKING_WORKS: list[bool] = []


def _packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"


def _computes_f_linear(product, operands=lambda t: t, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """Whether `product(x, W)` is `F.linear` over `operands(x)`, `operands(W)` for 1, 3 and 16 rows of x on a small
    random weight; False where it raises (a build whose ops exist but do not run here). The availability checks'
    one test, run once per process."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(72, 40, generator=generator)
    try:
        for rows in (1, 3, 16):
            x = torch.randn(rows, 40, generator=generator)
            expected = F.linear(operands(x), operands(weight))
            if not torch.allclose(product(x, weight).float(), expected, rtol=rtol, atol=atol):
                return False
    except RuntimeError:
        return False
    return True


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM and it computes `F.linear` here (checked once per process on a
    small weight)."""
    if not _PACKING_WORKS:
        works = bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))
        _PACKING_WORKS.append(works and _computes_f_linear(
            lambda x, weight: torch.ops.mkl._mkl_linear(x, _pack(weight, x.shape[0]), weight, None, x.shape[0])))
    return _PACKING_WORKS[0]


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place version counter. A tensor made under `torch.inference_mode` (a model loaded there, or the
    draft readout's lm_head rows cut there) has none: it counts as never changed in place (-1), so its pack is made
    again only for a new data pointer or shape."""
    return -1 if weight.is_inference() else weight._version


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == BF16_ROWS:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), ONEDNN_ROWS_HINT)
    if rows == ANY_ROWS:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def _keep_pack(weight: torch.Tensor, rows: int, new: bool) -> None:
    key = (weight.data_ptr(), rows)
    _PACKS[key] = (weight.shape, weight.stride(), _version(weight), _pack(weight, rows))
    if new:
        weakref.finalize(weight, _PACKS.pop, key, None)


def pack_weights(weights, rows: int) -> list[torch.Tensor]:
    """Prepack the fp32 CPU weights among `weights` for products over `rows` input rows (MKL), or reorder them for
    any row count (oneDNN, `rows=ANY_ROWS`); once each, again if one changed in place since. Returns the weights that
    had no pack for `rows` before."""
    new = []
    for weight in weights:
        if _packable(weight):
            kept = _PACKS.get((weight.data_ptr(), rows))
            if kept is None:
                new.append(weight)
            if kept is None or kept[2] != _version(weight) or kept[0] != weight.shape:
                _keep_pack(weight, rows, new=kept is None)
    return new


def release_packed_weights(weights=None, rows: int | None = None) -> None:
    """Drop the packs of `weights` for `rows` rows (`ANY_ROWS`: their oneDNN reorders), or every kept pack
    (`release_compiled_decoders` does this)."""
    if weights is None:
        _PACKS.clear()
        return
    for weight in weights:
        _PACKS.pop((weight.data_ptr(), rows), None)


def _current_pack(weight: torch.Tensor, rows: int) -> torch.Tensor | None:
    """W's kept pack for `rows` rows (`ANY_ROWS`: its oneDNN reorder), packed again if W changed in place since; None
    where there is none for this weight as it is now (shape, strides)."""
    key = (weight.data_ptr(), rows)
    kept = _PACKS.get(key)
    if kept is None or kept[0] != weight.shape or kept[1] != weight.stride():
        return None
    if kept[2] != _version(weight):  # changed in place since it was packed
        _keep_pack(weight, rows, new=False)
        kept = _PACKS[key]
    return kept[3]


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) · Wᵀ with W's pack for that many rows; `F.linear` where there is none."""
    pack = _current_pack(weight, x.shape[0])
    if pack is None:
        return F.linear(x, weight)
    return torch.ops.mkl._mkl_linear(x.contiguous(), pack, weight, None, x.shape[0])


# An operator of its own, so a compiled graph calls it as one opaque kernel with the weight as its input. Registered
# with a CPU kernel (`torch.library.Library`): as a `torch.library.custom_op` each call cost ~60 µs more inside a
# graph, against ~20 µs for a whole small product. Named after this module: the package and a checkpoint's copy of
# this file (loaded with trust_remote_code) can live in one process.
_OP_NAMESPACE = "xpress_" + re.sub(r"\W", "_", __name__)
_LIBRARY = torch.library.Library(_OP_NAMESPACE, "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake(f"{_OP_NAMESPACE}::packed_linear", lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]),
                            lib=_LIBRARY)  # fmt: skip
packed_linear = getattr(torch.ops, _OP_NAMESPACE).packed_linear.default


class PackedLinear(_FewRowLinear):
    """`F.linear` over a few rows of x with an fp32 CPU weight computed with W's MKL pack for that many rows
    (`pack_weights`; a weight without one goes through `F.linear`)."""

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return _packable(weight) and x.dtype == weight.dtype

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, weight)


# --- oneDNN-reordered weights (CPU, fp32) ---------------------------------------------------------------------------
# oneDNN, torch's other CPU GEMM library, can reorder a weight once into its kernels' blocked layout
# (`torch.ops.mkldnn._reorder_linear_weight`, as inductor's freezing does for its oneDNN linears) and multiply any
# number of input rows by it (`torch.ops.mkldnn._linear_pointwise`). Unlike an MKL pack, one reorder serves every row
# count at about the speed of a pack made for it, for +1x the weight's memory: so the eager verification, whose width
# changes every step, can use it. Measured on the 2-core Intel Xeon with AMX of this project (fp32, 2 threads), Gemma-3's
# lm_head (262,144 x 640) over 1 / 2 / 4 / 8 / 16 rows: 28 / 31 / 60 / 92 / 57 ms input-major, 27 / 29 / 30 / 35 / 43 ms
# reordered (an MKL pack made for 4 rows: 25 / 28 / 31 / 37 / 74 ms, and 1.8x the weight's memory); Gemma-3's 126
# other linears over the same rows: 18 / 20 / 30 / 37 / 48 ms input-major, 24 / 25 / 28 / 31 / 36 ms reordered. A group
# is reordered as a whole, where the sum of its products pays (`onednn_pays`): Gemma-3's verification from 4 rows.
ONEDNN_ROWS_HINT = 8  # the row count oneDNN is told to expect when it reorders (any row count runs)
_ONEDNN_WORKS: list[bool] = []


def onednn_reorder_available() -> bool:
    """Whether this torch build has oneDNN's reordered linear and it computes `F.linear` here (checked once per process
    on a small weight)."""
    if not _ONEDNN_WORKS:
        ops = torch.ops.mkldnn
        works = bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                     and hasattr(ops, "_reorder_linear_weight"))  # fmt: skip
        _ONEDNN_WORKS.append(works and _computes_f_linear(
            lambda x, weight: ops._linear_pointwise(x, _pack(weight, ANY_ROWS), None, "none", [], "")))
    return _ONEDNN_WORKS[0]


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) · Wᵀ with W's oneDNN reorder (`pack_weights(..., ANY_ROWS)`); `F.linear` where there is none."""
    pack = _current_pack(weight, ANY_ROWS)
    if pack is None:
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), pack, None, "none", [], "")


class OnednnLinear(PackedLinear):
    """`F.linear` over a few rows of x with an fp32 CPU weight computed with W's oneDNN reorder (`onednn_linear`; a
    weight without one goes through `F.linear`)."""

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, weight)


# --- bfloat16 products for the drafter (CPU) -------------------------------------------------------------------------
# The drafter's products decide only which tokens are proposed, never which are kept (the target verifies in its own
# precision), so they may be computed in bfloat16 where that is faster: x and W rounded to bfloat16, W reordered once
# by oneDNN (`BF16_ROWS`), the product accumulated in float32, rounded to bfloat16 and returned in x's dtype. On a CPU
# with native bfloat16 products (AVX512-BF16, AMX) this halves the weights' bytes and runs the faster kernels;
# elsewhere the timing says no. Measured on a 2-core AMD EPYC with AVX512-BF16, fp32 models: Gemma-3-270M's drafter
# products over 16 rows 11.0 -> 5.0 ms, its eager loop +9.6% tokens/s and compiled loop +3.2%, SmolLM2's +4.9% /
# +5.1%, τ unchanged (docs/results.md). Only a group the policy may approximate (`CpuLinearPolicy(approximate=...)`:
# the drafter) and only with "auto"; and only where the group's float32 products take at least
# `BFLOAT16_MIN_SECONDS`, so a few microseconds never trade a seeded call's draws (sampled drafts follow the drafter's
# rounding) for nothing.
BFLOAT16_MIN_SECONDS = 1e-3
_BF16_WORKS: list[bool] = []


def bfloat16_products_available() -> bool:
    """Whether oneDNN computes a bfloat16-reordered `F.linear` here (checked once per process on a small weight,
    against the product of the bfloat16-rounded operands)."""
    if not _BF16_WORKS:
        def product(x, weight):
            pack = _pack(weight, BF16_ROWS)
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), pack, None, "none", [], "")

        def rounded(tensor):
            return tensor.to(torch.bfloat16).float()

        _BF16_WORKS.append(onednn_reorder_available() and _computes_f_linear(product, rounded, rtol=2e-2, atol=2e-2))
    return _BF16_WORKS[0]


def _bfloat16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) · Wᵀ in bfloat16 with W's bfloat16 reorder (a bfloat16 result), returned in x's dtype; `F.linear`
    where there is none."""
    pack = _current_pack(weight, BF16_ROWS)
    if pack is None:
        return F.linear(x, weight)
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16).contiguous(), pack, None, "none", [], "")
    return out.to(x.dtype)


_LIBRARY.define("bfloat16_linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("bfloat16_linear", _bfloat16_linear, "CPU")
torch.library.register_fake(f"{_OP_NAMESPACE}::bfloat16_linear",
                            lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]), lib=_LIBRARY)  # fmt: skip
bfloat16_linear = getattr(torch.ops, _OP_NAMESPACE).bfloat16_linear.default


class Bfloat16Linear(PackedLinear):
    """`F.linear` over a few rows of x with an fp32 CPU weight computed in bfloat16 with W's bfloat16 reorder
    (`pack_weights(..., BF16_ROWS)`; a weight without one goes through `F.linear`)."""

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return bfloat16_linear(x, weight)


_BF16_TIMINGS: dict[tuple, tuple[float, float]] = {}


@torch.no_grad()
def bfloat16_pays(weights, rows: int, against: str, repeats: int = 3) -> bool:
    """Whether these weights' products over `rows` rows are faster in bfloat16 (`Bfloat16Linear`) than in the float32
    layout `against`, by `WEIGHT_MAJOR_MARGIN`, and the float32 products take at least `BFLOAT16_MIN_SECONDS`. Timed as
    a forward streams them, once per machine (`tuning.recorded_rounds`, as `_prepacked_pays`). False where oneDNN's
    bfloat16 products are unavailable or a weight is not float32 on a CPU."""
    if not bfloat16_products_available() or not all(_packable(weight) for weight in weights):
        return False
    key = (against, tuple((tuple(weight.shape), weight.dtype) for weight in weights), rows, torch.get_num_threads())
    if key not in _BF16_TIMINGS:
        layouts = ("bfloat16", against)
        record_key = {"machine": machine(weights[0].device), "weights": tensors_digest(weights), "rows": rows,
                      "repeats": repeats, "jobs": list(layouts)}  # fmt: skip
        jobs = [(weights, rows, layout) for layout in layouts]
        samples = recorded_rounds("layout", record_key, lambda: products_samples(jobs, rounds=repeats))
        _BF16_TIMINGS[key] = tuple(statistics.median(times) for times in samples)
    bfloat16, float32 = _BF16_TIMINGS[key]
    return float32 >= BFLOAT16_MIN_SECONDS and bfloat16 < WEIGHT_MAJOR_MARGIN * float32


_PREPACKED_TIMINGS: dict[tuple, tuple[float, float, float]] = {}


@torch.no_grad()
def _prepacked_pays(kind: str, weights, rows: int, repeats: int) -> bool:
    """Whether `F.linear` over `rows` rows of these weights is faster with prepacked weights (`kind`: "packed", MKL
    packs for that many rows, or "onednn", oneDNN reorders) than both other layouts, and than input-major by
    `WEIGHT_MAJOR_MARGIN`. Timed as a forward streams them (`products_samples`: every weight once, packed, the packs
    made for the timing dropped after): one weight timed over and over stays in cache, and on the Intel Xeon that
    ranked the layouts differently from the forward. Each (kind, weight shapes, rows, threads) is timed once per
    machine: the rounds are kept in its record (`tuning.recorded_rounds`), so a later process reads them instead of
    timing again (on the Xeon with AMX, Gemma-3 fp32, ~1.3 s per verification width, a few seconds before a first
    call's first token); a timing made while other jobs held the CPU is used in its process only."""
    key = (kind, tuple((tuple(weight.shape), weight.dtype) for weight in weights), rows, torch.get_num_threads())
    if key not in _PREPACKED_TIMINGS:
        layouts = (kind, "input_major", "weight_major")
        record_key = {"machine": machine(weights[0].device), "weights": tensors_digest(weights), "rows": rows,
                      "repeats": repeats, "jobs": list(layouts)}  # fmt: skip
        jobs = [(weights, rows, layout) for layout in layouts]
        samples = recorded_rounds("layout", record_key, lambda: products_samples(jobs, rounds=repeats))
        _PREPACKED_TIMINGS[key] = tuple(statistics.median(times) for times in samples)
    packed, input_major, weight_major = _PREPACKED_TIMINGS[key]
    return packed < WEIGHT_MAJOR_MARGIN * input_major and packed < weight_major


def packed_pays(weights, rows: int, repeats: int = 3) -> bool:
    """Whether MKL packs for `rows` rows pay for these weights (`_prepacked_pays`). False where packing is unavailable
    or a weight is not fp32 on a CPU."""
    if not mkl_packing_available() or not all(_packable(weight) for weight in weights):
        return False
    return _prepacked_pays("packed", weights, rows, repeats)


def onednn_pays(weights, rows: int, repeats: int = 3) -> bool:
    """Whether oneDNN reorders pay for these weights over `rows` rows (`_prepacked_pays`). False where oneDNN's
    reordered linear is unavailable or a weight is not fp32 on a CPU."""
    if not onednn_reorder_available() or not all(_packable(weight) for weight in weights):
        return False
    return _prepacked_pays("onednn", weights, rows, repeats)


def linear_layout_kind(linear_layout: str, weights, rows: int) -> str:
    """The layout the compiled graphs use for `F.linear` over `rows` rows of these weights: "packed" where asked (for
    weights that are all float32 on the CPU) or, with "auto", where `packed_pays`; else "weight_major" where
    `weight_major_layout` says so; else "input_major"."""
    if linear_layout == "packed":
        return "packed" if all(_packable(weight) for weight in weights) else "input_major"
    if linear_layout == "auto" and weights[0].device.type != "cuda" and packed_pays(weights, rows):
        return "packed"
    return "weight_major" if weight_major_layout(linear_layout, weights, rows) else "input_major"


def reordered_layout_kind(linear_layout: str, weights, rows: int) -> str:
    """The layout of a group whose width changes call to call (the eager verification): oneDNN-reordered weights
    ("onednn") where "packed" is asked (for weights that are all float32 on a CPU, with oneDNN's reordered linear) or,
    with "auto", where `onednn_pays`; else "weight_major" where `weight_major_layout` says so; else "input_major"."""
    if linear_layout == "packed":
        usable = onednn_reorder_available() and all(_packable(weight) for weight in weights)
        return "onednn" if usable else "input_major"
    if linear_layout == "auto" and weights[0].device.type != "cuda" and onednn_pays(weights, rows):
        return "onednn"
    return "weight_major" if weight_major_layout(linear_layout, weights, rows) else "input_major"


def linear_mode(kind: str, max_rows: int):
    """The context that computes `F.linear` over at most `max_rows` rows in layout `kind`."""
    if kind == "packed":
        return PackedLinear(max_rows)
    if kind == "onednn":
        return OnednnLinear(max_rows)
    if kind == "bfloat16":
        return Bfloat16Linear(max_rows)
    if kind == "weight_major":
        return WeightMajorLinear(max_rows)
    return contextlib.nullcontext()


def check_packed_layout(weights) -> None:
    """`linear_layout="packed"` needs MKL's packed GEMM and fp32 CPU weights: an error that says so, before tracing."""
    if not mkl_packing_available():
        raise ValueError(
            "linear_layout='packed' needs MKL's packed GEMM, which this torch build or CPU does not provide: use "
            "linear_layout='auto' (it picks the fastest layout available here)."
        )
    bad = sorted({f"{weight.dtype} on {weight.device.type}" for weight in weights if not _packable(weight)})
    if bad:
        raise ValueError(
            f"linear_layout='packed' packs float32 weights on a CPU, but these models have weights in {', '.join(bad)}: "
            "load them in float32 on the CPU, or use linear_layout='auto'."
        )


@torch.no_grad()
def products_samples(jobs: Sequence[tuple[Sequence[torch.Tensor], int, str]], *, rounds: int = 5) -> list[list[float]]:
    """Seconds of each job (weights, rows, layout) in each of `rounds` rounds: one pass of `rows` input rows through
    every weight in turn, as a forward multiplies them (each weight once, so they stream from memory), in that layout:
    `F.linear(x, W)`, `(W @ x.T).T` ("weight_major"), W's MKL pack for that many rows ("packed"), W's oneDNN reorder
    ("onednn") or its bfloat16 reorder ("bfloat16"). The unpacked jobs are timed in turn, round by round
    (`policy.time_rounds`), so a drift in the machine's speed hits them alike; each packed job is timed alone, its
    rounds between packing its weights and dropping the packs it made, so at most one extra copy of the weights is
    held."""
    product = {"input_major": F.linear, "weight_major": lambda x, w: torch.mm(w, x.t()), "packed": packed_linear,
               "onednn": onednn_linear, "bfloat16": bfloat16_linear}  # fmt: skip
    sweeps = product_sweeps([(weights, rows, product[kind]) for weights, rows, kind in jobs])
    device = jobs[0][0][0].device
    prepacked = ("packed", *_REORDER_ROWS)
    in_turn = [i for i, job in enumerate(jobs) if job[2] not in prepacked]
    samples = dict(zip(in_turn, time_rounds([sweeps[i] for i in in_turn], device, rounds)))
    for i, (weights, rows, kind) in enumerate(jobs):
        if kind in prepacked:
            pack_rows = _REORDER_ROWS.get(kind, rows)
            new = pack_weights(weights, pack_rows)
            samples[i] = time_rounds([sweeps[i]], device, rounds)[0]
            release_packed_weights(new, pack_rows)
    return [samples[i] for i in range(len(jobs))]


def products_seconds(jobs: Sequence[tuple[Sequence[torch.Tensor], int, str]], *, repeats: int = 5) -> list[float]:
    """Median seconds of each job (`products_samples`)."""
    return [statistics.median(times) for times in products_samples(jobs, rounds=repeats)]


class CpuLinearPolicy(LinearPolicy):
    """`LinearPolicy` on a CPU. A group in `tuned` (default: every group) runs where its timing says: MKL-packed (for
    a group in `packable`, float32 weights) or oneDNN-reordered (for a group in `reorderable`), else weight-major, else
    input-major (`linear_layout_kind`, `reordered_layout_kind`, or `weight_major_layout` for a group that may do
    neither); a group not in `tuned` runs input-major. `linear_layout` other than "auto" forces a layout ("packed": the
    group's prepacked kind). A group in `approximate`, whose products decide no output (the drafter's), runs in
    bfloat16 instead where that is faster than its float32 layout (`bfloat16_pays`; "auto" only). Packs are made by
    `prepare`, for the row counts a decoder runs (a reorder once, for all), and again if they were released or a weight
    changed in place."""

    KINDS = ("input_major", "weight_major", "packed", "onednn", "bfloat16")

    def __init__(self, linear_layout: str, weights: dict, *, packable=(), reorderable=(), approximate=(), tuned=None):
        super().__init__(linear_layout, weights)
        self.packable = frozenset(packable)
        self.reorderable = frozenset(reorderable)
        self.approximate = frozenset(approximate)
        self.tuned = frozenset(weights if tuned is None else tuned)
        self.packed_rows: set[tuple[str, int]] = set()  # (group, rows) this policy made packs for

    def decide(self, group: str, rows: int) -> str:
        weights = self.weights[group]
        if group not in self.tuned:
            return "input_major"
        if group in self.packable:
            kind = linear_layout_kind(self.linear_layout, weights, rows)
        elif group in self.reorderable:
            kind = reordered_layout_kind(self.linear_layout, weights, rows)
        else:
            kind = "weight_major" if weight_major_layout(self.linear_layout, weights, rows) else "input_major"
        approximate = group in self.approximate and self.linear_layout == "auto"
        return "bfloat16" if approximate and bfloat16_pays(weights, rows, kind) else kind

    def prepare(self, group: str, rows: int, *more_rows: int) -> None:
        kind = self.kind(group, rows)
        if kind == "packed":
            for count in (rows, *more_rows):
                pack_weights(self.weights[group], count)
                self.packed_rows.add((group, count))
        elif kind in _REORDER_ROWS:
            pack_weights(self.weights[group], _REORDER_ROWS[kind])
            self.packed_rows.add((group, _REORDER_ROWS[kind]))

    def release(self) -> None:
        for group, rows in self.packed_rows:
            release_packed_weights(self.weights[group], rows)
        self.packed_rows.clear()

    def mode(self, group: str, rows: int, max_rows: int):
        return linear_mode(self.kinds.get((group, rows), "input_major"), max_rows)

    def products_samples(self, jobs, *, rounds: int = 5) -> list[list[float]]:
        return products_samples([(self.weights[group], rows, self.kind(group, rows)) for group, rows in jobs],
                                rounds=rounds)  # fmt: skip


