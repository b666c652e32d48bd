"""xPress speculative decoding: draft → refine → verify → accept → roll back caches.

Two ways in:

* `target.generate(**inputs, assistant_model=xpress)` (and `pipeline(..., assistant_model=xpress)`): transformers'
  own assisted-decoding loop does verification and acceptance; `XPressCandidateGenerator` drafts and refines.
  transformers has no public parameter for a custom candidate generator, so `install_generation_hook` wraps two
  private `GenerationMixin` methods; see its docstring for exactly what it changes.
* `spec_generate(xpress, target, input_ids, ...)`: a standalone loop with its own caches and timing breakdown.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import contextlib
import functools
import inspect
import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import transformers
from transformers import DynamicCache, GenerationConfig, GenerationMixin, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator, DFlashTokenCandidateGenerator
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .configuration_xpress import is_integer, is_real
from .refinement import RefinementResult, gumbel_noise

# ---------------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------------


SECTIONS = ("drafter", "lm_head", "refiner", "verify")


def _elapsed(start, end) -> float:
    """Seconds between two marks of a `SectionTimer`: perf_counter floats, or CUDA events (waits for the end event)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass
class XPressGenerationStats:
    """What one generation call measured. τ counts tokens committed per target verification, bonus included.

    Section times (seconds) are read as `time_drafter`, `time_lm_head`, `time_refiner` (Jacobi / Markov serial decode /
    plain argmax, including drawing the block's Gumbel noise when sampling), `time_verify` (spec_generate: target
    verification and acceptance; generate: the time between two draft calls, i.e. transformers' verification step)
    and `time_total`. On a GPU they come from CUDA events that are only waited for when a time is read, so measuring
    adds no synchronisation to generation.
    """

    acceptance_lengths: list[int] = field(default_factory=list)  # per verification step, 1 ≤ τ_step ≤ block_size
    jacobi_iterations: list[int] = field(default_factory=list)  # refiner passes per drafted block
    draft_lengths: list[int] = field(default_factory=list)  # drafts verified per block, after the draft-length cut
    new_tokens: int = 0
    _spans: dict[str, list] = field(default_factory=lambda: {name: [] for name in SECTIONS}, repr=False)
    _total: tuple | None = field(default=None, repr=False)

    def record(self, section: str, start, end) -> None:
        """Charge the span between two `SectionTimer` marks to `section` (one of `SECTIONS`)."""
        self._spans[section].append((start, end))

    def record_total(self, start, end) -> None:
        self._total = (start, end)

    def seconds(self, section: str) -> float:
        return sum(_elapsed(start, end) for start, end in self._spans[section])

    time_drafter = property(lambda self: self.seconds("drafter"))
    time_lm_head = property(lambda self: self.seconds("lm_head"))
    time_refiner = property(lambda self: self.seconds("refiner"))
    time_verify = property(lambda self: self.seconds("verify"))
    time_total = property(lambda self: 0.0 if self._total is None else _elapsed(*self._total))

    @property
    def mean_tau(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def mean_jacobi_iterations(self) -> float:
        return sum(self.jacobi_iterations) / max(len(self.jacobi_iterations), 1)

    @property
    def mean_draft_length(self) -> float:
        return sum(self.draft_lengths) / max(len(self.draft_lengths), 1)

    def as_dict(self) -> dict:
        return {
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_tau": self.mean_tau,
            "jacobi_iterations": list(self.jacobi_iterations),
            "mean_jacobi_iterations": self.mean_jacobi_iterations,
            "draft_lengths": list(self.draft_lengths),
            "mean_draft_length": self.mean_draft_length,
            **{f"time_{name}": self.seconds(name) for name in SECTIONS},
            "time_total": self.time_total,
            "new_tokens": self.new_tokens,
        }


class SectionTimer:
    """Marks for timing the sections of generation without adding device synchronisations.

    On CPU a mark is `time.perf_counter()`. On CUDA it is an event recorded on the current stream, so the GPU work
    launched between two marks is what their span measures; nothing waits for it until the statistics are read.
    """

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class WallClock:
    """End-to-end wall clock for benchmarks: synchronises CUDA, so a span covers the GPU work launched inside it.
    Generation itself uses `SectionTimer`, which never synchronises."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def median_seconds(fn, repeats: int, *, warmup: int = 1, clock: WallClock | None = None) -> float:
    """Median wall time of `fn()` over `repeats` calls after `warmup` untimed ones (`clock`: a `WallClock` to
    synchronise a GPU; default, the host clock)."""
    now = clock.now if clock is not None else time.perf_counter
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = now()
        fn()
        samples.append(now() - start)
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------------------------------
# Shared steps
# ---------------------------------------------------------------------------------------------------------------------


def target_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int], count: int) -> torch.Tensor:
    """The drafter's context features for the first `count` tokens of a target forward: (1, count, L·H_t)."""
    return torch.cat([hidden_states[i + 1][:, :count] for i in layer_ids], dim=-1)


def processors_transform(logits_processor: LogitsProcessorList | None, input_ids: torch.Tensor):
    """Apply a transformers processor list to a block of logits (b, n, V), position by position in one batch.

    Processors see the committed `input_ids` (not the in-block draft prefix); that only affects how close q is to p,
    never correctness, because the logits returned are exactly those the draft tokens are drawn from.
    """
    if not logits_processor:
        return None

    def transform(logits: torch.Tensor) -> torch.Tensor:
        b, n, v = logits.shape
        ids = input_ids.expand(b * n, -1) if input_ids.shape[0] == 1 else input_ids.repeat_interleave(n, dim=0)
        return logits_processor(ids, logits.reshape(b * n, v)).reshape(b, n, v)

    return transform


# transformers' warpers that read neither the token prefix nor token ids, only the logits' values: verification can
# process all positions in one call, and over a draft vocabulary they give the distribution they give over the whole
# vocabulary with -inf outside it.
PREFIX_FREE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)


