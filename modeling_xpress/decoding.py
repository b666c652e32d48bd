"""The decode loop of `spec_generate`: prefill → draft → refine → verify → accept → commit, written once.

The loop (`decode`) decides what is drafted, verified, accepted, stopped at and committed; it asks a `DecodeSteps`
for the model work. Two implement it: `EagerSteps` (dynamic caches, any logits processor; here) and
`compiled_loop.CompiledSteps` (static caches and fixed-shape graphs under `torch.compile`). Everything outside the model
calls — the draft-length rule, the acceptance rule, stop tokens, random draws — is this one code for both, which is
why `compile=True` reproduces `compile=False` draw for draw. transformers' `generate(assistant_model=xpress)` runs
its own verification loop around the same eager draft step (`drafting.draft_block`, `generation.py`).

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, LogitsProcessorList

from .attention_masks import LayerKinds
from .compiled import CompiledGenerationStats, check_compilable
from .compiled_loop import compiled_steps
from .configuration_xpress import is_integer
from .draft_cap import DraftLengthRule, choose_draft_shape, draft_length, draft_length_rule, resolve_draft_cap
from .drafting import draft_block, last_tokens, run_drafter, target_features
from .layout_policy import decoder_policy
from .policy import LinearPolicy, check_linear_layout
from .processors import (
    check_decoding_arguments, decoding_processors, process_verification_logits, processors_transform,
    stop_token_tensor, vocabulary_local,
)  # fmt: skip
from .refinement import RefinementResult
from .stats import SectionTimer, XPressGenerationStats
from .trees import DraftTree, accept_tree_greedy, accept_tree_sampling, build_tree, keep_path, path_rows, verify_tree


@dataclass
class XPressGenerateOutput:
    sequences: torch.LongTensor  # (1, prompt + new tokens)
    stats: XPressGenerationStats


class DecodeSteps(Protocol):
    """The model work of one decode loop. `features` are the target's features of a verification's tokens (1, n,
    L·H_t), of which the first `count` are newly committed context for the drafter."""

    do_sample: bool
    processors: LogitsProcessorList  # what the target's next-token logits go through before a pick

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt through the target: logits of its last position (1, V) and its features (1, P, L·H_t)."""

    def start(self, sequence: torch.Tensor) -> None:
        """Once, after the prefill's token: prepare what every step needs (compiled: its verification graphs)."""

    def draft(self, sequence, features, count: int, context_len: int, stats, timer, generator,
              depth: int) -> RefinementResult | DraftTree:  # fmt: skip
        """A block after `sequence`: drafter → readout → head. A linear block: its first `cap` drafts (tokens (1, m)
        and the logits (1, m, V) each was drawn from), the loop cuts it to its draft length; with a tree budget, a
        `DraftTree` no deeper than `depth`. The drafter's cache holds context up to `context_len + count`."""

    def verify(self, sequence, tree: DraftTree, stats) -> tuple[torch.Tensor, torch.Tensor]:
        """The target on the anchor and the tree's nodes (a linear block: a chain, perhaps empty): processed logits of
        those `len(tree) + 1` positions (at least that many rows; row j + 1 is node j's child) and their features."""

    def commit(self, tree: DraftTree, path: list[int]) -> None:
        """Keep the anchor and the accepted `path` of the last verification in the target's cache."""


def pick(processors, logits: torch.Tensor, ids: torch.Tensor, do_sample: bool, generator) -> torch.Tensor:
    """The target's own next token after `ids`: argmax, or a draw from the processed distribution."""
    logits = processors(ids, logits.float()) if processors else logits.float()
    if not do_sample:
        return logits.argmax(dim=-1)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[:, 0]


