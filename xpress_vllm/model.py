"""An xPress checkpoint as a vLLM dFlash drafter: vLLM's own dFlash layers, plus what an xPress drafter differs in.

* **Attention without QK-norm** where the checkpoint has none (`qk_norm=False`: a Llama-style drafter, such as the
  bundled SmolLM2 one). vLLM's dFlash attention always normalises queries and keys; here both norms are identities,
  for the block's queries and keys and for the context keys vLLM precomputes.
* **A learned mask vector** (`mask_token_id=None`): mask slots carry an id no token has (`XPressVLLMConfig`), and
  `embed_input_ids` puts the vector there.
* **Gemma's embedding scale**: vLLM hands the drafter the target's `embed_tokens` table, and its Gemma-3 applies the
  √H scale outside that module; `embed_input_ids` applies it as transformers' Gemma-3 embedding does (training).
* **A draft vocabulary**: the readout takes the draft vocabulary's rows of the target's own lm_head (vLLM shares the
  target's lm_head with a drafter that has none), as `XPressModel.draft_logits` does.
* **The correction head** (`config.refiner`), applied to every proposal by `draft`, which `proposer` calls in place
  of vLLM's per-position sampling.

The checkpoint is read as saved by `XPressModel.save_pretrained`, or as the xPress authors' release serving folders
are (`Qwen3XPressModel`: a dFlash config and `xpress_head.*` tensors, `modeling_xpress.conversion`); nothing is
converted on disk.
"""

import json
from pathlib import Path

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

from modeling_xpress.configuration_xpress import XPressConfig
from modeling_xpress.conversion import RELEASE_HEAD_PREFIX, is_release_config, release_config_to_xpress, release_head_state
from modeling_xpress.heads import HEADS
from modeling_xpress.modeling_xpress import check_draft_token_ids
from modeling_xpress.refinement import scatter_vocabulary

from . import check_vllm_version
from .refine import refine_proposals


