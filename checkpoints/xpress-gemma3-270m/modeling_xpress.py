"""xPress: a dFlash-layout block-diffusion drafter with a causal logit refiner (paper §4.1) or a Markov head (§5).

Shapes use: b = batch, q = block positions fed to the drafter (anchor + masks, possibly several blocks), c = new
context tokens, n = draft positions per block (`block_size - 1`), H = hidden width, r = refiner rank, V = vocabulary.

The drafter never stores the target's embedding table or lm_head: callers pass them (see `embed_blocks` and
`base_logits`). This file travels with every saved checkpoint, so it imports only torch, transformers and its
sibling files.
"""

import os
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
from .decoding import spec_generate
from .generation import install_generation_hook
from .heads import HEADS, CorrectionHead, MarkovHead, NoHead, Readout, TokenEmbedding, XPressRefiner, decode_block
from .refinement import RefinementResult, scatter_vocabulary


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding for one tensor; x (b, heads, t, d), cos/sin (b, t, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class WindowMasks:
    """The masks of a drafter forward's windowed layers (`config.attention_windows`), built from token positions.

    A windowed layer's query sees the keys at positions p with `end - p < W`, where `end` is the query's own position
    or, with `config.window_anchored`, its block's anchor; with `config.window_causal` also only p <= its own position.
    (Nothing bounds the keys after a query: a non-causal window ending at the query is >= block_size, `XPressConfig`
    checks, so it sees the whole block as z-lab's and transformers' bounds do.) The keys' positions: `key_position_ids`
    when the caller gives them (a static cache, whose slots are not written in order), else the cache's `past` tokens
    just before the new ones, then the new ones (`position_ids`). One mask per window size, shared by its layers.
    """

    def __init__(self, config: XPressConfig, position_ids: torch.Tensor, q_len: int, past: int,
                 key_position_ids: torch.Tensor | None):  # fmt: skip
        self.config = config
        self.query = position_ids[:, -q_len:]  # (b, q)
        self.end = self.query
        if config.window_anchored:
            if q_len % config.block_size:
                raise ValueError(
                    f"window_anchored windows end at each block's anchor, so the drafter's input must be whole blocks "
                    f"of block_size={config.block_size} positions; got {q_len}"
                )
            self.end = self.query - torch.arange(q_len, device=position_ids.device) % config.block_size
        if key_position_ids is None:
            cached = position_ids[:, :1] - past + torch.arange(past, device=position_ids.device)  # (b, past)
            key_position_ids = torch.cat([cached, position_ids], dim=1)
        self.keys = key_position_ids  # (b, kv)
        self.built: dict[int, torch.Tensor] = {}

    def __call__(self, window: int, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The window's mask (b, 1, q, kv), True = attend, and'ed with the caller's `attention_mask`."""
        if window not in self.built:
            keys = self.keys[:, None, :]  # (b, 1, kv)
            visible = self.end[..., None] - keys < window  # (b, q, kv)
            if self.config.window_causal:
                visible &= keys <= self.query[..., None]
            self.built[window] = visible.unsqueeze(1)
        mask = self.built[window]
        return mask if attention_mask is None else mask & attention_mask


class XPressAttention(nn.Module):
    """Qwen3 attention (QK-norm, RoPE, GQA) adapted to block diffusion.

    Deviations from `Qwen3Attention`: queries come from the block only while keys/values come from
    `[context ; block]`, and attention is not causal (the block sees itself bidirectionally and all context), except in
    a windowed layer (`config.attention_windows`, `WindowMasks`).
    The caller's `cache` receives the K/V of `[new context ; block]`; the caller crops the block afterwards.
    With `config.qk_norm=False` there is no q_norm/k_norm (Llama's attention), so a Llama layer loads 1:1.
    """

    def __init__(self, config: XPressConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.window = None if config.attention_windows is None else config.attention_windows[layer_idx]
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
        windows: WindowMasks | None = None,  # the forward's window masks (only a windowed layer reads them)
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
        if self.window is not None:
            attention_mask = windows(self.window, attention_mask)
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

    def forward(self, hidden_states, context, cos, sin, attention_mask, cache, windows=None):
        attn = self.self_attn(self.input_layernorm(hidden_states), context, cos, sin, attention_mask, cache, windows)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def check_draft_token_ids(ids: torch.Tensor, size: int, vocab_size: int, where: str = "draft vocabulary") -> None:
    """A draft vocabulary is `size` distinct target ids in 0..vocab_size - 1: a ValueError naming what is wrong.
    Duplicates are not harmless: the drafter's q of a repeated token is split over its rows, while the token is drawn
    with their summed probability, so sampling would lose losslessness without any error."""
    ids = ids.flatten()
    if ids.shape[0] != size:
        raise ValueError(f"{where}: need {size} token ids (config.draft_vocab_size), got {ids.shape[0]}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(
            f"{where}: ids {bad[:8].tolist()} are outside the target vocabulary (0..{vocab_size - 1}); rebuild it "
            "with training.frequency_ranked_vocabulary and set it with xpress.set_draft_vocabulary(ids)"
        )
    unique, counts = ids.unique(return_counts=True)
    if unique.shape[0] != ids.shape[0]:
        raise ValueError(
            f"{where}: need {size} distinct token ids, got duplicate ids {unique[counts > 1][:8].tolist()} "
            f"({unique.shape[0]} distinct); rebuild it and set it with xpress.set_draft_vocabulary(ids)"
        )


def check_loaded_tensors(model: "XPressModel", info: dict) -> None:
    """A checkpoint whose tensors do not fit the model its config describes would run with some of them at fresh
    values, a different function that verification cannot see: a ValueError instead, saying what it holds."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    mismatched = sorted(str(entry[0]) for entry in info.get("mismatched_keys", ()))
    if not (missing or unexpected or mismatched):
        return
    config = model.config
    hint = ""
    if any(k.endswith(("up.bias", "down.bias")) for k in unexpected) and config.refiner_form == "release":
        hint = (
            ' Its head tensors are those of the "paper" form of the xPress head (checkpoints saved before '
            '`refiner_form` existed): add "refiner_form": "paper" to its config.json, or pass refiner_form="paper" '
            "to from_pretrained."
        )
    raise ValueError(
        f"The checkpoint's tensors do not fit its config (refiner={config.refiner!r}, refiner_form="
        f"{config.refiner_form!r}, refiner_rank={config.refiner_rank}): missing {missing[:6]}, unexpected "
        f"{unexpected[:6]}, wrong shape {mismatched[:6]}.{hint} Tensors left at fresh values would make a different "
        "function."
    )


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
        if isinstance(module, XPressModel):
            module.sync_head_vocabulary()  # after its children (transformers initialises them first)
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
        # a state dict brings draft_token_ids: the head's draft-vocabulary token table follows them
        self.register_load_state_dict_post_hook(lambda module, _keys: module.sync_head_vocabulary())
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
        key_position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Run the drafter on one or more blocks.

        noise_embeds: (b, q, H) target embeddings of `[anchor, MASK…]` per block. context_hidden_states: (b, c, L·H_t)
        target features of tokens not yet in `cache`. position_ids: (b, c + q). attention_mask: see
        `_attention_mask`. cache: receives K/V of `[context ; block]`; the caller crops the block afterwards.
        key_position_ids: (b, kv) the position of every key after the cache update, for windowed layers
        (`config.attention_windows`) over a cache that is not written in order (a static cache); by default the cache
        holds the tokens just before the new ones.
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
        windows = None
        if self.config.attention_windows is not None:
            windows = WindowMasks(self.config, position_ids, hidden.shape[1], past, key_position_ids)
        cos, sin = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, mask, cache, windows)
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
            if self._draft_head_cache is None or self._draft_head_cache[0][3:] != key[3:]:  # new or changed ids
                check_draft_token_ids(ids, self.config.draft_vocab_size, lm_head.weight.shape[0])
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
        return scatter_vocabulary(values, self.draft_token_ids, self.config.vocab_size, fill)

    @torch.no_grad()
    def set_draft_vocabulary(self, token_ids) -> None:
        """Store the draft vocabulary: `config.draft_vocab_size` distinct target token ids (e.g. the most frequent
        tokens of the training responses, `training.frequency_ranked_vocabulary`)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if self.draft_token_ids is None:
            raise ValueError("this drafter has no draft vocabulary: build its config with draft_vocab_size=<size>")
        check_draft_token_ids(ids, self.config.draft_vocab_size, self.config.vocab_size)
        self.draft_token_ids.copy_(ids.to(self.draft_token_ids.device))
        self.sync_head_vocabulary()

    @torch.no_grad()
    def compact_token_table(self) -> None:
        """Shrink the head's token table to the draft vocabulary (`config.refiner_token_vocab = "draft"`), in place:
        row k is the old row of `draft_token_ids[k]`, the shared last row the mean of the rows of every other token.
        Drafts are draft-vocabulary tokens, so the head's function changes only where a block's anchor or the token
        before it lies outside the draft vocabulary; measure the checkpoint again after compacting it."""
        embed = getattr(self.refiner, "token_embed", None)
        if embed is None or self.draft_token_ids is None or self.config.refiner_token_vocab == "draft":
            raise ValueError(
                "compact_token_table needs a head with a token table (refiner xpress or markov), a draft vocabulary "
                f"and a full table; this model has refiner={self.config.refiner!r}, draft_vocab_size="
                f"{self.config.draft_vocab_size}, refiner_token_vocab={self.config.refiner_token_vocab!r}"
            )
        ids = self.draft_token_ids
        others = torch.ones(embed.num_embeddings, dtype=torch.bool, device=ids.device).index_fill_(0, ids, False)
        self.config.refiner_token_vocab = "draft"
        compact = TokenEmbedding(self.config, embed.embedding_dim).to(embed.weight.device, embed.weight.dtype)
        shared = embed.weight[others].float().mean(dim=0).to(embed.weight.dtype)
        compact.weight.copy_(torch.cat([embed.weight[ids], shared[None]]))
        self.refiner.token_embed = compact
        self.sync_head_vocabulary()

    def sync_head_vocabulary(self) -> None:
        """Point a head's draft-vocabulary token table (`config.refiner_token_vocab == "draft"`) at `draft_token_ids`."""
        if self.draft_token_ids is not None:
            self.refiner.set_token_vocabulary(self.draft_token_ids)

    # --- refinement ----------------------------------------------------------------------------------------------

    def refine(
        self,
        hidden: torch.Tensor,
        base_logits: torch.Tensor,
        last_tokens: torch.Tensor,
        *,
        logits_transform=None,
        noise: torch.Tensor | None = None,
        max_iters: int | None = None,
        early_exit: bool | None = None,
    ) -> RefinementResult:
        """Turn one block's drafter outputs into draft tokens and the distribution each was drawn from.

        hidden: (b, B, H) the drafter's last hidden states of the block's slots, the anchor's first (what `forward`
        returns for one block); base_logits: (b, m, V) over the whole vocabulary (`base_logits`) or, for a drafter
        with a draft vocabulary, (b, m, V_d) over it (`draft_logits`); last_tokens: (b, 2) the block's last two
        committed tokens, the one before the anchor and the anchor (the head's previous tokens of the anchor's and
        the first draft's slots). m ≤ B - 1: only the first m draft positions are decoded (`draft_logits(...,
        positions=m)`), with the tokens and distributions they get in the whole block — every head is causal over
        positions, and the hidden states of every slot (the xPress head's block summary reads them all) come from
        the one drafter pass. `logits_transform` maps raw logits to the processed logits a token is decoded from
        (temperature, top-k/p); `noise` is the block's fixed Gumbel noise (None → greedy), shaped like
        `base_logits`. xPress runs Jacobi iterations, the Markov head a serial decode, and `refiner="none"` decodes
        the drafter's marginals (`CorrectionHead.decode`).

        Over the draft vocabulary every iteration works on V_d-wide logits (the same distribution: q is 0 outside
        it), so pass draft logits whenever `logits_transform` treats tokens alike whatever their id (none,
        temperature, top-k, top-p: `vocabulary_local`); a processor that reads ids (repetition penalty, n-gram
        blocking) needs the whole vocabulary. Tokens are target ids and logits (b, m, V) either way.
        """
        if last_tokens.dim() != 2 or last_tokens.shape[-1] != 2:
            raise ValueError(
                f"last_tokens must be (batch, 2): the token before the anchor and the anchor, got shape "
                f"{tuple(last_tokens.shape)}"
            )
        vocabulary, draft_space = self.decoding_vocabulary(base_logits)
        result = decode_block(
            self.refiner,
            hidden,
            base_logits,
            last_tokens,
            logits_transform=logits_transform,
            noise=noise,
            max_iters=self.config.jacobi_max_iters if max_iters is None else max_iters,
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

    def choose_draft_shape(self, target, **kwargs):
        """A draft tree's node budget, or linear blocks (None), with the most expected tokens per second on this
        machine, from `config.tree_acceptance` and the timed costs (`draft_cap.choose_draft_shape`; its `.tree_nodes`
        is what `spec_generate(..., tree_nodes="auto")` uses)."""
        from .draft_cap import choose_draft_shape

        return choose_draft_shape(self, target, **kwargs)

    # --- checkpoints ---------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained` for a folder or Hub repo id, then two checks. Tensors that do not fit the
        config's model are refused (`check_loaded_tensors`). The stored draft vocabulary is checked
        (`check_draft_token_ids`): a folder whose `draft_token_ids` repeat an id would draft that token with the wrong
        probability, which verification cannot see, so it is refused here instead.

        An xPress release serving folder of the authors (`conversion.RELEASE_ARCHITECTURE`) loads too, by path or Hub
        id, with its drafter and its head (`conversion.load_xpress_release`); `dtype=` and config fields as keywords
        (e.g. `jacobi_max_iters=`) apply, as do the Hub arguments (`revision`, `cache_dir`, `token`, ...)."""
        from .conversion import release_folder

        release = release_folder(cls, pretrained_model_name_or_path, kwargs)
        if release is not None:
            return release
        want_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("ignore_mismatched_sizes", True)  # refused below, with what the checkpoint holds
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        check_loaded_tensors(model, info)
        loaded = (model, info) if want_info else model
        if model.draft_token_ids is not None:
            check_draft_token_ids(model.draft_token_ids, model.config.draft_vocab_size, model.config.vocab_size,
                                  where="the checkpoint's draft_token_ids")  # fmt: skip
            model.sync_head_vocabulary()  # the ids were loaded after the head's table was initialised
        return loaded

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """Save a self-contained Hub folder: config with `auto_map`, safetensors, the modeling code files,
        `custom_generate/generate.py`, and a model card rendered from `hub_cards/` when the package is installed."""
        self.register_for_auto_class("AutoModel")
        self.config.register_for_auto_class()
        super().save_pretrained(save_directory, *args, **kwargs)
        from .hub_files import write_hub_extras

        write_hub_extras(self, Path(save_directory))

    @classmethod
    def from_dflash(cls, path: str | os.PathLike, *, dtype=None, **overrides) -> "XPressModel":
        """Build an xPress model from a released dFlash drafter: a folder or Hub repo id in z-lab's layout,
        transformers' native assistant's or speculators' DFlash format (`conversion.load_dflash`); the head starts
        fresh (δ = 0).

        `dtype` as in `from_pretrained` (default: the folder's own). Hub keywords (`revision`, `cache_dir`, `token`,
        `local_files_only`, ...) go to the download; other `overrides` set config fields the dFlash config does not
        carry (e.g. `refiner`, `refiner_rank`, or `num_target_layers` when its config lacks it).
        """
        from .conversion import load_dflash

        return load_dflash(cls, path, dtype=dtype, **overrides)


# The one side effect of loading xPress, whether as the package or as a checkpoint's own code with
# trust_remote_code (both import this file before any model exists): route xPress assistants in `generate` to
# `XPressCandidateGenerator`. Idempotent and guarded; `generation.install_generation_hook` says what it changes.
install_generation_hook()


__all__ = ["XPressModel", "XPressPreTrainedModel", "CorrectionHead", "XPressRefiner", "MarkovHead", "NoHead", "HEADS"]
