"""Configuration of an xPress checkpoint: a dFlash-layout block-diffusion drafter plus its causal refiner.

The config is the single source of truth for everything the drafter, the refiner, the generation loop and the
training code need to know. Fields are flat and documented where they are declared; `__post_init__` validates them
and names the bad value. Target-dependent fields are best derived with `XPressConfig.from_target_config`.

This file travels with every saved checkpoint, so it imports only torch/transformers.
"""

import math
import numbers
from typing import Any

from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

# Heads a config can name; `modeling_xpress.HEADS` maps each to its class.
REFINER_TYPES = ("xpress", "markov", "none")
# The function the xPress head computes (`refiner_form`): "release", the authors' released code and checkpoints, or
# "paper", the equations (5)-(9) of arXiv 2608.02438 as printed (`heads.XPressRefiner` says where they differ).
REFINER_FORMS = ("release", "paper")
# The rows of a head's token table (`refiner_token_vocab`): one per target token, or one per draft-vocabulary token
# and one shared by every other token.
REFINER_TOKEN_VOCABS = ("full", "draft")
# RoPE base of a config that does not name one (Qwen3's).
DEFAULT_ROPE_THETA = 1_000_000.0
# Whether a target family's attention RMS-normalises each query/key head before RoPE (Qwen3's QK-norm), by the
# target config's `model_type`. A config cannot see modules, and these families have no config field for it (the
# modules are hard-wired per family), so `model_type` is what a config says about it. Families not listed
# keep the default (`qk_norm=True`, dFlash's Qwen3 layout); these are also the families whose decoder layers
# `modeling_xpress.training.target_init` can copy into the drafter (it checks the modules themselves).
TARGET_QK_NORM = {"qwen3": True, "llama": False, "mistral": False}
# Fields that must hold whole numbers (a float such as 2.5 would be truncated, or fail deep inside torch, later).
_INTEGER_FIELDS = (
    "vocab_size", "target_hidden_size", "num_target_layers", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "block_size", "refiner_rank",
    "jacobi_max_iters",
)
_OPTIONAL_INTEGER_FIELDS = ("refiner_mlp_hidden",)  # fmt: skip


