"""The training objective of one batch: `XPressObjective` composes the block layout, the frozen target's signals and the
per-distribution loss (`loss.py`) into `L(p^r) + w_anchor · L(p^b) + w_cons · mean_k L(p̂^r_k)` (paper §4.3; k over
the consistency rounds, the authors' recipe runs three).

Read top to bottom: block layout (`block_position_ids`, `block_attention_mask`, `draft_blocks`: every block of the
batch in one drafter forward, as inference sees it), the frozen target's signals (`target_signals`), then
`XPressObjective`.

Shapes: b = sequences, T = padded sequence length, m = anchors per sequence, B = block size, n = B - 1 draft
positions, N = valid blocks in the batch, H = hidden width, V = vocabulary.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from ..modeling_xpress import XPressModel
from ..refinement import previous_tokens
from .arguments import XPressTrainingArguments
from .loss import (
    DistributionLoss,
    DraftTargets,
    distribution_loss,
    position_weights,
    restrict_to_draft_vocabulary,
    top_k_draft_targets,
)


def block_position_ids(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Positions of `[context ; blocks]`: context 0..T-1, block j at anchor_j .. anchor_j + B - 1. → (b, T + m·B)."""
    b = anchors.shape[0]
    context = torch.arange(context_len, device=anchors.device).expand(b, -1)
    blocks = (anchors[..., None] + torch.arange(block_size, device=anchors.device)).reshape(b, -1)
    return torch.cat([context, blocks], dim=1)


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Boolean (b, 1, m·B, T + m·B) mask, True = attend, reproducing inference for every block at once.

    A block anchored at t sees the context strictly before t (the anchor is the target's newest token, so its
    features are not known yet when the block is drafted), every position of itself, and no other block.
    """
    b, m = anchors.shape
    q = m * block_size
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # (b, q) anchor of each query's block
    sees_context = torch.arange(context_len, device=device).view(1, 1, -1) < query_anchor[..., None]  # (b, q, T)
    query_block = torch.arange(q, device=device) // block_size
    sees_block = (query_block[:, None] == query_block[None, :]).expand(b, q, q)  # block-diagonal
    return torch.cat([sees_context, sees_block], dim=-1).unsqueeze(1)


def draft_blocks(
    xpress: XPressModel, embed_tokens: nn.Module, context: torch.Tensor, anchors: torch.Tensor, anchor_ids: torch.Tensor
) -> torch.Tensor:
    """One drafter forward over every block of the batch: (b, m) anchors → last hidden states (b, m, B, H).

    context: (b, T, L·H_t) target features of every token; anchors: (b, m) positions; anchor_ids: (b, m) tokens.
    """
    b, m = anchors.shape
    block = xpress.config.block_size
    dtype = xpress.fc.weight.dtype
    noise_embeds = xpress.embed_blocks(anchor_ids, embed_tokens)  # (b, m·B, H)
    out = xpress(
        noise_embeds=noise_embeds.to(dtype),
        context_hidden_states=context.to(dtype),
        position_ids=block_position_ids(anchors, context.shape[1], block),
        attention_mask=block_attention_mask(anchors, context.shape[1], block),
    )
    return out.last_hidden_state.view(b, m, block, -1)


@dataclass
class TargetSignals:
    context: torch.Tensor  # (b, T, L·H_t) features of the chosen target layers for every token
    probs: torch.Tensor  # (N, n, V) target next-token distribution p^t at every position of every valid block


@torch.no_grad()
def target_signals(
    target: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    anchors: torch.Tensor,
    anchor_mask: torch.Tensor,
    layer_ids: list[int],
    num_draft_tokens: int,
) -> TargetSignals:
    """One frozen-target forward, teacher-forced on the data: the drafter's context and p^t for each valid block.

    Block position k of a block anchored at t predicts token t+k, so its p^t is the softmax of the target's logits at
    position t+k-1. Only the positions some block needs go through the lm_head (`logits_to_keep`).
    """
    t_len = input_ids.shape[1]
    offsets = torch.arange(num_draft_tokens, device=input_ids.device)
    positions = (anchors[..., None] + offsets).clamp(max=t_len - 1)[anchor_mask]  # (N, n)
    keep = torch.unique(positions)  # sorted
    out = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in layer_ids],
        logits_to_keep=keep,
    )
    context = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    b, m = anchors.shape
    rows = torch.arange(b, device=input_ids.device).view(b, 1, 1).expand(b, m, num_draft_tokens)[anchor_mask]
    logits = out.logits[rows, torch.searchsorted(keep, positions)]  # (N, n, V)
    return TargetSignals(context=context, probs=logits.float().softmax(dim=-1))


@dataclass
class XPressObjectiveOutput(ModelOutput):
    """`loss` to optimise; `metrics`: name → tensor([sum, count]) of every logged quantity (summed over batches and
    processes, then divided, so averages are exact)."""

    loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] | None = None


def _mean_metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.stack([(values.detach() * mask).sum().float(), mask.sum().float()])


class XPressObjective(nn.Module):
    """The training loss of one batch, as a module so that DDP wraps (and synchronises) all of it.

    It owns the drafter being trained (an `XPressModel`, or the `PeftModel` around it) and *borrows* the frozen
    target: the target is deliberately not a submodule, so it is never saved, never handed to the optimizer and
    never wrapped or broadcast by DDP. Its embedding table and lm_head are used, frozen, by the drafter.
    """

    def __init__(
        self,
        xpress: nn.Module,
        target: PreTrainedModel,
        *,
        gamma: float,
        ce_weight: float = XPressTrainingArguments.ce_weight,  # the objective's defaults are the arguments' defaults
        l1_weight: float = XPressTrainingArguments.l1_weight,
        consistency_weight: float = XPressTrainingArguments.consistency_weight,
        consistency_rounds: int = XPressTrainingArguments.consistency_rounds,
    ):
        super().__init__()
        self.xpress = xpress
        object.__setattr__(self, "target", target)  # borrowed, see the class docstring
        self.gamma = gamma
        self.ce_weight = ce_weight
        self.l1_weight = l1_weight
        self.consistency_weight = consistency_weight
        self.consistency_rounds = consistency_rounds

    @property
    def core(self) -> XPressModel:
        """The `XPressModel` itself (inside the PEFT wrapper when training LoRA)."""
        return self.xpress.get_base_model() if hasattr(self.xpress, "get_base_model") else self.xpress

    def _drafter_trainable(self) -> bool:
        return any(p.requires_grad for name, p in self.core.named_parameters() if not name.startswith("refiner."))

    def _loss(self, logits, targets: DraftTargets, weights) -> DistributionLoss:
        return distribution_loss(
            logits, targets.probs, targets.labels, weights, self.ce_weight, self.l1_weight, tail=targets.tail
        )

    def forward(
        self,
        input_ids: torch.LongTensor,
        anchors: torch.LongTensor,
        anchor_mask: torch.BoolTensor,
        labels: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        anchor_weight: float = XPressTrainingArguments.anchor_weight_start,
        features: torch.Tensor | None = None,
        teacher_ids: torch.LongTensor | None = None,
        teacher_probs: torch.Tensor | None = None,
        teacher_tail: torch.Tensor | None = None,
    ) -> XPressObjectiveOutput:
        """Batch from `XPressDataCollator` → total loss and metrics. `anchor_weight` is λ of the current step.

        From a signal cache (`signal_cache.SignalCacheCollator`) the batch also carries the target's `features`
        (b, T, L·H) and p^t of every block position as top-k `teacher_ids` / `teacher_probs` (b, m, n, k) plus
        `teacher_tail` (b, m, n): then the target runs no forward, only its embedding table and lm_head are used."""
        core = self.core
        config = core.config
        embed_tokens, lm_head = self.target.get_input_embeddings(), self.target.get_output_embeddings()
        cached = features is not None
        if cached and (teacher_ids is None or teacher_probs is None or teacher_tail is None):
            raise ValueError("a batch with cached features needs teacher_ids, teacher_probs and teacher_tail too")
        if cached:
            context = features
        else:
            signals = target_signals(
                self.target, input_ids, attention_mask, anchors, anchor_mask, config.target_layer_ids,
                config.num_draft_tokens,
            )  # fmt: skip
            context = signals.context
        anchor_ids = torch.gather(input_ids, 1, anchors)  # (b, m)
        before_ids = torch.gather(input_ids, 1, (anchors - 1).clamp(min=0))  # (b, m) the token before each anchor
        # A frozen drafter (train_mode="refiner") runs without a graph: nothing upstream of the head needs gradients.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self._drafter_trainable()):
            hidden = draft_blocks(core, embed_tokens, context, anchors, anchor_ids)[anchor_mask]  # (N, B, H)
        last = torch.stack([before_ids, anchor_ids], dim=-1)[anchor_mask]  # (N, 2)
        labels = labels[anchor_mask]  # (N, n)
        # Every distribution lives on the draft vocabulary (the whole one by default): s and δ are (N, n, V_d). The
        # head reads every slot of a block (the anchor's first); the drafter's readout only the draft positions.
        hidden = hidden.to(lm_head.weight.dtype)
        base = core.draft_logits(hidden, lm_head)
        if cached:
            targets = top_k_draft_targets(
                teacher_ids[anchor_mask], teacher_probs[anchor_mask].float(), teacher_tail[anchor_mask].float(), labels,
                core.draft_token_ids, lm_head.weight.shape[0],
            )  # fmt: skip
        else:
            targets = restrict_to_draft_vocabulary(signals.probs, labels, core.draft_token_ids)
        weights = position_weights(config.num_draft_tokens, self.gamma, device=base.device)

        def as_target_ids(tokens: torch.Tensor) -> torch.Tensor:
            return tokens if core.draft_token_ids is None else core.draft_token_ids[tokens]

        terms: dict[str, DistributionLoss] = {"base": self._loss(base, targets, weights)}
        if not core.refiner.corrects:  # dFlash's own objective: the drafter's distribution is the draft distribution
            loss, main = terms["base"].loss, "base"
        else:
            # p^r: teacher forcing, the head sees the gold previous tokens [x_-1, anchor, x*_1..x*_{n-1}]. Ignored
            # labels only ever feed ignored positions (validity is a prefix), so their placeholder ids do not matter.
            gold = previous_tokens(last, labels.clamp(min=0))
            terms["refined"] = self._loss(base + core.refiner(hidden, gold), targets, weights)
            loss = terms["refined"].loss + anchor_weight * terms["base"].loss
            main = "refined"
            # p̂^r_k: free-running Jacobi rounds. Round 1 is fed the drafter's own argmax (the seed Jacobi starts
            # from), round k the argmax of round k - 1: the prefixes Jacobi's iterations actually see. The tokens
            # carry no gradient; each round's distribution does.
            tokens, rounds = base.detach().argmax(dim=-1), []
            for _ in range(self.consistency_rounds):
                logits = base + core.refiner(hidden, previous_tokens(last, as_target_ids(tokens)))
                rounds.append(self._loss(logits, targets, weights))
                tokens = logits.detach().argmax(dim=-1)
            if rounds:
                last_round = rounds[-1]
                terms["consistency"] = DistributionLoss(
                    loss=torch.stack([r.loss for r in rounds]).mean(), ce=last_round.ce, l1=last_round.l1,
                    valid=last_round.valid, ce_valid=last_round.ce_valid,
                )  # fmt: skip
                loss = loss + self.consistency_weight * terms["consistency"].loss

        metrics: dict[str, torch.Tensor] = {}
        one = torch.ones((), device=base.device)
        for name, term in terms.items():
            metrics[f"loss_{name}"] = torch.stack([term.loss.detach().float(), one])
            metrics[f"ce_{name}"] = _mean_metric(term.ce, term.ce_valid)
            metrics[f"l1_{name}"] = _mean_metric(term.l1, term.valid)
            metrics[f"accept_{name}"] = _mean_metric(term.accept, term.valid)
        if core.refiner.corrects:
            metrics["anchor_weight"] = torch.stack([torch.tensor(float(anchor_weight), device=base.device), one])
        accept = terms[main].accept  # (N, n), of the distribution drafts are drawn from
        for k in range(config.num_draft_tokens):
            metrics[f"accept_k{k + 1}"] = _mean_metric(accept[:, k], terms[main].valid[:, k])
        # τ estimate at temperature 1: 1 + Σ_k Π_{j≤k} (1 − TV_j), over blocks whose every position is labelled. For
        # a head it is teacher-forced; `tau_estimate_jacobi` is the same estimate of the last free-running round,
        # the head fed its own previous round's drafts as Jacobi feeds it (the figure to select a head by).
        full = terms[main].valid.all(dim=-1)
        metrics["tau_estimate"] = _mean_metric(1.0 + accept.cumprod(dim=-1).sum(dim=-1), full)
        if "consistency" in terms:
            free = terms["consistency"].accept
            metrics["tau_estimate_jacobi"] = _mean_metric(1.0 + free.cumprod(dim=-1).sum(dim=-1), full)
        return XPressObjectiveOutput(loss=loss, metrics=metrics)
