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

    A head reads a block's drafter states over its slots, slot 0 the anchor's and slots 1..n the draft positions',
    and the block's previous tokens `[x_-1, x_0, x_1..x_{n-1}]`: the token before the anchor, the anchor, then the
    drafts (slot j's previous token is entry j). It returns δ for the draft positions only.

    * `forward(hidden, previous)` → δ (b, n, V): hidden (b, n + 1, H) all slots, previous (b, n + 1) — teacher-forced,
      as training uses it;
    * `decode(hidden, base_logits, last_tokens, ...)` → `RefinementResult`: one block's draft tokens and the
      distribution each was drawn from, however the head resolves its causal dependency; `last_tokens` (b, 2) are
      the block's committed tokens `[x_-1, x_0]`;
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

    def set_token_vocabulary(self, draft_token_ids: torch.Tensor) -> None:
        """Point a draft-vocabulary token table (`config.refiner_token_vocab == "draft"`) at the drafter's
        `draft_token_ids`; nothing for a head without a token table."""
        embed = getattr(self, "token_embed", None)
        if embed is not None:
            embed.set_vocabulary(draft_token_ids)

    def path_deltas(self, hidden: torch.Tensor):
        """For draft trees: a function of paths (b, d + 2) of previous tokens `[x_-1, x_0, x_1..x_d]` (target ids;
        x_-1 the token before the anchor, x_0 the anchor) → δ (b, V) of draft position d + 1, the head reading that
        path alone. hidden (1, n + 1, H): the block's drafter states, shared by every path. This reference runs the
        teacher-forced forward; heads override it with their cheaper form."""

        def deltas(paths: torch.Tensor) -> torch.Tensor:
            depth = paths.shape[1] - 2
            previous = paths.new_zeros(paths.shape[0], hidden.shape[1])  # positions past the path are never read
            previous[:, : depth + 2] = paths
            return self(hidden.expand(paths.shape[0], -1, -1), previous)[:, depth]

        return deltas

    def decode(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        last_tokens: torch.Tensor,
        *,
        to_vocabulary=None,
        logits_transform=None,
        noise: torch.Tensor | None = None,
        max_iters: int,
        early_exit: bool = True,
        token_ids: torch.Tensor | None = None,
    ) -> RefinementResult:
        """`base_logits` (b, m, V) are over the whole vocabulary; `to_vocabulary` maps the head's δ from its readout
        (the draft vocabulary) onto it (None: the readout already is the whole vocabulary). With `token_ids` (the
        draft vocabulary's target ids) `base_logits` and `noise` are over the draft vocabulary instead, like δ
        (`refinement` module docstring); tokens come back as target ids either way."""
        raise NotImplementedError


class TokenEmbedding(nn.Embedding):
    """A head's token table W_e, looked up by target token id. With `config.refiner_token_vocab == "draft"` it holds a
    row per draft-vocabulary token and one last row shared by every other token; `rows` maps target ids to rows (set
    by `set_vocabulary` from the drafter's `draft_token_ids`, which the model keeps in step)."""

    def __init__(self, config: XPressConfig, rank: int):
        compact = config.refiner_token_vocab == "draft"
        super().__init__(config.draft_vocab_size + 1 if compact else config.vocab_size, rank)
        # target id → row (non-persistent: rebuilt from draft_token_ids); None: the identity
        self.register_buffer("row_of", torch.zeros(config.vocab_size, dtype=torch.long) if compact else None,
                             persistent=False)  # fmt: skip

    @torch.no_grad()
    def set_vocabulary(self, draft_token_ids: torch.Tensor) -> None:
        """Row k for target token `draft_token_ids[k]`, the shared last row for every other token."""
        if self.row_of is not None:
            self.row_of.fill_(self.num_embeddings - 1)
            self.row_of[draft_token_ids.to(self.row_of.device)] = torch.arange(
                draft_token_ids.shape[0], device=self.row_of.device
            )

    def rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target token ids → rows of `weight` (the ids themselves for a full table)."""
        return tokens if self.row_of is None else self.row_of[tokens]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(self.rows(tokens))


@dataclass
class FoldedRefiner:
    """Inference form of the refiner's linear front end (paper §4.1, "Low overhead").

    Fuse and Mix are linear, so `W_in` is folded into the token table and the two hidden projections, and the
    per-channel mixers into one `(r, s, s)` operator `I + L ⊙ mask` over the head's s slots. The token-independent
    part of `c` is computed once per block (`prepare`); each Jacobi iteration then costs one table lookup and one
    r-space mix.
    """

    token_table: torch.Tensor  # (rows of W_e, r) = W_e W_in[:, 2r:]^T, read at `TokenEmbedding.rows(tokens)`
    hidden_weight: torch.Tensor  # (r, H) = W_in[:, :r] W_h
    global_weight: torch.Tensor  # (r, H) = W_in[:, r:2r] W_g
    mix: torch.Tensor  # (r, s, s) = I + L ⊙ mask


class XPressRefiner(CorrectionHead):
    """The xPress causal refiner R_θ: δ_k depends on tokens only through x_{<k}.

    Fuse  a_j = W_in [W_h h_j ‖ W_g g ‖ W_e[x_{j-1}]]      (g the mean of the h_j over the head's slots)
    Mix   c^(d) = (I + L^(d) ⊙ mask) a^(d)                  (per channel d, over the head's slots)
    Trans z_j = c_j + MLP(c_j)
    Read  δ_j = W_r z_j   (added to the drafter's logits, never replacing them)

    `config.refiner_form` says which function (the Jacobi solver, the training and every route are the same for both):

    * "release", the authors' code and checkpoints: the head runs over all B slots of a block. Slot 0 is the anchor,
      with the anchor's drafter state, the token before the anchor as its previous token, and an output that is no
      draft; g is the mean over all B slots. The mask is lower-triangular with its diagonal (L starts at zero, so the
      mixer starts as the identity), and the MLP is SwiGLU without biases, `down(silu(gate c) · up c)`, of width
      `config.refiner_mlp_width`.
    * "paper", eqs. (5)-(9) as printed: over the B - 1 draft positions only (g their mean), a strictly
      lower-triangular mask, and the MLP `W_2 σ(W_1 c)` (r → 2r → r, with biases).

    Tensor names are this package's; `conversion.release_head_state` maps them to the release's `xpress_head.*`.
    """

    iterative = True
    decode_name = "jacobi"

    def __init__(self, config: XPressConfig):
        super().__init__()
        r = config.refiner_rank
        self.release = config.refiner_form == "release"
        # Slots the head runs over, and how many of them precede the first draft position (the anchor's slot).
        self.offset = 1 if self.release else 0
        slots = config.num_draft_tokens + self.offset
        self.hidden_proj = nn.Linear(config.hidden_size, r, bias=False)  # W_h (release: down_h)
        self.global_proj = nn.Linear(config.hidden_size, r, bias=False)  # W_g (down_g)
        self.token_embed = TokenEmbedding(config, r)  # W_e (w1)
        self.fuse = nn.Linear(3 * r, r, bias=False)  # W_in (in_proj)
        self.mix = nn.Parameter(torch.zeros(r, slots, slots))  # L (mix.L); only its masked triangle is ever used
        if self.release:  # SwiGLU Trans (mlp.gate_proj / up_proj / down_proj)
            width = config.refiner_mlp_width
            self.gate = nn.Linear(r, width, bias=False)
            self.up = nn.Linear(r, width, bias=False)
            self.down = nn.Linear(width, r, bias=False)
        else:  # W_1, W_2 with biases
            self.gate = None
            self.up = nn.Linear(r, 2 * r)
            self.down = nn.Linear(2 * r, r)
        self.act = nn.SiLU()  # σ
        self.readout = Readout(r, config.draft_vocab_size or config.vocab_size)  # W_r (w2), over the draft vocabulary
        self.register_buffer("causal_mask", self._mask(slots), persistent=False)
        self._folded: FoldedRefiner | None = None
        self._folded_key: tuple | None = None

    def _mask(self, slots: int) -> torch.Tensor:
        return torch.tril(torch.ones(slots, slots), diagonal=0 if self.release else -1)

    def init_fresh(self) -> None:
        init.zeros_(self.mix)
        init.copy_(self.causal_mask, self._mask(self.causal_mask.shape[0]))

    def decode(self, hidden, base_logits, last_tokens, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters, early_exit=True, token_ids=None):  # fmt: skip
        """Jacobi refinement (Algorithm 1) with the folded operators: K parallel passes instead of n serial ones."""
        return jacobi_refine(
            self, hidden, base_logits, last_tokens, to_vocabulary=to_vocabulary, logits_transform=logits_transform,
            noise=noise, max_iters=max_iters, early_exit=early_exit, token_ids=token_ids,
        )  # fmt: skip

    def mix_operator(self) -> torch.Tensor:
        """(r, s, s) operator I + L ⊙ mask over the head's s slots."""
        eye = torch.eye(self.causal_mask.shape[0], device=self.mix.device, dtype=self.mix.dtype)
        return eye + self.mix * self.causal_mask.to(self.mix.dtype)

    def trans_read(self, c: torch.Tensor) -> torch.Tensor:
        """Trans + Read: (..., s, r) → δ (..., s, V)."""
        if self.gate is not None:
            z = c + self.down(self.act(self.gate(c)) * self.up(c))
        else:
            z = c + self.down(self.act(self.up(c)))
        return self.readout(z)

    def slots(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafter states the head reads: (b, p, H) over a block's p slots (anchor first) → (b, p - 1 + offset, H)."""
        return hidden if self.release else hidden[:, 1:]

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Reference (unfolded) path used in training.

        hidden: (b, p, H) drafter states of a block's p slots (anchor first); previous: (b, p) previous tokens
        `[x_-1, x_0, x_1..x_{p-2}]`. Returns δ (b, p - 1, V) of the p - 1 draft positions.
        """
        h = self.slots(hidden)
        tokens = previous[:, 1 - self.offset :]  # (b, s): the previous token of each of the head's slots
        g = h.mean(dim=1, keepdim=True).expand_as(h)  # block-global summary, (b, s, H)
        a = self.fuse(torch.cat([self.hidden_proj(h), self.global_proj(g), self.token_embed(tokens)], dim=-1))
        s = h.shape[1]
        c = torch.einsum("dkj,bjd->bkd", self.mix_operator()[:, :s, :s], a)  # (b, s, r)
        return self.trans_read(c[:, self.offset :])

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

    def prepare(self, hidden: torch.Tensor, folded: FoldedRefiner | None = None) -> torch.Tensor:
        """Token-independent part of c for a block, mixed: hidden (b, p, H) over its p slots → (b, s, r) over the
        head's slots. Computed once per block. A block of fewer slots than the head was trained on (vLLM drafts
        K + 1) uses the mix's first rows. `folded`: `self.folded()` computed by the caller (a compiled graph cannot
        consult its cache)."""
        f = folded or self.folded()
        h = self.slots(hidden)
        s = h.shape[1]
        g = h.mean(dim=1, keepdim=True)
        a_hidden = h @ f.hidden_weight.T + g @ f.global_weight.T  # (b, s, r)
        return torch.einsum("dkj,bjd->bkd", f.mix[:, :s, :s], a_hidden)

    def path_deltas(self, hidden: torch.Tensor):
        """`CorrectionHead.path_deltas` with the folded operators: the block's token-independent part once, then per
        path one table lookup, one r-space mix of its tokens and the readout of its last position."""
        prepared = self.prepare(hidden)  # (1, s, r)

        def deltas(paths: torch.Tensor) -> torch.Tensor:
            depth = paths.shape[1] - 2
            return self.delta_folded(prepared.expand(paths.shape[0], -1, -1), paths, start=depth)[:, 0]

        return deltas

    def delta_folded(self, prepared: torch.Tensor, previous: torch.Tensor, start: int = 0,
                     folded: FoldedRefiner | None = None) -> torch.Tensor:  # fmt: skip
        """δ for one Jacobi iteration from `prepare(hidden)` and the previous tokens `[x_-1, x_0, y_1..y_{m-1}]`
        (b, m + 1) of m draft positions.

        Only draft positions `start..m-1` (0-based) are computed, (b, m - start, V): by causality a position whose
        prefix did not change keeps its δ, so Jacobi recomputes just the tail after the first token that moved, and
        positions past m never enter.
        """
        f = folded or self.folded()
        tokens = previous[:, 1 - self.offset :]  # the previous token of each of the head's first m + offset slots
        rows, cols = slice(start + self.offset, tokens.shape[1]), tokens.shape[1]
        token_part = f.token_table[self.token_embed.rows(tokens)]
        c = prepared[:, rows] + torch.einsum("dkj,bjd->bkd", f.mix[:, rows, :cols], token_part)
        return self.trans_read(c)


class MarkovHead(CorrectionHead):
    """DSpark's Markov head (paper §5 baseline): δ_k = W_r W_e[x_{k-1}], a bias indexed by the previous token only.

    It is causal by construction but has no view of the drafter's hidden states, and it is decoded serially.
    """

    decode_name = "serial"

    def __init__(self, config: XPressConfig):
        super().__init__()
        self.token_embed = TokenEmbedding(config, config.refiner_rank)
        self.readout = Readout(config.refiner_rank, config.draft_vocab_size or config.vocab_size)

    def bias(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (...) → δ (..., V): the bias of the position after each token."""
        return self.readout(self.token_embed(tokens))

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """δ (b, p - 1, V) of the draft positions from their previous tokens alone (the hidden states are not read)."""
        return self.bias(previous[:, 1:])

    def path_deltas(self, hidden: torch.Tensor):
        """`CorrectionHead.path_deltas`: the bias of each path's last token."""
        return lambda paths: self.bias(paths[:, -1])

    def decode(self, hidden, base_logits, last_tokens, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters=0, early_exit=True, token_ids=None):  # fmt: skip
        """The serial decode: n dependent steps, whatever `max_iters` ≥ 1 says (`refine` never calls it with 0)."""
        return sequential_refine(self, hidden, base_logits, last_tokens, to_vocabulary=to_vocabulary,
                                 logits_transform=logits_transform, noise=noise, token_ids=token_ids)  # fmt: skip


class NoHead(CorrectionHead):
    """refiner="none": plain dFlash, every position decoded from the drafter's own marginals. No parameters."""

    corrects = False
    decode_name = "argmax"

    def __init__(self, config: XPressConfig):
        super().__init__()
        self.vocab_size = config.vocab_size

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(previous.shape[0], previous.shape[1] - 1, self.vocab_size)

    def decode(self, hidden, base_logits, last_tokens, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters=0, early_exit=True, token_ids=None):  # fmt: skip
        return plain_decode(base_logits, logits_transform=logits_transform, noise=noise, token_ids=token_ids)


def decode_block(head: CorrectionHead, hidden, base_logits, last_tokens, *, max_iters: int, early_exit: bool = True,
                 to_vocabulary=None, logits_transform=None, noise=None, token_ids=None) -> RefinementResult:  # fmt: skip
    """One block through `head`'s decode, or with `max_iters=0` through none (every head switched off the same way:
    the drafter's own marginals). The dispatch `XPressModel.refine` and the vLLM plugin share. hidden (b, p, H): the
    block's slots, anchor first; last_tokens (b, 2): the token before the anchor and the anchor."""
    if max_iters == 0:
        return plain_decode(base_logits, logits_transform=logits_transform, noise=noise, token_ids=token_ids)
    return head.decode(hidden, base_logits, last_tokens, to_vocabulary=to_vocabulary,
                       logits_transform=logits_transform, noise=noise, max_iters=max_iters, early_exit=early_exit,
                       token_ids=token_ids)  # fmt: skip


# config.refiner → head class. Adding a head is one class here and its name in configuration_xpress.REFINER_TYPES.
HEADS: dict[str, type[CorrectionHead]] = {"xpress": XPressRefiner, "markov": MarkovHead, "none": NoHead}


__all__ = ["HEADS", "CorrectionHead", "FoldedRefiner", "MarkovHead", "NoHead", "Readout", "XPressRefiner"]
