"""Draft trees: build a tree of drafts from the head's path-conditioned distributions, verify it in one target
forward, accept a path (greedy or lossless sampling), keep that path in the cache.

A linear block dies at its first wrong draft. A tree spends the same verification on alternatives where the drafter
is unsure. The causal head gives what per-position marginals cannot: a child's distribution conditioned on its own
parent path (δ_k reads the whole path x_<k). The pieces, each tested against a per-branch reference:

* `build_tree`: best-first under a budget of N draft nodes, a node's score the product of its path's slot
  probabilities; an expanded node's children come from `base_logits[depth] + δ(path)` (the head's correction for
  that path, `CorrectionHead.path_deltas`), or from the drafter's marginals when the head is off
  (`jacobi_max_iters=0`, `refiner="none"`), after the same logits processors as the target's p;
* `tree_attention_mask` / `verify_tree`: the target on [anchor, nodes] in one forward, each node at the position of
  its depth, seeing the committed context, the anchor and its own ancestors (sliding-window layers: those within
  their window of the node's position, `attention_masks.LayerKinds`);
* `accept_tree`: greedy follows the target's argmax down the tree; sampling is recursive rejection sampling over
  each node's children drawn without replacement (lossless; the argument is in its docstring);
* `keep_path`: a `DynamicCache` keeps the anchor and the accepted path, drops the other nodes.

A linear block is the chain `DraftTree.chain`: the decode loop (`decoding.decode`) runs both through the same steps.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import heapq
import itertools
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .attention_masks import LayerKinds
from .refinement import gumbel_noise


@dataclass
class DraftTree:
    """N draft nodes after an anchor. Node j holds `tokens[j]` (a target id) at depth `depths[j]` (1 = right after the
    anchor), below `parents[j]` (-1: the anchor); parents come before their children, and siblings in the order they
    were drawn. `logits[j]` is the processed distribution it was drawn from (its parent path's), over the target
    vocabulary: row `source[j]` of `distributions` (siblings share one). `chain`: a linear block (node j's parent is
    j - 1)."""

    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long
    depths: torch.Tensor  # (N,) long
    distributions: torch.Tensor  # (E, V): one per expanded path
    source: torch.Tensor  # (N,) long: node → its row of `distributions`
    chain: bool = False

    @classmethod
    def of_chain(cls, tokens: torch.Tensor, logits: torch.Tensor) -> "DraftTree":
        """A linear block: drafts (n,) and the logits (n, V) each was drawn from."""
        n = tokens.shape[0]
        order = torch.arange(n, device=tokens.device)
        return cls(tokens=tokens, parents=order - 1, depths=order + 1, distributions=logits, source=order, chain=True)

    @property
    def logits(self) -> torch.Tensor:
        return self.distributions[self.source]

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def path(self, node: int) -> list[int]:
        """The nodes from the anchor's child down to `node`."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = int(self.parents[node])
        return nodes[::-1]

    def leaves(self) -> list[int]:
        parents = set(self.parents.tolist())
        return [j for j in range(len(self)) if j not in parents]

    def children(self) -> dict[int, list[int]]:
        """parent (-1: the anchor) → its children, in the order they were drawn."""
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(self.parents.tolist()):
            children.setdefault(parent, []).append(j)
        return children


@torch.no_grad()
def build_tree(
    xpress,
    hidden: torch.Tensor,
    base_logits: torch.Tensor,
    last: torch.Tensor,
    budget: int,
    *,
    max_depth: int | None = None,
    use_head: bool | None = None,
    logits_transform=None,
    generator: torch.Generator | None = None,
    do_sample: bool = False,
) -> DraftTree:
    """A best-first tree of at most `budget` drafts after the anchor (the last committed token).

    hidden (1, B, H): the drafter's states of the block's slots, the anchor's first; last (1, 2): the token before
    the anchor and the anchor (`drafting.last_tokens`); base_logits (1, m, V or V_d): the drafter's logits of the
    first m draft positions (`XPressModel.base_logits` / `draft_logits`). The children of a path at depth d are drawn
    from `transform(base_logits[d] + δ_d(path))`: δ from the head on that path alone (`use_head`, default: the config's
    `jacobi_max_iters > 0`), else 0 (the drafter's marginals); `logits_transform` maps (b, k, V) raw logits to the
    processed logits of the sampling distribution (temperature, top-k, top-p), as in `XPressModel.refine`. Greedy,
    a path's children are its most probable tokens; sampling (`do_sample`), they are drawn without replacement
    (Gumbel-top-k with fresh noise per path from `generator`).

    Shape: each path offers its children as slots; slot i of a path scores the path's score times the i-th largest
    probability of its distribution (the sorted probabilities, not those of the tokens drawn), and the best `budget`
    slots become nodes, a slot only after the slot before it. So whether the i-th child of a path is in the tree
    depends on its ancestors, its earlier siblings and other branches, never on its own draw: what `accept_tree`
    needs to stay lossless. Depth is at most `max_depth` (default m)."""
    if budget < 1:
        raise ValueError(f"a draft tree needs at least one node, got budget={budget}")
    use_head = xpress.config.jacobi_max_iters > 0 if use_head is None else use_head
    use_head = use_head and xpress.refiner.corrects
    vocabulary, draft_space = xpress.decoding_vocabulary(base_logits)
    to_vocabulary = vocabulary["to_vocabulary"] or (lambda values: values)
    token_ids = vocabulary["token_ids"]
    device = base_logits.device
    max_depth = min(max_depth or base_logits.shape[1], base_logits.shape[1])
    deltas = xpress.refiner.path_deltas(hidden) if use_head else None
    before, anchor = (int(t) for t in last.view(2))

    def as_target_id(token: int) -> int:
        return int(token_ids[token]) if draft_space else token

    def expand(path: list[int], room: int):
        """The distribution after `path` (target ids, anchor first) and its first `room` children: (processed
        logits (V,) in the decoding space, tokens drawn in order, log-probabilities of the slots)."""
        depth = len(path) - 1
        logits = base_logits[0, depth : depth + 1].float()  # (1, V)
        if deltas is not None:
            logits = logits + to_vocabulary(deltas(torch.tensor([[before, *path]], device=device))).float()
        processed = logits_transform(logits.unsqueeze(0))[0, 0] if logits_transform else logits[0]
        logp = processed.log_softmax(-1)
        room = min(room, int(torch.isfinite(logp).sum()))
        slots = logp.topk(room).values  # sorted probabilities: the shape does not look at the draws
        scores = processed + gumbel_noise(processed.shape, generator, device) if do_sample else processed
        return processed, scores.topk(room).indices.tolist(), slots.tolist()

    def full(processed: torch.Tensor) -> torch.Tensor:
        return xpress.to_vocabulary(processed, fill=float("-inf")) if draft_space else processed

    tokens, parents, depths, source, paths, distributions = [], [], [], [], [], []
    expansions = []  # per expanded path: (drawn tokens, slot log-probabilities, its row of distributions)
    candidates = []  # heap of slots: (-log score, order, parent node, expansion, slot)
    order = itertools.count()  # ties go to the slot offered first

    def offer(node: int, path: list[int], log_score: float) -> None:
        room = budget - len(tokens)
        if room <= 0 or len(path) - 1 >= max_depth:
            return
        processed, drawn, slots = expand(path, room)
        if not drawn:
            return
        distributions.append(full(processed))
        expansions.append((drawn, slots, len(distributions) - 1))
        heapq.heappush(candidates, (-(log_score + slots[0]), next(order), node, len(expansions) - 1, 0))

    offer(-1, [anchor], 0.0)
    while candidates and len(tokens) < budget:
        neg_score, _, parent, expansion, slot = heapq.heappop(candidates)
        drawn, slots, row = expansions[expansion]
        if slot + 1 < len(drawn):  # the next sibling's slot
            sibling_score = -neg_score - slots[slot] + slots[slot + 1]
            heapq.heappush(candidates, (-sibling_score, next(order), parent, expansion, slot + 1))
        node = len(tokens)
        token = drawn[slot]
        path = (paths[parent] if parent >= 0 else [anchor]) + [as_target_id(token)]
        tokens.append(path[-1])
        parents.append(parent)
        depths.append(len(path) - 1)
        source.append(row)
        paths.append(path)
        offer(node, path, -neg_score)
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        distributions=torch.stack(distributions),
        source=torch.tensor(source, dtype=torch.long, device=device),
    )


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N + 1, N + 1) bool: row/column 0 is the anchor, row j + 1 node j; a row sees itself and its ancestors."""
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    mask[:, 0] = True
    for j, parent in enumerate(parents.tolist()):  # parents come before their children
        if parent >= 0:
            mask[j + 1] |= mask[parent + 1]
    return mask


@torch.no_grad()
def verify_tree(target, cache: DynamicCache, anchor: int, tree: DraftTree, kinds: LayerKinds | None = None, **kwargs):
    """The target on [anchor, nodes] in one forward after the `cache`'s committed tokens: node j at position
    committed + depth j, seeing the committed context, the anchor and its ancestors (a sliding-window layer: those
    within its window of the node's position, `attention_masks`). `kinds`: the target's `LayerKinds` (read from its
    config when None; a decode loop passes the ones it read once). Returns the forward's output (logits (1, N + 1, V):
    row 0 predicts the anchor's child, row j + 1 node j's child)."""
    past = cache.get_seq_length()
    device = tree.tokens.device
    ids = torch.cat([torch.tensor([anchor], device=device), tree.tokens]).view(1, -1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths])  # (N + 1,) from the anchor
    allowed = torch.ones(len(tree) + 1, past + len(tree) + 1, dtype=torch.bool, device=device)
    allowed[:, past:] = tree_attention_mask(tree.parents)
    key_positions = torch.cat([torch.arange(past, device=device), past + offsets])
    kinds = LayerKinds.of(target.config) if kinds is None else kinds
    mask = kinds.masks(allowed, past + offsets, key_positions, dtype=target.dtype, cache=cache)
    return target(input_ids=ids, position_ids=(past + offsets).view(1, -1), attention_mask=mask, cache=cache, **kwargs)


def accept_tree_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree from the anchor: the accepted nodes and the target's next token
    after them (the bonus). target_logits (N + 1, V) as `verify_tree` returns them."""
    choice = target_logits.argmax(dim=-1).tolist()
    children: dict[int, dict[int, int]] = {}
    for j, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children.setdefault(parent, {})[token] = j
    accepted, node = [], -1
    while choice[node + 1] in children.get(node, {}):
        node = children[node][choice[node + 1]]
        accepted.append(node)
    return accepted, choice[node + 1]


