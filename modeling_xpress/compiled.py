"""Compiled xPress decoding: `spec_generate(..., compile=True)`.

On a GPU the eager loop is launch-bound: a verification of 16 tokens through an 8B target is thousands of small
kernels, and so is a draft step. This file runs the same loop with every shape fixed, so that each model call can be
compiled once (`torch.compile`, mode "reduce-overhead" on CUDA: replayed as a CUDA graph; default inductor on CPU):

* static caches (transformers `StaticCache`) for the target and for the drafter, sized once per length bucket;
* verification runs `[anchor, d_1..d_{W-1}]`, W fixed per graph. Without a confidence threshold W is
  `num_assistant_tokens + 1` (the whole block B when uncapped): one graph per call. With a threshold the number of
  drafts `m` varies per block, so W is the smallest of a few buckets (powers of two below the cap's width, and that
  width: `verify_widths`) that holds `m + 1`. Only the first `m` drafts take part in acceptance, exactly as the eager
  loop verifies `m`: by causality the target's logits at positions 0..m do not depend on the drafts after them. On a
  CPU a short verification is much cheaper than a whole block in fp32 (compute-bound), so a cap pays there;
* the drafter's new context (the verified tokens' target features, 1..B of them per step) is padded to B rows and
  masked; the prompt's context, whose length varies per call, goes through the same function uncompiled (a prefill);
* only the drafts a step can verify (`num_assistant_tokens`) are read out and decoded: the drafter runs the whole
  block, but the lm_head readout and the head's decode cover the first `cap` positions, which by causality come out
  as in the whole block (`XPressModel.refine`);
* the Jacobi refiner runs a fixed `jacobi_max_iters` iterations inside its graph. Early exit needs no decision
  outside it: after a fixed point an iteration reproduces its input (Theorem 1), so the tokens and logits are those
  of the eager loop, and the iteration count is tracked per block inside the graph exactly as `jacobi_refine` does.

Static caches are never cropped. Each cache write starts at the first slot that is not committed (the write pointer
is set before every call), so the next write overwrites the rejected slots, and masks by position hide what is stale:
the target's causal mask lets a query at position p see slots <= p only, and the drafter's mask shows it its committed
context and the block it is drafting, nothing else. The loop itself (acceptance, stop tokens, the draft-length rule,
random draws) is the eager loop's own code, run outside the graphs on their outputs, so greedy and sampled outputs
match `compile=False`.

Compiled state (caches and compiled calls) is kept per (target, drafter, length bucket, decoding settings), so only
the first call pays compilation; `stats.time_compile` says how long it took. `release_compiled_decoders()` frees it.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import contextlib
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from .configuration_xpress import is_integer
from .generation import (
    SectionTimer,
    XPressGenerateOutput,
    XPressGenerationStats,
    _accept_greedy,
    _accept_sampling,
    decoding_processors,
    draft_length,
    median_seconds,
    target_features,
)
from .refinement import RefinementResult, decode, gumbel_noise, previous_tokens, target_ids

# Static caches are sized to a multiple of this many tokens, so prompts of different lengths share compiled state.
LENGTH_BUCKET = 256
# Compiled decoders kept alive at once (each holds two static caches); the least recently used is released first.
MAX_DECODERS = 8
# How the compiled graphs compute `F.linear` (`spec_generate(..., linear_layout=...)`): "auto" times the layouts on
# the models' own weights once per row count and leaves input-major only where another is clearly faster (on a GPU:
# never). "packed" multiplies by weights prepacked for MKL's packed GEMM (CPU, fp32; `PackedLinear`).
LINEAR_LAYOUTS = ("auto", "input_major", "weight_major", "packed")
# Weight-major is chosen only if the timed products are at least 1.25× faster that way: the microbenchmark leaves out
# what the layout changes around the product inside a graph. Measured on SmolLM2 (2-core AMD EPYC), whole compiled
# target forwards: fp32 at 3 rows 82 → 30 ms weight-major (products 2.6× faster), at 16 rows 75 → 66 ms (1.26×); bf16
# at 16 rows 26.5 → 33.6 ms, slower, although its products timed 1.15× faster.
WEIGHT_MAJOR_MARGIN = 0.8


@dataclass
class CompiledGenerationStats(XPressGenerationStats):
    """`XPressGenerationStats` of a compiled call, plus the seconds spent in calls that compiled a graph (0 when all
    graphs were compiled by an earlier call). Section times and `time_total` include that compilation."""

    time_compile: float = 0.0
    # tokens each verification ran through the target: its bucketed width W (the eager loop's is draft length + 1)
    verify_widths: list[int] = field(default_factory=list)
    # the decoder's graphs that compute F.linear weight-major, as "name:rows" (`spec_generate`'s linear_layout)
    weight_major_graphs: list[str] = field(default_factory=list)
    # the decoder's graphs that compute F.linear with MKL-packed weights, likewise
    packed_graphs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "time_compile": self.time_compile, "verify_widths": list(self.verify_widths),
                "weight_major_graphs": list(self.weight_major_graphs),
                "packed_graphs": list(self.packed_graphs)}  # fmt: skip


def verify_widths(widest: int) -> list[int]:
    """The verification widths of a call whose blocks verify at most `widest` tokens (anchor + the cap's drafts) and
    a varying number below it: powers of two below `widest`, and `widest`. Each is one graph; a block's drafts go
    through the smallest that holds them."""
    return [*(w for w in (2**i for i in range(1, widest.bit_length())) if w < widest), widest]


def verify_width(widest: int, tokens: int) -> int:
    """The smallest of `verify_widths(widest)` that holds `tokens` (anchor + the drafts to verify)."""
    return next(w for w in verify_widths(widest) if w >= tokens)


# --- CPU matmul layout -------------------------------------------------------------------------------------------
# A verification multiplies a few rows (anchor + drafts) by every weight of the target. Some CPU BLAS builds run
# `F.linear(x, W)` = x·Wᵀ for 2–3 rows through a per-row path: on the 2-core AMD EPYC of this project (MKL, fp32) the
# SmolLM2 lm_head (49,152 × 576) took 6.8 ms for 1 row, 20 ms for 3 and 9.8 ms for 4, and a 3-token verification cost
# two plain decoding steps. The same product computed weight-major, (W·xᵀ)ᵀ, is one streaming pass over W: 3.1 ms for
# 3 rows. Which layout is faster depends on the CPU and the BLAS build, so "auto" times both (`weight_major_pays`).


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


_LAYOUT_TIMINGS: dict[tuple, tuple[float, float]] = {}


def linear_weights(*modules: nn.Module) -> list[torch.Tensor]:
    """The weights of every `nn.Linear` in the modules (each tensor once: a tied lm_head counts once)."""
    seen, weights = set(), []
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.Linear) and id(sub.weight) not in seen:
                seen.add(id(sub.weight))
                weights.append(sub.weight)
    return weights


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
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
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
    graphs, the eager loops' verification (`generation.VerificationLayout`) and `draft_cap`."""
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
# compiles, until `release_compiled_decoders()`. The graphs call them through one operator with the weight as its
# input, so no weight is folded into a graph: a weight changed in place is repacked at its next use (its version
# counter moved), and a (weight, rows) that was never packed goes through `F.linear`.

_PACKS: dict[tuple[int, int], tuple[torch.Tensor, int, torch.Tensor]] = {}  # (data_ptr, rows) -> weight, version, pack
_PACKING_WORKS: list[bool] = []


def _packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"


def mkl_packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM and it computes `F.linear` here (checked once per process on a
    small weight)."""
    if not _PACKING_WORKS:
        works = bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear"))
        if works:
            try:
                generator = torch.Generator().manual_seed(0)
                weight = torch.randn(72, 40, generator=generator)
                for rows in (1, 3, 16):
                    x = torch.randn(rows, 40, generator=generator)
                    out = torch.ops.mkl._mkl_linear(x, _pack(weight, rows), weight, None, rows)
                    works &= torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-5)
            except RuntimeError:  # a build whose MKL ops exist but do not run here
                works = False
        _PACKING_WORKS.append(works)
    return _PACKING_WORKS[0]


def _version(weight: torch.Tensor) -> int:
    """The weight's in-place version counter. A tensor made under `torch.inference_mode` (a model loaded there, or the
    draft readout's lm_head rows cut there) has none: it counts as never changed in place (-1), so its pack is made
    again only for a new data pointer or shape."""
    return -1 if weight.is_inference() else weight._version


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)


def pack_weights(weights, rows: int) -> list[torch.Tensor]:
    """Prepack the fp32 CPU weights among `weights` for products over `rows` input rows (once each; again if one
    changed in place since). Returns the weights that had no pack for `rows` before."""
    new = []
    for weight in weights:
        if _packable(weight):
            kept = _PACKS.get((weight.data_ptr(), rows))
            if kept is None:
                new.append(weight)
            if kept is None or kept[1] != _version(weight) or kept[0].shape != weight.shape:
                _PACKS[weight.data_ptr(), rows] = (weight, _version(weight), _pack(weight, rows))
    return new


def release_packed_weights(weights=None, rows: int | None = None) -> None:
    """Drop the packs of `weights` for `rows` rows, or every kept pack (`release_compiled_decoders` does this)."""
    if weights is None:
        _PACKS.clear()
        return
    for weight in weights:
        _PACKS.pop((weight.data_ptr(), rows), None)


def _packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (rows, in) · Wᵀ with W's pack for that many rows; `F.linear` where there is none."""
    key = (weight.data_ptr(), x.shape[0])
    kept = _PACKS.get(key)
    if kept is None or kept[0].shape != weight.shape or kept[0].stride() != weight.stride():
        return F.linear(x, weight)
    if kept[1] != _version(weight):  # changed in place since it was packed
        kept = _PACKS[key] = (kept[0], _version(weight), _pack(weight, x.shape[0]))
    return torch.ops.mkl._mkl_linear(x.contiguous(), kept[2], weight, None, x.shape[0])


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


_PACKED_TIMINGS: dict[tuple, tuple[float, float, float]] = {}


@torch.no_grad()
def packed_pays(weights, rows: int, repeats: int = 3) -> bool:
    """Whether `F.linear` over `rows` rows of these weights is faster with MKL-packed weights than both other layouts,
    and than input-major by `WEIGHT_MAJOR_MARGIN`. Timed as a forward streams them (`draft_cap.products_seconds`:
    every weight once, packed for `rows`, the packs dropped after): one weight timed over and over stays in cache,
    and on the Intel Xeon that ranked the layouts differently from the forward. Each (weights, rows, threads) is timed
    once per process. False where packing is unavailable or a weight is not fp32 on a CPU."""
    if not mkl_packing_available() or not all(_packable(weight) for weight in weights):
        return False
    key = (tuple(weight.data_ptr() for weight in weights), rows, torch.get_num_threads())
    if key not in _PACKED_TIMINGS:
        from .draft_cap import products_seconds  # (draft_cap imports this module)

        jobs = [(weights, rows, kind) for kind in ("packed", "input_major", "weight_major")]
        _PACKED_TIMINGS[key] = tuple(products_seconds(jobs, repeats=repeats))
    packed, input_major, weight_major = _PACKED_TIMINGS[key]
    return packed < WEIGHT_MAJOR_MARGIN * input_major and packed < weight_major


def linear_layout_kind(linear_layout: str, weights, rows: int) -> str:
    """The layout the compiled graphs use for `F.linear` over `rows` rows of these weights: "packed" where asked (for
    weights that are all float32 on the CPU) or, with "auto", where `packed_pays`; else "weight_major" where
    `weight_major_layout` says so; else "input_major"."""
    if linear_layout == "packed":
        return "packed" if all(_packable(weight) for weight in weights) else "input_major"
    if linear_layout == "auto" and weights[0].device.type != "cuda" and packed_pays(weights, rows):
        return "packed"
    return "weight_major" if weight_major_layout(linear_layout, weights, rows) else "input_major"


def linear_mode(kind: str, max_rows: int):
    """The context that computes `F.linear` over at most `max_rows` rows in layout `kind`."""
    if kind == "packed":
        return PackedLinear(max_rows)
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


def check_linear_layout(linear_layout) -> None:
    if linear_layout not in LINEAR_LAYOUTS:
        raise ValueError(
            f"linear_layout must be one of {', '.join(map(repr, LINEAR_LAYOUTS))}, got {linear_layout!r}: 'auto' "
            "times the layouts on the models' weights and leaves input-major where no other is clearly faster, "
            "'input_major' is F.linear as is, 'weight_major' computes it as (W @ x.T).T, 'packed' multiplies by "
            "weights prepacked for MKL (compile=True, float32 on a CPU)."
        )


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class _TimedCompile:
    """A `torch.compile`d function that charges the wall time of each call that compiled a graph to its decoder.
    `fullgraph=True`: a graph break is an error at the first call, not a silent slow path."""

    def __init__(self, fn, decoder: "CompiledDecoder", mode: str | None):
        self.fn = torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)
        self.decoder = decoder

    def __call__(self, *args):
        before, start = _graphs_compiled(), time.perf_counter()
        out = self.fn(*args)
        if _graphs_compiled() != before:
            self.decoder.compile_seconds += time.perf_counter() - start
        return out


