"""The head's place in vLLM's dFlash proposer.

vLLM drafts a dFlash block in one forward and then picks every position's token independently
(`SpecDecodeBaseProposer._sample_draft_tokens`). For an xPress drafter that is where the correction head runs
instead: each request's K draft positions are decoded together, every position conditioned on the request's own
anchor and drafted prefix (`XPressDFlashForCausalLM.draft`). Any other drafter takes vLLM's own path unchanged.
"""

import gc

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from .context import DeferredContext, context_can_wait
from .model import XPressDFlashForCausalLM
from .refine import draft_noise_seed


def _unwrapped(model):
    return model.unwrap() if hasattr(model, "unwrap") else model


class XPressDFlashProposer(DFlashProposer):
    """vLLM's `DFlashProposer` whose token choice goes through an xPress drafter's head.

    A step whose schedule asks for no drafts (vLLM's dynamic schedule at large batches) only keeps the new context
    writes (`context.DeferredContext`): vLLM's own proposer projects them into the drafter's cache there, and also
    runs the drafter's query forward and throws its result away. The kept writes go into the cache, in one batch,
    before a step that drafts touches their blocks, or once `max_num_batched_tokens` of them are pending. The query
    slots vLLM's forward would have written are overwritten by the next step's context before any draft reads them.
    The writes wait on CPU only, where this was measured (docs/vllm.md), and only where the drafter's cache is not
    overlaid by other layers' (`context.context_can_wait`: one KV-cache group); elsewhere, or with
    XPRESS_VLLM_EAGER_CONTEXT=1, each step's context goes into the cache in that step, as in vLLM."""

    def initialize_attn_backend(self, kv_cache_config, kernel_block_sizes=None) -> None:
        super().initialize_attn_backend(kv_cache_config, kernel_block_sizes)
        self._context_waits = context_can_wait(kv_cache_config, self.device)

    def load_model(self, target_model) -> None:
        """vLLM's loading, then a garbage collection. vLLM has just replaced the drafter's own embedding table and
        lm_head by the target's (`_maybe_share_embeddings`, `_maybe_share_lm_head`). On CPU each dropped module
        holds a oneDNN matmul handler whose `__del__` calls `.item()` on a tensor, and the modules sit in reference
        cycles (their weights' loader attributes), so they are freed whenever the collector next runs. Inside
        torch.compile's tracing, under fake tensors, that `.item()` fails: on Gemma-3-270M with the bundled
        checkpoint the worker died of a stack overflow while collecting garbage, in vLLM's default compiled mode,
        in 2 of 2 starts (none of 1 with this collection). Collected here, they are freed before anything is
        traced; the collection costs once per engine start, for any drafter."""
        super().load_model(target_model)
        gc.collect()

    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                mm_embed_inputs=None, num_rejected_tokens_gpu=None, slot_mappings=None):
        ours = isinstance(_unwrapped(self.model), XPressDFlashForCausalLM)
        if ours and num_speculative_tokens:  # this step's drafts read (and write) its requests' blocks: context first
            blocks = common_attn_metadata.block_table_tensor[: common_attn_metadata.num_reqs]
            self._write_context(self._deferred_context().take(blocks))
            # The token before each request's anchor (its last verified token), which the head reads first.
            last = common_attn_metadata.query_start_loc[1 : common_attn_metadata.num_reqs + 1] - 1
            if num_rejected_tokens_gpu is not None:
                last = last - num_rejected_tokens_gpu[: common_attn_metadata.num_reqs]
            self._before_anchor = target_token_ids[last.long()]
        if num_speculative_tokens or not ours:
            return super().propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                                   next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata,
                                   mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings)
        self.num_speculative_tokens = 0
        self._last_draft_probs = None
        self.set_inputs_first_pass(  # context positions and slots for this step's verified tokens
            target_token_ids=target_token_ids,
            next_token_ids=next_token_ids,
            target_positions=target_positions,
            target_hidden_states=target_hidden_states,
            token_indices_to_sample=token_indices_to_sample,
            cad=common_attn_metadata,
            num_rejected_tokens_gpu=num_rejected_tokens_gpu,
        )
        n = self._dflash_num_context
        writes = (target_hidden_states[:n], self._context_positions_buffer[:n], self._context_slot_mapping_buffer[:n])
        if getattr(self, "_context_waits", False):  # (set when vLLM hands the proposer its KV-cache layout)
            pending = self._deferred_context()
            pending.add(*writes)
            if pending.full:
                self._write_context(pending.take())
        else:
            self._write_context(writes)
        return torch.empty(common_attn_metadata.batch_size(), 0, dtype=torch.int64, device=self.device)

    def _deferred_context(self) -> DeferredContext:
        if getattr(self, "_pending_context", None) is None:
            self._pending_context = DeferredContext(self.block_size, self.max_num_tokens)
        return self._pending_context

    def _write_context(self, writes) -> None:
        """vLLM's context projection (fc over the target's hidden states, then each layer's K/V) into the cache."""
        if writes is not None:
            hidden, positions, slots = writes
            self.model.precompute_and_store_context_kv(self.model.combine_hidden_states(hidden), positions, slots)

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        model = _unwrapped(self.model)
        if not isinstance(model, XPressDFlashForCausalLM):
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        k = self.num_speculative_tokens
        b = hidden_states.shape[0] // k
        # The first pass wrote each request's queries as [anchor, mask × K], request after request; the model kept
        # every query slot's state (`XPressDFlashForCausalLM.forward`), `hidden_states` being the mask slots' only.
        anchors = self.input_ids[: b * (k + 1)].view(b, k + 1)[:, 0].long()
        block = model.query_hidden_states[: b * (k + 1)].view(b, k + 1, -1)
        last_tokens = torch.stack([self._before_anchor[:b].long(), anchors], dim=1)
        sampled = self._enable_probabilistic_draft_probs and not sampling_metadata.all_greedy
        temperature = sampling_metadata.temperature if sampled else None
        tokens, probs = model.draft(block, last_tokens, temperature,
                                    self._noise_seeds(sampling_metadata, b, k) if sampled else None)  # fmt: skip
        return tokens.reshape(-1), None if probs is None else probs.view(b * k, -1)

    def _noise_seeds(self, sampling_metadata, b: int, k: int) -> dict[int, int]:
        """Batch index → the seed of its draft noise this step, for the requests with a `seed` (vLLM's per-request
        generators): `refine.draft_noise_seed` of the request's seed and its anchor's position."""
        if not sampling_metadata.generators:
            return {}
        positions = self.positions[: b * (k + 1)].view(b, k + 1)[:, 0].tolist()  # each request's anchor slot
        return {i: draft_noise_seed(generator.initial_seed(), positions[i])
                for i, generator in sampling_metadata.generators.items()}  # fmt: skip


def install_proposer() -> None:
    """Make vLLM's model runner build `XPressDFlashProposer` for `method: "dflash"` (it falls back to vLLM's own
    behaviour for any drafter that is not xPress)."""
    from vllm.v1.worker import gpu_model_runner

    gpu_model_runner.DFlashProposer = XPressDFlashProposer


__all__ = ["XPressDFlashProposer", "install_proposer"]

