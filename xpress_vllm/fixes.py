"""Fixes for vLLM's CPU build, installed by `register`: a bug that breaks every speculative method at temperature
> 0, a compile-cache fault, and two costs paid in steps that verify no draft.

vLLM 0.32's CPU build replaces the rejection sampler's `expand_kernel` (per-request values such as temperatures
expanded to one per draft token) with `vllm.utils.cpu_triton_utils._expand_kernel_impl`. That function casts the
output buffer to int64 before the C++ kernel fills it: for the float temperatures the kernel writes into a copy, the
real buffer stays as `new_empty` left it, and the target's logits are divided by garbage. Measured here with vLLM's
own ngram method as with dFlash: NaN target probabilities, near-zero acceptance, and "recovered" tokens drawn from
them, so sampled output is not the target's distribution. (The cast also truncates a temperature of 0.5 to 0.)

`expand_kernel_impl` does the same expansion in torch, for any dtype. It is put in place of the broken function
before vLLM's CPU platform registers its kernel overrides (plugins load first in every vLLM process), so vLLM's own
override machinery installs it; nothing else changes.

A second CPU-build fault: every load of vLLM's compile cache fails ("'function' object has no attribute
'finalize_loading'"; seen for plain engines as for speculative ones), and vLLM then compiles again. For an engine
with a dFlash drafter that second compile died here with a stack overflow while collecting garbage, so a second
`make serve` (or benchmark) on the same machine crashed where the first one, with an empty cache, worked. On CPU
the plugin therefore sets `VLLM_DISABLE_COMPILE_CACHE=1` unless you set it yourself: nothing is lost, since the
cache never loaded.

A cost, not a bug: with speculation configured, vLLM verifies every step through its rejection sampler, also a step
in which no request has drafts (such as every step of the dynamic schedule above its batch threshold).
At temperature > 0 the sampler still draws "recovered" tokens there: an exponential noise tensor over the whole
vocabulary for each request, for zero draft positions. With 16 requests on this CPU that draw took 15 ms a step,
0.96 s of a 5.9 s pass where vLLM plain took 4.6 s (`torch.profiler`, one process, T=1, 64 tokens each; 4.85 s
with the wrapper). `skip_recovered_tokens_without_drafts` returns the empty result without drawing; with any draft
in the step, vLLM's own function runs unchanged.

The rest of that pass costs too: for a step without drafts vLLM's rejection sampler copies the logits, samples the
bonus tokens from the copy (and copies them again as logprobs it then drops), then runs its logits processors and
rejection kernels on zero draft positions; 0.9 ms a step at batch 16 here, 1.1% of a greedy pass (cProfile, one
process). `sample_plainly_without_drafts` hands such a step's logits to vLLM's own sampler, the bonus-token call the
rejection sampler makes itself, as vLLM plain does, when no logprobs are asked for; anything else runs vLLM's code.
"""

import functools
import os

import torch


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from → replace_to), in the output's own dtype."""
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    expanded = values.repeat_interleave(counts)
    output[: expanded.shape[0]] = expanded.to(output.dtype)


def skip_recovered_tokens_without_drafts(sample_recovered_tokens):
    """Wrap vLLM's `sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids,
    ...)`: a step with no draft token has no recovered token to sample, so nothing is drawn for it."""
    if getattr(sample_recovered_tokens, "skips_steps_without_drafts", False):
        return sample_recovered_tokens

    @functools.wraps(sample_recovered_tokens)
    def wrapper(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, *args, **kwargs):
        if draft_token_ids.numel() == 0:
            return torch.empty_like(draft_token_ids)  # what vLLM's function returns there, after drawing the noise
        return sample_recovered_tokens(max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, *args,
                                       **kwargs)  # fmt: skip

    wrapper.skips_steps_without_drafts = True
    return wrapper


def sample_plainly_without_drafts(forward):
    """Wrap vLLM's `RejectionSampler.forward(metadata, draft_probs, logits, sampling_metadata)`: with no draft in the
    step (`max_spec_len == 0`: one row of logits per request, each the request's bonus position) and no logprobs
    requested, the output is the bonus tokens, sampled by the same `self.sampler(..., predict_bonus_token=True)` call
    vLLM makes, on the logits themselves rather than a copy (vLLM plain's sampler also works on them in place)."""
    if getattr(forward, "samples_plainly_without_drafts", False):
        return forward

    @functools.wraps(forward)
    def wrapper(self, metadata, draft_probs, logits, sampling_metadata):
        one_row_per_request = logits is not None and logits.shape[0] == metadata.bonus_logits_indices.numel()
        no_logprobs = sampling_metadata.max_num_logprobs is None and not sampling_metadata.logprob_token_ids
        if metadata.max_spec_len == 0 and one_row_per_request and no_logprobs:
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata, predict_bonus_token=True)
        return forward(self, metadata, draft_probs, logits, sampling_metadata)

    wrapper.samples_plainly_without_drafts = True
    return wrapper


def install_cpu_fixes() -> None:
    """Replace the broken CPU expand override, keep vLLM's compile cache off, and in steps without drafts skip the
    recovered-token draw and the rejection pass (vLLM 0.32's CPU build only, where they were found and measured; a
    no-op elsewhere).
    XPRESS_VLLM_KEEP_CPU_EXPAND=1 keeps vLLM's own expand, to reproduce the bug (the tests check their χ² test sees
    it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")  # inherited by the engine's processes
    from vllm.v1.sample import rejection_sampler

    rejection_sampler.sample_recovered_tokens = skip_recovered_tokens_without_drafts(
        rejection_sampler.sample_recovered_tokens)  # fmt: skip
    sampler_class = rejection_sampler.RejectionSampler
    sampler_class.forward = sample_plainly_without_drafts(sampler_class.forward)
    if os.environ.get("XPRESS_VLLM_KEEP_CPU_EXPAND") == "1":
        return
    from vllm.utils import cpu_triton_utils

    if hasattr(cpu_triton_utils, "_expand_kernel_impl"):
        cpu_triton_utils._expand_kernel_impl = expand_kernel_impl


__all__ = ["expand_kernel_impl", "install_cpu_fixes", "sample_plainly_without_drafts",
           "skip_recovered_tokens_without_drafts"]