def vocabulary_local(logits_processor: LogitsProcessorList | None) -> bool:
    """Whether a drafter may decode over its draft vocabulary under these processors (`XPressModel.refine`): none,
    or only temperature / top-k / top-p. Any other processor may read token ids, so it gets the whole vocabulary."""
    return all(type(processor) in PREFIX_FREE_PROCESSORS for processor in logits_processor or [])


def sampling_processors(temperature: float, top_k: int | None, top_p: float | None) -> LogitsProcessorList:
    """Temperature, top-k and top-p as transformers' own warpers (applied identically to q and p)."""
    processors = LogitsProcessorList()
    if temperature > 0 and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    return processors


def process_verification_logits(
    processors: LogitsProcessorList, sequence: torch.Tensor, draft: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """The target's processed logits at the verification positions: logits (m + 1, V) after `sequence` (1, L) and
    the drafts (m,); position j is processed as transformers does, with the prefix `sequence + draft[:j]`."""
    if not processors:
        return logits
    if all(isinstance(p, PREFIX_FREE_PROCESSORS) for p in processors):
        return processors(sequence.expand(logits.shape[0], -1), logits)
    ids, length = torch.cat([sequence, draft.view(1, -1)], dim=1), sequence.shape[1]
    return torch.cat([processors(ids[:, : length + j], logits[j : j + 1]) for j in range(logits.shape[0])])


def check_decoding_arguments(
    max_new_tokens, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size
) -> None:
    """`spec_generate`'s decoding arguments, each refused by name when it cannot work (as `GenerationConfig` does)."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not is_integer(top_k) or top_k < 0):
        raise ValueError(f"top_k must be None or an integer >= 0 (0 = no top-k), got {top_k!r}")
    if top_p is not None and (not is_real(top_p) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if repetition_penalty is not None and (
        not is_real(repetition_penalty) or not math.isfinite(repetition_penalty) or repetition_penalty <= 0
    ):
        raise ValueError(f"repetition_penalty must be None or a finite number > 0, got {repetition_penalty!r}")
    if no_repeat_ngram_size is not None and (not is_integer(no_repeat_ngram_size) or no_repeat_ngram_size < 0):
        raise ValueError(f"no_repeat_ngram_size must be None or an integer >= 0, got {no_repeat_ngram_size!r}")


def decoding_processors(
    temperature: float,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
) -> LogitsProcessorList:
    """The processors `spec_generate` applies to the target's p and the drafter's q alike, in `generate`'s order:
    repetition penalty, n-gram blocking and the caller's own processors, then (when sampling) the warpers."""
    processors = LogitsProcessorList()
    if repetition_penalty is not None and repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(no_repeat_ngram_size))
    processors.extend(logits_processor or [])
    if temperature > 0:
        processors.extend(sampling_processors(temperature, top_k, top_p))
    return processors


def stop_token_tensor(stop_token_ids, device) -> torch.Tensor:
    """Stop tokens as a 1-D LongTensor from None, an int (Python, numpy or 0-d tensor) or a sequence/tensor of ids."""
    if stop_token_ids is None:
        return torch.empty(0, dtype=torch.long, device=device)
    try:
        stop = torch.as_tensor(stop_token_ids, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"stop_token_ids must be token ids (an int or a list of ints), got {stop_token_ids!r}") from error
    if stop.numel() and (stop.dtype == torch.bool or stop.is_floating_point() or stop.is_complex()):
        raise ValueError(f"stop_token_ids must be integer token ids, got {stop_token_ids!r}")
    return stop.to(torch.long).flatten()