def _static_cache(config, max_cache_len: int, who: str) -> StaticCache:
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    kinds = sorted({type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer})
    if kinds:
        raise ValueError(
            f"spec_generate(compile=True) needs full-attention layers in the {who}, but its static cache has {kinds} "
            "layers (sliding-window, chunked or other attention), whose slots are not token positions. Use "
            "compile=False for this model."
        )
    return cache


def _set_write_position(cache: StaticCache, position) -> None:
    """Point every layer's next write at `position` (an int or a 0-d tensor): the committed slots stay, everything
    from `position` on is overwritten by the next call."""
    for layer in cache.layers:
        if isinstance(position, int):
            layer.cumulative_length.fill_(position)
        else:
            layer.cumulative_length.copy_(position)


def _pad_rows(features: torch.Tensor, rows: int) -> torch.Tensor:
    """(1, c, F) → (1, rows, F) with zero rows after the c real ones (masked out by the drafter)."""
    missing = rows - features.shape[1]
    if missing == 0:
        return features
    return torch.cat([features, features.new_zeros(features.shape[0], missing, features.shape[2])], dim=1)


def _prefix_free_transform(processors):
    """The logits transform of prefix-free processors (temperature/top-k/top-p) for a block (b, n, V): they never read
    the token prefix, so it is not passed (in the eager loop `processors_transform` passes it, unread)."""
    if not processors:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        b, n, v = logits.shape
        unread_ids = torch.zeros(b * n, 1, dtype=torch.long, device=logits.device)
        return processors(unread_ids, logits.reshape(b * n, v)).reshape(b, n, v)

    return transform


