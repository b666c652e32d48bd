"""The compiled implementation of the decode loop's steps (`decoding.DecodeSteps`) on a `compiled.CompiledDecoder`:
`spec_generate(compile=True)` runs `decoding.decode` over these.

Linear blocks verify `[anchor, d_1..d_{W-1}]` in a graph of fixed width W. Draft trees (`tree_nodes=N`) verify
`[anchor, N nodes]` in one graph of width N + 1 with the tree's mask and per-depth positions over the static cache
(a tree that comes out smaller is padded with placeholder nodes that see only the anchor and themselves, and that no
acceptance reads); the accepted path's keys and values are then moved to the slots right after the committed tokens
(`trees.keep_path_static`), where the next verification writes on. The tree itself is built by the eager
`trees.build_tree` on the compiled drafter's and readout's outputs, with the same draws as `compile=False`.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

from contextlib import contextmanager

import torch

from .compiled import (
    _CALLS, LENGTH_BUCKET, CompiledDecoder, CompiledGenerationStats, _block_transform, _pad_rows, compiled_decoder,
    cache_length, recompile_limit, verify_width, verify_widths,
)  # fmt: skip
from .configuration_xpress import is_integer
from .processors import decoding_processors, warper_values
from .drafting import last_tokens
from .refinement import RefinementResult, gumbel_noise
from .trees import build_tree, keep_path_static, tree_attention_mask


class CompiledSteps:
    """`decoding.DecodeSteps` on a `CompiledDecoder`: the same steps as the eager loop's, as fixed-shape graphs.

    Verification runs `[anchor, d_1..d_{W-1}]` with W fixed per graph: without a confidence threshold W is the cap's
    width (one graph per call), with one the smallest `verify_widths` bucket that holds the drafts to verify (only
    those take part in acceptance; by causality the target's logits at positions 0..m do not depend on the drafts
    after them). A step with no draft budget verifies placeholder drafts no acceptance reads. Nothing is cropped: the
    next verification writes from the slot after the committed tokens. With `tree_nodes`, a tree of that many nodes
    (module docstring)."""

    def __init__(self, decoder: CompiledDecoder, draft_rule, processors, warp_values, tree_nodes: int | None = None):
        self.decoder, self.processors, self.warp_values = decoder, processors, warp_values
        self.do_sample, self.tree_nodes = decoder.do_sample, tree_nodes
        self.widest = draft_rule.cap + 1  # anchor + the cap's drafts (a tree: its depth limit)
        self.fixed_width = not draft_rule.threshold
        self.anchor_pos = 0

    def prefill(self, input_ids):
        return self.decoder.prefill(input_ids)

    def start(self, sequence) -> None:
        # Verification widths this call can use, compiled now rather than in the middle of decoding.
        if self.tree_nodes is None:
            widths = [self.widest] if self.fixed_width else verify_widths(self.widest)
            self.decoder.compile_verify_widths(widths, sequence[0, -1], sequence.shape[1] - 1, self.warp_values)
        else:  # the tree's one graph
            self.decoder.compile_verify_widths([self.tree_nodes + 1], sequence[0, -1], sequence.shape[1] - 1,
                                               self.warp_values, tree=True)  # fmt: skip
        self.decoder.prepare("head", self.widest - 1)  # the readout of the cap's drafts

    def draft(self, sequence, features, count, context_len, stats, timer, generator, depth):
        decoder, block = self.decoder, self.decoder.block
        if decoder.cuda:  # outputs of the previous step's graphs are dead; what is carried over was cloned
            torch.compiler.cudagraph_mark_step_begin()
        anchor = sequence[0, -1].view(1, 1)  # not sequence[:, -1:], whose stride (the length) would recompile
        t0 = timer.mark()
        positions = torch.tensor([context_len, count], device=sequence.device)
        if features.shape[1] <= block:  # padded to B rows: the fixed-shape graph
            hidden = decoder.drafter(anchor, _pad_rows(features, block), positions[0], positions[1])
        else:  # a prompt longer than a block: a prefill of varying length, uncompiled
            hidden = decoder._draft(anchor, features, positions[0], positions[1])
        t1 = timer.mark()
        base = decoder.head(hidden[:, : self.widest], decoder.head_rows())  # the cap's drafts only: (1, cap, V_d)
        t2 = timer.mark()
        stats.record("drafter", t0, t1)
        stats.record("lm_head", t1, t2)
        if self.tree_nodes is not None:  # the eager tree construction on the graphs' outputs, as compile=False
            tree = build_tree(decoder.xpress, hidden, base, last_tokens(sequence), self.tree_nodes, max_depth=depth,
                              logits_transform=_block_transform(decoder.warpers, self.warp_values),
                              generator=generator, do_sample=self.do_sample)  # fmt: skip
            stats.record("refiner", t2, timer.mark())
            return tree
        noise = gumbel_noise(base.shape, generator=generator, device=base.device) if self.do_sample else None
        last = sequence[0, -2:].clone().view(1, 2)  # the token before the anchor, the anchor
        tokens, logits, iterations = decoder.refiner(hidden, base, last, noise, decoder.folded(),
                                                     self.warp_values)  # fmt: skip
        stats.record("refiner", t2, timer.mark())
        stats.jacobi_iterations.append(int(iterations[0]))
        return RefinementResult(tokens=tokens, logits=logits, iterations=iterations)

    def verify(self, sequence, tree, stats):
        decoder = self.decoder
        anchor = sequence[0, -1].view(1, 1)
        if not len(tree) and decoder.cuda:  # one token left: the drafts are placeholders no acceptance reads
            torch.compiler.cudagraph_mark_step_begin()
        self.anchor_pos = sequence.shape[1] - 1
        anchor_pos = torch.tensor(self.anchor_pos, device=sequence.device)
        if self.tree_nodes is None:
            width = self.widest if self.fixed_width else verify_width(self.widest, len(tree) + 1)
            # [anchor, d_1..d_m], then placeholders to the graph's width: by causality no row up to m reads them.
            verify_ids = torch.cat([anchor, tree.tokens.view(1, -1), anchor.expand(1, width - 1 - len(tree))], dim=1)
            p_logits, features = decoder.verify(verify_ids, anchor_pos, self.warp_values)
        else:  # a tree (or, with one token left, no drafts) through the tree's one graph
            width = self.tree_nodes + 1
            ids, depths, mask = padded_tree(tree, int(anchor), width)
            p_logits, features = decoder.verify(ids, anchor_pos, self.warp_values, depths, mask)
        stats.verify_widths.append(width)
        return p_logits, (features.clone() if decoder.cuda else features)  # (a CUDA graph reuses its output)

    def commit(self, tree, path) -> None:
        # The next verification writes from the slot after the committed tokens; a tree's path moves there first.
        if not tree.chain:
            keep_path_static(self.decoder.target_cache, self.anchor_pos, path)


def padded_tree(tree, anchor: int, width: int):
    """A tree's verification inputs at a fixed width: ids (1, W) [anchor, nodes, placeholders], depths (W,) and the
    tree mask (W, W); placeholder nodes (the anchor's token at depth 1) see only the anchor and themselves."""
    device, missing = tree.tokens.device, width - 1 - len(tree)
    ids = torch.cat([torch.tensor([anchor], device=device), tree.tokens, tree.tokens.new_full((missing,), anchor)])
    depths = torch.cat([tree.depths.new_zeros(1), tree.depths, tree.depths.new_ones(missing)])
    parents = torch.cat([tree.parents, tree.parents.new_full((missing,), -1)])
    return ids.view(1, -1), depths, tree_attention_mask(parents)


@contextmanager
def compiled_steps(xpress, target, input_ids, draft_rule, stats: CompiledGenerationStats, *, max_new_tokens: int,
                   temperature: float, top_k, top_p, max_cache_len: int | None = None, linear_layout: str = "auto",
                   tree_nodes: int | None = None):  # fmt: skip
    """The `CompiledSteps` of one `spec_generate(compile=True)` call, on the kept decoder for these models and
    settings (built, and its graphs compiled, on first use); `stats` gets what the compiled call measured.

    One compiled call at a time in a process: a decoder's static caches and write positions belong to the call that
    runs it, and dynamo's configuration is process-wide. Every decoder's calls share code objects, so dynamo may keep
    more than its default 8 entries each (`recompile_limit`); past that it fails loudly rather than fall back to
    eager. `max_cache_len`: the caches' length (default: this call's bucket, `cache_length`). `linear_layout`: how
    the graphs compute `F.linear` (`layout_policy`)."""
    block = xpress.config.block_size
    # A tree's verification writes its N + 1 slots past the committed tokens: room for them as for new tokens.
    new_slots = max_new_tokens + (tree_nodes or 0)
    cache_len = cache_length(input_ids.shape[1], new_slots, block)
    if max_cache_len is not None:
        if not is_integer(max_cache_len):
            raise ValueError(
                f"max_cache_len must be an integer number of cache slots, got {max_cache_len!r}: pass an int (e.g. "
                f"{4 * LENGTH_BUCKET}), or leave it unset to size the caches per call."
            )
        needed = input_ids.shape[1] + new_slots + 2 * block
        if max_cache_len < needed:
            raise ValueError(
                f"max_cache_len={max_cache_len!r} cannot hold this call: the prompt ({input_ids.shape[1]} tokens), "
                f"max_new_tokens ({max_new_tokens}), a tree's {tree_nodes or 0} nodes and two blocks of {block} need "
                f"at least {needed} slots. Pass a larger max_cache_len (one that fits your longest prompt), or leave it "
                "unset to size the caches per call."
            )
        cache_len = int(max_cache_len)
    if temperature == 0:  # greedy: top-k/top-p do not apply
        top_k = top_p = None
    processors = decoding_processors(temperature, top_k, top_p)  # the loop's own picks, outside the graphs
    max_positions = getattr(target.config.get_text_config(), "max_position_embeddings", None) or cache_len
    limit = recompile_limit(max(max_positions, cache_len), block)
    with _CALLS, torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        decoder = compiled_decoder(xpress, target, cache_len, temperature, top_k, top_p, linear_layout)
        compiled_before = decoder.compile_seconds
        warp_values = warper_values(temperature, top_k, top_p, input_ids.device)
        yield CompiledSteps(decoder, draft_rule, processors, warp_values, tree_nodes)
        stats.time_compile = decoder.compile_seconds - compiled_before
        stats.weight_major_graphs = [f"{g}:{rows}" for g, rows in sorted(decoder.weight_major)]
        stats.packed_graphs = [f"{g}:{rows}" for g, rows in sorted(decoder.packed)]


__all__ = ["CompiledSteps", "compiled_steps"]