class NoQKNorm(nn.Module):
    """Stands where vLLM's dFlash attention expects a per-head RMSNorm, for a drafter trained without one. It keeps
    the attributes vLLM's fused context-K/V precompute reads (`weight`, `variance_epsilon`); the model skips that
    norm itself (`XPressDFlashModel._normalize_context_k`)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.variance_epsilon = eps
        self.register_buffer("weight", torch.ones(head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class XPressDFlashModel(DFlashQwen3Model):
    """vLLM's dFlash drafter layers with an xPress checkpoint's attention (QK-norm or not), mask vector and the
    target's embedding scale."""

    def __init__(self, *, vllm_config: VllmConfig, start_layer_id: int = 0, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        self.embed_scale = target_embedding_scale(vllm_config.model_config.hf_config)
        self.qk_norm = bool(getattr(self.config, "qk_norm", True))
        if not self.qk_norm:
            for layer in self.layers:
                attn = layer.self_attn
                eps = attn.q_norm.variance_epsilon
                attn.q_norm, attn.k_norm = NoQKNorm(attn.head_dim, eps), NoQKNorm(attn.head_dim, eps)

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        return super()._normalize_context_k(all_k) if self.qk_norm else all_k

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The block's input embeddings as `XPressModel.embed_blocks` makes them: tokens (a mask id included) through
        the target's embedding, with its scale; the learned mask vector as it is."""
        is_mask = input_ids == self.mask_token_id if self.has_separate_mask_embedding else None
        # The mask id may lie past the embedding table (a drafter with its own mask vector): embed a real id there.
        embeds = self.embed_tokens(input_ids if is_mask is None else torch.where(is_mask, 0, input_ids))
        if self.embed_scale is not None:  # as Gemma3TextScaledWordEmbedding: the scale rounded to the table's dtype
            embeds = embeds * embeds.new_tensor(self.embed_scale)
        if is_mask is None:
            return embeds
        return torch.where(is_mask.unsqueeze(-1), self.mask_embedding.to(embeds.dtype), embeds)


def xpress_config(model: str, revision: str | None) -> XPressConfig:
    """The `XPressConfig` of a draft checkpoint (a folder or Hub id): an xPress folder's own, or the one a release
    serving folder's dFlash config and `xpress_*` fields describe."""
    from transformers.utils import cached_file

    raw = json.loads(Path(cached_file(model, "config.json", revision=revision)).read_text())
    if is_release_config(raw):
        return release_config_to_xpress(raw)
    return XPressConfig.from_pretrained(model, revision=revision)


# Targets whose models scale token embeddings by √H inside the model (transformers: `Gemma3TextScaledWordEmbedding`;
# vLLM: the `normalizer` its Gemma models apply in `embed_input_ids`, outside the `embed_tokens` module).
SCALED_EMBEDDING_TARGETS = ("gemma", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text")
# Those of them xpress_vllm serves: vLLM's Gemma3ForCausalLM, given hidden states by `gemma3.Gemma3ForCausalLMWithAux`.
SERVED_SCALED_TARGETS = ("gemma3_text",)


def target_embedding_scale(hf_config) -> float | None:
    """The factor a target's model applies to its token embeddings (√hidden_size for Gemma), rounded to float32 as
    transformers' buffer holds it; None for a target whose embedding table is its input embedding."""
    if getattr(hf_config.get_text_config(), "model_type", None) not in SCALED_EMBEDDING_TARGETS:
        return None
    return float(torch.tensor(hf_config.get_text_config().hidden_size**0.5, dtype=torch.float32))


def check_served_target(hf_config) -> None:
    """A ValueError for a target vLLM 0.32's dFlash path cannot serve an xPress drafter with (docs/vllm.md).

    A Gemma-3 text target (`gemma3_text`: Gemma-3 270M, 1B) is served: `register` gives vLLM's `Gemma3ForCausalLM`
    the hidden-state outputs a dFlash drafter reads (`gemma3.py`), and the drafter applies Gemma's √H embedding
    scale itself (`XPressDFlashModel.embed_input_ids`). Other Gemma models are refused: vLLM's Gemma, Gemma 2,
    Gemma-3n and multimodal Gemma-3 (`Gemma3ForConditionalGeneration`) do not implement `SupportsEagle3`, so the
    model runner raises for any dFlash drafter, and none of them is given the outputs here."""
    kinds = {getattr(hf_config, "model_type", None), getattr(hf_config.get_text_config(), "model_type", None)} - {None}
    if kinds & set(SCALED_EMBEDDING_TARGETS) and not kinds <= set(SERVED_SCALED_TARGETS):
        raise ValueError(
            f"xpress_vllm serves Gemma-3 text models (model_type 'gemma3_text', such as Gemma-3 270M and 1B) but not "
            f"a {sorted(kinds)} target: vLLM 0.32's model for it gives a dFlash drafter no intermediate hidden states "
            "(no SupportsEagle3). Decode with transformers instead: xpress.spec_generate(target, input_ids, "
            "compile=True) or target.generate(..., assistant_model=xpress)."
        )


class XPressDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's dFlash drafter class for an xPress checkpoint (architecture `XPressModel`, or a release's
    `Qwen3XPressModel`)."""

    model_cls = XPressDFlashModel

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_vllm_version()
        if get_tensor_model_parallel_world_size() > 1:
            raise NotImplementedError(
                "xpress_vllm is tested with tensor_parallel_size=1 only (the draft-vocabulary readout gathers rows of "
                "an unsharded lm_head). Serve with --tensor-parallel-size 1, or use vLLM's own dFlash drafter."
            )
        spec = vllm_config.speculative_config
        source = spec.draft_model_config
        config = xpress_config(source.model, source.revision)
        config.check_target(vllm_config.model_config.hf_config)
        check_served_target(vllm_config.model_config.hf_config)
        if max(config.target_layer_ids) >= config.num_target_layers - 1:
            raise ValueError(
                f"target_layer_ids {config.target_layer_ids}: vLLM reads a target layer's output at the next layer's "
                f"input, so the last layer ({config.num_target_layers - 1}) cannot be one of them. Serve this "
                "checkpoint with transformers, or train a drafter on earlier layers."
            )
        if any(w is not None for w in config.attention_windows or []):
            raise ValueError(
                f"This xPress drafter has sliding-window layers (attention_windows={config.attention_windows}), which "
                "xpress_vllm does not pass to vLLM's dFlash layers. Serve it with transformers, or serve its drafter "
                "without the head through vLLM's own dFlash support: write it with "
                "modeling_xpress.conversion.write_dflash_checkpoint and pass that folder."
            )
        if spec.num_speculative_tokens > config.num_draft_tokens:
            raise ValueError(
                f"num_speculative_tokens={spec.num_speculative_tokens}, but this xPress drafter drafts blocks of "
                f"{config.block_size} (at most {config.num_draft_tokens} draft tokens). Pass num_speculative_tokens "
                f"<= {config.num_draft_tokens}."
            )
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.xpress_config = config
        self.draft_id_to_target_id = None  # the draft vocabulary is `draft_token_ids`, read from the checkpoint
        self.refiner = HEADS[self.xpress_config.refiner](self.xpress_config)
        size = self.xpress_config.draft_vocab_size
        self.register_buffer("draft_token_ids", torch.arange(size) if size else None, persistent=False)
        self._readout_rows: tuple[tuple, torch.Tensor] | None = None

    # --- weights -------------------------------------------------------------------------------------------------

    def _read_mask_embedding(self) -> torch.Tensor | None:
        return None  # an xPress checkpoint stores its mask vector in model.safetensors (`load_weights`)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        head, release, drafter, mask_vector, vocabulary = {}, {}, [], None, None
        for name, tensor in weights:
            if name.startswith("refiner."):
                head[name.removeprefix("refiner.")] = tensor
            elif name.startswith(RELEASE_HEAD_PREFIX):  # a release folder's head, in the authors' names
                release[name] = tensor
            elif name == "draft_token_ids":
                vocabulary = tensor
            elif name == "mask_embedding":
                mask_vector = tensor
            else:
                drafter.append((name, tensor))
        if (mask_vector is None) != (self.xpress_config.mask_token_id is not None):
            raise ValueError(
                "The checkpoint's mask_embedding does not match its config (a learned mask vector exactly when "
                "mask_token_id is null); re-save it with XPressModel.save_pretrained."
            )
        if mask_vector is not None:
            self.model.has_separate_mask_embedding = True
            drafter.append(("mask_embedding", mask_vector))
        if self.draft_token_ids is not None:
            if vocabulary is None:
                raise ValueError("The checkpoint has draft_vocab_size set but stores no draft_token_ids")
            check_draft_token_ids(vocabulary, self.xpress_config.draft_vocab_size, self.xpress_config.vocab_size)
            self.draft_token_ids.copy_(vocabulary.to(self.draft_token_ids.device))
        if release:
            head.update({k.removeprefix("refiner."): v for k, v in release_head_state(release).items()})
        self.refiner.load_state_dict(head, strict=True)
        if self.draft_token_ids is not None:  # a draft-vocabulary token table follows the ids
            self.refiner.set_token_vocabulary(self.draft_token_ids)
        super().load_weights(drafter)

    # --- readout and drafting ------------------------------------------------------------------------------------

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter logits (N, V_d) over the draft vocabulary (the whole vocabulary without one) for hidden (N, H),
        through the target's lm_head (vLLM shares it: an xPress checkpoint has none of its own)."""
        weight = self.lm_head.weight  # vLLM pads its rows to a multiple of 64: read the real vocabulary only
        if self.draft_token_ids is None:
            return F.linear(hidden.to(weight.dtype), weight[: self.xpress_config.vocab_size])
        key = (weight.data_ptr(), weight._version, weight.dtype)
        if self._readout_rows is None or self._readout_rows[0] != key:
            self._readout_rows = (key, weight.index_select(0, self.draft_token_ids))
        return F.linear(hidden.to(weight.dtype), self._readout_rows[1])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The drafter's own logits over the target vocabulary (-inf outside the draft vocabulary), before the head."""
        return scatter_vocabulary(self.draft_logits(hidden_states), self.draft_token_ids, self.xpress_config.vocab_size,
                                  fill=float("-inf"))  # fmt: skip

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None):
        """vLLM's drafter forward; its output, every query slot's state (the anchor's included), is kept for `draft`:
        vLLM hands the proposer's token choice the draft slots' states only, and the head reads the anchor's too."""
        out = super().forward(input_ids, positions, inputs_embeds)
        self.query_hidden_states = out
        return out

    def draft(self, hidden: torch.Tensor, last_tokens: torch.Tensor, temperature: torch.Tensor | None,
              noise_seeds: dict[int, int] | None = None):
        """Each request's proposal from its block's drafter states (b, K + 1, H), the anchor's first, and its last two
        committed tokens (b, 2), the token before the anchor and the anchor: `refine.refine_proposals`."""
        b, slots, width = hidden.shape
        base = self.draft_logits(hidden[:, 1:].reshape(b * (slots - 1), width)).view(b, slots - 1, -1)
        return refine_proposals(self.refiner, self.xpress_config, hidden, base, last_tokens, self.draft_token_ids,
                                temperature, noise_seeds=noise_seeds)  # fmt: skip


__all__ = ["XPressDFlashForCausalLM", "XPressDFlashModel"]
