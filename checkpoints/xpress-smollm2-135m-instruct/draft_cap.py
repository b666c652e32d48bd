"""How many drafts per block pay on this machine: `spec_generate(..., num_assistant_tokens="auto")`.

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
tokens per second: E(c) / (drafter + verification(c + 1)).

The timing is of the products only (every `nn.Linear` weight once, in order, so the weights stream from memory as in
a forward, in the layout the compiled graphs will use): attention, norms, the head's decode and the loop's own work
are left out. They are about the same for any c, so leaving them out only understates the fixed part of a block,
which leans the choice towards shorter blocks. Outputs never depend on the choice: every cap is exact.

This file travels with every saved checkpoint; it imports only torch, transformers and its siblings.
"""

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .compiled import linear_layout_kind, linear_weights, pack_weights, packed_linear, release_packed_weights
from .configuration_xpress import check_acceptance
from .generation import VerificationLayout, WallClock


@dataclass
class DraftCapChoice:
    """What `choose_draft_cap` measured: per candidate cap c = 1..len(expected_tokens), the expected tokens per block
    E(c) and the estimated seconds per block: the fixed `draft_seconds` (the drafter's products over the block) plus
    `verify_seconds[c - 1]` (the readout of c drafts and the verification's products over c + 1 tokens); and the cap
    with the most tokens per second."""

    cap: int
    expected_tokens: list[float]
    verify_seconds: list[float]
    draft_seconds: float
    compiled: bool

    @property
    def tokens_per_second(self) -> list[float]:
        return [e / (self.draft_seconds + v) for e, v in zip(self.expected_tokens, self.verify_seconds)]

    def table(self) -> str:
        """One line per candidate cap, the chosen one marked."""
        lines = [f"drafter step (products) {1e3 * self.draft_seconds:.1f} ms per block"]
        for c, (e, v, r) in enumerate(zip(self.expected_tokens, self.verify_seconds, self.tokens_per_second), 1):
            mark = "  <- chosen" if c == self.cap else ""
            lines.append(f"{c:>2} drafts: {e:.2f} tokens per block, verification products {1e3 * v:.1f} ms, "
                         f"{r:.1f} tokens/s (products only){mark}")  # fmt: skip
        return "\n".join(lines)


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
    """The cap c in 1..len(verify_seconds) with the most expected tokens per second, E(c) / (draft + verify[c - 1]);
    the shorter cap on a tie."""
    rates = [expected_tokens(acceptance, c) / (draft_seconds + v) for c, v in enumerate(verify_seconds, 1)]
    return max(range(len(rates)), key=lambda i: (rates[i], -i)) + 1


@torch.no_grad()
def products_seconds(jobs: Sequence[tuple[Sequence[torch.Tensor], int, str]], *, repeats: int = 5) -> list[float]:
    """Median seconds of each job (weights, rows, layout): one pass of `rows` input rows through every weight in
    turn, as a forward multiplies them (each weight once, so they stream from memory), in the layout the graphs or
    the eager loop use (`compiled.linear_layout_kind`): `F.linear(x, W)`, `(W @ x.T).T` ("weight_major") or W's MKL
    pack for that many rows ("packed"). The unpacked jobs are timed in turn, `repeats` rounds after one untimed
    round, so a drift in the machine's speed hits them alike; each packed job is timed alone, between packing its
    weights and dropping the packs it made, so at most one extra copy of the weights is held."""
    inputs = {}
    for weights, rows, _ in jobs:
        for weight in weights:
            key = (rows, weight.shape[1], weight.dtype, weight.device)
            if key not in inputs:
                inputs[key] = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    product = {"input_major": F.linear, "weight_major": lambda x, w: torch.mm(w, x.t()), "packed": packed_linear}

    def sweep(weights, rows, kind):
        for weight in weights:
            product[kind](inputs[(rows, weight.shape[1], weight.dtype, weight.device)], weight)

    clock = WallClock(jobs[0][0][0].device)
    samples = [[] for _ in jobs]
    in_turn = [i for i, job in enumerate(jobs) if job[2] != "packed"]
    for round_ in range(repeats + 1):
        for i in in_turn:
            start = clock.now()
            sweep(*jobs[i])
            if round_:  # the first round warms up
                samples[i].append(clock.now() - start)
    for i, (weights, rows, kind) in enumerate(jobs):
        if kind == "packed":
            new = pack_weights(weights, rows)
            for round_ in range(repeats + 1):
                start = clock.now()
                sweep(weights, rows, kind)
                if round_:
                    samples[i].append(clock.now() - start)
            release_packed_weights(new, rows)
    return [statistics.median(times) for times in samples]