def accept_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Longest prefix of `draft` (n,) that matches the target's argmax, plus the target's next token."""
    choice = target_logits.argmax(dim=-1)  # (n + 1,)
    matches = int((draft == choice[:-1]).long().cumprod(dim=0).sum())
    return matches, choice[matches]


def accept_sampling(draft, q_logits, p_logits, generator) -> tuple[int, torch.Tensor]:
    """Speculative sampling (Leviathan et al., Alg. 1): keep draft token x_k with probability min(1, p/q); at the first
    rejection resample from norm(max(p − q, 0)); if all are kept, draw the bonus from p. Lossless for any q from which
    the drafts were truly drawn."""
    n = draft.shape[0]
    if n == 0:
        return 0, torch.multinomial(p_logits[0].softmax(dim=-1), 1, generator=generator)[0]
    q = q_logits.softmax(dim=-1)  # (n, V)
    p = p_logits.softmax(dim=-1)  # (n + 1, V)
    idx = torch.arange(n, device=draft.device)
    ratio = p[idx, draft] / q[idx, draft]
    u = torch.rand(n, generator=generator, device=draft.device)
    matches = int((u <= ratio).long().cumprod(dim=0).sum())
    if matches < n:
        residual = (p[matches] - q[matches]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[matches]
        return matches, torch.multinomial(residual, 1, generator=generator)[0]
    return matches, torch.multinomial(p[n], 1, generator=generator)[0]


def accept(tree: DraftTree, p_logits: torch.Tensor, do_sample: bool, generator) -> tuple[list[int], torch.Tensor]:
    """The accepted path of a verification (its nodes, in order) and the target's token after it. A chain: the
    vectorised rules above; a tree: the walk down it (`trees.accept_tree_greedy` / `accept_tree_sampling`), of which
    they are the one-child case."""
    if tree.chain:
        if do_sample:
            matches, bonus = accept_sampling(tree.tokens, tree.distributions, p_logits, generator)
        else:
            matches, bonus = accept_greedy(tree.tokens, p_logits)
        return list(range(matches)), bonus
    if do_sample:
        path, bonus = accept_tree_sampling(tree, p_logits, generator)
    else:
        path, bonus = accept_tree_greedy(tree, p_logits)
    return path, torch.tensor(bonus, device=p_logits.device)


def committed_tokens(path_tokens: torch.Tensor, bonus, stop: torch.Tensor, room: int) -> torch.Tensor:
    """What a verification commits: the accepted drafts and the target's bonus token, up to and including the first
    stop token, at most `room` tokens (what is left of `max_new_tokens`)."""
    accepted = torch.cat([path_tokens, bonus.view(1)])
    stop_at = torch.isin(accepted, stop).nonzero()
    if stop_at.numel():
        accepted = accepted[: int(stop_at[0]) + 1]
    return accepted[:room]


def decode(steps: DecodeSteps, input_ids, *, max_new_tokens: int, stop: torch.Tensor, generator,
           draft_rule: DraftLengthRule, stats: XPressGenerationStats) -> XPressGenerateOutput:  # fmt: skip
    """The loop: prefill, then per step draft a block, cut it to its draft length, verify it, accept a prefix (greedy:
    the target's argmax; sampling: speculative sampling against the q each draft was drawn from) plus the target's
    own next token, stop at a stop token or `max_new_tokens`, and commit. `stats` collects τ, draft lengths, Jacobi
    iterations and section times."""
    timer = SectionTimer(input_ids.device)
    start = timer.mark()
    # Prefill: the prompt's features become the drafter's first context, and the target emits the first token.
    last_logits, features = steps.prefill(input_ids)
    sequence = torch.cat([input_ids, pick(steps.processors, last_logits, input_ids, steps.do_sample, generator)
                          .view(1, 1)], dim=1)  # fmt: skip
    steps.start(sequence)
    stats.record("verify", start, timer.mark())
    prompt_len, count, context_len = input_ids.shape[1], input_ids.shape[1], 0

    while sequence.shape[1] - prompt_len < max_new_tokens and not bool(torch.isin(sequence[0, -1], stop)):
        anchor_pos = sequence.shape[1] - 1
        budget = min(draft_rule.cap, max_new_tokens - (sequence.shape[1] - prompt_len) - 1)
        if budget > 0:
            drafted = steps.draft(sequence, features, count, context_len, stats, timer, generator, depth=budget)
            context_len = anchor_pos
            if isinstance(drafted, DraftTree):
                tree = drafted
            else:
                length = draft_length(drafted, draft_rule.threshold, budget)
                tree = DraftTree.of_chain(drafted.tokens[0, :length].to(sequence.device), drafted.logits[0, :length])
            stats.draft_lengths.append(len(tree))
        else:  # one token left: the target alone emits it
            tree = DraftTree.of_chain(sequence.new_empty(0), None)

        t_verify = timer.mark()
        p_logits, features = steps.verify(sequence, tree, stats)
        p_logits = p_logits[: len(tree) + 1]  # a wider verification's later rows are not read
        path, bonus = accept(tree, p_logits, steps.do_sample, generator)
        accepted = committed_tokens(tree.tokens[path], bonus, stop, max_new_tokens - (sequence.shape[1] - prompt_len))
        # The anchor and the accepted path stay in the target's cache; their features are the next context.
        steps.commit(tree, path)
        count = len(path) + 1
        if not tree.chain:  # a chain's path is its first rows already
            features = features[:, path_rows(path, features.device)]
        sequence = torch.cat([sequence, accepted.view(1, -1)], dim=1)
        if len(tree):  # τ counts verification steps of a draft only
            stats.acceptance_lengths.append(int(accepted.shape[0]))
        stats.record("verify", t_verify, timer.mark())

    stats.new_tokens = sequence.shape[1] - prompt_len
    stats.record_total(start, timer.mark())
    return XPressGenerateOutput(sequences=sequence, stats=stats)


class EagerSteps:
    """`DecodeSteps` in plain PyTorch: dynamic caches cropped after every verification, every logits processor
    (those that read the token prefix see it, position by position), the products in `policy`'s layouts. With
    `tree_nodes`, each step drafts a tree of that many nodes (`trees.build_tree`) and verifies it in one forward."""

    def __init__(self, xpress, target, processors, draft_rule: DraftLengthRule, policy: LinearPolicy, do_sample: bool,
                 tree_nodes: int | None = None):  # fmt: skip
        self.xpress, self.target, self.processors, self.policy = xpress, target, processors, policy
        self.do_sample, self.cap, self.tree_nodes = do_sample, draft_rule.cap, tree_nodes
        policy.prepare_widths("verify", (tree_nodes or self.cap) + 1)
        self.layer_ids = list(xpress.config.target_layer_ids)
        self.hidden_request = [i + 1 for i in self.layer_ids]
        self.embed_tokens, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.draft_space = vocabulary_local(processors)  # decode over the draft vocabulary when allowed
        self.target_cache = DynamicCache(config=target.config)
        self.draft_cache = DynamicCache(config=xpress.config)
        self.target_kinds = None if tree_nodes is None else LayerKinds.of(target.config)  # a tree's masks per kind
        self.verified = 0  # tokens of the last verification

    def prefill(self, input_ids):
        out = self.target(input_ids=input_ids, cache=self.target_cache, output_hidden_states=self.hidden_request,
                          logits_to_keep=1)  # fmt: skip
        # From now on every verification is cropped back to what was accepted. Layers that keep only a window
        # (sliding attention) or a state (linear attention) must keep what a crop needs; after the prefill, so it
        # stays small.
        self.target_cache.activate_past_recording()
        return out.logits[:, -1], target_features(out.hidden_states, self.layer_ids, input_ids.shape[1])

    def start(self, sequence) -> None:
        pass

    def draft(self, sequence, features, count, context_len, stats, timer, generator, depth):
        transform = processors_transform(self.processors, sequence) if self.processors else None
        context = features[:, :count].to(self.xpress.device)
        if self.tree_nodes is None:
            return draft_block(
                self.xpress, self.embed_tokens, self.lm_head, last_tokens(sequence), context, context_len, self.draft_cache,
                logits_transform=transform, do_sample=self.do_sample, generator=generator, stats=stats, timer=timer,
                draft_space=self.draft_space,
                positions=self.cap,  # the cap, not the step's budget: as compile=True draws
                policy=self.policy,
            )  # fmt: skip
        hidden, base = run_drafter(self.xpress, self.embed_tokens, self.lm_head, sequence[0, -1:], context,
                                   context_len, self.draft_cache, draft_space=self.draft_space, positions=depth,
                                   policy=self.policy, stats=stats, timer=timer)  # fmt: skip
        t0 = timer.mark()
        tree = build_tree(self.xpress, hidden, base, last_tokens(sequence), self.tree_nodes, max_depth=depth,
                          logits_transform=transform, generator=generator, do_sample=self.do_sample)  # fmt: skip
        stats.record("refiner", t0, timer.mark())
        return tree

    def verify(self, sequence, tree, stats):
        width = self.verified = len(tree) + 1
        self.policy.prepare("verify", width)
        with self.policy.mode("verify", width, width):
            if tree.chain:
                verify_ids = torch.cat([sequence[:, -1:], tree.tokens.view(1, -1)], dim=1)  # [anchor, d_1..d_m]
                out = self.target(input_ids=verify_ids, cache=self.target_cache,
                                  output_hidden_states=self.hidden_request)  # fmt: skip
            else:
                out = verify_tree(self.target, self.target_cache, int(sequence[0, -1]), tree, self.target_kinds,
                                  output_hidden_states=self.hidden_request)  # fmt: skip
        # (a tree has prefix-free processors only, `check_tree_arguments`: every row is processed alike)
        p_logits = process_verification_logits(self.processors, sequence, tree.tokens, out.logits[0].float())
        return p_logits, target_features(out.hidden_states, self.layer_ids, width)

    def commit(self, tree, path) -> None:
        keep_path(self.target_cache, self.verified, path)  # a chain's path is in place: a crop


def check_tree_arguments(target, tree_nodes, assistant_confidence_threshold, num_assistant_tokens,
                         repetition_penalty, no_repeat_ngram_size, logits_processor) -> None:  # fmt: skip
    """Errors for a `tree_nodes` call that a draft tree cannot honour, before any model runs."""
    LayerKinds.of(target.config)  # full and sliding-window layers only: a mask per kind
    if not is_integer(tree_nodes) or tree_nodes < 1:
        raise ValueError(
            f"tree_nodes must be None (a linear block), an integer >= 1 (draft nodes) or 'auto' (chosen on this "
            f"machine from config.tree_acceptance), got {tree_nodes!r}"
        )
    if assistant_confidence_threshold:
        raise ValueError(
            "assistant_confidence_threshold cuts a linear block; a draft tree is sized by tree_nodes. Drop one of them."
        )
    if num_assistant_tokens is not None and (not is_integer(num_assistant_tokens) or num_assistant_tokens < 1):
        raise ValueError(
            f"with tree_nodes, num_assistant_tokens is the tree's depth limit: None (the whole block) or an integer "
            f">= 1, got {num_assistant_tokens!r}"
        )
    if repetition_penalty not in (None, 1.0) or no_repeat_ngram_size or logits_processor:
        raise ValueError(
            "A draft tree's nodes follow different prefixes, so logits processors that read the token prefix "
            "(repetition_penalty, no_repeat_ngram_size, a custom logits_processor) are not applied to trees. Use "
            "tree_nodes=None (a linear block) with them, or only temperature / top_k / top_p with a tree."
        )


def check_assistant_call(target, xpress, input_ids: torch.Tensor) -> None:
    """Errors for a target or input xPress cannot serve, raised before any model runs."""
    xpress.config.check_target(target.config)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"xPress speculative decoding runs one sequence at a time, got input_ids of shape {tuple(input_ids.shape)}. "
            "Call generate once per prompt (or use plain target.generate for batched decoding)."
        )


@torch.no_grad()
def spec_generate(
    xpress,
    target,
    input_ids: torch.LongTensor,
    *,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    logits_processor: LogitsProcessorList | None = None,
    stop_token_ids=None,
    generator: torch.Generator | None = None,
    assistant_confidence_threshold: float | None = None,
    num_assistant_tokens: int | str | None = None,
    compile: bool = False,
    max_cache_len: int | None = None,
    linear_layout: str = "auto",
    tree_nodes: int | str | None = None,
) -> XPressGenerateOutput:
    """xPress speculative decoding without `generate`: prefill, then draft → refine → verify → accept → commit.

    Takes a tokenizer's output as is (`spec_generate(xpress, target, **inputs)`: one unpadded sequence).
    `temperature=0` is greedy (output identical to the target's greedy decode); `temperature>0` samples losslessly
    from the target's distribution after temperature/top-k/top-p. `repetition_penalty`, `no_repeat_ngram_size` and
    any `logits_processor` list apply to the target's p and the drafter's q alike, as in `generate`.
    `stop_token_ids` (default: the target's EOS; an int, a list or a tensor of ids) end generation after they are
    emitted. `assistant_confidence_threshold` and `num_assistant_tokens` (None: the xPress config's
    `draft_confidence_threshold` / `num_assistant_tokens`) set how many drafts of each block are verified
    (`draft_length`); `num_assistant_tokens="auto"` chooses the cap on this machine, from the checkpoint's measured
    acceptance (`config.draft_acceptance`) and the timed cost of verifying more tokens here (`draft_cap.py`; outputs
    never depend on the cap), and is the default when neither the call nor the config sets a cap and the checkpoint
    carries `draft_acceptance` (`resolve_draft_cap`). `compile=True` runs the same loop with static caches and fixed shapes under `torch.compile`
    (CUDA graphs on a GPU; see `compiled.py`): same results, the first call per (target, drafter, length bucket)
    compiles (`stats.time_compile`); greedy and temperature/top-k/top-p sampling only. `max_cache_len` (compile=True
    only) fixes the static caches' length instead of the bucket of this call, so calls with prompts of any length up
    to it share one compiled state, as `generate(cache_implementation="static", max_cache_len=...)` does for plain
    decoding; it must hold the prompt, `max_new_tokens` and two blocks. `linear_layout`: how `F.linear` is computed
    by the compiled graphs and by the eager loop's verification and drafter (`layout_policy.decoder_policy`); "auto" (default) times `x @ W.T` against
    `(W @ x.T).T` on the models' own weights at each row count once, on a CPU, and goes weight-major where that is at
    least 1.25× faster (on some CPU BLAS builds a few-row product is several times faster weight-major), and in the
    compiled graphs also times MKL-packed float32 weights (`compiled.PackedLinear`) and uses them where they are the
    fastest (the eager loop: its drafter's); "input_major" / "weight_major" / "packed" (compile=True only) force one. (`generate(assistant_model=xpress)` uses "auto".) `tree_nodes=N` drafts a tree of N nodes per step instead of
    a linear block (`trees.py`): built best-first from the head's path-conditioned distributions (from the drafter's
    marginals with `jacobi_max_iters=0`), verified in one target forward, a path accepted greedily or by lossless
    recursive rejection sampling; `num_assistant_tokens` then limits its depth. `tree_nodes="auto"`: the budget with the
    most expected tokens per second on this machine from the checkpoint's `config.tree_acceptance`, or linear blocks
    where no tree pays (`draft_cap.choose_draft_shape`). Both loops (compile=True: one
    verification graph of N + 1 tokens); temperature/top-k/top-p only. Targets with sliding-window layers (Gemma 3,
    Mistral, ...) take every route: their windows are masks by position (`attention_masks`). Returns `.sequences` (prompt
    included) and `.stats`; the stats are also left at `xpress.generation_stats`.
    """
    check_assistant_call(target, xpress, input_ids)
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    check_linear_layout(linear_layout)
    if linear_layout == "packed" and not compile:
        raise ValueError(
            "linear_layout='packed' (weights prepacked for MKL) is a layout of the compiled graphs: pass compile=True, "
            "or use 'auto' (it prepacks the eager drafter's and verification's weights where that is fastest), "
            "'input_major' or 'weight_major' with the eager loop."
        )
    check_decoding_arguments(max_new_tokens, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size)
    if tree_nodes == "auto":  # the tree budget that pays on this machine, or linear blocks where none does
        check_tree_arguments(target, 1, assistant_confidence_threshold, num_assistant_tokens, repetition_penalty,
                             no_repeat_ngram_size, logits_processor)  # fmt: skip
        tree_nodes = choose_draft_shape(xpress, target, compiled=compile, linear_layout=linear_layout).tree_nodes
    if tree_nodes is None:
        num_assistant_tokens = resolve_draft_cap(xpress, target, num_assistant_tokens, compiled=compile,
                                                 linear_layout=linear_layout)  # fmt: skip
        draft_rule = draft_length_rule(xpress.config, assistant_confidence_threshold, num_assistant_tokens)
    else:
        check_tree_arguments(target, tree_nodes, assistant_confidence_threshold, num_assistant_tokens,
                             repetition_penalty, no_repeat_ngram_size, logits_processor)  # fmt: skip
        # A tree's depth: every draft position of the block, or an explicit num_assistant_tokens.
        draft_rule = DraftLengthRule(threshold=None, cap=min(num_assistant_tokens or xpress.config.num_draft_tokens,
                                                             xpress.config.num_draft_tokens))  # fmt: skip
    if attention_mask is not None and (attention_mask.shape != input_ids.shape or not bool(attention_mask.all())):
        raise ValueError(
            f"attention_mask (shape {tuple(attention_mask.shape)}) must be all ones over input_ids (shape "
            f"{tuple(input_ids.shape)}): spec_generate decodes one unpadded sequence. Tokenize the prompt alone, "
            "without padding."
        )
    if stop_token_ids is None:
        stop_token_ids = target.generation_config.eos_token_id
    stop = stop_token_tensor(stop_token_ids, input_ids.device, target.get_output_embeddings().weight.shape[0])
    if max_cache_len is not None and not compile:
        raise ValueError(
            "max_cache_len sizes the static caches of compile=True; the eager loop (compile=False) grows a dynamic "
            "cache as it goes. Pass compile=True, or drop max_cache_len."
        )
    loop = dict(max_new_tokens=max_new_tokens, stop=stop, generator=generator, draft_rule=draft_rule)
    if compile:
        check_compilable(xpress, target, repetition_penalty, no_repeat_ngram_size, logits_processor)
        stats = xpress.generation_stats = CompiledGenerationStats()
        with compiled_steps(xpress, target, input_ids, draft_rule, stats, max_new_tokens=max_new_tokens,
                            temperature=temperature, top_k=top_k, top_p=top_p, max_cache_len=max_cache_len,
                            linear_layout=linear_layout, tree_nodes=tree_nodes) as steps:  # fmt: skip
            return decode(steps, input_ids, stats=stats, **loop)
    processors = decoding_processors(temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size, logits_processor)
    policy = decoder_policy(linear_layout, target, xpress, compiled=False)
    steps = EagerSteps(xpress, target, processors, draft_rule, policy, do_sample=temperature > 0, tree_nodes=tree_nodes)
    stats = xpress.generation_stats = XPressGenerationStats()
    return decode(steps, input_ids, stats=stats, **loop)


__all__ = ["DecodeSteps", "EagerSteps", "XPressGenerateOutput", "decode", "spec_generate"]