def draft_block(
    xpress,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    anchor: torch.Tensor,
    context_features: torch.Tensor,
    context_start: int,
    cache: DynamicCache,
    *,
    logits_transform=None,
    do_sample: bool = False,
    generator: torch.Generator | None = None,
    stats: XPressGenerationStats | None = None,
    timer: SectionTimer | None = None,
    draft_space: bool = False,
    positions: int | None = None,
    drafter_layout: "DrafterLayout | None" = None,
) -> RefinementResult:
    """Draft one block after the committed prefix and return its tokens and their distributions.

    anchor: (1,) last committed token (position `context_start + c`); context_features: (1, c, L·H_t) target features
    of committed tokens the drafter cache has not seen. The drafter cache keeps only context K/V: the block's K/V are
    cropped before returning. `draft_space`: decode over the draft vocabulary (allowed when `vocabulary_local` holds
    for the processors behind `logits_transform`); the result is the same either way, over the whole vocabulary.
    `positions`: read out and decode only the block's first that many drafts (the most a step can verify), which
    come out as they would in the whole block; the drafter itself always runs the whole block. `drafter_layout`: how
    the drafter's forward computes `F.linear` (`DrafterLayout`; None: as it is).
    """
    timer = timer or SectionTimer(anchor.device)
    block = xpress.config.block_size
    t0 = timer.mark()
    noise_embeds = xpress.embed_blocks(anchor.view(1, 1), embed_tokens)  # (1, B, H)
    c = context_features.shape[1]
    position_ids = torch.arange(context_start, context_start + c + block, device=anchor.device).unsqueeze(0)
    dtype = xpress.fc.weight.dtype
    with drafter_layout() if drafter_layout is not None else contextlib.nullcontext():
        out = xpress(
            noise_embeds=noise_embeds.to(dtype),
            context_hidden_states=context_features.to(dtype),
            position_ids=position_ids,
            cache=cache,
        )
    cache.crop(-block)
    hidden = out.last_hidden_state  # (1, B, H)
    t1 = timer.mark()
    read = xpress.draft_logits if draft_space else xpress.base_logits
    base = read(hidden.to(lm_head.weight.dtype), lm_head, positions=positions)  # (1, m, V_d) draft vocabulary, else V
    t2 = timer.mark()
    noise = gumbel_noise(base.shape, generator=generator, device=base.device) if do_sample else None
    result = xpress.refine(hidden[:, 1:], base, anchor.view(1), logits_transform=logits_transform, noise=noise)
    t3 = timer.mark()
    if stats is not None:
        stats.record("drafter", t0, t1)
        stats.record("lm_head", t1, t2)
        stats.record("refiner", t2, t3)
        stats.jacobi_iterations.append(int(result.iterations[0]))
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Draft length: which part of a block is verified
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftLengthRule:
    """How many drafts of a block go to verification: at most `cap`, cut by cumulative confidence (`draft_length`)."""

    threshold: float | None  # cumulative-confidence threshold; None or 0 = no cut
    cap: int  # at most this many drafts per block, 1..block_size - 1


def draft_length_rule(config, assistant_confidence_threshold=None, num_assistant_tokens=None) -> DraftLengthRule:
    """The draft-length rule of one generation call: the call's values where given (not None), else the xPress
    config's (`draft_confidence_threshold`, `num_assistant_tokens`). A cap above the block is clamped to the block."""
    threshold, cap = assistant_confidence_threshold, num_assistant_tokens
    # getattr: a checkpoint saved before these fields existed, loaded with its own code (trust_remote_code), has a
    # config class without them; it keeps verifying whole blocks, as it did.
    threshold = getattr(config, "draft_confidence_threshold", None) if threshold is None else threshold
    cap = getattr(config, "num_assistant_tokens", None) if cap is None else cap
    if threshold is not None and (not is_real(threshold) or not 0 <= threshold <= 1):
        raise ValueError(
            f"assistant_confidence_threshold must be None or a number in [0, 1] (0 = no cut), got {threshold!r}"
        )
    if cap is not None and (not is_integer(cap) or cap < 1):
        raise ValueError(f"num_assistant_tokens must be None or an integer >= 1, got {cap!r}")
    block = config.num_draft_tokens
    return DraftLengthRule(threshold=threshold, cap=block if cap is None else min(cap, block))


def generation_config_draft_settings(generation_config) -> tuple[float | None, int | None]:
    """(assistant_confidence_threshold, num_assistant_tokens) as a `generate` call sets them; None for each it does not.

    By the time a candidate generator is built, transformers has filled every field nobody set with its global default
    (`GenerationConfig._get_default_generation_params()`: `num_assistant_tokens=20`,
    `assistant_confidence_threshold=0.4`), so which fields a caller passed cannot be read back. The rule: a value
    counts as set when it differs from that global default (whether it came from the call or from the target's
    `generation_config.json`); a value equal to it leaves the xPress config in charge. To use exactly 0.4 or 20, set
    it on the xPress config (`xpress.config.draft_confidence_threshold = 0.4`) or pass it to `spec_generate`.
    """
    defaults = GenerationConfig._get_default_generation_params()
    values = []
    for name in ("assistant_confidence_threshold", "num_assistant_tokens"):
        value = getattr(generation_config, name, None)
        values.append(None if value is None or value == defaults.get(name) else value)
    return values[0], values[1]


def draft_length(result: RefinementResult, threshold: float | None, budget: int) -> int:
    """How many of the block's first `budget` drafts to verify: up to and including the first draft whose cumulative
    confidence prod_{j<=k} q_j(x_j) falls below `threshold` (q_j: softmax of `result.logits`, the distribution x_j was
    drawn from); all `budget` when none does or `threshold` is None/0. At least one draft is always verified.

    Why the first draft below the threshold is still verified: speculative sampling stays lossless when the number of
    drafts verified is a stopping rule on the drafter's own samples, i.e. whether draft k is verified depends only on
    drafts 1..k-1 (here: on their cumulative confidence), never on draft k itself. Then, given that k is verified, x_k
    is still an unconditioned draw from q_k, and the accept/resample step at k yields the target's p_k exactly, as in
    the standard proof (Leviathan et al., Thm. 1); a cut before k just makes the target's own token the bonus there.
    Cutting *before* the first low-confidence draft would decide on x_k by its own value: the drafts verified at k
    would come from q_k restricted to its confident tokens while acceptance divides by q_k, which is biased (q_k =
    (0.9, 0.1), p_k = (0.5, 0.5), threshold 0.5: the first token would come out with probability 0.55, not 0.5).
    Greedy output is the target's own whatever the length.
    """
    if not threshold or budget <= 1:
        return budget
    logits = result.logits[0, :budget].float()  # (m, V)
    tokens = result.tokens[0, :budget].to(logits.device)
    log_q = logits.gather(-1, tokens.view(-1, 1))[:, 0] - logits.logsumexp(dim=-1)  # (m,) log q_k(x_k)
    below = (log_q.cumsum(dim=0) < math.log(threshold)).nonzero()
    return budget if below.numel() == 0 else int(below[0]) + 1


