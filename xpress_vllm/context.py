"""The drafter's context K/V, written when a draft is about to read it rather than in every step.

vLLM's dFlash proposer projects the target's hidden states of every token the target verifies into the drafter's
K/V cache, in the step that verifies it. Under vLLM's dynamic schedule a step with many requests drafts nothing:
what it writes is read only by a request that drafts later (once the batch has shrunk below the schedule's
threshold), and most requests finish before that. `DeferredContext` keeps those writes (hidden states, positions,
cache slots) and hands them out, oldest first, for the blocks a draft is about to read or write; `proposer` then
runs vLLM's own projection on them in one batch.

Why the cache ends up as vLLM's own eager writes would leave it: before any step touches a block, every pending
write to that block is taken, so a pending write is always newer than every write already done to its slot; among
pending writes to one slot (a rejected draft's slot, reused by the next token; a freed block that another request
now fills) only the newest is kept. Imports torch only: tested without vLLM (tests/test_vllm_refine.py).

The writes wait only where the drafter's cache is memory of its own (`context_can_wait`). A target with two kinds of
attention layers (Gemma-3: sliding-window and full) gets several KV-cache groups, and vLLM overlays the groups'
tensors, sound because a block ID is owned by one group at a time: the drafter's layers share their bytes with
sliding-window layers. A write kept past its block's release then lands, when it is made, in the target's cache of
whichever request now owns the block. Seen on Gemma-3-270M under `make serve`'s schedule, batches of 4, 64 tokens:
in 2 of 7 passes over 16 prompts, all 4 requests of one batch left the target's greedy path (the target's top token
passed over by 0.02-1.9 logits), before writes waited only on a single group.
"""

import os

import torch


def context_can_wait(kv_cache_config, device: torch.device) -> bool:
    """Whether the drafter's context writes may wait (`DeferredContext`): on CPU, where it was measured, unless
    XPRESS_VLLM_EAGER_CONTEXT=1, and only with one KV-cache group, where no other layer's cache overlays the
    drafter's (module docstring). `kv_cache_config`: vLLM's `KVCacheConfig` (its `kv_cache_groups`)."""
    return (torch.device(device).type == "cpu" and os.environ.get("XPRESS_VLLM_EAGER_CONTEXT") != "1"
            and len(kv_cache_config.kv_cache_groups) == 1)  # fmt: skip


class DeferredContext:
    """Pending context writes in the order vLLM would have made them.

    block_size: tokens per cache block (a slot's block is `slot // block_size`); max_tokens: how many pending tokens
    to hold before `full` says to write them all (the proposer uses vLLM's `max_num_batched_tokens`, the largest
    context it projects in one step anyway)."""

    def __init__(self, block_size: int, max_tokens: int):
        self.block_size = block_size
        self.max_tokens = max_tokens
        self._hidden: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []
        self.num_tokens = 0

    @property
    def full(self) -> bool:
        return self.num_tokens >= self.max_tokens

    def add(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep one step's context writes: hidden (n, H) as the drafter's projection takes them, positions (n,),
        cache slots (n,). The tensors are copied (vLLM reuses its buffers); padding slots (< 0) are never written."""
        real = slots >= 0
        if not bool(real.any()):
            return
        self._hidden.append(hidden[real])  # boolean indexing copies
        self._positions.append(positions[real])
        self._slots.append(slots[real].long())
        self.num_tokens += self._slots[-1].numel()

    def take(self, block_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pending writes to the blocks `block_ids` (every pending write when None), oldest first and only the
        newest one per slot, as (hidden, positions, slots); None when there is none. The others stay pending."""
        if not self._slots:
            return None
        slots = torch.cat(self._slots)
        self._slots = [slots]
        if block_ids is None:
            taken = torch.ones_like(slots, dtype=torch.bool)
        else:
            blocks = torch.div(slots, self.block_size, rounding_mode="floor")
            taken = torch.isin(blocks, block_ids.to(blocks.dtype).reshape(-1))
        index = taken.nonzero().squeeze(1)
        if index.numel() == 0:  # the common case in a drafting step: leave the pending hidden states untouched
            return None
        hidden, positions = torch.cat(self._hidden), torch.cat(self._positions)
        kept = ~taken
        self.num_tokens = int(kept.sum())
        self._hidden, self._positions, self._slots = (
            ([hidden[kept]], [positions[kept]], [slots[kept]]) if self.num_tokens else ([], [], []))  # fmt: skip
        # The newest write to each slot: the largest index among the writes that share it.
        unique, inverse = torch.unique(slots[index], return_inverse=True)
        order = torch.arange(index.numel(), device=index.device)
        newest = torch.full_like(unique, -1).scatter_reduce(0, inverse, order, reduce="amax")
        index = index[newest.sort().values]
        return hidden[index], positions[index], slots[index]


__all__ = ["DeferredContext", "context_can_wait"]
