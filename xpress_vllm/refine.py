"""The head's decode of a batch of proposals, one per request, as vLLM asks for it: greedy, or sampled at each
request's own temperature with the distribution each draft was drawn from. It imports torch and modeling_xpress
only (no vLLM), so the tests check it against `XPressModel.refine` in the main virtualenv."""

import hashlib

import torch

from modeling_xpress.configuration_xpress import XPressConfig
from modeling_xpress.heads import decode_block
from modeling_xpress.refinement import gumbel_noise, scatter_vocabulary

# vLLM's threshold below which a request's temperature means greedy (vllm/v1/sample/sampler.py, _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


def draft_noise_seed(request_seed: int, position: int) -> int:
    """The seed of a seeded request's draft noise in the step whose anchor sits at `position`: a hash of the two.

    vLLM keeps a generator per request with a `seed` and draws from it in sampling and rejection sampling, but only in
    the steps where the request is sampled or has drafts; how many steps draft depends on the batch (vLLM's dynamic
    schedule) and a chunked prefill's draws are discarded. Noise keyed by (seed, anchor position) is the same for the
    same request history whatever happened around it, and it leaves the request's own generator untouched, so vLLM's
    draws from it are those of any other speculative method."""
    digest = hashlib.blake2b(f"xpress-draft:{request_seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # a non-negative int64


def proposal_noise(shape: tuple[int, int, int], device, noise_seeds: dict[int, int] | None = None) -> torch.Tensor:
    """Gumbel noise (b, K, V_d) for one step's proposals: from the global RNG, as vLLM's samplers draw for requests
    without a seed, except request i's rows where `noise_seeds` has a seed for it (`draft_noise_seed`)."""
    noise = gumbel_noise(shape, device=device)
    for i, seed in (noise_seeds or {}).items():
        noise[i] = gumbel_noise(shape[1:], torch.Generator(device=device).manual_seed(seed), device)
    return noise


@torch.no_grad()
def refine_proposals(head, config: XPressConfig, hidden: torch.Tensor, base: torch.Tensor, last_tokens: torch.Tensor,
                     token_ids: torch.Tensor | None, temperature: torch.Tensor | None = None,
                     noise: torch.Tensor | None = None, noise_seeds: dict[int, int] | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """One proposal per request, decoded by the checkpoint's head.

    hidden: (b, K + 1, H) drafter states of each request's block, the anchor's slot first; base: (b, K, V_d) drafter
    logits of its K draft positions over the draft vocabulary `token_ids` (the whole vocabulary when None);
    last_tokens: (b, 2) each request's last two committed tokens, the one before the anchor and the anchor;
    temperature: (b,) per request when vLLM samples drafts (`draft_sample_method="probabilistic"`), else None
    (greedy); noise: (b, K, V_d) Gumbel noise (drawn here when None: `proposal_noise`, seeded per request by
    `noise_seeds`). Returns draft token ids (b, K) and, when sampling, q (b, K, V) over the target vocabulary:
    q_k = softmax((s_k + δ_k(y_<k)) / T), the distribution y_k was drawn from given the request's own drafted prefix
    y_<k.

    Greedy: the Jacobi fixed point of y_k = argmax(s_k + δ_k(y_<k)), the sequential decode. Sampling: the same
    iteration on (s_k + δ_k) / T + G_k with G fixed per block, so y_k is a draw from q_k given y_<k. vLLM's rejection
    sampler accepts y_k with min(1, p/q_k) and otherwise resamples from norm(max(p − q_k, 0)), which leaves the
    target's distribution p exactly. A request whose temperature is below `SAMPLING_EPS` is greedy in the same batch
    (vLLM does not read its q).
    """
    b = base.shape[0]
    transform = None
    if temperature is not None:
        greedy = temperature < SAMPLING_EPS
        scale = torch.where(greedy, torch.ones_like(temperature), temperature).float().view(b, 1, 1)
        transform = lambda logits: logits / scale  # noqa: E731
        if noise is None:
            noise = proposal_noise(base.shape, base.device, noise_seeds)
        noise = noise.masked_fill(greedy.view(b, 1, 1), 0.0)
    else:
        noise = None
    head_dtype = next((p.dtype for p in head.parameters()), hidden.dtype)
    result = decode_block(head, hidden.to(head_dtype), base.float(), last_tokens, logits_transform=transform, noise=noise,
                          max_iters=config.jacobi_max_iters, early_exit=config.jacobi_early_exit,
                          token_ids=token_ids)  # fmt: skip
    if temperature is None:
        return result.tokens, None
    return result.tokens, scatter_vocabulary(result.logits.softmax(dim=-1), token_ids, config.vocab_size)


__all__ = ["SAMPLING_EPS", "draft_noise_seed", "proposal_noise", "refine_proposals"]
