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
context and the block it is drafting, nothing else. A target's sliding-window layers keep a slot per position too
(`_static_cache`), so a rejected draft is rolled back like any other, and their windows are masks by position. The loop itself (acceptance, stop tokens, the draft-length rule,
random draws) is `decoding.decode`, the eager loop's own code, run on these graphs' outputs
(`compiled_loop.CompiledSteps`), so
greedy and sampled outputs match `compile=False`. Sampling settings are graph inputs (`warp`), not constants.

Compiled state (caches and compiled calls) is kept per (target, drafter, length bucket, kind of decoding) on the
drafter (`DecoderCache`), so only the first call pays compilation (`stats.time_compile` says how long it took), and
deleting the models frees it; `release_compiled_decoders()` frees it while they live. What stays after that is the
compiler's own: dynamo's and inductor's caches of compiled code, shared by any later call with the same shapes, and
the compiler stack itself (on a 2-core CPU, a process that compiled a tiny pair and freed it kept ~105 MB above its
size before, ~70 MB of which any first `torch.compile` in a process loads: inductor, sympy, dynamo, FX;
`torch._dynamo.reset()` drops the compiled code for the whole process, not that).

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from .attention_masks import LayerKinds
from .drafting import target_features
from .layout_policy import decoder_policy
from .processors import Warpers, warp
from .refinement import RefinementResult, decode, previous_tokens, target_ids
from .stats import XPressGenerationStats
from .trees import static_tree_mask

# Static caches are sized to a multiple of this many tokens, so prompts of different lengths share compiled state.
LENGTH_BUCKET = 256
# Compiled decoders kept alive at once (each holds two static caches); the least recently used is released first.
MAX_DECODERS = 8


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
    """A static cache with one slot per token position in every layer. transformers' `StaticCache` gives a
    sliding-window layer a rolling buffer of its window (`StaticSlidingWindowLayer`): it evicts the oldest slot on
    every write, rejected drafts included, cannot be rolled back once past its window (`is_croppable`), and decides
    its writes on a Python count of tokens, not on a graph input. Here such a layer keeps every slot, like a full one,
    and its window is a mask by position (the target's own masks for a linear block, `attention_masks.LayerKinds`
    for a tree): exact, at the cost of the full layers' memory and attention width for it."""
    LayerKinds.of(config, use=f"spec_generate(compile=True) (its {who})", instead="compile=False")
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [layer if type(layer) is StaticLayer else StaticLayer(max_cache_len=max_cache_len)
                    for layer in cache.layers]  # fmt: skip
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


def _block_transform(warpers: Warpers | None, values):
    """`warp` for a block (b, n, V), or None when greedy."""
    if warpers is None:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        b, n, v = logits.shape
        return warp(logits.reshape(b * n, v), warpers, values).reshape(b, n, v)

    return transform


