"""Which drafts of a block are verified: the draft-length rule (a cap and a confidence cut, `draft_length`), and the
cap that pays on this machine (`choose_draft_cap`: `num_assistant_tokens="auto"`, and the default of a checkpoint that
carries its measured `draft_acceptance`).

A block that verifies its first c drafts commits on average

    E(c) = 1 + s_1 + ... + s_c        tokens (the anchor's bonus token and the accepted drafts),

where s_k is the fraction of blocks whose first k drafts the target accepts. The checkpoint carries s
(`XPressConfig.draft_acceptance`, measured by greedy decoding of held-out training prompts with whole blocks:
`acceptance_from_blocks`). What a block costs depends on the machine: the drafter's step costs about the same for any
c, the verification is a target forward over c + 1 tokens. On a GPU that forward barely grows with c; on a CPU it is
its matrix products, and how their cost grows with the row count depends on the CPU and its BLAS (on one 2-core Intel
Xeon, MKL's fp32 product over 4 rows cost twice its 1-row cost input-major, and about 1.2x with MKL-packed weights;
on an AMD EPYC, weight-major, about the same). So
`choose_draft_cap` times those products here, on the models' own weights, and takes the c with the most expected
tokens per second: E(c) / (drafter + verification(c + 1)); of caps within the timing's noise of the fastest, the fewest
drafts. How the timing is made stable (repeated rounds, a paired noise check, a record per machine and models that
later processes read instead of timing again) is `tuning.py`.

The timing is of the products only (every `nn.Linear` weight once, in order, so the weights stream from memory as in
a forward, in the layout the compiled graphs will use): attention, norms, the head's decode and the loop's own work
are left out. They are about the same for any c, so leaving them out only understates the fixed part of a block,
which leans the choice towards shorter blocks. Outputs never depend on the choice: every cap is exact.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import math
import statistics
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from .configuration_xpress import check_acceptance, is_integer, is_real
from .layout_policy import decoder_policy
from .policy import time_rounds
from .refinement import RefinementResult
from .trees import build_tree
from .tuning import MIN_ADVANTAGE, Comparison, check_remeasure, compare, machine, models_digest, timed_choice


@dataclass
class DraftCapChoice:
    """What `choose_draft_cap` measured, or read from this machine's record. Per candidate cap (`caps`, fewer drafts
    first: `candidate_caps`) the expected tokens per block E(c) and the median seconds per block: the fixed
    `draft_seconds` (the drafter's products over the block) plus `verify_seconds[i]` (the readout of c drafts and the
    verification's products over c + 1 tokens). `comparison` compares their tokens per second round by round
    (`tuning.compare`); `cap` is the one it chose: the fewest drafts not resolvably slower than the fastest.
    `measure_seconds`: the timing this call did (0 when it read `record`); `record`: the file the rounds were read
    from or written to (None: not kept, `why_not` says why)."""

    cap: int
    caps: list[int]
    expected_tokens: list[float]
    verify_seconds: list[float]
    draft_seconds: float
    compiled: bool
    comparison: Comparison
    rounds: int
    measure_seconds: float
    record: str | None
    why_not: str | None = None

    @property
    def tokens_per_second(self) -> list[float]:
        return [e / (self.draft_seconds + v) for e, v in zip(self.expected_tokens, self.verify_seconds)]

    def table(self) -> str:
        """One line per candidate cap, the chosen one marked."""
        lines = [f"drafter step (products) {1e3 * self.draft_seconds:.1f} ms per block; {_provenance(self)}"]
        for i, (c, e, v, r) in enumerate(zip(self.caps, self.expected_tokens, self.verify_seconds,
                                             self.tokens_per_second)):  # fmt: skip
            mark = "  <- chosen" if c == self.cap else ""
            lines.append(f"{c:>2} drafts: {e:.2f} tokens per block, verification products {1e3 * v:.1f} ms, "
                         f"{r:.1f} tokens/s (products only; {self.comparison.note(i)}){mark}")  # fmt: skip
        return "\n".join(lines)


def _provenance(choice) -> str:
    rounds = f"medians of {choice.rounds} rounds"
    if not choice.measure_seconds:
        return f"{rounds} read from {choice.record}"
    kept = f"kept in {choice.record}" if choice.record else f"{choice.why_not} (the next process measures again)"
    return f"{rounds} timed here in {choice.measure_seconds:.1f} s, {kept}"


def acceptance_from_blocks(acceptance_lengths: Sequence[int], draft_lengths: Sequence[int], block_size: int) -> list[float]:
    """s_1..s_{B-1} from decoded blocks: block i verified `draft_lengths[i]` drafts and committed
    `acceptance_lengths[i]` tokens (its accepted drafts + 1). s_k = among the blocks that verified at least k drafts,
    the fraction whose first k were accepted (a block cut short by the end of generation counts only for the k it
    verified). Positions no block verified get the last estimate's value at most, so s stays non-increasing."""
    if len(acceptance_lengths) != len(draft_lengths) or not acceptance_lengths:
        raise ValueError(
            f"need one acceptance length per drafted block, got {len(acceptance_lengths)} acceptance lengths and "
            f"{len(draft_lengths)} draft lengths"
        )
    survival, previous = [], 1.0
    for k in range(1, block_size):
        verified = [a - 1 for a, d in zip(acceptance_lengths, draft_lengths) if d >= k]
        s = sum(accepted >= k for accepted in verified) / len(verified) if verified else 0.0
        previous = min(previous, s)
        survival.append(previous)
    return survival


def expected_tokens(acceptance: Sequence[float], cap: int) -> float:
    """E(cap) = 1 + s_1 + ... + s_cap: tokens one block commits on average when it verifies `cap` drafts."""
    return 1.0 + sum(acceptance[:cap])


def best_cap(acceptance: Sequence[float], draft_seconds: float, verify_seconds: Sequence[float]) -> int:
    """The cap `choose_draft_cap` takes on one set of costs, `verify_seconds[c - 1]` for caps c = 1, 2, ...: the fewest
    drafts whose expected tokens per second, E(c) / (draft + verify[c - 1]), are within `tuning.MIN_ADVANTAGE` of the
    most (`tuning.compare` of a single round, which has no spread to widen that)."""
    rates = [[expected_tokens(acceptance, c) / (draft_seconds + v)] for c, v in enumerate(verify_seconds, 1)]
    return compare(rates).chosen + 1


def candidate_caps(acceptance: Sequence[float], most: int) -> list[int]:
    """The caps worth timing among 1..`most`: each one's E(c) at least `tuning.MIN_ADVANTAGE` above the last kept
    cap's (E(0) = 1). A cap left out commits fewer than that much more tokens than a shorter kept one and, verifying
    more tokens, costs at least as much (an assumption: input-major products over 3 rows could cost more than over 4,
    the cliff the few-row layouts remove), so it could not be resolvably faster and would not be chosen; leaving it
    out saves its timing. The bundled checkpoint's 15 caps come down to 6 (1, 2, 3, 4, 7, 14)."""
    caps, last = [], 1.0
    for c in range(1, most + 1):
        if expected_tokens(acceptance, c) >= (1 + MIN_ADVANTAGE) * last:
            caps.append(c)
            last = expected_tokens(acceptance, c)
    return caps or [1]


def _record_key(xpress, target, compiled: bool, policy, jobs) -> dict:
    """What the timings of `jobs` depend on: this machine, the models' shapes and dtypes, the loop's layouts (asked,
    and the kinds its policy can choose from)."""
    config = xpress.config
    return {"machine": machine(target.device), "models": models_digest(target, xpress), "compiled": compiled,
            "linear_layout": policy.linear_layout, "layout_kinds": list(policy.KINDS),
            "head": [config.refiner, config.jacobi_max_iters], "jobs": [list(job) for job in jobs]}  # fmt: skip


def _kept_choices(xpress) -> dict:
    """The choices made for this drafter, kept on it (so nothing process-global refers to a model): (target, setting)
    key -> (weak reference to the target, choice)."""
    kept = getattr(xpress, "_draft_cap_choices", None)
    if kept is None:
        kept = xpress._draft_cap_choices = {}
    return kept


def choose_draft_cap(xpress, target, *, acceptance: Sequence[float] | None = None, compiled: bool = True,
                     linear_layout: str = "auto", max_cap: int | None = None, remeasure: bool = False) -> DraftCapChoice:  # fmt: skip
    """The number of drafts per block with the most expected tokens per second on this machine (module docstring);
    of caps within the noise of the fastest, the fewest drafts (`tuning`).

    `acceptance`: s_1..s_n (default: the checkpoint's `config.draft_acceptance`); candidates are
    `candidate_caps` of 1..min(n, `max_cap`, block_size - 1). `compiled`: time the products in the layouts
    `spec_generate(compile=True, linear_layout=...)`'s graphs will use, else in the eager loops' (the loops' own
    `layout_policy.decoder_policy`). The timed rounds are kept in this machine's record (`tuning.Records`, under
    `$XPRESS_CACHE/choices/`), so only the first process times them: the layouts' decisions, a warm-up and
    `tuning.MIN_ROUNDS` rounds, then more for up to `tuning.BUDGET_SECONDS`, and for up to
    `tuning.SETTLE_BUDGET_SECONDS` more where those left the choice to their noise (SmolLM2 fp32 on two cores at load
    5-7: 27-37 s eager, 83-101 s compiled, before the settling rounds; not measured idle); a later process reads the record (0.05 s). A measurement
    that is too noisy, or made while other jobs held the cores (then: the fewest drafts), is used but not kept. Each
    (models, setting, thread count) is resolved once per process; `remeasure=True` (or `XPRESS_REMEASURE=1`) times
    again and replaces the record.
    """
    block = xpress.config.block_size
    if acceptance is None:
        acceptance = getattr(xpress.config, "draft_acceptance", None)
        if acceptance is None:
            raise ValueError(
                "this checkpoint's config has no draft_acceptance, so num_assistant_tokens='auto' cannot weigh drafts "
                "against their cost: pass an integer num_assistant_tokens, or measure it on held-out prompts "
                "(examples/choose_draft_length.py writes it; set xpress.config.draft_acceptance = [s_1, s_2, ...])"
            )
    acceptance = check_acceptance(acceptance, block)
    if max_cap is not None and (not isinstance(max_cap, int) or max_cap < 1):
        raise ValueError(f"max_cap must be a positive integer or None, got {max_cap!r}")
    check_remeasure(remeasure)
    caps = candidate_caps(acceptance, min(len(acceptance), block - 1, max_cap or block))
    key = (id(target), tuple(acceptance), compiled, linear_layout, tuple(caps), torch.get_num_threads(),
           target.dtype, xpress.dtype, target.device)  # fmt: skip
    kept = _kept_choices(xpress).get(key)
    if kept is not None and kept[0]() is target and not remeasure:
        return kept[1]

    policy = decoder_policy(linear_layout, target, xpress, compiled=compiled)  # the loop's own layouts
    jobs = [("drafter", block)]
    for cap in caps:  # the verification over cap + 1 tokens, the readout of cap drafts
        jobs += [("verify", cap + 1), ("head", cap)]
    expected = [expected_tokens(acceptance, c) for c in caps]

    def decide(samples):  # per round: E(c) / (drafter + verification + readout)
        drafter = samples[0]
        return compare([[e / sum(parts) for parts in zip(drafter, samples[2 * i + 1], samples[2 * i + 2])]
                        for i, e in enumerate(expected)])  # fmt: skip

    timed = timed_choice("draft-cap", _record_key(xpress, target, compiled, policy, jobs),
                         lambda rounds: policy.products_samples(jobs, rounds=rounds), decide,
                         remeasure=remeasure)  # fmt: skip
    seconds = timed.medians
    choice = DraftCapChoice(
        cap=caps[timed.comparison.chosen], caps=caps, expected_tokens=expected,
        verify_seconds=[seconds[2 * i + 1] + seconds[2 * i + 2] for i in range(len(caps))],
        draft_seconds=seconds[0], compiled=compiled, comparison=timed.comparison, rounds=timed.rounds,
        measure_seconds=timed.measure_seconds, record=timed.record, why_not=timed.why_not,
    )  # fmt: skip
    _kept_choices(xpress)[key] = (weakref.ref(target), choice)
    return choice


@dataclass
class DraftShapeChoice:
    """What `choose_draft_shape` measured, or read from this machine's record: linear blocks (`linear`, the
    `DraftCapChoice` made here) at the caps `lines` (its chosen cap, and its fastest where that differs), their step's
    median seconds `line_seconds`, and per tree budget N of the checkpoint's `tree_acceptance` the median seconds of a
    tree step (the drafter's products, the readout of every draft position, the construction of N nodes, the
    verification's products over N + 1 tokens); `comparison` of their tokens per second round by round, the lines
    first, then the budgets from the smallest (`tuning.compare`); `tree_nodes` the budget it chose, or None for linear
    blocks (at `linear.cap`). `measure_seconds` and `record` as in `DraftCapChoice`."""

    tree_nodes: int | None
    linear: DraftCapChoice
    lines: list[int]
    line_seconds: list[float]
    tree_tokens: dict[int, float]
    tree_seconds: dict[int, float]
    comparison: Comparison
    rounds: int
    measure_seconds: float
    record: str | None
    why_not: str | None = None

    @property
    def tree_rates(self) -> dict[int, float]:
        return {n: self.tree_tokens[n] / self.tree_seconds[n] for n in self.tree_tokens}

    def table(self) -> str:
        lines = [_provenance(self)]
        for i, (cap, seconds) in enumerate(zip(self.lines, self.line_seconds)):
            tokens = self.linear.expected_tokens[self.linear.caps.index(cap)]
            mark = "  <- chosen" if self.tree_nodes is None and cap == self.linear.cap else ""
            lines.append(f"linear blocks, {cap} drafts: {tokens:.2f} tokens per step, step {1e3 * seconds:.1f} ms, "
                         f"{tokens / seconds:.1f} tokens/s (products only; {self.comparison.note(i)}){mark}")  # fmt: skip
        for i, (n, rate) in enumerate(self.tree_rates.items(), len(self.lines)):
            mark = "  <- chosen" if n == self.tree_nodes else ""
            lines.append(f"tree of {n:>3} nodes: {self.tree_tokens[n]:.2f} tokens per step, step "
                         f"{1e3 * self.tree_seconds[n]:.1f} ms, {rate:.1f} tokens/s (products and construction; "
                         f"{self.comparison.note(i)}){mark}")  # fmt: skip
        return "\n".join(lines)


def choose_draft_shape(xpress, target, *, compiled: bool = True, linear_layout: str = "auto",
                       remeasure: bool = False) -> DraftShapeChoice:  # fmt: skip
    """`tree_nodes="auto"`: a draft tree of the budget with the most expected tokens per second on this machine, or
    linear blocks (None, at the cap chosen here: `choose_draft_cap`) where no tree is resolvably faster than the best
    linear cap; of settings within the noise of the fastest, linear blocks, then the smallest tree (`tuning`). So a
    busy machine, whose cap falls back on fewer drafts, does not hand the win to a tree. τ per budget is the
    checkpoint's `config.tree_acceptance`; the costs are the loop's products timed in its own layouts, as for the cap,
    plus the tree's construction (the head on each node's path), timed on this drafter, all in the same rounds and
    kept in this machine's record like the cap's. On a GPU, where verifying more tokens costs little, that is the
    largest budget that pays; on a CPU in fp32 often none."""
    acceptance = getattr(xpress.config, "tree_acceptance", None)
    if acceptance is None:
        raise ValueError(
            "this checkpoint's config has no tree_acceptance, so tree_nodes='auto' cannot weigh a tree against its "
            "cost: pass an integer tree_nodes, or measure it on held-out prompts (examples/tree_benchmark.py) and set "
            "xpress.config.tree_acceptance = {N: tokens per verification, ...}"
        )
    check_remeasure(remeasure)
    linear = choose_draft_cap(xpress, target, compiled=compiled, linear_layout=linear_layout, remeasure=remeasure)
    key = ("trees", id(target), tuple(acceptance.items()), linear.cap, compiled, linear_layout,
           torch.get_num_threads(), target.dtype, xpress.dtype, target.device)  # fmt: skip
    kept = _kept_choices(xpress).get(key)
    if kept is not None and kept[0]() is target and not remeasure:
        return kept[1]
    block, n = xpress.config.block_size, xpress.config.block_size - 1
    policy = decoder_policy(linear_layout, target, xpress, compiled=compiled)
    budgets = sorted(acceptance)
    # Linear blocks at the cap chosen here and at the fastest cap (when they differ): a tree must be resolvably faster
    # than the best line, not only than the simplest one the cap's noise allowed.
    lines = sorted({linear.cap, linear.caps[linear.comparison.fastest]})
    jobs = [("drafter", block), *[job for c in lines for job in (("verify", c + 1), ("head", c))], ("head", n),
            *[("verify", b + 1) for b in budgets]]  # fmt: skip
    generator = torch.Generator(device=xpress.device).manual_seed(0)  # not the caller's random state
    hidden = torch.randn(1, n + 1, xpress.config.hidden_size, generator=generator, device=xpress.device)  # B slots
    width = xpress.config.draft_vocab_size or xpress.config.vocab_size
    base = torch.randn(1, n, width, generator=generator, device=xpress.device) * 4
    last = torch.zeros(1, 2, dtype=torch.long, device=xpress.device)  # the token before the anchor, the anchor
    builds = [lambda b=b: build_tree(xpress, hidden.to(xpress.dtype), base, last, b) for b in budgets]

    def measure(rounds: int) -> list[list[float]]:
        return policy.products_samples(jobs, rounds=rounds) + time_rounds(builds, xpress.device, rounds)

    trees = 2 + 2 * len(lines)  # samples[trees + i]: the verification of budget i; after them, the constructions

    def step_seconds(samples) -> list[list[float]]:
        """Per candidate (the lines, then the trees), its step's seconds in each round."""
        drafter, readout_all = samples[0], samples[1 + 2 * len(lines)]
        steps = [[sum(p) for p in zip(drafter, samples[1 + 2 * i], samples[2 + 2 * i])] for i in range(len(lines))]
        for i in range(len(budgets)):
            steps.append([sum(p) for p in zip(drafter, readout_all, samples[trees + i],
                                              samples[trees + len(budgets) + i])])  # fmt: skip
        return steps

    tokens = [linear.expected_tokens[linear.caps.index(c)] for c in lines] + [acceptance[b] for b in budgets]

    def decide(samples):  # per round: tokens per step / the step's seconds; the lines first, then the budgets
        return compare([[t / s for s in step] for t, step in zip(tokens, step_seconds(samples))])

    all_jobs = jobs + [("build", b) for b in budgets]
    timed = timed_choice("draft-shape", _record_key(xpress, target, compiled, policy, all_jobs), measure,
                         decide, remeasure=remeasure)  # fmt: skip
    seconds = [statistics.median(step) for step in step_seconds(timed.samples)]
    chosen = timed.comparison.chosen
    choice = DraftShapeChoice(
        tree_nodes=None if chosen < len(lines) else budgets[chosen - len(lines)], linear=linear, lines=lines,
        line_seconds=seconds[: len(lines)], tree_tokens={b: acceptance[b] for b in budgets},
        tree_seconds=dict(zip(budgets, seconds[len(lines) :])), comparison=timed.comparison, rounds=timed.rounds,
        measure_seconds=timed.measure_seconds, record=timed.record, why_not=timed.why_not,
    )  # fmt: skip
    _kept_choices(xpress)[key] = (weakref.ref(target), choice)
    return choice


@dataclass(frozen=True)
class DraftLengthRule:
    """How many drafts of a block go to verification: at most `cap`, cut by cumulative confidence (`draft_length`)."""

    threshold: float | None  # cumulative-confidence threshold; None or 0 = no cut
    cap: int  # at most this many drafts per block, 1..block_size - 1


def draft_length_rule(config, assistant_confidence_threshold=None, num_assistant_tokens=None) -> DraftLengthRule:
    """The draft-length rule of one generation call: the call's values where given (not None), else the xPress
    config's (`draft_confidence_threshold`, `num_assistant_tokens`). A cap above the block is clamped to the block."""
    threshold, cap = assistant_confidence_threshold, num_assistant_tokens
    # getattr: a checkpoint saved before these fields existed, loaded with its own code (trust_remote_code), has a
    # config class without them; it keeps verifying whole blocks, as it did.
    threshold = getattr(config, "draft_confidence_threshold", None) if threshold is None else threshold
    cap = getattr(config, "num_assistant_tokens", None) if cap is None else cap
    if threshold is not None and (not is_real(threshold) or not 0 <= threshold <= 1):
        raise ValueError(
            f"assistant_confidence_threshold must be None or a number in [0, 1] (0 = no cut), got {threshold!r}"
        )
    if cap is not None and (not is_integer(cap) or cap < 1):
        raise ValueError(f"num_assistant_tokens must be None or an integer >= 1, got {cap!r}")
    block = config.num_draft_tokens
    return DraftLengthRule(threshold=threshold, cap=block if cap is None else min(cap, block))


def resolve_draft_cap(xpress, target, num_assistant_tokens, *, compiled: bool, linear_layout: str = "auto"):
    """A call's `num_assistant_tokens` as an int or None (whole blocks): an int as given; "auto" the cap chosen on this
    machine (`draft_cap.choose_draft_cap`, in the layout of the loop that will run: compiled or eager); None the xPress
    config's `num_assistant_tokens` if it sets one, else, for a checkpoint that carries its measured
    `draft_acceptance`, the cap chosen on this machine (the default that pays: on a CPU in fp32 a whole block's
    verification costs several plain steps), else None. The choice is timed once per machine, models and setting and
    kept in the cache folder's record (`choose_draft_cap` says what that costs), and in a process on the drafter."""
    if isinstance(num_assistant_tokens, str):
        if num_assistant_tokens != "auto":
            raise ValueError(
                f"num_assistant_tokens must be None (the config's), a positive integer or 'auto' (chosen on this "
                f"machine from config.draft_acceptance), got {num_assistant_tokens!r}"
            )
    elif num_assistant_tokens is not None or getattr(xpress.config, "num_assistant_tokens", None) is not None:
        return num_assistant_tokens
    elif getattr(xpress.config, "draft_acceptance", None) is None:
        return None
    return choose_draft_cap(xpress, target, compiled=compiled is True, linear_layout=linear_layout).cap


def draft_length(result: RefinementResult, threshold: float | None, budget: int) -> int:
    """How many of the block's first `budget` drafts to verify: up to and including the first draft whose cumulative
    confidence prod_{j<=k} q_j(x_j) falls below `threshold` (q_j: softmax of `result.logits`, the distribution x_j was
    drawn from); all `budget` when none does or `threshold` is None/0. At least one draft is always verified.

    Why the first draft below the threshold is still verified: speculative sampling stays lossless when the number of
    drafts verified is a stopping rule on the drafter's own samples, i.e. whether draft k is verified depends only on
    drafts 1..k-1 (here: on their cumulative confidence), never on draft k itself. Then, given that k is verified, x_k
    is still an unconditioned draw from q_k, and the accept/resample step at k yields the target's p_k exactly, as in
    the standard proof (Leviathan et al., Thm. 1); a cut before k just makes the target's own token the bonus there.
    Cutting *before* the first low-confidence draft would decide on x_k by its own value: the drafts verified at k
    would come from q_k restricted to its confident tokens while acceptance divides by q_k, which is biased (q_k =
    (0.9, 0.1), p_k = (0.5, 0.5), threshold 0.5: the first token would come out with probability 0.55, not 0.5).
    Greedy output is the target's own whatever the length.
    """
    if not threshold or budget <= 1:
        return budget
    logits = result.logits[0, :budget].float()  # (m, V)
    tokens = result.tokens[0, :budget].to(logits.device)
    log_q = logits.gather(-1, tokens.view(-1, 1))[:, 0] - logits.logsumexp(dim=-1)  # (m,) log q_k(x_k)
    below = (log_q.cumsum(dim=0) < math.log(threshold)).nonzero()
    return budget if below.numel() == 0 else int(below[0]) + 1


__all__ = [
    "DraftCapChoice",
    "DraftLengthRule",
    "DraftShapeChoice",
    "acceptance_from_blocks",
    "best_cap",
    "candidate_caps",
    "choose_draft_cap",
    "choose_draft_shape",
    "draft_length",
    "draft_length_rule",
    "expected_tokens",
    "resolve_draft_cap",
]
