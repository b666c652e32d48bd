"""The head's place in vLLM's dFlash proposer.

vLLM drafts a dFlash block in one forward and then picks every position's token independently
(`SpecDecodeBaseProposer._sample_draft_tokens`). For an xPress drafter that is where the correction head runs
instead: each request's K draft positions are decoded together, every position conditioned on the request's own
anchor and drafted prefix (`XPressDFlashForCausalLM.draft`). Any other drafter takes vLLM's own path unchanged.
"""

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from .model import XPressDFlashForCausalLM


def _unwrapped(model):
    return model.unwrap() if hasattr(model, "unwrap") else model


class XPressDFlashProposer(DFlashProposer):
    """vLLM's `DFlashProposer` whose token choice goes through an xPress drafter's head."""

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        model = _unwrapped(self.model)
        if not isinstance(model, XPressDFlashForCausalLM):
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        k = self.num_speculative_tokens
        b = hidden_states.shape[0] // k
        # The first pass wrote each request's queries as [anchor, mask × K], request after request.
        anchors = self.input_ids[: b * (k + 1)].view(b, k + 1)[:, 0].long()
        sampled = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        tokens, probs = model.draft(hidden_states.view(b, k, -1), anchors, sampling_metadata.temperature if sampled else None)
        return tokens.reshape(-1), None if probs is None else probs.view(b * k, -1)


def install_proposer() -> None:
    """Make vLLM's model runner build `XPressDFlashProposer` for `method: "dflash"` (it falls back to vLLM's own
    behaviour for any drafter that is not xPress)."""
    from vllm.v1.worker import gpu_model_runner

    gpu_model_runner.DFlashProposer = XPressDFlashProposer


__all__ = ["XPressDFlashProposer", "install_proposer"]