def jacobi_fixed_iterations(refiner, folded, hidden, base_logits, last_tokens, *, iterations: int,
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
    prepared = refiner.prepare(hidden, folded)  # the token-independent part of c, once per block
    processed, tokens = decode(base_logits, logits_transform, noise)  # seed Y^0 from the drafter's marginals
    b = tokens.shape[0]
    counts = torch.zeros(b, dtype=torch.long, device=tokens.device)
    settled = torch.zeros(b, dtype=torch.bool, device=tokens.device)
    for _ in range(iterations):
        previous = previous_tokens(last_tokens, target_ids(tokens, token_ids))  # (b, m + 1)
        delta = to_vocabulary(refiner.delta_folded(prepared, previous, folded=folded))  # (b, m, V)
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

    def __init__(self, xpress, target, max_cache_len: int, warpers: Warpers | None, linear_layout: str = "auto"):
        self.xpress, self.target = xpress, target
        self.block = xpress.config.block_size
        self.max_cache_len = max_cache_len
        self.layer_ids = list(xpress.config.target_layer_ids)
        self.hidden_request = [i + 1 for i in self.layer_ids]
        self.embed_tokens, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.warpers = warpers  # which sampling warpers the graphs apply (None: greedy); their values are inputs
        self.do_sample = warpers is not None
        self.jacobi_iters = xpress.config.jacobi_max_iters
        self.target_kinds = LayerKinds.of(target.config, use="spec_generate(compile=True)", instead="compile=False")
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
        # How each graph's products run on this device (`layout_policy`): decided per (graph, rows) before the graph
        # first runs (`prepare`), so a traced graph reads a decided layout as a constant.
        self.policy = decoder_policy(linear_layout, target, xpress, compiled=True, readout=self.head_rows())
        self.prepare("drafter", self.block)
        self.compile_seconds = 0.0
        self.verified_widths: set[tuple[int, bool]] = set()  # (width, tree) of the compiled verification graphs
        self.drafter = _TimedCompile(self._draft, self, mode)
        self.head = _TimedCompile(self._base_logits, self, mode)
        self.refiner = _TimedCompile(self._refine, self, mode)
        self.verify = _TimedCompile(self._verify, self, mode)

    def prepare(self, graph: str, rows: int) -> None:
        """Decide the layout of graph (`graph`, `rows`) and make what it needs (packs), before the graph first runs:
        the drafter when the decoder is built, each verification width before it is compiled, the readout before a
        call's loop; so only the widths a decoder uses are timed and hold packs. The drafter's K/V read [context;
        block], 2B rows: its weights are prepared for those too."""
        self.policy.prepare(graph, rows, *([2 * rows] if graph == "drafter" else []))

    @property
    def layouts(self) -> dict:
        """(graph, rows) -> the layout decided for it."""
        return self.policy.kinds

    @property
    def weight_major(self) -> frozenset:
        return self.policy.decided("weight_major")

    @property
    def packed(self) -> frozenset:
        return self.policy.decided("packed")

    def _linear_mode(self, graph: str, rows: int):
        """The layout of one graph's products: entered inside it, so the choice is traced into the graph (max_rows
        2B: the drafter's K/V read [context; block]). A graph run without `prepare` computes F.linear as it is."""
        return self.policy.mode(graph, rows, 2 * self.block)

    # --- the four graphs ------------------------------------------------------------------------------------------

    def _draft(self, anchor: torch.Tensor, context: torch.Tensor, context_len: torch.Tensor, count: torch.Tensor):
        """Drafter forward for one block. anchor (1, 1); context (1, W, L·H_t) target features whose first `count`
        rows are the committed tokens at positions context_len..anchor_pos-1 (the rest is padding); returns the
        block's last hidden states (1, B, H).

        Cache slots: the context rows go to context_len..context_len+W-1, the block to the next B slots. The block
        sees the committed slots (< anchor_pos) and itself; padding rows and stale slots are masked out. A slot's
        token position is its index, but the block's slots hold positions anchor_pos.. (`key_position_ids`, which
        windowed drafter layers measure their windows by).
        """
        xpress, block, width = self.xpress, self.block, context.shape[1]
        device = anchor.device
        anchor_pos = context_len + count
        noise_embeds = xpress.embed_blocks(anchor, self.embed_tokens)  # (1, B, H)
        position_ids = torch.cat([context_len + torch.arange(width, device=device),
                                  anchor_pos + torch.arange(block, device=device)]).unsqueeze(0)  # fmt: skip
        slots = torch.arange(self.max_cache_len, device=device)
        block_start = context_len + width
        in_block = (slots >= block_start) & (slots < block_start + block)  # (S,)
        mask = ((slots < anchor_pos) | in_block).view(1, 1, 1, -1).expand(1, 1, block, -1)  # (1, 1, B, S)
        key_positions = torch.where(in_block, slots - block_start + anchor_pos, slots).unsqueeze(0)  # (1, S)
        _set_write_position(self.draft_cache, context_len)
        dtype = xpress.fc.weight.dtype
        with self._linear_mode("drafter", block):
            out = xpress(noise_embeds=noise_embeds.to(dtype), context_hidden_states=context.to(dtype),
                         position_ids=position_ids, attention_mask=mask, cache=self.draft_cache,
                         key_position_ids=key_positions)  # fmt: skip
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

    def _refine(self, hidden, base_logits, last_tokens, noise, folded, warp_values):
        xpress, transform = self.xpress, _block_transform(self.warpers, warp_values)
        if folded is None:  # Markov serial decode, plain argmax, or Jacobi with K = 0: no data-dependent control flow
            result = xpress.refine(hidden, base_logits, last_tokens, logits_transform=transform, noise=noise)
        else:  # over the draft vocabulary when there is one (`_base_logits`), as `xpress.refine` decides
            vocabulary, draft_space = xpress.decoding_vocabulary(base_logits)
            result = jacobi_fixed_iterations(
                xpress.refiner, folded, hidden, base_logits, last_tokens, iterations=self.jacobi_iters,
                logits_transform=transform, noise=noise, **vocabulary,
            )  # fmt: skip
            if draft_space:
                result.logits = xpress.to_vocabulary(result.logits, fill=float("-inf"))
        return result.tokens, result.logits, result.iterations

    def _verify(self, tokens: torch.Tensor, anchor_pos: torch.Tensor, warp_values, depths=None, tree_mask=None):
        """Target forward on tokens (1, W) = [anchor, drafts] at positions anchor_pos.. (W a `verify_widths` bucket,
        one graph each): processed logits (W, V) and the drafter's context features of these tokens (1, W, L·H_t).
        A tree (`depths` (W,) from 0, `tree_mask` (W, W)): row j at position anchor_pos + depths[j], seeing the
        committed slots and its tree ancestors (`trees.static_tree_mask`); its own graph per W."""
        width = tokens.shape[1]
        _set_write_position(self.target_cache, anchor_pos)
        offsets = torch.arange(width, device=tokens.device) if depths is None else depths
        mask = None if tree_mask is None else static_tree_mask(self.target_kinds, tree_mask, offsets, anchor_pos,
                                                               self.max_cache_len, self.target.dtype)  # fmt: skip
        with self._linear_mode("verify", width):
            out = self.target(input_ids=tokens, position_ids=(anchor_pos + offsets).unsqueeze(0), attention_mask=mask,
                              cache=self.target_cache, output_hidden_states=self.hidden_request)  # fmt: skip
        logits = out.logits[0].float()  # (W, V)
        if self.warpers is not None:  # prefix-free: the ids are not read
            logits = warp(logits, self.warpers, warp_values)
        return logits, target_features(out.hidden_states, self.layer_ids, width)

    def compile_verify_widths(self, widths, anchor: torch.Tensor, anchor_pos: int, warp_values, tree=False) -> None:
        """Compile the verification graphs of `widths` not compiled yet (`tree`: the tree graphs), on placeholder
        tokens at the first step's slots (right after the prefill): the first real verification writes from the same
        slot, so nothing they leave in the cache is ever read. Then no step of a call compiles in the middle of
        decoding."""
        for width in widths:
            if (width, tree) not in self.verified_widths:
                self.prepare("verify", width)
                placeholder = anchor.reshape(1, 1).expand(1, width).contiguous()  # laid out as the real calls' ids
                shape = (torch.arange(width, device=anchor.device), torch.ones(width, width, dtype=torch.bool,
                                                                               device=anchor.device).tril())
                self.verify(placeholder, torch.tensor(anchor_pos, device=anchor.device), warp_values,
                            *(shape if tree else ()))  # fmt: skip
                self.verified_widths.add((width, tree))

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


class DecoderCache:
    """The compiled decoders of one drafter, kept on it (`xpress._compiled_decoders`), so they live and die with it:
    nothing process-global refers to a model, and `del` of the drafter and its target frees their decoders, static
    caches and packed weights with them. A copy of the drafter (`copy.deepcopy`, pickling) starts with none."""

    def __init__(self):
        self.decoders: "OrderedDict[tuple, CompiledDecoder]" = OrderedDict()

    def __deepcopy__(self, memo) -> "DecoderCache":
        return DecoderCache()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state) -> None:
        self.decoders = OrderedDict()