def accept_tree_sampling(tree: DraftTree, target_logits: torch.Tensor, generator=None) -> tuple[list[int], int]:
    """Recursive rejection sampling down the tree: the accepted nodes and the token drawn after them.

    At a path with target distribution p (the processed row of `target_logits`) and children x_1..x_k drawn without
    replacement from q (the path's processed draft distribution, `tree.logits`), in their draw order: with p_1 = p,
    q_1 = q, child x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); on rejection
    p_{i+1} = norm(max(p_i − q_i, 0)) and q_{i+1} = q_i with x_i removed, renormalised. An accepted child becomes the
    path and the walk goes on below it; when every child is rejected (or there are none), the token is drawn from
    p_{k+1}.

    Why the output is distributed as p (by induction from the last child up). Given x_1..x_{i-1}, the draw x_i is
    distributed as q_i: that is what drawing without replacement means, and whether slot i is in the tree at all does
    not depend on x_i (`build_tree`). One step — x_i ~ q_i, keep it with probability min(1, p_i/q_i), else a token
    from norm(max(p_i − q_i, 0)) — is speculative sampling of p_i with proposal q_i, whose output is distributed as p_i
    (Leviathan et al., Thm. 1); the residual of step i is p_{i+1}, which the following steps (or the final draw)
    produce exactly. So the token at this path is distributed as p_1 = p. Below an accepted child the same holds for
    that child's path, whose children were drawn (from its own path-conditioned q) independently of everything that
    decided acceptance above; so each committed token is a draw from the target's p given the tokens before it.
    A chain is the special case k = 1 everywhere: standard speculative sampling."""
    children = tree.children()
    p_rows = target_logits.float().softmax(dim=-1)
    accepted, node = [], -1
    while True:
        p = p_rows[node + 1]
        kids = children.get(node, [])
        chosen = None
        if kids:
            q = tree.distributions[int(tree.source[kids[0]])].float().softmax(dim=-1)  # siblings share their q
            for kid in kids:
                token = int(tree.tokens[kid])
                u = float(torch.rand((), generator=generator, device=p.device))
                if u * float(q[token]) <= float(p[token]):
                    chosen = kid
                    break
                residual = (p - q).clamp(min=0)
                total = residual.sum()
                p = residual / total if total > 0 else p  # total 0 only when p == q, where rejection never happens
                q = q.clone()
                q[token] = 0
                q_total = q.sum()
                if q_total <= 0:
                    break
                q = q / q_total
        if chosen is None:
            return accepted, int(torch.multinomial(p, 1, generator=generator))
        accepted.append(chosen)
        node = chosen


