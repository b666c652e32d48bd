"""xPress in transformers: `target.generate(**inputs, assistant_model=xpress)` and `pipeline(..., assistant_model=)`.

transformers' own assisted-decoding loop does verification and acceptance; `XPressCandidateGenerator` drafts and
refines with the eager draft step (`drafting.draft_block`) and hands transformers each draft's q. transformers has no
public parameter for a custom candidate generator, so `install_generation_hook` wraps two private `GenerationMixin`
methods; see its docstring for exactly what it changes. The standalone loop, `spec_generate`, is `decoding.py`.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import contextlib
import functools
import inspect
import threading

import torch
import transformers
from transformers import DynamicCache, GenerationConfig, GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator, DFlashTokenCandidateGenerator

from .decoding import check_assistant_call
from .draft_cap import draft_length, draft_length_rule, resolve_draft_cap
from .drafting import draft_block, last_tokens, target_features
from .layout_policy import decoder_policy
from .processors import processors_transform, vocabulary_local
from .stats import SectionTimer, XPressGenerationStats


def generation_config_draft_settings(generation_config) -> tuple[float | None, int | None]:
    """(assistant_confidence_threshold, num_assistant_tokens) as a `generate` call sets them; None for each it does not.

    By the time a candidate generator is built, transformers has filled every field nobody set with its global default
    (`GenerationConfig._get_default_generation_params()`: `num_assistant_tokens=20`,
    `assistant_confidence_threshold=0.4`), so which fields a caller passed cannot be read back. The rule: a value
    counts as set when it differs from that global default (whether it came from the call or from the target's
    `generation_config.json`); a value equal to it leaves the xPress config in charge. To use exactly 0.4 or 20, set
    it on the xPress config (`xpress.config.draft_confidence_threshold = 0.4`) or pass it to `spec_generate`.
    """
    defaults = GenerationConfig._get_default_generation_params()
    values = []
    for name in ("assistant_confidence_threshold", "num_assistant_tokens"):
        value = getattr(generation_config, name, None)
        values.append(None if value is None or value == defaults.get(name) else value)
    return values[0], values[1]


def _is_xpress(model) -> bool:
    # Duck-typed on purpose: the package's class and the copy loaded with trust_remote_code are different objects.
    return getattr(getattr(model, "config", None), "model_type", None) == "xpress"


def check_generation_config(generation_config) -> None:
    """Errors for `generate` settings an xPress assistant cannot serve (transformers would otherwise ignore the
    assistant silently or fail deep inside its loop)."""
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} is not supported with an xPress assistant: "
            "it decodes one sequence per call. Call generate several times (with do_sample=True) instead."
        )
    if (generation_config.num_beams or 1) > 1:
        raise ValueError(
            f"num_beams={generation_config.num_beams} is not supported with an xPress assistant: speculative decoding "
            "verifies a single sequence, and beam search would silently ignore the drafter. Use num_beams=1 (greedy or "
            "sampling) with assistant_model, or beam search without it."
        )
    if "static" in str(generation_config.cache_implementation or ""):
        raise ValueError(
            f"cache_implementation={generation_config.cache_implementation!r} is not supported with an xPress "
            "assistant: transformers would compile the target once per verification length, which changes from step "
            "to step. For static caches and compiled fixed-shape graphs use xpress.spec_generate(target, input_ids, "
            "compile=True); generate with an xPress assistant uses the default dynamic cache."
        )


class XPressCandidateGenerator(CandidateGenerator):
    """transformers `CandidateGenerator` that drafts with the xPress drafter and refiner.

    It consumes the target's hidden states of its previous forward (`requires_model_outputs`): on the first call it
    returns the prompt unchanged so that the target prefills; afterwards it drafts `block_size - 1` tokens after the
    bonus token and returns them with the processed logits they were drawn from, so `_speculative_sampling` is
    lossless. Only the block's first `draft_length` drafts are returned: the call's `assistant_confidence_threshold`
    and `num_assistant_tokens` (when they differ from transformers' defaults, `generation_config_draft_settings`)
    over the xPress config's `draft_confidence_threshold` and `num_assistant_tokens`.
    """

    requires_model_outputs = True

    def __init__(self, xpress, target, input_ids: torch.Tensor, generation_config, logits_processor=None):
        check_assistant_call(target, xpress, input_ids)
        check_generation_config(generation_config)
        self.xpress = xpress
        self.layer_ids = list(xpress.config.target_layer_ids)
        self.model_kwargs_overrides = {"output_hidden_states": [i + 1 for i in self.layer_ids]}
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        threshold, cap = generation_config_draft_settings(generation_config)
        cap = resolve_draft_cap(xpress, target, cap, compiled=False)  # the machine's cap unless the call sets one
        self.draft_rule = draft_length_rule(xpress.config, threshold, cap)
        self.logits_processor = logits_processor
        self.draft_space = vocabulary_local(logits_processor)  # decode over the draft vocabulary when allowed
        self.cache = DynamicCache(config=xpress.config)
        self.context_len = 0  # committed tokens whose features are in the drafter cache
        self.timer = SectionTimer(xpress.device)
        self.stats = XPressGenerationStats()
        xpress.generation_stats = self.stats
        self.target = target
        # transformers verifies: its forward runs in the policy's layout under `_arm_verification`
        self.policy = decoder_policy("auto", target, xpress, compiled=False)
        self.policy.prepare_widths("verify", self.draft_rule.cap + 1)
        self._hooks: list = []
        self._start = self.timer.mark()
        self._last_draft_end = None
        self._drafted = False  # whether the step being verified carries a draft (not the prefill / a budget-0 step)

    @torch.no_grad()
    def get_candidates(
        self, input_ids: torch.LongTensor, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        self._disarm()
        now = self.timer.mark()
        if self._last_draft_end is not None:
            self.stats.record("verify", self._last_draft_end, now)
        self.stats.record_total(self._start, now)
        self._drafted = False
        if is_first_iteration:
            return input_ids, None  # the target prefills first; we need its hidden states
        budget = min(self.draft_rule.cap, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None  # the last token comes from the target alone; no later draft will follow
        if model_outputs is None or model_outputs.hidden_states is None:
            raise RuntimeError(
                "xPress needs the target's hidden states from its previous forward, but transformers passed none. "
                "This transformers version changed the assisted-decoding protocol; use transformers 5.24."
            )
        # The target's last forward started at the first token the drafter has not seen (prompt start at prefill,
        # the previous anchor afterwards); the committed ones among them become new context.
        anchor_pos = input_ids.shape[1] - 1
        count = anchor_pos - self.context_len
        features = target_features(model_outputs.hidden_states, self.layer_ids, count)
        transform = processors_transform(self.logits_processor, input_ids)
        result = draft_block(
            self.xpress,
            self.embed_tokens,
            self.lm_head,
            last_tokens(input_ids),
            features.to(self.xpress.device),
            self.context_len,
            self.cache,
            logits_transform=transform,
            do_sample=self.do_sample,
            stats=self.stats,
            timer=self.timer,
            draft_space=self.draft_space,
            positions=self.draft_rule.cap,
            policy=self.policy,
        )
        self.context_len = anchor_pos
        length = draft_length(result, self.draft_rule.threshold, budget)
        self.stats.draft_lengths.append(length)
        self._last_draft_end = self.timer.mark()
        candidates = result.tokens[:, :length].to(input_ids.device)
        self._drafted = True
        # A dynamic cache is never auto-compiled by transformers: the hooks run in plain Python around the forward.
        if type((model_kwargs or {}).get("cache")) is DynamicCache:
            self._arm_verification(length + 1)
        return torch.cat([input_ids, candidates], dim=1), result.logits[:, :length]

    def _arm_verification(self, width: int) -> None:
        """Run the target's next forward, transformers' verification of these `width` tokens, in this CPU's layout
        for that many rows (its `LinearPolicy`): a forward pre-hook enters the layout's mode, a forward hook
        (called on an exception too) leaves it and removes both. Never armed where the input-major layout is the
        faster one; disarmed again at the next draft and after the verification, so no other forward is changed. A
        forward that is not a verification of `width` tokens (say, the caller's own after transformers raised between
        the draft and its verification) only disarms them. The hooks act only in the thread that armed them: the
        target may be shared by `generate` calls in other threads, whose forwards run the same hooks."""
        if self.policy.kind("verify", width) == "input_major":
            return
        self.policy.prepare("verify", width)  # (its reorders, once: a dictionary lookup once they exist)
        mode = self.policy.mode("verify", width, width)
        owner, entered = threading.get_ident(), []

        def enter(module, args, kwargs):
            if threading.get_ident() != owner:  # another thread's forward of the shared target: not ours
                return
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor) or ids.shape[-1] != width:
                self._disarm()
                return
            mode.__enter__()  # (torch function modes are per thread: this one is on the owner's stack only)
            entered.append(True)

        def leave(module, args, output):
            if threading.get_ident() != owner or not entered:
                return
            entered.clear()
            mode.__exit__(None, None, None)
            self._disarm()

        self._hooks = [self.target.register_forward_pre_hook(enter, with_kwargs=True),
                       self.target.register_forward_hook(leave, always_call=True)]  # fmt: skip

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        self._disarm()
        self.stats.new_tokens += int(num_matches) + 1
        if self._drafted:  # τ counts verification steps of a draft only
            self.stats.acceptance_lengths.append(int(num_matches) + 1)
        self.stats.record_total(self._start, self.timer.mark())


@contextlib.contextmanager
def _placeholder_mask_id(config):
    """The native dFlash generator embeds `config.mask_token_id`; a drafter with a learned mask vector has none and
    overwrites the mask positions itself, so any valid id serves as a placeholder while the generator is built."""
    original = config.mask_token_id
    if original is None:
        config.mask_token_id = 0
    try:
        yield
    finally:
        config.mask_token_id = original


def make_candidate_generator(target, xpress, generation_config, input_ids, logits_processor, model_kwargs):
    """The candidate generator for an xPress assistant: ours, or transformers' native dFlash generator on our drafter
    (refiner bypassed) when `speculation_type="dflash"`."""
    if generation_config.speculation_type == "dflash":
        check_assistant_call(target, xpress, input_ids)
        check_generation_config(generation_config)
        with _placeholder_mask_id(xpress.config):
            return DFlashTokenCandidateGenerator(
                assistant_model=xpress,
                main_model_input_embeddings=target.get_input_embeddings(),
                main_model_output_embeddings=target.get_output_embeddings(),
                generation_config=generation_config,
                logits_processor=logits_processor,
            )
    return XPressCandidateGenerator(xpress, target, input_ids, generation_config, logits_processor)


_HOOK_MARK = "_xpress_hook"
_TESTED_TRANSFORMERS = "5.24"


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise RuntimeError(
            f"xPress cannot hook into transformers {transformers.__version__}: {what}. The hook was written against "
            f"transformers {_TESTED_TRANSFORMERS}; install that version (pip install 'transformers=={_TESTED_TRANSFORMERS}.*') "
            "or use xpress.spec_generate(target, input_ids, ...), which does not depend on transformers internals."
        )


def _check_internals() -> None:
    """Fail loudly if the private transformers API the hook relies on is not the one it was written for."""
    for name, params in {
        "_get_candidate_generator": {"generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model"},
        "_validate_generation_mode": {"generation_mode", "generation_config", "generation_mode_kwargs"},
    }.items():
        method = getattr(GenerationMixin, name, None)
        _require(method is not None, f"GenerationMixin.{name} no longer exists")
        missing = params - set(inspect.signature(method).parameters)
        _require(not missing, f"GenerationMixin.{name} lost the parameters {sorted(missing)}")
    _require(hasattr(CandidateGenerator, "requires_model_outputs"), "CandidateGenerator.requires_model_outputs is gone")
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    _require(
        {"num_assistant_tokens", "assistant_confidence_threshold"} <= set(defaults),
        "GenerationConfig._get_default_generation_params no longer names the assistant defaults",
    )
    source = inspect.getsource(GenerationMixin._assisted_decoding)
    _require(
        "model_outputs=" in source and "model_kwargs_overrides" in source,
        "_assisted_decoding no longer hands the target's outputs to the candidate generator",
    )


def install_generation_hook() -> None:
    """Route xPress assistants through `XPressCandidateGenerator`; leave every other assistant untouched.

    What it changes, and nothing else:

    * `GenerationMixin._validate_generation_mode`: when the assistant is an xPress model, first checks it was built
      for this target and that the call is single-sequence without beams, so a mismatch fails with an xPress error
      instead of a misleading "different tokenizers" one (or beam search silently ignoring the drafter); then runs
      the original validation.
    * `GenerationMixin._get_candidate_generator`: when the assistant is an xPress model, returns its generator;
      otherwise calls the original method with the original arguments.

    Idempotent (the wrappers are marked and installed once per process, even if the package and a trust_remote_code
    copy are both imported). Raises `RuntimeError` if the transformers internals it relies on have changed.
    """
    if getattr(GenerationMixin._get_candidate_generator, _HOOK_MARK, False):
        return
    _check_internals()
    original_candidates = GenerationMixin._get_candidate_generator
    original_validate = GenerationMixin._validate_generation_mode

    @functools.wraps(original_validate)
    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = generation_mode_kwargs.get("assistant_model")
        if _is_xpress(assistant):
            assistant.config.check_target(self.config)
            check_generation_config(generation_config)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    @functools.wraps(original_candidates)
    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                                 assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):  # fmt: skip
        if _is_xpress(assistant_model):
            return make_candidate_generator(
                self, assistant_model, generation_config, input_ids, logits_processor, model_kwargs
            )
        return original_candidates(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    setattr(_validate_generation_mode, _HOOK_MARK, True)
    setattr(_get_candidate_generator, _HOOK_MARK, True)
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._get_candidate_generator = _get_candidate_generator


__all__ = ["XPressCandidateGenerator", "generation_config_draft_settings", "install_generation_hook"]