# Drafters that hold compiled decoders, weakly (for `release_compiled_decoders`); and the lock of compiled calls.
_HOLDERS: "weakref.WeakSet" = weakref.WeakSet()
_CALLS = threading.RLock()


def release_compiled_decoders(*models) -> None:
    """Drop the compiled decoders (static caches, references to the target, packed weights) of the given drafters,
    or of every drafter. Deleting the models frees them too; this frees them while the models live. The compiled
    code itself stays (dynamo's and inductor's caches, shared by any later call with the same shapes:
    `torch._dynamo.reset()` drops it for the whole process)."""
    with _CALLS:
        for xpress in models or list(_HOLDERS):
            cache = getattr(xpress, "_compiled_decoders", None)
            for decoder in cache.decoders.values() if cache is not None else ():
                decoder.policy.release()
            if cache is not None:
                cache.decoders.clear()


def compiled_decoder(xpress, target, max_cache_len: int, temperature: float, top_k, top_p,
                     linear_layout: str = "auto") -> CompiledDecoder:  # fmt: skip
    """The kept decoder for these models (their dtypes and devices too), cache length, sampling warpers and linear
    layout, built on first use. The warpers' values are not part of it: they are graph inputs."""
    config = xpress.config
    key = (id(target), max_cache_len, Warpers.of(temperature, top_k, top_p), config.block_size,
           config.jacobi_max_iters, config.refiner, linear_layout, xpress.fc.weight.dtype, xpress.device,
           target.dtype, target.device)  # fmt: skip
    cache = getattr(xpress, "_compiled_decoders", None)
    if cache is None:
        cache = xpress._compiled_decoders = DecoderCache()
        _HOLDERS.add(xpress)
    decoder = cache.decoders.get(key)
    if decoder is None or decoder.target is not target:
        decoder = CompiledDecoder(xpress, target, max_cache_len, Warpers.of(temperature, top_k, top_p), linear_layout)
        cache.decoders[key] = decoder
        while len(cache.decoders) > MAX_DECODERS:
            cache.decoders.popitem(last=False)
    cache.decoders.move_to_end(key)
    return decoder


def recompile_limit(max_positions: int, block_size: int) -> int:
    """dynamo's recompile limit for the compiled calls: above the entries one pair of model shapes can make, so it
    is never reached in normal use. Every decoder's calls share code objects, and each code object gets one entry
    per length bucket (up to the target's context) × verification width × kind of sampling (greedy, or which
    warpers apply: 9 kinds) — values of the sampling settings are graph inputs and add none — with room for four
    dtype/device variants. Past it a call fails loudly rather than running uncompiled."""
    buckets = max_positions // LENGTH_BUCKET + 1
    return max(64, 4 * 9 * buckets * len(verify_widths(block_size)))


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
    LayerKinds.of(target.config, use="spec_generate(compile=True)", instead="compile=False")
    if xpress.device != target.device:
        raise ValueError(
            f"spec_generate(compile=True) needs the drafter and the target on one device, got {xpress.device} and "
            f"{target.device}: move the drafter with xpress.to(target.device), or use compile=False."
        )


__all__ = [
    "CompiledDecoder",
    "CompiledGenerationStats",
    "cache_length",
    "jacobi_fixed_iterations",
    "recompile_limit",
    "release_compiled_decoders",
    "verify_width",
    "verify_widths",
]