# ---------------------------------------------------------------------------------------------------------------------
# transformers integration
# ---------------------------------------------------------------------------------------------------------------------


def _is_xpress(model) -> bool:
    # Duck-typed on purpose: the package's class and the copy loaded with trust_remote_code are different objects.
    return getattr(getattr(model, "config", None), "model_type", None) == "xpress"


def check_assistant_call(target, xpress, input_ids: torch.Tensor) -> None:
    """Errors for a target or input xPress cannot serve, raised before any model runs."""
    xpress.config.check_target(target.config)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"xPress speculative decoding runs one sequence at a time, got input_ids of shape {tuple(input_ids.shape)}. "
            "Call generate once per prompt (or use plain target.generate for batched decoding)."
        )


def check_generation_config(generation_config) -> None:
    """Errors for `generate` settings an xPress assistant cannot serve (transformers would otherwise ignore the
    assistant silently or fail deep inside its loop)."""
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} is not supported with an xPress assistant: "
            "it decodes one sequence per call. Call generate several times (with do_sample=True) instead."
        )
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams} is not supported with an xPress assistant: speculative decoding "
            "verifies a single sequence, and beam search would silently ignore the drafter. Use num_beams=1 (greedy or "
            "sampling) with assistant_model, or beam search without it."
        )
    if "static" in str(generation_config.cache_implementation or ""):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} is not supported with an xPress "
            "assistant: transformers would compile the target once per verification length, which changes from step "
            "to step. For static caches and compiled fixed-shape graphs use xpress.spec_generate(target, input_ids, "
            "compile=True); generate with an xPress assistant uses the default dynamic cache."
        )


class VerificationLayout:
    """How the eager loops multiply the few rows of a verification: `compiled.WeightMajorLinear` where the target's
    products over that many rows are clearly faster weight-major on this CPU (`linear_layout="auto"`, decided as the
    compiled graphs decide it, `compiled.weight_major_pays`, once per width and process), always ("weight_major") or
    never ("input_major"). On some CPU BLAS builds a 2-4-row fp32 product takes a per-row path: on a 2-core AMD EPYC
    an eager 4-token SmolLM2 forward measured 154 ms input-major and 102 ms weight-major (one token: 74 ms)."""

    def __init__(self, target, linear_layout: str = "auto"):
        from .compiled import check_linear_layout, linear_weights

        check_linear_layout(linear_layout)
        self.linear_layout = linear_layout
        self.weights = linear_weights(target)
        self.decided: dict[int, bool] = {}

    def weight_major(self, width: int) -> bool:
        if width not in self.decided:
            from .compiled import weight_major_layout

            self.decided[width] = weight_major_layout(self.linear_layout, self.weights, width)
        return self.decided[width]

    def __call__(self, width: int):
        """The context to run a `width`-token verification forward in."""
        from .compiled import WeightMajorLinear

        return WeightMajorLinear(max_rows=width) if self.weight_major(width) else contextlib.nullcontext()


class DrafterLayout:
    """How the eager loops multiply the drafter's weights. A block is B rows through every query, output and MLP
    product (K/V also read the new context rows, fc only those), and on some CPUs a B-row `F.linear` is several times
    slower than the same product over MKL-packed weights: on a 2-core Intel Xeon (Ice Lake), fp32, the bundled SmolLM2
    drafter's eager forward spent ~13 ms of its ~18 ms per block in input-major products. The layout is decided as the
    compiled drafter graph's (`compiled.linear_layout_kind` at B rows: packed where fastest, float32 on a CPU only,
    else weight-major where that pays, else input-major; timed once per drafter and process), and packed weights are
    made for B rows (kept until `release_compiled_decoders()`); products over another row count go through `F.linear`
    (or weight-major). `linear_layout="packed"` is not an eager layout (`spec_generate` says so)."""

    def __init__(self, xpress, linear_layout: str = "auto"):
        from .compiled import check_linear_layout, linear_weights

        check_linear_layout(linear_layout)
        self.linear_layout = linear_layout
        self.rows = xpress.config.block_size
        self.weights = linear_weights(xpress)
        self._kind: str | None = None

    @property
    def kind(self) -> str:
        """"packed", "weight_major" or "input_major", decided on first use."""
        if self._kind is None:
            from .compiled import linear_layout_kind

            self._kind = linear_layout_kind(self.linear_layout, self.weights, self.rows)
        return self._kind

    def __call__(self):
        """The context to run one drafter forward in."""
        from .compiled import linear_mode, pack_weights

        if self.kind == "packed":
            pack_weights(self.weights, self.rows)  # (a dictionary lookup per weight once they are packed)
        return linear_mode(self.kind, 2 * self.rows)