def jacobi_fixed_iterations(refiner, folded, hidden, base_logits, anchor_ids, *, iterations: int,
                            to_vocabulary=None, logits_transform=None, noise=None,
                            token_ids=None) -> RefinementResult:  # fmt: skip
    """`jacobi_refine` with a fixed number of full-block iterations and no early exit: the graph-friendly form.

    `folded` is `refiner.folded()`, computed outside the graph (it is cached by tensor versions, which a graph cannot
    read). Every iteration re-decodes all positions; a block's iteration count stops at its first iteration that
    changes no token, as in `jacobi_refine`, and iterations after a fixed point reproduce it (Theorem 1), so tokens,
    logits and counts equal `jacobi_refine(..., max_iters=iterations)` with or without early exit. `token_ids`: as
    in `jacobi_refine`, everything over the draft vocabulary.
    """
    to_vocabulary = to_vocabulary or (lambda values: values)
    m = base_logits.shape[1]  # the first m of hidden's n positions are decoded, as in `jacobi_refine`
    mix = folded.mix[:, :m, :m]
    # refiner.prepare(hidden), from the precomputed operators: the token-independent part of c, once per block
    g = hidden.mean(dim=1, keepdim=True)
    a_hidden = hidden @ folded.hidden_weight.T + g @ folded.global_weight.T  # (b, n, r)
    prepared = torch.einsum("dkj,bjd->bkd", folded.mix[:, :m], a_hidden)  # (b, m, r)
    processed, tokens = decode(base_logits, logits_transform, noise)  # seed Y^0 from the drafter's marginals
    b = tokens.shape[0]
    counts = torch.zeros(b, dtype=torch.long, device=tokens.device)
    settled = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    for _ in range(iterations):
        # refiner.delta_folded(prepared, previous) over the m decoded positions
        previous = previous_tokens(anchor_ids, target_ids(tokens, token_ids))  # (b, m)
        c = prepared + torch.einsum("dkj,bjd->bkd", mix, folded.token_table[previous])
        delta = to_vocabulary(refiner.trans_read(c))  # (b, m, V)
        processed, new_tokens = decode(base_logits + delta, logits_transform, noise)
        changed = (new_tokens != tokens).any(dim=1)
        counts += (~settled).long()
        settled |= ~changed
        tokens = new_tokens
    return RefinementResult(tokens=target_ids(tokens, token_ids), logits=processed, iterations=counts)


