"""Correction heads on the drafter's logits (`config.refiner`): the xPress causal refiner, the Markov head (the DSpark
baseline) and none (plain dFlash). Each adds a logit bias δ to the drafter's base logits and decodes a block with it.

This file travels with every saved checkpoint; it imports only torch and its siblings.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import initialization as init

from .configuration_xpress import XPressConfig
from .refinement import RefinementResult, jacobi_refine, plain_decode, sequential_refine


class Readout(nn.Linear):
    """A head's vocabulary readout W_r (r → V, no bias), initialised to zero: a fresh head adds δ = 0, so it starts as
    the plain drafter and never hurts a converted one. (A Linear of its own, because transformers skips the init of
    a module without direct parameters, such as the Markov head, so the head itself cannot zero it.)"""

    def __init__(self, rank: int, vocab_size: int):
        super().__init__(rank, vocab_size, bias=False)


class CorrectionHead(nn.Module):
    """What every correction head offers the drafter (`config.refiner` picks one from `HEADS`).

    * `forward(hidden, previous)` → δ (b, n, V): the correction of the drafter's logits given its hidden states
      h_1..h_n (b, n, H) and the previous tokens x_0..x_{n-1} (b, n) — teacher-forced, as training uses it;
    * `decode(hidden, base_logits, anchor_ids, ...)` → `RefinementResult`: one block's draft tokens and the
      distribution each was drawn from, however the head resolves its causal dependency;
    * `init_fresh()`: the state of the head's own tensors before training (its `Readout` starts at zero, so a fresh
      head adds δ = 0).

    `corrects` is False only for `NoHead` (plain dFlash): there is nothing to train and δ ≡ 0. `iterative` says whether
    `max_iters` ≥ 1 / `early_exit` change the decode (the Jacobi K sweep applies); `max_iters=0` switches any head
    off in `decode_block` (the drafter's own marginals). `decode_name` names the decode in benchmarks.
    """

    corrects: bool = True
    iterative: bool = False
    decode_name: str = ""

    def init_fresh(self) -> None:
        pass

    def path_deltas(self, hidden: torch.Tensor):
        """For draft trees: a function of paths (b, d + 1) of previous tokens x_0..x_d (target ids; x_0 the anchor)
        → δ_d (b, V) of the position after each path, the head reading that path alone. hidden (1, n, H): the block's
        drafter states, shared by every path. This reference runs the teacher-forced forward; heads override it with
        their cheaper form."""

        def deltas(paths: torch.Tensor) -> torch.Tensor:
            depth = paths.shape[1] - 1
            previous = paths.new_zeros(paths.shape[0], hidden.shape[1])  # positions past the path are never read
            previous[:, : depth + 1] = paths
            return self(hidden.expand(paths.shape[0], -1, -1), previous)[:, depth]

        return deltas

    def decode(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        *,
        to_vocabulary=None,
        logits_transform=None,
        noise: torch.Tensor | None = None,
        max_iters: int,
        early_exit: bool = True,
        token_ids: torch.Tensor | None = None,
    ) -> RefinementResult:
        """`base_logits` (b, n, V) are over the whole vocabulary; `to_vocabulary` maps the head's δ from its readout
        (the draft vocabulary) onto it (None: the readout already is the whole vocabulary). With `token_ids` (the
        draft vocabulary's target ids) `base_logits` and `noise` are over the draft vocabulary instead, like δ
        (`refinement` module docstring); tokens come back as target ids either way."""
        raise NotImplementedError


@dataclass
class FoldedRefiner:
    """Inference form of the refiner's linear front end (paper §4.1, "Low overhead").

    Fuse and Mix are linear, so `W_in` is folded into the token table and the two hidden projections, and the
    per-channel mixers into one `(r, n, n)` operator `I + L`. The token-independent part of `c` is computed once per
    block (`prepare`); each Jacobi iteration then costs one table lookup and one r-space mix.
    """

    token_table: torch.Tensor  # (V, r) = W_e W_in[:, 2r:]^T
    hidden_weight: torch.Tensor  # (r, H) = W_in[:, :r] W_h
    global_weight: torch.Tensor  # (r, H) = W_in[:, r:2r] W_g
    mix: torch.Tensor  # (r, n, n) = I + strictly-lower L


class XPressRefiner(CorrectionHead):
    """The causal refiner R_θ of paper eqs. (5)–(9): δ_k depends on tokens only through x_{<k}.

    Fuse  a_k = W_in [W_h h_k ‖ W_g g ‖ W_e[x_{k-1}]]
    Mix   c^(d) = (I + L^(d)) a^(d),  L^(d) strictly lower-triangular over the n block positions
    Trans z_k = c_k + W_2 σ(W_1 c_k)
    Read  δ_k = W_r z_k   (added to the drafter's logits, never replacing them)
    """

    iterative = True
    decode_name = "jacobi"

    def __init__(self, config: XPressConfig):
        super().__init__()
        n, r = config.num_draft_tokens, config.refiner_rank
        self.hidden_proj = nn.Linear(config.hidden_size, r, bias=False)  # W_h
        self.global_proj = nn.Linear(config.hidden_size, r, bias=False)  # W_g
        self.token_embed = nn.Embedding(config.vocab_size, r)  # W_e
        self.fuse = nn.Linear(3 * r, r, bias=False)  # W_in
        self.mix = nn.Parameter(torch.zeros(r, n, n))  # L; only the strictly-lower triangle is ever used
        self.up = nn.Linear(r, 2 * r)  # W_1
        self.down = nn.Linear(2 * r, r)  # W_2
        self.act = nn.SiLU()  # σ
        self.readout = Readout(r, config.draft_vocab_size or config.vocab_size)  # W_r, over the draft vocabulary
        self.register_buffer("causal_mask", torch.tril(torch.ones(n, n), diagonal=-1), persistent=False)
        self._folded: FoldedRefiner | None = None
        self._folded_key: tuple | None = None

    def init_fresh(self) -> None:
        init.zeros_(self.mix)
        n = self.causal_mask.shape[0]
        init.copy_(self.causal_mask, torch.tril(torch.ones(n, n), diagonal=-1))

    def decode(self, hidden, base_logits, anchor_ids, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters, early_exit=True, token_ids=None):  # fmt: skip
        """Jacobi refinement (Algorithm 1) with the folded operators: K parallel passes instead of n serial ones."""
        return jacobi_refine(
            self, hidden, base_logits, anchor_ids, to_vocabulary=to_vocabulary, logits_transform=logits_transform,
            noise=noise, max_iters=max_iters, early_exit=early_exit, token_ids=token_ids,
        )  # fmt: skip

    def mix_operator(self) -> torch.Tensor:
        """(r, n, n) operator I + L with L masked to its strictly-lower triangle."""
        eye = torch.eye(self.causal_mask.shape[0], device=self.mix.device, dtype=self.mix.dtype)
        return eye + self.mix * self.causal_mask.to(self.mix.dtype)

    def trans_read(self, c: torch.Tensor) -> torch.Tensor:
        """Trans + Read: (..., n, r) → δ (..., n, V)."""
        z = c + self.down(self.act(self.up(c)))
        return self.readout(z)

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Reference (unfolded) path used in training.

        hidden: (b, n, H) drafter hidden states h_1..h_n; tokens: (b, n) previous tokens x_0..x_{n-1}.
        Returns δ: (b, n, V).
        """
        g = hidden.mean(dim=1, keepdim=True).expand_as(hidden)  # block-global summary, (b, n, H)
        a = self.fuse(torch.cat([self.hidden_proj(hidden), self.global_proj(g), self.token_embed(tokens)], dim=-1))
        c = torch.einsum("dkj,bjd->bkd", self.mix_operator(), a)  # (b, n, r)
        return self.trans_read(c)

    # --- folded inference path -----------------------------------------------------------------------------------

    def folded(self) -> FoldedRefiner:
        """The folded operators, recomputed only when a parameter changed (tracked by tensor versions)."""
        params = (self.token_embed.weight, self.fuse.weight, self.hidden_proj.weight, self.global_proj.weight, self.mix)
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if self._folded is None or key != self._folded_key:
            with torch.no_grad():
                r = self.fuse.weight.shape[0]
                w_in = self.fuse.weight  # (r, 3r)
                self._folded = FoldedRefiner(
                    token_table=self.token_embed.weight @ w_in[:, 2 * r :].T,
                    hidden_weight=w_in[:, :r] @ self.hidden_proj.weight,
                    global_weight=w_in[:, r : 2 * r] @ self.global_proj.weight,
                    mix=self.mix_operator(),
                )
            self._folded_key = key
        return self._folded

    def prepare(self, hidden: torch.Tensor) -> torch.Tensor:
        """Token-independent part of c for a block, mixed: (b, p, H) → (b, p, r). Computed once per block. A drafter
        block shorter than the head's n positions (p < n, as vLLM drafts K + 1 slots) uses the mix's first p rows."""
        f = self.folded()
        p = hidden.shape[1]
        g = hidden.mean(dim=1, keepdim=True)
        a_hidden = hidden @ f.hidden_weight.T + g @ f.global_weight.T  # (b, p, r)
        return torch.einsum("dkj,bjd->bkd", f.mix[:, :p, :p], a_hidden)

    def path_deltas(self, hidden: torch.Tensor):
        """`CorrectionHead.path_deltas` with the folded operators: the block's token-independent part once, then per
        path one table lookup, one r-space mix of its tokens and the readout of its last position."""
        prepared = self.prepare(hidden)  # (1, n, r)

        def deltas(paths: torch.Tensor) -> torch.Tensor:
            depth = paths.shape[1] - 1
            return self.delta_folded(prepared.expand(paths.shape[0], -1, -1), paths, start=depth)[:, 0]

        return deltas

    def delta_folded(self, prepared: torch.Tensor, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """δ for one Jacobi iteration from `prepare(hidden)` and the current previous tokens (b, n).

        Only positions `start..m-1` are computed, (b, m - start, V), for the tokens' m ≤ n positions: by causality a
        position whose prefix did not change keeps its δ, so Jacobi recomputes just the tail after the first token
        that moved, and positions past m never enter.
        """
        f = self.folded()
        m = tokens.shape[1]  # `prepared` may cover only the first m positions (a block decoded in part)
        c = prepared[:, start:m] + torch.einsum("dkj,bjd->bkd", f.mix[:, start:m, :m], f.token_table[tokens])
        return self.trans_read(c)


class MarkovHead(CorrectionHead):
    """DSpark's Markov head (paper §5 baseline): δ_k = W_r W_e[x_{k-1}], a bias indexed by the previous token only.

    It is causal by construction but has no view of the drafter's hidden states, and it is decoded serially.
    """

    decode_name = "serial"

    def __init__(self, config: XPressConfig):
        super().__init__()
        self.token_embed = nn.Embedding(config.vocab_size, config.refiner_rank)
        self.readout = Readout(config.refiner_rank, config.draft_vocab_size or config.vocab_size)

    def bias(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) → δ (..., V): the bias of the position after each token."""
        return self.readout(self.token_embed(tokens))

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """δ (b, n, V) from the previous tokens alone (the hidden states are not read)."""
        return self.bias(previous)

    def path_deltas(self, hidden: torch.Tensor):
        """`CorrectionHead.path_deltas`: the bias of each path's last token."""
        return lambda paths: self.bias(paths[:, -1])

    def decode(self, hidden, base_logits, anchor_ids, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters=0, early_exit=True, token_ids=None):  # fmt: skip
        """The serial decode: n dependent steps, whatever `max_iters` ≥ 1 says (`refine` never calls it with 0)."""
        return sequential_refine(self, hidden, base_logits, anchor_ids, to_vocabulary=to_vocabulary,
                                 logits_transform=logits_transform, noise=noise, token_ids=token_ids)  # fmt: skip


class NoHead(CorrectionHead):
    """refiner="none": plain dFlash, every position decoded from the drafter's own marginals. No parameters."""

    corrects = False
    decode_name = "argmax"

    def __init__(self, config: XPressConfig):
        super().__init__()
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(*previous.shape, self.vocab_size)

    def decode(self, hidden, base_logits, anchor_ids, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters=0, early_exit=True, token_ids=None):  # fmt: skip
        return plain_decode(base_logits, logits_transform=logits_transform, noise=noise, token_ids=token_ids)


def decode_block(head: CorrectionHead, hidden, base_logits, anchor_ids, *, max_iters: int, early_exit: bool = True,
                 to_vocabulary=None, logits_transform=None, noise=None, token_ids=None) -> RefinementResult:  # fmt: skip
    """One block through `head`'s decode, or with `max_iters=0` through none (every head switched off the same way:
    the drafter's own marginals). The dispatch `XPressModel.refine` and the vLLM plugin share."""
    if max_iters == 0:
        return plain_decode(base_logits, logits_transform=logits_transform, noise=noise, token_ids=token_ids)
    return head.decode(hidden, base_logits, anchor_ids, to_vocabulary=to_vocabulary,
                       logits_transform=logits_transform, noise=noise, max_iters=max_iters, early_exit=early_exit,
                       token_ids=token_ids)  # fmt: skip


# config.refiner → head class. Adding a head is one class here and its name in configuration_xpress.REFINER_TYPES.
HEADS: dict[str, type[CorrectionHead]] = {"xpress": XPressRefiner, "markov": MarkovHead, "none": NoHead}


__all__ = ["HEADS", "CorrectionHead", "FoldedRefiner", "MarkovHead", "NoHead", "Readout", "XPressRefiner"]
