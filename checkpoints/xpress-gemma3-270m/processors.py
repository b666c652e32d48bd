"""Logits processors of the decode loops, and the checks of a call's decoding arguments.

What is applied to the target's p is applied to the drafter's q alike (temperature, top-k, top-p, repetition penalty,
n-gram blocking, a caller's own processors), so acceptance compares the distributions a user asked for.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import math
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .configuration_xpress import is_integer, is_real


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


# The smallest sampling temperature: logits up to ~3e32 divided by it stay finite in float32.
MIN_TEMPERATURE = 1e-6


def check_decoding_arguments(
    max_new_tokens, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size
) -> None:
    """`spec_generate`'s decoding arguments, each refused by name when it cannot work (as `GenerationConfig` does)."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature!r} is too small to sample with: the logits divided by it overflow float32 "
            f"(inf, then NaN probabilities). Use temperature=0 for greedy decoding (what such a temperature means), "
            f"or a temperature >= {MIN_TEMPERATURE}."
        )
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


def stop_token_tensor(stop_token_ids, device, vocab_size: int | None = None) -> torch.Tensor:
    """Stop tokens as a 1-D LongTensor from None, an int (Python, numpy or 0-d tensor) or a sequence/tensor of ids;
    ids outside 0..vocab_size - 1 (which the target never emits, so they would never stop anything) are refused."""
    if stop_token_ids is None:
        return torch.empty(0, dtype=torch.long, device=device)
    try:
        stop = torch.as_tensor(stop_token_ids, device=device)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"stop_token_ids must be token ids (an int or a list of ints), got {stop_token_ids!r}") from error
    if stop.numel() and (stop.dtype == torch.bool or stop.is_floating_point() or stop.is_complex()):
        raise ValueError(f"stop_token_ids must be integer token ids, got {stop_token_ids!r}")
    stop = stop.to(torch.long).flatten()
    if vocab_size is not None and stop.numel() and (int(stop.min()) < 0 or int(stop.max()) >= vocab_size):
        bad = [i for i in stop.tolist() if not 0 <= i < vocab_size]
        raise ValueError(
            f"stop_token_ids {bad} are outside the target's vocabulary (0..{vocab_size - 1}), so they could never be "
            "emitted and would never stop generation: pass ids of the target's tokenizer (e.g. "
            "tokenizer.eos_token_id)."
        )
    return stop


# --- sampling settings as graph inputs (the compiled loop) --------------------------------------------------------
# The compiled graphs apply temperature, top-k and top-p themselves, with the values as tensor inputs: traced as
# Python constants (transformers' warpers hold floats), every new value compiled every graph again, towards dynamo's
# recompile limit. Which warpers apply is structure (a decoder's `warpers`); their values change from call to call.


@dataclass(frozen=True)
class Warpers:
    """Which of transformers' warpers a sampling call applies, in `generation.sampling_processors`' order and by its
    rules: temperature (when != 1), top-k (when > 0), top-p (when < 1)."""

    temperature: bool
    top_k: bool
    top_p: bool

    @classmethod
    def of(cls, temperature: float, top_k, top_p) -> "Warpers | None":
        """None for greedy decoding (temperature 0), which applies none."""
        if temperature == 0:
            return None
        return cls(temperature != 1.0, top_k is not None and top_k > 0, top_p is not None and top_p < 1.0)


def warper_values(temperature: float, top_k, top_p, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The graph inputs of a call's sampling settings: temperature and top-p's floor 1 - top_p as float32 (what a
    float32 score is divided by / compared with when transformers' warpers take them as Python floats), top-k as an
    integer. Unused ones hold neutral values."""
    return (
        torch.tensor(temperature or 1.0, dtype=torch.float32, device=device),
        torch.tensor(top_k or 1, dtype=torch.long, device=device),
        torch.tensor(1 - (top_p if top_p is not None else 1.0), dtype=torch.float32, device=device),
    )


def warp(scores: torch.Tensor, warpers: Warpers, values) -> torch.Tensor:
    """transformers' `TemperatureLogitsWarper`, `TopKLogitsWarper` and `TopPLogitsWarper` (min_tokens_to_keep=1) on
    scores (rows, V), with `warper_values` as tensors: the same arithmetic, so the same processed logits. Top-k's
    threshold is the k-th largest score read from a sort (a tensor k), where transformers calls `torch.topk` with a
    Python int: the same value."""
    temperature, top_k, top_p_floor = values
    if warpers.temperature:
        scores = scores / temperature
    if warpers.top_k:
        k = top_k.clamp(max=scores.shape[-1]) - 1
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, k.expand(scores.shape[0], 1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if warpers.top_p:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= top_p_floor
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_indices, remove), float("-inf"))
    return scores


__all__ = [
    "MIN_TEMPERATURE",
    "PREFIX_FREE_PROCESSORS",
    "check_decoding_arguments",
    "decoding_processors",
    "process_verification_logits",
    "processors_transform",
    "sampling_processors",
    "stop_token_tensor",
    "vocabulary_local",
    "Warpers",
    "warp",
    "warper_values",
]