_CHOICES: dict[tuple, tuple] = {}


def choose_draft_cap(xpress, target, *, acceptance: Sequence[float] | None = None, compiled: bool = True,
                     linear_layout: str = "auto", max_cap: int | None = None, repeats: int = 5) -> DraftCapChoice:  # fmt: skip
    """The number of drafts per block with the most expected tokens per second on this machine (module docstring).

    `acceptance`: s_1..s_n (default: the checkpoint's `config.draft_acceptance`); candidates are 1..min(n, `max_cap`,
    block_size - 1). `compiled`: time the products in the layout `spec_generate(compile=True, linear_layout=...)`'s
    graphs will use ("auto": MKL-packed or weight-major where that is clearly faster, on a CPU), else as the eager
    loop runs them (its verification weight-major where that pays, `generation.VerificationLayout`; the drafter as
    the compiled graph's, `generation.DrafterLayout`; the readout input-major).
    Each (models, setting, thread count) is timed once per process: a few seconds on a 2-core CPU for SmolLM2 and 15
    candidates.
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
    candidates = min(len(acceptance), block - 1, max_cap or block)
    key = (id(xpress), id(target), tuple(acceptance), compiled, linear_layout, candidates, torch.get_num_threads(),
           target.dtype, xpress.dtype, target.device)  # fmt: skip
    kept = _CHOICES.get(key)
    if kept is not None and kept[0] is xpress and kept[1] is target:
        return kept[2]

    verification = VerificationLayout(target, linear_layout)  # the eager loop's verification layout

    def graph_layout(weights, rows: int) -> str:  # the readout: input-major in the eager loop
        return linear_layout_kind(linear_layout, weights, rows) if compiled else "input_major"

    def verify_layout(rows: int) -> str:
        if compiled:
            return graph_layout(verification.weights, rows)
        return "weight_major" if verification.weight_major(rows) else "input_major"

    lm_head = target.get_output_embeddings()
    readout = xpress.draft_readout(lm_head)
    readout_weight = [lm_head.weight if readout is None else readout[0]]
    drafter_weights = linear_weights(xpress)
    drafter_kind = linear_layout_kind(linear_layout, drafter_weights, block)  # the eager loop's `DrafterLayout` too
    jobs = [(drafter_weights, block, drafter_kind)]
    for cap in range(1, candidates + 1):  # the verification over cap + 1 tokens, the readout of cap drafts
        jobs += [(verification.weights, cap + 1, verify_layout(cap + 1)),
                 (readout_weight, cap, graph_layout(readout_weight, cap))]  # fmt: skip
    seconds = products_seconds(jobs, repeats=repeats)
    draft_seconds = seconds[0]
    verify_seconds = [seconds[2 * c - 1] + seconds[2 * c] for c in range(1, candidates + 1)]
    choice = DraftCapChoice(
        cap=best_cap(acceptance, draft_seconds, verify_seconds),
        expected_tokens=[expected_tokens(acceptance, c) for c in range(1, candidates + 1)],
        verify_seconds=verify_seconds,
        draft_seconds=draft_seconds,
        compiled=compiled,
    )
    _CHOICES[key] = (xpress, target, choice)
    return choice