class CompiledDecoder:
    """Static caches and compiled calls for one (target, drafter, cache length, decoding settings).

    Four compiled calls, each with fixed shapes: `drafter` (block embedding + drafter forward on a context padded to
    B rows), `head` (the drafter's base logits through the target's lm_head, for the cap's drafts only: a graph per
    draft count), `refiner` (the head's decode of those drafts) and
    `verify` (the target on the anchor and the first drafts, one graph per width: its processed logits and the
    drafter's next context features). The compiled calls of every decoder share code, so dynamo reuses a graph for any
    models of the same shapes (weights and caches are graph inputs) and compiles only for new shapes.
    """

    def __init__(self, xpress, target, max_cache_len: int, temperature: float, top_k, top_p,
                 linear_layout: str = "auto"):  # fmt: skip
        self.xpress, self.target = xpress, target
        self.block = xpress.config.block_size
        self.max_cache_len = max_cache_len
        self.layer_ids = list(xpress.config.target_layer_ids)
        self.hidden_request = [i + 1 for i in self.layer_ids]
        self.embed_tokens, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.do_sample = temperature > 0
        self.processors = decoding_processors(temperature, top_k, top_p)
        self.transform = _prefix_free_transform(self.processors)
        self.jacobi_iters = xpress.config.jacobi_max_iters
        self.target_cache = _static_cache(target.config, max_cache_len, "target")
        self.draft_cache = _static_cache(xpress.config, max_cache_len, "drafter")
        # Allocated now, not lazily inside the first (compiled) drafter call: a graph traced through the allocation
        # would be traced again on the next call. (The target's cache is allocated by the uncompiled prefill.)
        config = xpress.config
        self.draft_cache.early_initialization(
            1, config.num_key_value_heads, config.head_dim, xpress.fc.weight.dtype, xpress.device
        )
        self.cuda = target.device.type == "cuda"
        mode = "reduce-overhead" if self.cuda else None  # CUDA graphs on a GPU; plain inductor kernels on CPU
        self.linear_layout = linear_layout
        self.graph_weights = self._graph_weights(linear_layout)
        self.layouts: dict[tuple[str, int], str] = {}  # (graph, rows) -> layout, decided by `prepare`
        self.prepare("drafter", self.block)
        self.compile_seconds = 0.0
        self.verified_widths: set[int] = set()  # verification widths whose graph is compiled
        self.drafter = _TimedCompile(self._draft, self, mode)
        self.head = _TimedCompile(self._base_logits, self, mode)
        self.refiner = _TimedCompile(self._refine, self, mode)
        self.verify = _TimedCompile(self._verify, self, mode)

    def _graph_weights(self, linear_layout: str) -> dict:
        """The weights each graph multiplies by: the target's (verification), the drafter's, and the readout's one
        matrix (the draft vocabulary's lm_head rows, or the whole lm_head). "packed" needs the target's to be float32
        on the CPU: checked here, before anything is traced."""
        rows = self.head_rows()
        weights = {
            "verify": linear_weights(self.target),
            "drafter": linear_weights(self.xpress),
            "head": [self.lm_head.weight if rows is None else rows[0]],
        }
        if linear_layout == "packed":
            check_packed_layout(weights["verify"])
        return weights

    def prepare(self, graph: str, rows: int) -> None:
        """Decide the `F.linear` layout of graph (`graph`, `rows`) (`linear_layout_kind`: "auto" times the layouts on
        that graph's weights for that many rows) and pack its weights if it is a packed graph. Called before the
        graph first runs (the drafter when the decoder is built, each verification width before it is compiled, the
        readout before a call's loop), so only the widths a decoder uses are timed and hold packs, and a traced
        graph reads a decided layout as a constant. Packs are made again if they were released or a weight changed
        in place; the layout is never changed. The drafter's K/V read [context; block], 2B rows: its weights are
        packed for those too."""
        key = (graph, rows)
        if key not in self.layouts:  # a bfloat16 drafter, or a GPU: input-major in the rule itself
            self.layouts[key] = linear_layout_kind(self.linear_layout, self.graph_weights[graph], rows)
        if self.layouts[key] == "packed":
            pack_weights(self.graph_weights[graph], rows)
            if graph == "drafter":
                pack_weights(self.graph_weights[graph], 2 * rows)

    def graphs_in(self, kind: str) -> frozenset:
        """The graphs decided so far, as (name, rows), whose `F.linear` layout is `kind`."""
        return frozenset(graph for graph, layout in self.layouts.items() if layout == kind)

    @property
    def weight_major(self) -> frozenset:
        return self.graphs_in("weight_major")

    @property
    def packed(self) -> frozenset:
        return self.graphs_in("packed")

    def _linear_mode(self, graph: str, rows: int):
        """The `F.linear` layout of one graph: entered inside it, so the choice is traced into the graph."""
        # max_rows 2B: the drafter's K/V read [context; block]
        # A graph run without `prepare` (only a direct call of `_draft` / `_verify`) computes F.linear as it is.
        return linear_mode(self.layouts.get((graph, rows), "input_major"), 2 * self.block)

    # --- the four graphs ------------------------------------------------------------------------------------------

    def _draft(self, anchor: torch.Tensor, context: torch.Tensor, context_len: torch.Tensor, count: torch.Tensor):
        """Drafter forward for one block. anchor (1, 1); context (1, W, L·H_t) target features whose first `count`
        rows are the committed tokens at positions context_len..anchor_pos-1 (the rest is padding); returns the
        block's last hidden states (1, B, H).

        Cache slots: the context rows go to context_len..context_len+W-1, the block to the next B slots. The block
        sees the committed slots (< anchor_pos) and itself; padding rows and stale slots are masked out.
        """
        xpress, block, width = self.xpress, self.block, context.shape[1]
        device = anchor.device
        anchor_pos = context_len + count
        noise_embeds = xpress.embed_blocks(anchor, self.embed_tokens)  # (1, B, H)
        position_ids = torch.cat([context_len + torch.arange(width, device=device),
                                  anchor_pos + torch.arange(block, device=device)]).unsqueeze(0)  # fmt: skip
        slots = torch.arange(self.max_cache_len, device=device)
        block_start = context_len + width
        visible = (slots < anchor_pos) | ((slots >= block_start) & (slots < block_start + block))  # (S,)
        mask = visible.view(1, 1, 1, -1).expand(1, 1, block, -1)  # (1, 1, B, S)
        _set_write_position(self.draft_cache, context_len)
        dtype = xpress.fc.weight.dtype
        with self._linear_mode("drafter", block):
            out = xpress(noise_embeds=noise_embeds.to(dtype), context_hidden_states=context.to(dtype),
                         position_ids=position_ids, attention_mask=mask, cache=self.draft_cache)  # fmt: skip
        return out.last_hidden_state  # (1, B, H)

    def _base_logits(self, hidden: torch.Tensor, rows) -> torch.Tensor:
        # `rows` (the draft vocabulary's lm_head rows, or None) come from `head_rows`, outside the graph. Over the
        # draft vocabulary when there is one: the compiled loop's processors are all `vocabulary_local`.
        with self._linear_mode("head", hidden.shape[1] - 1):
            return self.xpress.draft_logits(hidden.to(self.lm_head.weight.dtype), self.lm_head, rows)  # (1, n, V_d)

    def head_rows(self):
        """`xpress.draft_readout` outside the graph: its cache is keyed by data pointers, which a graph cannot
        compare."""
        rows = self.xpress.draft_readout(self.lm_head)
        if rows is not None and self.cuda:  # read in place by a CUDA graph, like parameters
            torch._dynamo.mark_static_address(rows[0])
        return rows

    def _refine(self, hidden, base_logits, anchor_ids, noise, folded):
        xpress = self.xpress
        if folded is None:  # Markov serial decode, plain argmax, or Jacobi with K = 0: no data-dependent control flow
            result = xpress.refine(hidden, base_logits, anchor_ids, logits_transform=self.transform, noise=noise)
        else:  # over the draft vocabulary when there is one (`_base_logits`), as `xpress.refine` decides
            vocabulary, draft_space = xpress.decoding_vocabulary(base_logits)
            result = jacobi_fixed_iterations(
                xpress.refiner, folded, hidden, base_logits, anchor_ids, iterations=self.jacobi_iters,
                logits_transform=self.transform, noise=noise, **vocabulary,
            )  # fmt: skip
            if draft_space:
                result.logits = xpress.to_vocabulary(result.logits, fill=float("-inf"))
        return result.tokens, result.logits, result.iterations

    def _verify(self, tokens: torch.Tensor, anchor_pos: torch.Tensor):
        """Target forward on tokens (1, W) = [anchor, drafts] at positions anchor_pos.. (W a `verify_widths` bucket,
        one graph each): processed logits (W, V) and the drafter's context features of these tokens (1, W, L·H_t)."""
        width = tokens.shape[1]
        _set_write_position(self.target_cache, anchor_pos)
        position_ids = (anchor_pos + torch.arange(width, device=tokens.device)).unsqueeze(0)
        with self._linear_mode("verify", width):
            out = self.target(input_ids=tokens, position_ids=position_ids, cache=self.target_cache,
                              output_hidden_states=self.hidden_request)  # fmt: skip
        logits = out.logits[0].float()  # (W, V)
        if self.processors:  # prefix-free: the ids are not read
            logits = self.processors(tokens.expand(width, -1), logits)
        return logits, target_features(out.hidden_states, self.layer_ids, width)

    def compile_verify_widths(self, widths, anchor: torch.Tensor, anchor_pos: int) -> None:
        """Compile the verification graphs of `widths` not compiled yet, on placeholder tokens at the first step's
        slots (right after the prefill): the first real verification writes from the same slot, so nothing they
        leave in the cache is ever read. Then no step of a call compiles in the middle of decoding."""
        for width in widths:
            if width not in self.verified_widths:
                self.prepare("verify", width)
                placeholder = anchor.reshape(1, 1).expand(1, width).contiguous()  # laid out as the real calls' ids
                self.verify(placeholder, torch.tensor(anchor_pos, device=anchor.device))
                self.verified_widths.add(width)

    # --- one call -------------------------------------------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor):
        """The prompt through the target, uncompiled (its length varies): logits of the last position, features."""
        _set_write_position(self.target_cache, 0)
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        out = self.target(input_ids=input_ids, position_ids=position_ids, cache=self.target_cache,
                          output_hidden_states=self.hidden_request, logits_to_keep=1)  # fmt: skip
        return out.logits[:, -1], target_features(out.hidden_states, self.layer_ids, input_ids.shape[1])

    def folded(self):
        """The refiner's folded operators for a Jacobi graph, or None when the head's decode needs none."""
        refiner = self.xpress.refiner
        if not refiner.iterative or self.jacobi_iters == 0:
            return None
        folded = refiner.folded()
        if self.cuda:  # parameters-like: a CUDA graph reads them in place instead of copying them in every replay
            for tensor in (folded.token_table, folded.hidden_weight, folded.global_weight, folded.mix):
                torch._dynamo.mark_static_address(tensor)
        return folded