def is_integer(value) -> bool:
    """A whole number (Python, numpy, ...), not a float and not a bool: what every integer setting must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_tree_acceptance(acceptance) -> dict[int, float]:
    """`acceptance` as {N: τ_N} with int N >= 1 (JSON's string keys read back) and τ_N >= 1 tokens per verification,
    non-decreasing in N (a best-first tree of N nodes holds the tree of fewer), or a ValueError naming it."""
    def budget(n) -> int:  # JSON keys are strings
        if isinstance(n, str) and n.strip().isdigit():
            return int(n)
        if is_integer(n):
            return int(n)
        raise ValueError(n)

    try:
        values = {budget(n): float(tau) for n, tau in dict(acceptance).items()}
        valid = bool(values) and all(n >= 1 and math.isfinite(t) and t >= 1 for n, t in values.items())
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(
            f"tree_acceptance must map node budgets N (integers >= 1) to measured tokens per verification (>= 1), "
            f"e.g. {{4: 2.4, 8: 2.8}}; got {acceptance!r}"
        )
    budgets = sorted(values)
    falling = [b for a, b in zip(budgets, budgets[1:]) if values[b] < values[a]]
    if falling:
        raise ValueError(
            f"tree_acceptance must not decrease with N (a tree of more nodes holds the smaller one), but N={falling[0]} "
            f"has less than a smaller budget in {acceptance!r}: measure it with examples/tree_benchmark.py"
        )
    return {n: values[n] for n in budgets}


def check_acceptance(acceptance, block_size: int) -> list[float]:
    """`acceptance` as a list of floats s_1..s_n (n <= block_size - 1, each in [0, 1], non-increasing: s_k is the
    fraction of blocks whose first k drafts are accepted, so it cannot grow with k), or a ValueError naming it."""
    values = list(acceptance) if isinstance(acceptance, (list, tuple)) else None
    if not values or len(values) > block_size - 1 or not all(is_real(s) and 0 <= s <= 1 for s in values):
        raise ValueError(
            f"draft_acceptance must be a non-empty list of at most {block_size - 1} (block_size - 1) fractions in "
            f"[0, 1], entry k - 1 the fraction of blocks whose first k drafts are accepted; got {acceptance!r}"
        )
    rising = [k for k in range(1, len(values)) if values[k] > values[k - 1]]
    if rising:
        raise ValueError(
            f"draft_acceptance must be non-increasing (entry k - 1 is the fraction of blocks whose first k drafts are "
            f"accepted, which cannot grow with k), but entry {rising[0]} ({values[rising[0]]}) exceeds entry "
            f"{rising[0] - 1} ({values[rising[0] - 1]}) in {acceptance!r}: measure it with "
            "draft_cap.acceptance_from_blocks (examples/choose_draft_length.py)"
        )
    return [float(s) for s in values]


def single_rope(rope_parameters: dict | None) -> dict | None:
    """One RoPE for every drafter layer from a target's `rope_parameters`. A target whose kinds of layer have their
    own (Gemma 3: `{"full_attention": θ 1e6, "sliding_attention": θ 1e4}`) gives its full-attention layers' RoPE: the
    drafter's layers attend to the whole context, as those do (kept whole, the per-kind dict is no RoPE transformers'
    rope code reads: it warns "Unrecognized keys" and falls back to the default base)."""
    if not rope_parameters:
        return None
    rope = dict(rope_parameters)
    if "full_attention" in rope and isinstance(rope["full_attention"], dict):
        return dict(rope["full_attention"])
    return rope


def decoder_layer_fields(text_config: PreTrainedConfig) -> dict:
    """The `XPressConfig` fields a transformers decoder config gives about its decoder layers (widths, heads, norm eps,
    activation, attention bias, RoPE, positions) and its special tokens; None where it says nothing. A target's
    (`XPressConfig.from_target_config`) or a dFlash drafter's own (`dflash_formats`)."""
    heads = text_config.num_attention_heads
    return dict(
        hidden_size=text_config.hidden_size,
        intermediate_size=text_config.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        rms_norm_eps=getattr(text_config, "rms_norm_eps", None),
        hidden_act=getattr(text_config, "hidden_act", None),
        attention_bias=getattr(text_config, "attention_bias", None),
        max_position_embeddings=getattr(text_config, "max_position_embeddings", None),
        rope_parameters=single_rope(getattr(text_config, "rope_parameters", None)),
        bos_token_id=getattr(text_config, "bos_token_id", None),
        eos_token_id=getattr(text_config, "eos_token_id", None),
        pad_token_id=getattr(text_config, "pad_token_id", None),
    )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dFlash's rule for which target layers feed the drafter's context.

    One drafter layer reads the middle target layer; otherwise the layers are spread evenly over
    `[1, L - 3]`, e.g. Qwen3-8B (36 layers) with 5 drafter layers gives `[1, 9, 17, 25, 33]`.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(
            f"need at least one target and one drafter layer, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}"
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    ids = [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
    # Tiny targets (L < 5) would round outside the stack: clamp to valid layer indices.
    return [min(max(i, 0), num_target_layers - 1) for i in ids]


class XPressConfig(PreTrainedConfig):
    r"""
    Configuration for [`XPressModel`]: a block-diffusion drafter (Qwen3-style decoder layers that attend to the
    target's hidden states) and a causal logit refiner on top of it.

    The drafter borrows the target's input embedding table and `lm_head` at call time, so its `hidden_size` must
    equal the target's. Use [`XPressConfig.from_target_config`] to fill every target-dependent field from the target's
    own config.

    Example:

    ```python
    >>> from transformers import AutoConfig
    >>> from modeling_xpress import XPressConfig, XPressModel
    >>> target_config = AutoConfig.from_pretrained("Qwen/Qwen3-8B")
    >>> config = XPressConfig.from_target_config(target_config, num_hidden_layers=5, mask_token_id=151669)
    >>> model = XPressModel(config)
    ```
    """

    model_type = "xpress"
    keys_to_ignore_at_inference = ["past_key_values"]
    default_theta = DEFAULT_ROPE_THETA  # the RoPE base transformers' `rope_parameters` rule fills in when none is given

    # --- target facts -------------------------------------------------------------------------------------------
    # Size of the target's vocabulary (rows of its input embedding table / lm_head).
    vocab_size: int = 151936
    # Width of the target's hidden states; the drafter works at this width because it reads the target's embeddings
    # and its lm_head reads the drafter's output.
    target_hidden_size: int = 4096
    # Number of decoder layers in the target.
    num_target_layers: int = 36
    # Target layers whose hidden states form the drafter's context (0-based decoder layer index; the transformers
    # `hidden_states` tuple index is `i + 1`). None → dFlash's default rule (`default_target_layer_ids`).
    target_layer_ids: list[int] | None = None
    # The target's special tokens: transformers' assisted decoding and pipelines compare them to decide whether the
    # assistant shares the target's tokenizer.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Hub repo id or path the target was loaded from (its config's `name_or_path`); names the target in model cards.
    target_model_name: str | None = None

    # --- drafter architecture (Qwen3 decoder layers) ------------------------------------------------------------
    # Drafter hidden width; must equal `target_hidden_size`.
    hidden_size: int = 4096
    # SwiGLU MLP width.
    intermediate_size: int = 12288
    # Number of drafter decoder layers.
    num_hidden_layers: int = 5
    # Query heads of the drafter's attention.
    num_attention_heads: int = 32
    # Key/value heads (grouped-query attention); must divide `num_attention_heads`.
    num_key_value_heads: int = 8
    # Width of one attention head.
    head_dim: int = 128
    # RMS-normalise each query and key head before RoPE (Qwen3's QK-norm, dFlash's layout). False: no q_norm/k_norm
    # modules at all (no such tensors in the state dict), the attention of Llama/Mistral, so layers copied from such a
    # target compute exactly what they computed there. `from_target_config` follows the target (`TARGET_QK_NORM`).
    qk_norm: bool = True
    # Activation of the SwiGLU MLP.
    hidden_act: str = "silu"
    # Epsilon of every RMSNorm (layers, QK-norm, `hidden_norm`, final norm).
    rms_norm_eps: float = 1e-6
    # Longest position the rotary embedding is set up for.
    max_position_embeddings: int = 40960
    # RoPE settings as transformers' `rope_parameters`; None → `{"rope_type": "default", "rope_theta":
    # DEFAULT_ROPE_THETA}`. The flat `rope_theta=` and `rope_scaling=` keywords of configs saved by transformers 4.x
    # (`{"type": "yarn", "factor": 4.0, ...}`) are folded into it by transformers' own rule
    # (`convert_rope_params_to_dict`, which its model configs and vLLM apply too), never dropped.
    rope_parameters: RopeParameters | dict | None = None
    # Bias on the q/k/v/o projections.
    attention_bias: bool = False
    # Dropout on attention weights during training.
    attention_dropout: float = 0.0
    # Per drafter layer, what its queries see of [context ; block]: None → everything (full attention, dFlash's
    # default), an integer W → a sliding window of W positions ending at the query's own position (or its block's
    # anchor, `window_anchored`): keys at positions p with `end - p < W`, transformers' `sliding_window` convention.
    # None (the field) → every layer full. Released drafters declare it as `layer_types` + `sliding_window`
    # (`conversion` maps them); it is not stored under those names because they make transformers' caches drop the keys
    # outside the window, while the drafter's caches keep every context position (a rejected block is rolled back by
    # cropping them) and the window is a mask by position.
    attention_windows: list[int | None] | None = None
    # Whether a windowed layer is also causal inside the block (a block position sees the block positions up to its own):
    # z-lab's and vLLM's default for sliding layers, and speculators' unless `sliding_window_non_causal`. False → it sees
    # the whole block (transformers' native dFlash assistant); a window ending at the query must then be >= block_size
    # (the references disagree on what a shorter one cuts). Full-attention layers always see the whole block.
    window_causal: bool = True
    # Where a window ends: False → at each query's own position (z-lab's dFlash, vLLM, transformers); True → at the
    # block's anchor for every query of the block, the block itself always visible (how speculators trains its
    # sliding-window layers: the anchor's W - 1 preceding context tokens).
    window_anchored: bool = False
    # Standard deviation of the normal initialisation of fresh linear layers.
    initializer_range: float = 0.02

    # --- block diffusion ----------------------------------------------------------------------------------------
    # Tokens per draft block, anchor included: one pass proposes `block_size - 1` draft tokens.
    block_size: int = 16
    # Token id whose target embedding marks a masked (to-be-drafted) position. None → the drafter owns a learned
    # mask vector (for targets whose embedding table has no spare row, e.g. SmolLM2).
    mask_token_id: int | None = None

    # Rows of the target's lm_head the drafter and its head read out: a frequency-ranked subset of the vocabulary,
    # stored with the weights as the `draft_token_ids` buffer (FR-Spec / EAGLE-3). None → the whole vocabulary.
    # Tokens outside it are never drafted (q = 0 there), so verification stays lossless; the lm_head and head
    # readouts shrink from vocab_size to draft_vocab_size rows.
    draft_vocab_size: int | None = None

    # --- refiner ------------------------------------------------------------------------------------------------
    # Correction head on the drafter's logits: "xpress" (causal low-rank refiner solved by Jacobi iterations),
    # "markov" (bias indexed by the previous token, decoded serially: the DSpark baseline) or "none" (plain dFlash).
    refiner: str = "xpress"
    # Low-rank width r of the refiner / Markov head.
    refiner_rank: int = 256
    # Which function the xPress head computes (`REFINER_FORMS`). "release" (the authors' code and checkpoints): over all
    # `block_size` slots of a block, slot 0 the anchor (its drafter state; its previous token the one before the
    # anchor; its output not a draft), a mixer that keeps its diagonal and a SwiGLU Trans without biases. "paper":
    # eqs. (5)-(9) as printed, over the `block_size - 1` draft positions, a strictly lower-triangular mixer and a
    # two-layer MLP with biases (the head of checkpoints saved before this field existed).
    refiner_form: str = "release"
    # Hidden width of the xPress head's Trans MLP. None → 2 · refiner_rank (the authors' mlp_ratio of 2: 512 at r = 256).
    # The "paper" form's MLP is always r → 2r → r.
    refiner_mlp_hidden: int | None = None
    # The head's token table W_e (the authors' w1), by the previous token: "full", a row per target token; "draft", a
    # row per draft-vocabulary token and one row shared by every other token (needs draft_vocab_size). Drafts are
    # always draft-vocabulary tokens, so only a block's committed tokens (the anchor and the token before it) can fall
    # on the shared row; for a 262k vocabulary at r = 256 it is 1M parameters instead of 67M.
    refiner_token_vocab: str = "full"
    # Maximum Jacobi iterations K per block. 0 → no refiner pass: the xPress (or Markov) head drafts the drafter's own
    # marginals (exactly what refiner="none" drafts, same loop and same draft-length rule), so its contribution can be
    # measured by switching it off. The Markov head's serial decode is the same for every K ≥ 1.
    jacobi_max_iters: int = 4
    # Stop a block's Jacobi iteration as soon as an iteration changes no token (the fixed point is reached; the
    # result is identical, only fewer iterations run).
    jacobi_early_exit: bool = True

    # --- draft length (which part of a block is verified) ---------------------------------------------------------
    # Verify only the confident head of each block. The cumulative confidence of draft k is the product, over drafts
    # 1..k, of each draft's probability under the distribution it was drawn from (its q). The block is cut after the
    # first draft whose cumulative confidence falls below the threshold (that draft is still verified, so at least
    # one always is; see `generation.draft_length` for why the cut must include it to stay lossless). None or 0 →
    # no cut. A `generate(..., assistant_confidence_threshold=...)` or `spec_generate(...,
    # assistant_confidence_threshold=...)` call overrides it. (transformers' own assistants stop at the first token
    # whose *own* probability is below their threshold; this one is cumulative, over the block.) It pays where a
    # long verification costs more than a short one, e.g. fp32 on a CPU (choose it on held-out prompts with
    # examples/choose_draft_length.py). Where verifying a whole block costs about one step (a GPU, bf16 on a CPU with
    # AMX), no cut is the better default.
    draft_confidence_threshold: float | None = None
    # At most this many drafts verified per block, in 1..block_size - 1 (transformers' `num_assistant_tokens`, same
    # name and meaning). None → the whole block (block_size - 1). A call's `num_assistant_tokens` overrides it.
    num_assistant_tokens: int | None = None
    # The acceptance measured for this checkpoint: entry k - 1 is the fraction of blocks whose first k drafts the
    # target accepted (greedy decoding of held-out training prompts with whole blocks; examples/choose_draft_length.py
    # writes it, `draft_cap.acceptance_from_blocks`). `spec_generate(..., num_assistant_tokens="auto")` weighs it
    # against this machine's cost of verifying more tokens (`draft_cap.choose_draft_cap`). None: not measured.
    draft_acceptance: list[float] | None = None
    # Tokens per verification (τ) measured for draft trees of N nodes with the head on: {N: τ} (greedy decoding of
    # held-out training prompts, examples/tree_benchmark.py). `tree_nodes="auto"` weighs it against this machine's
    # cost of verifying N + 1 tokens (`draft_cap.choose_draft_shape`). None: not measured.
    tree_acceptance: dict[int, float] | None = None

    def __post_init__(self, **kwargs):
        if self.target_layer_ids is None and self.num_target_layers and self.num_hidden_layers:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        if self.target_layer_ids is not None:
            self.target_layer_ids = list(self.target_layer_ids)
        super().__post_init__(**kwargs)
        self.validate_xpress()

    def validate_xpress(self) -> None:
        """Raise a `ValueError` naming the first field whose value cannot work."""
        for name in _INTEGER_FIELDS:
            if not is_integer(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in _OPTIONAL_INTEGER_FIELDS:
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"{name} must be None or a positive integer, got {value!r}")
        if self.refiner not in REFINER_TYPES:
            raise ValueError(f"refiner must be one of {REFINER_TYPES}, got {self.refiner!r}")
        if self.refiner_form not in REFINER_FORMS:
            raise ValueError(
                f"refiner_form must be one of {REFINER_FORMS} (\"release\": the authors' released head, \"paper\": "
                f"the paper's printed equations), got {self.refiner_form!r}"
            )
        if self.refiner_form == "paper" and self.refiner_mlp_hidden not in (None, 2 * self.refiner_rank):
            raise ValueError(
                f"refiner_mlp_hidden={self.refiner_mlp_hidden}: the \"paper\" form's MLP is r -> 2r -> r "
                f"({2 * self.refiner_rank}); leave it None, or use refiner_form=\"release\""
            )
        if self.refiner_token_vocab not in REFINER_TOKEN_VOCABS:
            raise ValueError(f"refiner_token_vocab must be one of {REFINER_TOKEN_VOCABS}, got {self.refiner_token_vocab!r}")
        if self.refiner_token_vocab == "draft" and self.draft_vocab_size is None:
            raise ValueError(
                'refiner_token_vocab="draft" gives the head a row per draft-vocabulary token, but this config has no '
                'draft vocabulary: set draft_vocab_size, or use refiner_token_vocab="full"'
            )
        for name in ("qk_norm", "window_causal", "window_anchored"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.check_attention_windows()
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus at least one draft), got {self.block_size}")
        if self.refiner_rank < 1:
            raise ValueError(f"refiner_rank must be a positive integer, got {self.refiner_rank}")
        if self.jacobi_max_iters < 0:
            raise ValueError(
                f"jacobi_max_iters must be >= 0 (0 = the drafter's own marginals, no refiner pass), got "
                f"{self.jacobi_max_iters}"
            )
        threshold = self.draft_confidence_threshold
        if threshold is not None and (
            not is_real(threshold) or not 0 <= threshold <= 1
        ):
            raise ValueError(
                f"draft_confidence_threshold must be None (no cut) or a number in [0, 1], got {threshold!r}"
            )
        cap = self.num_assistant_tokens
        if cap is not None and (not is_integer(cap) or not 1 <= cap <= self.block_size - 1):
            raise ValueError(
                f"num_assistant_tokens must be None (the whole block) or an integer in 1..{self.block_size - 1} "
                f"(block_size - 1), got {cap!r}"
            )
        if self.draft_acceptance is not None:
            self.draft_acceptance = check_acceptance(self.draft_acceptance, self.block_size)
        if self.tree_acceptance is not None:
            self.tree_acceptance = check_tree_acceptance(self.tree_acceptance)
        if self.hidden_size != self.target_hidden_size:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must equal target_hidden_size ({self.target_hidden_size}): the "
                "drafter reads the target's embeddings and feeds the target's lm_head. Build the config with "
                "XPressConfig.from_target_config(target.config)."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer as context")
        not_int = [i for i in self.target_layer_ids if not is_integer(i)]
        if not_int:
            raise ValueError(f"target_layer_ids must be integer layer indices, got {not_int} in {self.target_layer_ids}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are out of range for a target with num_target_layers="
                f"{self.num_target_layers} (valid: 0..{self.num_target_layers - 1})"
            )
        if self.draft_vocab_size is not None and (
            not is_integer(self.draft_vocab_size) or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise ValueError(
                f"draft_vocab_size must be None (the whole vocabulary) or an integer in 1..{self.vocab_size}, got "
                f"{self.draft_vocab_size!r}"
            )
        if self.mask_token_id is not None and not is_integer(self.mask_token_id):
            raise ValueError(
                f"mask_token_id must be an integer token id (or None for a learned mask vector), got {self.mask_token_id!r}"
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target vocabulary (0..{self.vocab_size - 1}); "
                "pass None to let the drafter learn its own mask vector"
            )

    def check_attention_windows(self) -> None:
        """`attention_windows` is None or one entry per drafter layer, each None or a window >= 1 (>= block_size for a
        non-causal window that ends at the query): a ValueError naming the entry otherwise."""
        windows = self.attention_windows
        if windows is None:
            return
        if not isinstance(windows, (list, tuple)) or len(windows) != self.num_hidden_layers:
            raise ValueError(
                f"attention_windows must be None (every layer full) or a list with one entry per drafter layer "
                f"(num_hidden_layers={self.num_hidden_layers}), each None (full attention) or a window size; got "
                f"{windows!r}"
            )
        bad = [w for w in windows if w is not None and not (is_integer(w) and w >= 1)]
        if bad:
            raise ValueError(f"attention_windows entries must be None or integers >= 1, got {bad[0]!r} in {windows!r}")
        short = [w for w in windows if w is not None and w < self.block_size]
        if short and not self.window_causal and not self.window_anchored:
            raise ValueError(
                f"attention_windows has a window of {short[0]} < block_size ({self.block_size}) with window_causal="
                "False: z-lab's code and transformers disagree on which block positions such a window hides after "
                "the query, so no loaded drafter means one function by it. Use a window >= block_size."
            )
        self.attention_windows = list(windows)

    @property
    def refiner_mlp_width(self) -> int:
        """The xPress head's Trans hidden width: `refiner_mlp_hidden`, or 2 · refiner_rank when it is None."""
        return self.refiner_mlp_hidden or 2 * self.refiner_rank

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens proposed per block (the anchor is already committed)."""
        return self.block_size - 1

    @classmethod
    def from_target_config(cls, target_config: PreTrainedConfig, **overrides: Any) -> "XPressConfig":
        """Derive every target-dependent field from the target's config; `overrides` set drafter/refiner fields.

        The drafter copies the target's attention geometry (heads, head_dim, RoPE, norm eps, attention bias, QK-norm
        by `TARGET_QK_NORM`) and MLP (width, activation) unless overridden, so a decoder layer of the target fits the
        drafter as it is (`modeling_xpress.training.target_init`); `target_layer_ids` follows dFlash's default rule for the
        chosen number of drafter layers.
        """
        text = target_config.get_text_config(decoder=True)
        derived = dict(
            decoder_layer_fields(text),
            vocab_size=text.vocab_size,
            target_hidden_size=text.hidden_size,
            num_target_layers=text.num_hidden_layers,
            qk_norm=TARGET_QK_NORM.get(getattr(text, "model_type", None)),
        )
        # What the target does not say falls back to this class's own defaults (declared once, above).
        derived = {k: v for k, v in derived.items() if v is not None or k.endswith("token_id")}
        if target_config.name_or_path:
            derived["target_model_name"] = str(target_config.name_or_path)
        derived.update(overrides)
        if "target_layer_ids" not in overrides:
            derived["target_layer_ids"] = default_target_layer_ids(
                derived["num_target_layers"], derived.get("num_hidden_layers", cls.num_hidden_layers)
            )
        return cls(**derived)

    def check_target(self, target_config: PreTrainedConfig) -> None:
        """Raise a `ValueError` if this drafter was not built for `target_config` (vocab, width, depth)."""
        text = target_config.get_text_config(decoder=True)
        problems = []
        if text.vocab_size != self.vocab_size:
            problems.append(f"vocab_size {text.vocab_size} != drafter's {self.vocab_size}")
        if text.hidden_size != self.target_hidden_size:
            problems.append(f"hidden_size {text.hidden_size} != drafter's target_hidden_size {self.target_hidden_size}")
        if text.num_hidden_layers != self.num_target_layers:
            problems.append(
                f"num_hidden_layers {text.num_hidden_layers} != drafter's num_target_layers {self.num_target_layers}"
            )
        if problems:
            raise ValueError(
                "This xPress drafter was built for a different target model: target " + "; ".join(problems) + ". "
                "Use the checkpoint trained for this target, or build one with XPressConfig.from_target_config."
            )


__all__ = ["XPressConfig", "default_target_layer_ids"]