def keep_path(cache: DynamicCache, width: int, accepted: list[int]) -> None:
    """After a verification of `width` = N + 1 tokens (`verify_tree`): keep the anchor and the accepted nodes' keys and
    values (in path order) right after the committed tokens, drop the rest. The accepted rows move forward within the
    verified tail (a path's nodes come in increasing order, so no row is overwritten before it is read), then the
    cache is cropped: a few rows copied per layer, and any layer type that can be cropped (sliding windows included)."""
    rows = [0] + [j + 1 for j in accepted]
    if rows != list(range(len(rows))):  # (a chain's prefix is already in place)
        for layer in cache.layers:
            if layer.is_initialized:
                index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device) + layer.keys.shape[-2] - width
                start = layer.keys.shape[-2] - width
                layer.keys[..., start : start + len(rows), :] = layer.keys.index_select(-2, index)
                layer.values[..., start : start + len(rows), :] = layer.values.index_select(-2, index)
    cache.crop(-(width - len(rows)))


def static_tree_mask(kinds: LayerKinds, tree_mask: torch.Tensor, depths: torch.Tensor, anchor_pos: torch.Tensor,
                     cache_len: int, dtype: torch.dtype):  # fmt: skip
    """The attention mask(s) (`LayerKinds.masks`) of a tree verified into a static cache of S slots, one per position,
    from slot `anchor_pos` (a 0-d tensor: a graph input): every committed slot (< anchor_pos), and of the W verified
    slots a row's ancestors (`tree_attention_mask`); nothing stale after them. Row j sits at position anchor_pos +
    depths[j]; a sliding-window layer sees only the slots within its window of that position."""
    width = tree_mask.shape[0]
    slots = torch.arange(cache_len, device=tree_mask.device)
    offset = slots - anchor_pos  # (S,) slot - anchor_pos
    inside = (offset >= 0) & (offset < width)
    row = offset.clamp(0, width - 1)  # (S,) the verified row a slot holds (where `inside`)
    tree_part = tree_mask[:, row] & inside  # (W, S)
    key_positions = torch.where(inside, anchor_pos + depths[row], slots)  # (S,)
    return kinds.masks((offset < 0) | tree_part, anchor_pos + depths, key_positions, dtype=dtype)


def keep_path_static(cache, anchor_pos: int, accepted: list[int]) -> None:
    """`keep_path` for a static cache: the accepted nodes' keys and values move to the slots right after the anchor's
    (`anchor_pos`), where the next verification writes on; nothing is cropped."""
    rows = [0] + [j + 1 for j in accepted]
    if rows == list(range(len(rows))):
        return
    for layer in cache.layers:
        source = torch.tensor(rows, dtype=torch.long, device=layer.keys.device) + anchor_pos
        slots = torch.arange(anchor_pos, anchor_pos + len(rows), device=layer.keys.device)
        layer.keys.index_copy_(-2, slots, layer.keys.index_select(-2, source))
        layer.values.index_copy_(-2, slots, layer.values.index_select(-2, source))


def path_rows(accepted: list[int], device=None) -> torch.Tensor:
    """The verification rows of the anchor and the accepted path: [0, j_1 + 1, ...]."""
    return torch.tensor([0] + [j + 1 for j in accepted], dtype=torch.long, device=device)


__all__ = [
    "DraftTree", "accept_tree_greedy", "accept_tree_sampling", "build_tree", "keep_path", "keep_path_static",
    "path_rows", "static_tree_mask", "tree_attention_mask", "verify_tree",
]  # fmt: skip
