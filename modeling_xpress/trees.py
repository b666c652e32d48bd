"""Draft trees (groundwork): build a tree of drafts from the head's path-conditioned distributions, verify it in one
target forward, keep the accepted path.

A linear block dies at its first wrong draft. A tree spends the same verification on alternatives where the drafter
is unsure. The causal head gives what per-position marginals cannot: a child's distribution conditioned on its own
parent path (δ_k reads the whole path x_<k). This module has the pieces, tested against per-branch references:

* `build_tree`: best-first under a budget of N draft nodes, a node's score the product of its path's probabilities;
  each expanded node's children come from `base_logits[depth] + δ(path)` (the head's correction for that path), or
  from the drafter's marginals when the head is off (`jacobi_max_iters=0`, `refiner="none"`);
* `tree_attention_mask`: each node sees the committed context, the anchor and its own ancestors;
* `verify_tree`: the target on [anchor, nodes] in one forward, positions by depth;
* `accept_tree_greedy`: follow the target's argmax down the tree; `keep_path`: a `DynamicCache` keeps only the
  anchor and the accepted path.

Not wired into `spec_generate` yet (no sampling rule, no compiled form): greedy only.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import heapq
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .refinement import previous_tokens, target_ids


@dataclass
class DraftTree:
    """N draft nodes after an anchor. Node j holds `tokens[j]` (a target id) at depth `depths[j]` (1 = right after the
    anchor), below `parents[j]` (-1: the anchor); `logits[j]` is the distribution it was chosen from (its parent
    path's), over the target vocabulary."""

    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long
    depths: torch.Tensor  # (N,) long
    logits: torch.Tensor  # (N, V)

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


@torch.no_grad()
def build_tree(xpress, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: int, budget: int,
               use_head: bool | None = None) -> DraftTree:  # fmt: skip
    """Best-first tree of `budget` drafts. hidden (1, n, H): the drafter's states of the block's draft positions;
    base_logits (1, m, V or V_d): its logits of the first m of them (`XPressModel.base_logits` / `draft_logits`);
    anchor: the last committed token. A node at depth d is chosen from `base_logits[d - 1] + δ_{d-1}(path)`, δ from
    the head on the node's own path (`use_head`, default: the config's `jacobi_max_iters > 0`), else from the drafter's
    marginals. Scores are products of the path's softmax probabilities."""
    if budget < 1:
        raise ValueError(f"a draft tree needs at least one node, got budget={budget}")
    use_head = xpress.config.jacobi_max_iters > 0 if use_head is None else use_head
    vocabulary, draft_space = xpress.decoding_vocabulary(base_logits)
    to_vocabulary = vocabulary["to_vocabulary"] or (lambda values: values)
    token_ids = vocabulary["token_ids"]
    n, m = hidden.shape[1], base_logits.shape[1]
    anchor_ids = torch.tensor([anchor], device=base_logits.device)

    def children(path: list[int]) -> torch.Tensor:
        """Logits (decoding space) of the position after `path` (decoding-space tokens below the anchor)."""
        depth = len(path)
        logits = base_logits[0, depth].float()
        if use_head:
            tokens = torch.zeros(1, n, dtype=torch.long, device=base_logits.device)  # later ones are never read
            tokens[0, :depth] = torch.tensor(path, dtype=torch.long, device=tokens.device)
            previous = previous_tokens(anchor_ids, target_ids(tokens, token_ids))  # (1, n) x_0..x_{n-1}
            logits = logits + to_vocabulary(xpress.refiner(hidden, previous))[0, depth].float()
        return logits

    def full(logits: torch.Tensor) -> torch.Tensor:
        return xpress.to_vocabulary(logits, fill=float("-inf")) if draft_space else logits

    # heap of candidates: (-log score, order, parent node, token in decoding space, parent's logits)
    candidates, order = [], 0
    root = children([])
    for logp, token in zip(*root.log_softmax(-1).topk(min(budget, root.shape[-1]))):
        heapq.heappush(candidates, (-float(logp), order, -1, int(token), root))
        order += 1
    tokens, parents, depths, logits, paths = [], [], [], [], []
    while candidates and len(tokens) < budget:
        score, _, parent, token, parent_logits = heapq.heappop(candidates)
        node = len(tokens)
        path = (paths[parent] if parent >= 0 else []) + [token]
        tokens.append(token)
        parents.append(parent)
        depths.append(len(path))
        logits.append(full(parent_logits))
        paths.append(path)
        room = budget - len(tokens)
        if room and len(path) < m:
            below = children(path)
            for logp, child in zip(*below.log_softmax(-1).topk(min(room, below.shape[-1]))):
                heapq.heappush(candidates, (score - float(logp), order, node, int(child), below))
                order += 1
    device = base_logits.device
    tokens = torch.tensor(tokens, dtype=torch.long, device=device)
    return DraftTree(
        tokens=target_ids(tokens.view(1, -1), token_ids)[0] if draft_space else tokens,
        parents=torch.tensor(parents, dtype=torch.long, device=device),
        depths=torch.tensor(depths, dtype=torch.long, device=device),
        logits=torch.stack(logits),
    )


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N + 1, N + 1) bool: row/column 0 is the anchor, row j + 1 node j; a row sees itself and its ancestors."""
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    mask[:, 0] = True
    for j in range(n):  # parents come before their children (best-first adds a parent first)
        parent = int(parents[j])
        if parent >= 0:
            mask[j + 1] |= mask[parent + 1]
    return mask


@torch.no_grad()
def verify_tree(target, cache: DynamicCache, anchor: int, tree: DraftTree, **kwargs):
    """The target on [anchor, nodes] in one forward after the `cache`'s committed tokens: node j at position
    committed + depth j, seeing the committed context, the anchor and its ancestors. Returns the forward's output
    (logits (1, N + 1, V): row 0 predicts the anchor's child, row j + 1 node j's child)."""
    past = cache.get_seq_length()
    device = tree.tokens.device
    ids = torch.cat([torch.tensor([anchor], device=device), tree.tokens]).view(1, -1)
    positions = (past + torch.cat([torch.zeros(1, dtype=torch.long, device=device), tree.depths])).view(1, -1)
    mask = torch.ones(1, 1, len(tree) + 1, past + len(tree) + 1, dtype=torch.bool, device=device)
    mask[0, 0, :, past:] = tree_attention_mask(tree.parents)
    return target(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, **kwargs)


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


def keep_path(cache: DynamicCache, committed: int, accepted: list[int]) -> None:
    """After `verify_tree`: keep the `committed` tokens, the anchor and the accepted nodes' keys and values (in path
    order), drop the other nodes'."""
    rows = torch.tensor([0] + [j + 1 for j in accepted], dtype=torch.long)
    for layer in cache.layers:
        if layer.is_initialized:
            keep = torch.cat([torch.arange(committed), committed + rows]).to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


__all__ = ["DraftTree", "accept_tree_greedy", "build_tree", "keep_path", "tree_attention_mask", "verify_tree"]
