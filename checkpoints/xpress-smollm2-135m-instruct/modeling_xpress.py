"""xPress: a dFlash-layout block-diffusion drafter with a causal logit refiner (paper §4.1) or a Markov head (§5).

Shapes use: b = batch, q = block positions fed to the drafter (anchor + masks, possibly several blocks), c = new
context tokens, n = draft positions per block (`block_size - 1`), H = hidden width, r = refiner rank, V = vocabulary.

The drafter never stores the target's embedding table or lm_head: callers pass them (see `embed_blocks` and
`base_logits`). This file travels with every saved checkpoint, so it imports only torch, transformers and its
sibling files.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

from .configuration_xpress import XPressConfig
from .generation import install_generation_hook, spec_generate
from .refinement import RefinementResult, jacobi_refine, markov_decode, plain_decode


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for one tensor; x (b, heads, t, d), cos/sin (b, t, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class XPressAttention(nn.Module):
    """Qwen3 attention (QK-norm, RoPE, GQA) adapted to block diffusion.

    Deviations from `Qwen3Attention`: queries come from the block only while keys/values come from
    `[context ; block]`, and attention is not causal (the block sees itself bidirectionally and all context).
    The caller's `cache` receives the K/V of `[new context ; block]`; the caller crops the block afterwards.
    With `config.qk_norm=False` there is no q_norm/k_norm (Llama's attention), so a Llama layer loads 1:1.
    """

    def __init__(self, config: XPressConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # Absent (not identity weights) without QK-norm: the state dict then has exactly a Llama layer's tensors.
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        hidden_states: torch.Tensor,  # (b, q, H) normed block
        context: torch.Tensor | None,  # (b, c, H) projected target features, or None
        cos: torch.Tensor,  # (b, c + q, d)
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,  # bool (b, 1, q, kv) True = attend, or None = attend everywhere
        cache: Cache | None,
    ) -> torch.Tensor:
        b, q_len, _ = hidden_states.shape
        kv_input = hidden_states if context is None else torch.cat([context, hidden_states], dim=1)
        kv_len = kv_input.shape[1]
        query = self.q_proj(hidden_states).view(b, q_len, -1, self.head_dim)  # (b, q, h, d)
        key = self.k_proj(kv_input).view(b, kv_len, -1, self.head_dim)  # (b, kv, kvh, d)
        if self.q_norm is not None:  # QK-norm per head, before RoPE (Qwen3)
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # (b, h, q, d), (b, kvh, kv, d)
        value = self.v_proj(kv_input).view(b, kv_len, -1, self.head_dim).transpose(1, 2)  # (b, kvh, kv, d)
        query = _rope(query, cos[:, -q_len:], sin[:, -q_len:])
        key = _rope(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scaling,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # (b, h, q, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class XPressDecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer; the context features enter attention un-normed (they are normed once by
    `hidden_norm` in the model), exactly as in dFlash."""

    def __init__(self, config: XPressConfig, layer_idx: int):
        super().__init__()
        self.self_attn = XPressAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, cos, sin, attention_mask, cache):
        attn = self.self_attn(self.input_layernorm(hidden_states), context, cos, sin, attention_mask, cache)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


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
    off in `XPressModel.refine` (the drafter's own marginals). `decode_name` names the decode in benchmarks.
    """

    corrects: bool = True
    iterative: bool = False
    decode_name: str = ""

    def init_fresh(self) -> None:
        pass

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
        """Token-independent part of c for a block, mixed: (b, n, H) → (b, n, r). Computed once per block."""
        f = self.folded()
        g = hidden.mean(dim=1, keepdim=True)
        a_hidden = hidden @ f.hidden_weight.T + g @ f.global_weight.T  # (b, n, r)
        return torch.einsum("dkj,bjd->bkd", f.mix, a_hidden)

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

    def decode(self, hidden, base_logits, anchor_ids, *, to_vocabulary=None, logits_transform=None, noise=None,
               max_iters=0, early_exit=True, token_ids=None):  # fmt: skip
        """The serial decode: n dependent steps, whatever `max_iters` ≥ 1 says (`refine` never calls it with 0)."""
        return markov_decode(self, base_logits, anchor_ids, to_vocabulary=to_vocabulary,
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


# config.refiner → head class. Adding a head is one class here and its name in configuration_xpress.REFINER_TYPES.
HEADS: dict[str, type[CorrectionHead]] = {"xpress": XPressRefiner, "markov": MarkovHead, "none": NoHead}


class XPressPreTrainedModel(PreTrainedModel):
    config_class = XPressConfig
    base_model_prefix = "xpress"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["XPressDecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # Linear/Embedding/RMSNorm and the RoPE buffers follow transformers' defaults. Every tensor, including the
        # non-persistent buffers below, must be (re)built here: from_pretrained creates modules on the meta device.
        super()._init_weights(module)
        if isinstance(module, Readout):
            init.zeros_(module.weight)  # δ = 0: a fresh head starts as the plain drafter
        if isinstance(module, CorrectionHead):
            module.init_fresh()
        if isinstance(module, XPressModel) and module.draft_token_ids is not None:
            # a placeholder until `set_draft_vocabulary` (a loaded checkpoint brings its own ids)
            init.copy_(module.draft_token_ids, torch.arange(module.draft_token_ids.shape[0]))
        if isinstance(module, XPressModel) and module.mask_embedding is not None:
            init.normal_(module.mask_embedding, mean=0.0, std=self.config.initializer_range)


class XPressModel(XPressPreTrainedModel):
    """Block-diffusion drafter in the dFlash layout plus its correction head.

    The forward pass has the call signature of transformers' native dFlash assistants
    (`noise_embeds, context_hidden_states, position_ids, attention_mask, cache` → `.last_hidden_state`, normed), so
    `speculation_type="dflash"` runs this drafter unchanged. `draft` adds the target lm_head readout and the refiner.
    """

    def __init__(self, config: XPressConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(XPressDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # Learned mask vector, for targets without a spare embedding row (config.mask_token_id is None).
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if config.mask_token_id is None else None
        # Target token id of each draft-vocabulary row (config.draft_vocab_size), or None for the whole vocabulary.
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size))
        else:
            self.draft_token_ids = None
        self._draft_head_cache: tuple | None = None
        self.refiner = HEADS[config.refiner](config)
        # Statistics of the last `generate(assistant_model=self)` / `spec_generate` call.
        self.generation_stats = None
        self.post_init()

    # --- inputs --------------------------------------------------------------------------------------------------

    def embed_blocks(self, anchor_ids: torch.Tensor, embed_tokens: nn.Module) -> torch.Tensor:
        """Block inputs `[anchor, MASK × (B-1)]` per anchor: anchor_ids (b, m) → noise_embeds (b, m·B, H)."""
        b, m = anchor_ids.shape
        block = self.config.block_size
        anchors = embed_tokens(anchor_ids)  # (b, m, H)
        if self.mask_embedding is not None:
            masks = self.mask_embedding.to(anchors.dtype).expand(b, m, block - 1, -1)
        else:
            mask_ids = torch.full((b, m, block - 1), self.config.mask_token_id, device=anchor_ids.device)
            masks = embed_tokens(mask_ids)
        return torch.cat([anchors.unsqueeze(2), masks], dim=2).reshape(b, m * block, -1)

    def _use_own_mask(self, noise_embeds: torch.Tensor) -> torch.Tensor:
        """Put the learned mask vector at every non-anchor block position. Callers such as the native dFlash
        generator embed a mask *id*, which means nothing to a drafter that owns its mask vector."""
        if self.mask_embedding is None:
            return noise_embeds
        q = noise_embeds.shape[1]
        is_mask = (torch.arange(q, device=noise_embeds.device) % self.config.block_size != 0).view(1, q, 1)
        return torch.where(is_mask, self.mask_embedding.to(noise_embeds.dtype), noise_embeds)

    def project_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """Concatenated target features (b, c, L·H_t) → drafter context (b, c, H)."""
        expected = self.fc.in_features
        if context_hidden_states.shape[-1] != expected:
            raise ValueError(
                f"context_hidden_states has {context_hidden_states.shape[-1]} features but this drafter expects "
                f"{expected} = {len(self.config.target_layer_ids)} target layers x {self.config.target_hidden_size}. "
                "Pass the target's hidden_states[i + 1] for i in config.target_layer_ids, concatenated on the last axis."
            )
        return self.hidden_norm(self.fc(context_hidden_states))

    @staticmethod
    def _attention_mask(mask: torch.Tensor | None, q_len: int, kv_len: int) -> torch.Tensor | None:
        """Accept None, a 2-D padding mask (b, kv) of 1/0 or a boolean 4-D mask (b, 1, q, kv)."""
        if mask is None:
            return None
        if mask.dim() == 4:
            return mask.bool()
        if mask.dim() == 2:
            if bool(mask.all()):
                return None
            if mask.shape[-1] != kv_len:
                raise ValueError(f"2-D attention_mask has length {mask.shape[-1]}, expected {kv_len} (cache + inputs)")
            return mask.bool()[:, None, None, :].expand(-1, 1, q_len, -1)
        raise ValueError(f"attention_mask must be 2-D or 4-D, got shape {tuple(mask.shape)}")

    # --- drafter -------------------------------------------------------------------------------------------------

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Run the drafter on one or more blocks.

        noise_embeds: (b, q, H) target embeddings of `[anchor, MASK…]` per block. context_hidden_states: (b, c, L·H_t)
        target features of tokens not yet in `cache`. position_ids: (b, c + q). attention_mask: see
        `_attention_mask`. cache: receives K/V of `[context ; block]`; the caller crops the block afterwards.
        Returns `last_hidden_state` (b, q, H) after the final norm (what the target's lm_head reads).

        dtype: the drafter computes in its own dtype (the one it was loaded in); inputs are cast to it, and the output
        comes back in the dtype of `noise_embeds` (the target's embeddings), so a bfloat16 drafter serves a float32
        target and vice versa.
        """
        kwargs.pop("past_key_values", None)
        out_dtype, dtype = noise_embeds.dtype, self.fc.weight.dtype
        hidden = self._use_own_mask(noise_embeds.to(dtype))
        context = None
        if context_hidden_states is not None:
            context = self.project_context(context_hidden_states.to(dtype))
        new_tokens = hidden.shape[1] + (0 if context is None else context.shape[1])
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + new_tokens, device=hidden.device).unsqueeze(0)
        if position_ids.shape[-1] != new_tokens:
            raise ValueError(f"position_ids covers {position_ids.shape[-1]} tokens, expected context + block = {new_tokens}")
        past = cache.get_seq_length() if cache is not None else 0
        mask = self._attention_mask(attention_mask, hidden.shape[1], past + new_tokens)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, mask, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden).to(out_dtype), cache=cache)

    def draft_logits(
        self, last_hidden_state: torch.Tensor, lm_head: nn.Module, rows=None, positions: int | None = None
    ) -> torch.Tensor:
        """Drafter logits s_k of one block's draft positions over the draft vocabulary: (b, B, H) → (b, n, V_d)
        through the draft vocabulary's rows of the target's lm_head (all of it without a draft vocabulary). `rows`:
        `draft_readout(lm_head)` computed by the caller (a compiled graph cannot consult that cache). `positions`:
        read out only the first that many draft positions, (b, positions, V_d) — the drafts a block can verify
        (`refine` decodes them exactly as it would decode them in the whole block)."""
        # As a 2-D (b·n, H) matrix: a 3-D input that is a strided view makes `F.linear` fall back to a batched matmul
        # over a copy of the (V, H) weight per batch row. `.contiguous()` is not enough: at decode time (b = 1) the
        # view [:, 1:] already counts as contiguous, yet its stride on the size-1 batch dimension still selects that
        # path (measured, SmolLM2's 576-wide hidden, bf16, one thread: 4,096 rows 2.9 → 0.42 ms, all 49,152 rows
        # 191 → 5.6 ms). In training (b > 1) the reshape copies, which is what made the training step fast.
        hidden = last_hidden_state[:, 1:] if positions is None else last_hidden_state[:, 1 : 1 + positions]
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.draft_token_ids is None:
            logits = lm_head(flat)
        else:
            logits = F.linear(flat, *(rows if rows is not None else self.draft_readout(lm_head)))
        return logits.view(*hidden.shape[:-1], logits.shape[-1])

    def draft_readout(self, lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The lm_head's rows of the draft vocabulary (weight, bias), copied once and reused while neither changes;
        None without a draft vocabulary (the lm_head itself reads out)."""
        if self.draft_token_ids is None:
            return None
        ids, weight, bias = self.draft_token_ids, lm_head.weight, getattr(lm_head, "bias", None)
        key = (weight.data_ptr(), weight._version, weight.dtype, ids.data_ptr(), ids._version, ids.device)
        if self._draft_head_cache is None or self._draft_head_cache[0] != key:
            with torch.no_grad():
                rows = (weight.index_select(0, ids), None if bias is None else bias.index_select(0, ids))
            self._draft_head_cache = (key, rows)
        return self._draft_head_cache[1]

    def base_logits(
        self, last_hidden_state: torch.Tensor, lm_head: nn.Module, rows=None, positions: int | None = None
    ) -> torch.Tensor:
        """Drafter logits s_k for the draft positions of one block over the whole vocabulary: (b, B, H) → (b, n, V),
        -inf outside the draft vocabulary (so the drafter's q is exactly 0 there). `positions` as in `draft_logits`."""
        logits = self.draft_logits(last_hidden_state, lm_head, rows, positions)
        return self.to_vocabulary(logits, fill=float("-inf"))

    def to_vocabulary(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(..., V_d) over the draft vocabulary → (..., V) over the target's, `fill` elsewhere (identity without a
        draft vocabulary)."""
        if self.draft_token_ids is None:
            return values
        out = values.new_full((*values.shape[:-1], self.config.vocab_size), fill)
        return out.index_copy_(values.dim() - 1, self.draft_token_ids, values)

    @torch.no_grad()
    def set_draft_vocabulary(self, token_ids) -> None:
        """Store the draft vocabulary: `config.draft_vocab_size` distinct target token ids (e.g. the most frequent
        tokens of the training responses, `training.frequency_ranked_vocabulary`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if self.draft_token_ids is None:
            raise ValueError("this drafter has no draft vocabulary: build its config with draft_vocab_size=<size>")
        if ids.shape[0] != self.draft_token_ids.shape[0] or ids.unique().shape[0] != ids.shape[0]:
            raise ValueError(
                f"need {self.draft_token_ids.shape[0]} distinct token ids (config.draft_vocab_size), got {ids.shape[0]} "
                f"ids of which {ids.unique().shape[0]} distinct"
            )
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0..{self.config.vocab_size - 1}")
        self.draft_token_ids.copy_(ids.to(self.draft_token_ids.device))

    # --- refinement ----------------------------------------------------------------------------------------------

    def refine(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        *,
        logits_transform=None,
        noise: torch.Tensor | None = None,
        max_iters: int | None = None,
        early_exit: bool | None = None,
    ) -> RefinementResult:
        """Turn one block's drafter outputs into draft tokens and the distribution each was drawn from.

        hidden: (b, n, H) drafter states of the draft positions; base_logits: (b, m, V) over the whole vocabulary
        (`base_logits`) or, for a drafter with a draft vocabulary, (b, m, V_d) over it (`draft_logits`); anchor_ids:
        (b,). m ≤ n: only the first m positions are decoded (`draft_logits(..., positions=m)`), with the tokens and
        distributions they get in the whole block — every head is causal over positions, and the hidden states of
        all n positions (the xPress head's block summary reads them all) come from the one drafter pass.
        `logits_transform` maps raw logits to the processed logits a token is decoded from (temperature,
        top-k/p); `noise` is the block's fixed Gumbel noise (None → greedy), shaped like `base_logits`. xPress runs
        Jacobi iterations, the Markov head a serial decode, and `refiner="none"` decodes the drafter's marginals
        (`CorrectionHead.decode`).

        Over the draft vocabulary every iteration works on V_d-wide logits (the same distribution: q is 0 outside
        it), so pass draft logits whenever `logits_transform` treats tokens alike whatever their id (none,
        temperature, top-k, top-p: `vocabulary_local`); a processor that reads ids (repetition penalty, n-gram
        blocking) needs the whole vocabulary. Tokens are target ids and logits (b, m, V) either way.
        """
        vocabulary, draft_space = self.decoding_vocabulary(base_logits)
        max_iters = self.config.jacobi_max_iters if max_iters is None else max_iters
        if max_iters == 0:  # every head switched off the same way: the drafter's own marginals (refiner="none")
            result = plain_decode(base_logits, logits_transform=logits_transform, noise=noise,
                                  token_ids=vocabulary["token_ids"])  # fmt: skip
        else:
            result = self.refiner.decode(
                hidden,
                base_logits,
                anchor_ids,
                logits_transform=logits_transform,
                noise=noise,
                max_iters=max_iters,
                early_exit=self.config.jacobi_early_exit if early_exit is None else early_exit,
                **vocabulary,
            )
        if draft_space:
            result.logits = self.to_vocabulary(result.logits, fill=float("-inf"))
        return result

    def decoding_vocabulary(self, base_logits: torch.Tensor) -> tuple[dict, bool]:
        """How a head decodes `base_logits`: the `to_vocabulary` / `token_ids` arguments of its decode, and whether
        they are over the draft vocabulary (then q is expanded to the whole one afterwards). Shared by `refine` and
        the compiled loop's Jacobi graph."""
        if self.draft_token_ids is None:
            return {"to_vocabulary": None, "token_ids": None}, False
        if base_logits.shape[-1] == self.config.vocab_size:
            return {"to_vocabulary": self.to_vocabulary, "token_ids": None}, False
        if base_logits.shape[-1] != self.draft_token_ids.shape[0]:
            raise ValueError(
                f"base_logits must span the whole vocabulary ({self.config.vocab_size}) or the draft vocabulary "
                f"({self.draft_token_ids.shape[0]}), got {base_logits.shape[-1]}: pass xpress.base_logits(...) or "
                "xpress.draft_logits(...)"
            )
        return {"to_vocabulary": None, "token_ids": self.draft_token_ids}, True

    # --- generation ----------------------------------------------------------------------------------------------

    def spec_generate(self, target, input_ids: torch.LongTensor, **kwargs):
        """Standalone xPress speculative decoding with `target`; see `generation.spec_generate` for the arguments
        (`compile=True`: static caches and compiled fixed-shape graphs, `compiled.py`)."""
        return spec_generate(self, target, input_ids, **kwargs)

    def choose_draft_cap(self, target, **kwargs):
        """The drafts per block with the most expected tokens per second on this machine, from `config.draft_acceptance`
        and the timed products of the verifications (`draft_cap.choose_draft_cap`, a `DraftCapChoice`; its `.cap` is
        what `spec_generate(..., num_assistant_tokens="auto")` uses; pass it to `generate(..., num_assistant_tokens=)`
        as an int)."""
        from .draft_cap import choose_draft_cap

        return choose_draft_cap(self, target, **kwargs)

    # --- checkpoints ---------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """Save a self-contained Hub folder: config with `auto_map`, safetensors, the modeling code files,
        `custom_generate/generate.py`, and a model card rendered from `hub_cards/` when the package is installed."""
        self.register_for_auto_class("AutoModel")
        self.config.register_for_auto_class()
        super().save_pretrained(save_directory, *args, **kwargs)
        from .hub_files import write_hub_extras

        write_hub_extras(self, Path(save_directory))

    @classmethod
    def from_dflash(cls, path: str | os.PathLike, **overrides) -> "XPressModel":
        """Build an xPress model from a dFlash checkpoint folder (released layout, SPEC §2); the head starts fresh.

        `overrides` set config fields the dFlash config does not carry (e.g. `refiner`, `refiner_rank`, or the
        target facts `vocab_size`/`num_target_layers` when its config lacks them).
        """
        from .conversion import load_dflash

        return load_dflash(cls, path, **overrides)


# The one side effect of loading xPress, whether as the package or as a checkpoint's own code with
# trust_remote_code (both import this file before any model exists): route xPress assistants in `generate` to
# `XPressCandidateGenerator`. Idempotent and guarded; `generation.install_generation_hook` says what it changes.
install_generation_hook()


__all__ = ["XPressModel", "XPressPreTrainedModel", "CorrectionHead", "XPressRefiner", "MarkovHead", "NoHead", "HEADS"]