class XPressCandidateGenerator(CandidateGenerator):
    """transformers `CandidateGenerator` that drafts with the xPress drafter and refiner.

    It consumes the target's hidden states of its previous forward (`requires_model_outputs`): on the first call it
    returns the prompt unchanged so that the target prefills; afterwards it drafts `block_size - 1` tokens after the
    bonus token and returns them with the processed logits they were drawn from, so `_speculative_sampling` is
    lossless. Only the block's first `draft_length` drafts are returned: the call's `assistant_confidence_threshold`
    and `num_assistant_tokens` (when they differ from transformers' defaults, `generation_config_draft_settings`)
    over the xPress config's `draft_confidence_threshold` and `num_assistant_tokens`.
    """

    requires_model_outputs = True

    def __init__(self, xpress, target, input_ids: torch.Tensor, generation_config, logits_processor=None):
        check_assistant_call(target, xpress, input_ids)
        check_generation_config(generation_config)
        self.xpress = xpress
        self.layer_ids = list(xpress.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.layer_ids]}
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.draft_rule = draft_length_rule(xpress.config, *generation_config_draft_settings(generation_config))
        self.logits_processor = logits_processor
        self.draft_space = vocabulary_local(logits_processor)  # decode over the draft vocabulary when allowed
        self.cache = DynamicCache(config=xpress.config)
        self.context_len = 0  # committed tokens whose features are in the drafter cache
        self.timer = SectionTimer(xpress.device)
        self.stats = XPressGenerationStats()
        xpress.generation_stats = self.stats
        self.target = target
        self.layout = VerificationLayout(target)  # transformers verifies: its forward runs under `_arm_verification`
        self.drafter_layout = DrafterLayout(xpress)
        self._hooks: list = []
        self._start = self.timer.mark()
        self._last_draft_end = None
        self._drafted = False  # whether the step being verified carries a draft (not the prefill / a budget-0 step)

    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        self._disarm()
        now = self.timer.mark()
        if self._last_draft_end is not None:
            self.stats.record("verify", self._last_draft_end, now)
        self.stats.record_total(self._start, now)
        self._drafted = False
        if is_first_iteration:
            return input_ids, None  # the target prefills first; we need its hidden states
        budget = min(self.draft_rule.cap, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None  # the last token comes from the target alone; no later draft will follow
        if model_outputs is None or model_outputs.hidden_states is None:
            raise RuntimeError(
                "xPress needs the target's hidden states from its previous forward, but transformers passed none. "
                "This transformers version changed the assisted-decoding protocol; use transformers 5.24."
            )
        # The target's last forward started at the first token the drafter has not seen (prompt start at prefill,
        # the previous anchor afterwards); the committed ones among them become new context.
        anchor_pos = input_ids.shape[1] - 1
        count = anchor_pos - self.context_len
        features = target_features(model_outputs.hidden_states, self.layer_ids, count)
        transform = processors_transform(self.logits_processor, input_ids)
        result = draft_block(
            self.xpress,
            self.embed_tokens,
            self.lm_head,
            input_ids[0, -1:],
            features.to(self.xpress.device),
            self.context_len,
            self.cache,
            logits_transform=transform,
            do_sample=self.do_sample,
            stats=self.stats,
            timer=self.timer,
            draft_space=self.draft_space,
            positions=self.draft_rule.cap,
            drafter_layout=self.drafter_layout,
        )
        self.context_len = anchor_pos
        length = draft_length(result, self.draft_rule.threshold, budget)
        self.stats.draft_lengths.append(length)
        self._last_draft_end = self.timer.mark()
        candidates = result.tokens[:, :length].to(input_ids.device)
        self._drafted = True
        # A dynamic cache is never auto-compiled by transformers: the hooks run in plain Python around the forward.
        if type((model_kwargs or {}).get("cache")) is DynamicCache:
            self._arm_verification(length + 1)
        return torch.cat([input_ids, candidates], dim=1), result.logits[:, :length]

    def _arm_verification(self, width: int) -> None:
        """Run the target's next forward, transformers' verification of these `width` tokens, in this CPU's layout
        for that many rows (`VerificationLayout`): a forward pre-hook enters `WeightMajorLinear`, a forward hook
        (called on an exception too) leaves it and removes both. Never armed where the input-major layout is the
        faster one; disarmed again at the next draft and after the verification, so no other forward is changed. A
        forward that is not a verification of `width` tokens (say, the caller's own after transformers raised between
        the draft and its verification) only disarms them: the post-hook is gone before it could run, so it runs only
        after an entered mode."""
        if not self.layout.weight_major(width):
            return
        from .compiled import WeightMajorLinear

        mode = WeightMajorLinear(max_rows=width)

        def enter(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor) or ids.shape[-1] != width:
                self._disarm()
                return
            mode.__enter__()

        def leave(module, args, output):
            mode.__exit__(None, None, None)
            self._disarm()

        self._hooks = [self.target.register_forward_pre_hook(enter, with_kwargs=True),
                       self.target.register_forward_hook(leave, always_call=True)]  # fmt: skip

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self._disarm()
        self.stats.new_tokens += int(num_matches) + 1
        if self._drafted:  # τ counts verification steps of a draft only
            self.stats.acceptance_lengths.append(int(num_matches) + 1)
        self.stats.record_total(self._start, self.timer.mark())


@contextlib.contextmanager
def _placeholder_mask_id(config):
    """The native dFlash generator embeds `config.mask_token_id`; a drafter with a learned mask vector has none and
    overwrites the mask positions itself, so any valid id serves as a placeholder while the generator is built."""
    original = config.mask_token_id
    if original is None:
        config.mask_token_id = 0
    try:
        yield
    finally:
        config.mask_token_id = original


def make_candidate_generator(target, xpress, generation_config, input_ids, logits_processor, model_kwargs):
    """The candidate generator for an xPress assistant: ours, or transformers' native dFlash generator on our drafter
    (refiner bypassed) when `speculation_type="dflash"`."""
    if generation_config.speculation_type == "dflash":
        check_assistant_call(target, xpress, input_ids)
        check_generation_config(generation_config)
        with _placeholder_mask_id(xpress.config):
            return DFlashTokenCandidateGenerator(
                assistant_model=xpress,
                main_model_input_embeddings=target.get_input_embeddings(),
                main_model_output_embeddings=target.get_output_embeddings(),
                generation_config=generation_config,
                logits_processor=logits_processor,
            )
    return XPressCandidateGenerator(xpress, target, input_ids, generation_config, logits_processor)


_HOOK_MARK = "_xpress_hook"
_TESTED_TRANSFORMERS = "5.24"


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise RuntimeError(
            f"xPress cannot hook into transformers {transformers.__version__}: {what}. The hook was written against "
            f"transformers {_TESTED_TRANSFORMERS}; install that version (pip install 'transformers=={_TESTED_TRANSFORMERS}.*') "
            "or use xpress.spec_generate(target, input_ids, ...), which does not depend on transformers internals."
        )


def _check_internals() -> None:
    """Fail loudly if the private transformers API the hook relies on is not the one it was written for."""
    for name, params in {
        "_get_candidate_generator": {"generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model"},
        "_validate_generation_mode": {"generation_mode", "generation_config", "generation_mode_kwargs"},
    }.items():
        method = getattr(GenerationMixin, name, None)
        _require(method is not None, f"GenerationMixin.{name} no longer exists")
        missing = params - set(inspect.signature(method).parameters)
        _require(not missing, f"GenerationMixin.{name} lost the parameters {sorted(missing)}")
    _require(hasattr(CandidateGenerator, "requires_model_outputs"), "CandidateGenerator.requires_model_outputs is gone")
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    _require(
        {"num_assistant_tokens", "assistant_confidence_threshold"} <= set(defaults),
        "GenerationConfig._get_default_generation_params no longer names the assistant defaults",
    )
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    _require(
        "model_outputs=" in source and "model_kwargs_overrides" in source,
        "_assisted_decoding no longer hands the target's outputs to the candidate generator",
    )


def install_generation_hook() -> None:
    """Route xPress assistants through `XPressCandidateGenerator`; leave every other assistant untouched.

    What it changes, and nothing else:

    * `GenerationMixin._validate_generation_mode`: when the assistant is an xPress model, first checks it was built
      for this target and that the call is single-sequence without beams, so a mismatch fails with an xPress error
      instead of a misleading "different tokenizers" one (or beam search silently ignoring the drafter); then runs
      the original validation.
    * `GenerationMixin._get_candidate_generator`: when the assistant is an xPress model, returns its generator;
      otherwise calls the original method with the original arguments.

    Idempotent (the wrappers are marked and installed once per process, even if the package and a trust_remote_code
    copy are both imported). Raises `RuntimeError` if the transformers internals it relies on have changed.
    """
    if getattr(GenerationMixin._get_candidate_generator, _HOOK_MARK, False):
        return
    _check_internals()
    original_candidates = GenerationMixin._get_candidate_generator
    original_validate = GenerationMixin._validate_generation_mode

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        if _is_xpress(assistant):
            assistant.config.check_target(self.config)
            check_generation_config(generation_config)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(original_candidates)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        if _is_xpress(assistant_model):
            return make_candidate_generator(
                self, assistant_model, generation_config, input_ids, logits_processor, model_kwargs
            )
        return original_candidates(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    setattr(_validate_generation_mode, _HOOK_MARK, True)
    setattr(_get_candidate_generator, _HOOK_MARK, True)
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._get_candidate_generator = _get_candidate_generator


# ---------------------------------------------------------------------------------------------------------------------
# Standalone loop
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class XPressGenerateOutput:
    sequences: torch.LongTensor  # (1, prompt + new tokens)
    stats: XPressGenerationStats


def _accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Longest prefix of `draft` (n,) that matches the target's argmax, plus the target's next token."""
    choice = target_logits.argmax(dim=-1)  # (n + 1,)
    matches = int((draft == choice[:-1]).long().cumprod(dim=0).sum())
    return matches, choice[matches]


def _accept_sampling(draft, q_logits, p_logits, generator) -> tuple[int, torch.Tensor]:
    """Speculative sampling (Leviathan et al., Alg. 1): keep draft token x_k with probability min(1, p/q); at the first
    rejection resample from norm(max(p − q, 0)); if all are kept, draw the bonus from p. Lossless for any q from which
    the drafts were truly drawn."""
    n = draft.shape[0]
    if n == 0:
        return 0, torch.multinomial(p_logits[0].softmax(dim=-1), 1, generator=generator)[0]
    q = q_logits.softmax(dim=-1)  # (n, V)
    p = p_logits.softmax(dim=-1)  # (n + 1, V)
    idx = torch.arange(n, device=draft.device)
    ratio = p[idx, draft] / q[idx, draft]
    u = torch.rand(n, generator=generator, device=draft.device)
    matches = int((u <= ratio).long().cumprod(dim=0).sum())
    if matches < n:
        residual = (p[matches] - q[matches]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[matches]
        return matches, torch.multinomial(residual, 1, generator=generator)[0]
    return matches, torch.multinomial(p[n], 1, generator=generator)[0]


@torch.no_grad()
def spec_generate(
    xpress,
    target,
    input_ids: torch.LongTensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stop_token_ids=None,
    generator: torch.Generator | None = None,
    assistant_confidence_threshold: float | None = None,
    num_assistant_tokens: int | str | None = None,
    compile: bool = False,
    max_cache_len: int | None = None,
    linear_layout: str = "auto",
) -> XPressGenerateOutput:
    """xPress speculative decoding without `generate`: prefill, then draft → refine → verify → accept → crop.

    Takes a tokenizer's output as is (`spec_generate(xpress, target, **inputs)`: one unpadded sequence).
    `temperature=0` is greedy (output identical to the target's greedy decode); `temperature>0` samples losslessly
    from the target's distribution after temperature/top-k/top-p. `repetition_penalty`, `no_repeat_ngram_size` and
    any `logits_processor` list apply to the target's p and the drafter's q alike, as in `generate`.
    `stop_token_ids` (default: the target's EOS; an int, a list or a tensor of ids) end generation after they are
    emitted. `assistant_confidence_threshold` and `num_assistant_tokens` (None: the xPress config's
    `draft_confidence_threshold` / `num_assistant_tokens`) set how many drafts of each block are verified
    (`draft_length`); `num_assistant_tokens="auto"` chooses the cap on this machine, from the checkpoint's measured
    acceptance (`config.draft_acceptance`) and the timed cost of verifying more tokens here (`draft_cap.py`; outputs
    never depend on the cap). `compile=True` runs the same loop with static caches and fixed shapes under `torch.compile`
    (CUDA graphs on a GPU; see `compiled.py`): same results, the first call per (target, drafter, length bucket)
    compiles (`stats.time_compile`); greedy and temperature/top-k/top-p sampling only. `max_cache_len` (compile=True
    only) fixes the static caches' length instead of the bucket of this call, so calls with prompts of any length up
    to it share one compiled state, as `generate(cache_implementation="static", max_cache_len=...)` does for plain
    decoding; it must hold the prompt, `max_new_tokens` and two blocks. `linear_layout`: how `F.linear` is computed
    by the compiled graphs and by the eager loop's verification and drafter (`DrafterLayout`); "auto" (default) times `x @ W.T` against
    `(W @ x.T).T` on the models' own weights at each row count once, on a CPU, and goes weight-major where that is at
    least 1.25× faster (on some CPU BLAS builds a few-row product is several times faster weight-major), and in the
    compiled graphs also times MKL-packed float32 weights (`compiled.PackedLinear`) and uses them where they are the
    fastest (the eager loop: its drafter's); "input_major" / "weight_major" / "packed" (compile=True only) force one. (`generate(assistant_model=xpress)` uses "auto".) Returns `.sequences` (prompt included) and `.stats`; the stats are also left at `xpress.generation_stats`.
    """
    check_assistant_call(target, xpress, input_ids)
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    from .compiled import check_linear_layout

    check_linear_layout(linear_layout)
    if linear_layout == "packed" and not compile:
        raise ValueError(
            "linear_layout='packed' (weights prepacked for MKL) is a layout of the compiled graphs: pass compile=True, "
            "or use 'auto' (it packs the eager drafter's weights where that is fastest), 'input_major' or "
            "'weight_major' with the eager loop."
        )
    if isinstance(num_assistant_tokens, str):
        if num_assistant_tokens != "auto":
            raise ValueError(
                f"num_assistant_tokens must be None (the config's), a positive integer or 'auto' (chosen on this "
                f"machine from config.draft_acceptance), got {num_assistant_tokens!r}"
            )
        from .draft_cap import choose_draft_cap

        num_assistant_tokens = choose_draft_cap(xpress, target, compiled=compile is True, linear_layout=linear_layout).cap
    draft_rule = draft_length_rule(xpress.config, assistant_confidence_threshold, num_assistant_tokens)
    check_decoding_arguments(max_new_tokens, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size)
    if attention_mask is not None and (attention_mask.shape != input_ids.shape or not bool(attention_mask.all())):
        raise ValueError(
            f"attention_mask (shape {tuple(attention_mask.shape)}) must be all ones over input_ids (shape "
            f"{tuple(input_ids.shape)}): spec_generate decodes one unpadded sequence. Tokenize the prompt alone, "
            "without padding."
        )
    if stop_token_ids is None:
        stop_token_ids = target.generation_config.eos_token_id
    stop = stop_token_tensor(stop_token_ids, input_ids.device)
    if max_cache_len is not None and not compile:
        raise ValueError(
            "max_cache_len sizes the static caches of compile=True; the eager loop (compile=False) grows a dynamic "
            "cache as it goes. Pass compile=True, or drop max_cache_len."
        )
    if compile:
        from .compiled import check_compilable, compiled_spec_generate

        check_compilable(xpress, target, repetition_penalty, no_repeat_ngram_size, logits_processor)
        return compiled_spec_generate(
            xpress, target, input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
            top_p=top_p, stop=stop, generator=generator, draft_rule=draft_rule, max_cache_len=max_cache_len,
            linear_layout=linear_layout,
        )  # fmt: skip
    do_sample = temperature > 0
    processors = decoding_processors(temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size, logits_processor)
    layer_ids = list(xpress.config.target_layer_ids)
    hidden_request = [i + 1 for i in layer_ids]
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    stats = XPressGenerationStats()
    xpress.generation_stats = stats
    layout = VerificationLayout(target, linear_layout)
    drafter_layout = DrafterLayout(xpress, linear_layout)
    timer = SectionTimer(input_ids.device)
    start = timer.mark()

    def pick(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        logits = processors(ids, logits.float()) if processors else logits.float()
        if not do_sample:
            return logits.argmax(dim=-1)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]

    # Prefill: the prompt's features become the drafter's first context, and the target emits the first token.
    target_cache = DynamicCache(config=target.config)
    out = target(input_ids=input_ids, cache=target_cache, output_hidden_states=hidden_request, logits_to_keep=1)
    # From now on every verification is cropped back to what was accepted. Layers that keep only a window (sliding
    # attention) or a state (linear attention) must keep what a crop needs; after the prefill, so it stays small.
    target_cache.activate_past_recording()
    features = target_features(out.hidden_states, layer_ids, input_ids.shape[1])
    sequence = torch.cat([input_ids, pick(out.logits[:, -1], input_ids).view(1, 1)], dim=1)
    draft_cache = DynamicCache(config=xpress.config)
    context_len = 0
    stats.record("verify", start, timer.mark())
    prompt_len = input_ids.shape[1]

    draft_space = vocabulary_local(processors)  # decode over the draft vocabulary when the processors allow it
    while sequence.shape[1] - prompt_len < max_new_tokens and not bool(torch.isin(sequence[0, -1], stop)):
        anchor_pos = sequence.shape[1] - 1
        budget = min(draft_rule.cap, max_new_tokens - (sequence.shape[1] - prompt_len) - 1)
        if budget > 0:
            transform = processors_transform(processors, sequence) if processors else None
            result = draft_block(
                xpress, embed_tokens, lm_head, sequence[0, -1:], features.to(xpress.device), context_len, draft_cache,
                logits_transform=transform, do_sample=do_sample, generator=generator, stats=stats, timer=timer,
                draft_space=draft_space, positions=draft_rule.cap,  # the cap, not the budget: as compile=True draws
                drafter_layout=drafter_layout,
            )  # fmt: skip
            context_len = anchor_pos
            length = draft_length(result, draft_rule.threshold, budget)
            stats.draft_lengths.append(length)
            draft, q_logits = result.tokens[0, :length].to(sequence.device), result.logits[0, :length]
        else:  # one token left: the target alone emits it
            draft = sequence.new_empty(0)
            q_logits = None

        t0 = timer.mark()
        verify_ids = torch.cat([sequence[:, -1:], draft.view(1, -1)], dim=1)  # [anchor, d_1..d_m]
        with layout(verify_ids.shape[1]):
            out = target(input_ids=verify_ids, cache=target_cache, output_hidden_states=hidden_request)
        p_logits = process_verification_logits(processors, sequence, draft, out.logits[0].float())  # (m + 1, V)
        if do_sample:
            matches, bonus = _accept_sampling(draft, q_logits, p_logits, generator)
        else:
            matches, bonus = _accept_greedy(draft, p_logits)
        accepted = torch.cat([draft[:matches], bonus.view(1)])
        stop_at = torch.isin(accepted, stop).nonzero()
        if stop_at.numel():
            accepted = accepted[: int(stop_at[0]) + 1]
        accepted = accepted[: max_new_tokens - (sequence.shape[1] - prompt_len)]
        # Roll back: the target cache keeps the anchor and the accepted drafts; their features are the next context.
        target_cache.crop(-(draft.shape[0] - matches))
        features = target_features(out.hidden_states, layer_ids, matches + 1)
        sequence = torch.cat([sequence, accepted.view(1, -1)], dim=1)
        if draft.numel():  # τ counts verification steps of a draft only
            stats.acceptance_lengths.append(int(accepted.shape[0]))
        stats.record("verify", t0, timer.mark())

    stats.new_tokens = sequence.shape[1] - prompt_len
    stats.record_total(start, timer.mark())
    return XPressGenerateOutput(sequences=sequence, stats=stats)


__all__ = [
    "XPressCandidateGenerator",
    "XPressGenerationStats",
    "XPressGenerateOutput",
    "SectionTimer",
    "WallClock",
    "install_generation_hook",
    "spec_generate",
]