_DECODERS: "OrderedDict[tuple, CompiledDecoder]" = OrderedDict()


def release_compiled_decoders() -> None:
    """Drop every kept compiled decoder (its static caches and the models it references) and every weight pack."""
    _DECODERS.clear()
    release_packed_weights()


def compiled_decoder(xpress, target, max_cache_len: int, temperature: float, top_k, top_p,
                     linear_layout: str = "auto") -> CompiledDecoder:  # fmt: skip
    """The kept decoder for these models, cache length, decoding settings and linear layout, built on first use."""
    config = xpress.config
    if temperature == 0:  # greedy: top-k/top-p do not apply
        top_k = top_p = None
    key = (id(xpress), id(target), max_cache_len, temperature, top_k, top_p, config.block_size,
           config.jacobi_max_iters, config.refiner, linear_layout)  # fmt: skip
    decoder = _DECODERS.get(key)
    if decoder is None or decoder.xpress is not xpress or decoder.target is not target:
        decoder = CompiledDecoder(xpress, target, max_cache_len, temperature, top_k, top_p, linear_layout)
        _DECODERS[key] = decoder
        while len(_DECODERS) > MAX_DECODERS:
            _DECODERS.popitem(last=False)
    _DECODERS.move_to_end(key)
    return decoder


def cache_length(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Slots of both static caches for a call: the prompt, the new tokens and the last verified block plus its padded
    drafter context, rounded up to a multiple of `LENGTH_BUCKET` (calls in one bucket share compiled state)."""
    return -(-(prompt_len + max_new_tokens + 2 * block_size) // LENGTH_BUCKET) * LENGTH_BUCKET


def check_compilable(xpress, target, repetition_penalty, no_repeat_ngram_size, logits_processor) -> None:
    """Errors for what the compiled loop cannot reproduce exactly; `compile=False` serves all of them."""
    unsupported = [
        name
        for name, used in (
            ("repetition_penalty", repetition_penalty is not None and repetition_penalty != 1.0),
            ("no_repeat_ngram_size", bool(no_repeat_ngram_size)),
            ("logits_processor", bool(logits_processor)),
        )
        if used
    ]
    if unsupported:
        raise ValueError(
            f"spec_generate(compile=True) does not support {', '.join(unsupported)}: these processors read the token "
            "prefix, whose length changes every step, so they cannot run in a fixed-shape graph. It supports greedy "
            "decoding and sampling with temperature, top_k and top_p; use compile=False for the rest."
        )
    if xpress.device != target.device:
        raise ValueError(
            f"spec_generate(compile=True) needs the drafter and the target on one device, got {xpress.device} and "
            f"{target.device}: move the drafter with xpress.to(target.device), or use compile=False."
        )


@torch.no_grad()
def compiled_spec_generate(
    xpress,
    target,
    input_ids: torch.LongTensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k,
    top_p,
    stop: torch.Tensor,
    generator: torch.Generator | None,
    draft_rule,
    max_cache_len: int | None = None,
    linear_layout: str = "auto",
) -> XPressGenerateOutput:
    """`spec_generate`'s loop on a `CompiledDecoder`: prefill → draft → refine → verify → accept, fixed shapes.

    Arguments are checked by `spec_generate`, which dispatches here for `compile=True`. `max_cache_len`: the caches'
    length (default: this call's bucket, `cache_length`). `linear_layout`: how the graphs compute `F.linear`
    (`LINEAR_LAYOUTS`; "auto" times them on the models' weights, on a CPU, for each graph width the first time a call
    uses it: `CompiledDecoder.prepare`).
    """
    block = xpress.config.block_size
    cache_len = cache_length(input_ids.shape[1], max_new_tokens, block)
    if max_cache_len is not None:
        needed = input_ids.shape[1] + max_new_tokens + 2 * block
        if not is_integer(max_cache_len) or max_cache_len < needed:
            raise ValueError(
                f"max_cache_len={max_cache_len!r} cannot hold this call: the prompt ({input_ids.shape[1]} tokens), "
                f"max_new_tokens ({max_new_tokens}) and two blocks of {block} need at least {needed} slots. Pass a "
                "larger max_cache_len (one that fits your longest prompt), or leave it unset to size the caches per "
                "call."
            )
        cache_len = int(max_cache_len)
    # Every compiled decoder's calls share code objects; dynamo keeps one entry per decoder, so allow more than its
    # default 8, and fail loudly rather than fall back to eager if even that is exceeded.
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        decoder = compiled_decoder(xpress, target, cache_len, temperature, top_k, top_p, linear_layout)
        compiled_before = decoder.compile_seconds
        stats = CompiledGenerationStats()
        xpress.generation_stats = stats
        out = _decode(decoder, input_ids, max_new_tokens, stop, generator, draft_rule, stats)
        stats.time_compile = decoder.compile_seconds - compiled_before
        stats.weight_major_graphs = [f"{g}:{rows}" for g, rows in sorted(decoder.weight_major)]
        stats.packed_graphs = [f"{g}:{rows}" for g, rows in sorted(decoder.packed)]
    return out


def _decode(decoder: CompiledDecoder, input_ids, max_new_tokens, stop, generator, draft_rule, stats):
    xpress, block, n = decoder.xpress, decoder.block, decoder.block - 1
    device, do_sample, processors = input_ids.device, decoder.do_sample, decoder.processors
    timer = SectionTimer(device)
    start = timer.mark()
    stop_ids = set(stop.tolist())

    def pick(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = processors(ids, logits.float()) if processors else logits.float()
        if not do_sample:
            return logits.argmax(dim=-1)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]

    # Prefill: the prompt's features become the drafter's first context, and the target emits the first token.
    last_logits, features = decoder.prefill(input_ids)
    sequence = torch.cat([input_ids, pick(last_logits, input_ids).view(1, 1)], dim=1)
    last_token = int(sequence[0, -1])
    count = input_ids.shape[1]  # rows of `features` that are new committed context
    context_len = 0
    # Verification widths this call can use: the cap's (anchor + cap drafts) without a confidence threshold, else
    # the buckets up to it; their graphs are compiled now, before the first step.
    widest = draft_rule.cap + 1
    fixed_width = not draft_rule.threshold
    decoder.compile_verify_widths([widest] if fixed_width else verify_widths(widest), sequence[0, -1],
                                  sequence.shape[1] - 1)  # fmt: skip
    decoder.prepare("head", widest - 1)  # the readout of the cap's drafts
    stats.record("verify", start, timer.mark())
    prompt_len = input_ids.shape[1]

    while sequence.shape[1] - prompt_len < max_new_tokens and last_token not in stop_ids:
        if decoder.cuda:  # outputs of the previous step's graphs are dead; what is carried over was cloned
            torch.compiler.cudagraph_mark_step_begin()
        anchor_pos = sequence.shape[1] - 1
        anchor = sequence[0, -1].view(1, 1)  # not sequence[:, -1:], whose stride (the length) would recompile
        budget = min(draft_rule.cap, max_new_tokens - (sequence.shape[1] - prompt_len) - 1)
        if budget > 0:
            t0 = timer.mark()
            positions = torch.tensor([context_len, count], device=device)
            if features.shape[1] <= block:  # padded to B rows: the fixed-shape graph
                hidden = decoder.drafter(anchor, _pad_rows(features, block), positions[0], positions[1])
            else:  # a prompt longer than a block: a prefill of varying length, uncompiled
                hidden = decoder._draft(anchor, features, positions[0], positions[1])
            t1 = timer.mark()
            base = decoder.head(hidden[:, :widest], decoder.head_rows())  # the cap's drafts only: (1, cap, V_d)
            t2 = timer.mark()
            noise = gumbel_noise(base.shape, generator=generator, device=base.device) if do_sample else None
            tokens, q_logits, iterations = decoder.refiner(hidden[:, 1:], base, anchor.view(1), noise, decoder.folded())
            t3 = timer.mark()
            stats.record("drafter", t0, t1)
            stats.record("lm_head", t1, t2)
            stats.record("refiner", t2, t3)
            stats.jacobi_iterations.append(int(iterations[0]))
            context_len = anchor_pos
            result = RefinementResult(tokens=tokens, logits=q_logits, iterations=iterations)
            length = draft_length(result, draft_rule.threshold, budget)
            stats.draft_lengths.append(length)
            block_drafts = tokens[0]  # (n,): the first W - 1 are verified, the first `length` are accepted from
        else:  # one token left: the target alone emits it (the drafts are placeholders no acceptance reads)
            length, q_logits = 0, torch.empty(1, 0)
            block_drafts = anchor[0].expand(n)

        t_verify = timer.mark()
        width = widest if fixed_width else verify_width(widest, length + 1)
        stats.verify_widths.append(width)
        verify_ids = torch.cat([anchor, block_drafts[: width - 1].view(1, -1)], dim=1)  # (1, W) [anchor, d_1..]
        p_logits, block_features = decoder.verify(verify_ids, torch.tensor(anchor_pos, device=device))
        draft = block_drafts[:length]
        if do_sample:
            matches, bonus = _accept_sampling(draft, q_logits[0, :length], p_logits[: length + 1], generator)
        else:
            matches, bonus = _accept_greedy(draft, p_logits[: length + 1])
        accepted = torch.cat([draft[:matches], bonus.view(1)])
        stop_at = torch.isin(accepted, stop).nonzero()
        if stop_at.numel():
            accepted = accepted[: int(stop_at[0]) + 1]
        accepted = accepted[: max_new_tokens - (sequence.shape[1] - prompt_len)]
        # No crop: the next verification writes from the slot after the accepted tokens. The anchor and the accepted
        # drafts are the next drafter context: the first matches + 1 rows of this block's features (W >= that).
        features, count = (block_features.clone() if decoder.cuda else block_features), matches + 1
        sequence = torch.cat([sequence, accepted.view(1, -1)], dim=1)
        last_token = int(sequence[0, -1])
        if length:  # τ counts verification steps of a draft only
            stats.acceptance_lengths.append(int(accepted.shape[0]))
        stats.record("verify", t_verify, timer.mark())

    stats.new_tokens = sequence.shape[1] - prompt_len
    stats.record_total(start, timer.mark())
    return XPressGenerateOutput(sequences=sequence, stats=stats)


__all__ = [
    "LINEAR_LAYOUTS",
    "PackedLinear",
    "WeightMajorLinear",
    "CompiledDecoder",
    "cache_length",
    "verify_width",
    "verify_widths",
    "CompiledGenerationStats",
    "compiled_spec_generate",
    "jacobi_fixed_iterations",
    "linear_layout_kind",
    "linear_weights",
    "mkl_packing_available",
    "pack_weights",
    "packed_pays",
    "release_compiled_decoders",
    "release_packed_weights",
    "weight_major_pays",
]
