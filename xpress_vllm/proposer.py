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
    """vLLM's `DFlashProposer` whose token choice goes through an xPress drafter's head.

    A step whose schedule asks for no drafts (vLLM's dynamic schedule at large batches) only writes the new context
    K/V into the drafter's cache, which later drafts attend to; vLLM's own proposer also runs the drafter's query
    forward there and throws its result away. The query slots it would have written are overwritten by the next
    step's context before any draft reads them."""

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        if num_speculative_tokens or not isinstance(_unwrapped(self.model), XPressDFlashForCausalLM):
            return super().propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                                   next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                                   mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings)
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        self.set_inputs_first_pass(  # context positions and slots for this step's verified tokens
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=self.model.combine_hidden_states(target_hidden_states),
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        num_context = self._dflash_num_context
        self.model.precompute_and_store_context_kv(self._dflash_hidden_states,
                                                   self._context_positions_buffer[:num_context],
                                                   self._context_slot_mapping_buffer[:num_context])
        return torch.empty(common_attn_metadata.batch_size(), 0, dtype=torch.int64, device=self.device)

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        model = _unwrapped(self.model)
        if not isinstance(model, XPressDFlashForCausalLM):
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        k = self.num_speculative_tokens
        b = hidden_states.shape[0] // k
        # The first pass wrote each request's queries as [anchor, mask × K], request after request.
        anchors = self.input_ids[: b * (k + 1)].view(b, k + 1)[:, 0].long()
        sampled = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        temperature = sampling_metadata.temperature if sampled else None
        tokens, probs = model.draft(hidden_states.view(b, k, -1), anchors, temperature)
        return tokens.reshape(-1), None if probs is None else probs.view(b * k, -1)


def install_proposer() -> None:
    """Make vLLM's model runner build `XPressDFlashProposer` for `method: "dflash"` (it falls back to vLLM's own
    behaviour for any drafter that is not xPress)."""
    from vllm.v1.worker import gpu_model_runner

    gpu_model_runner.DFlashProposer = XPressDFlashProposer


__all__ = ["XPressDFlashProposer", "install_proposer"]

