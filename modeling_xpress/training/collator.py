"""`XPressDataCollator`: pads `{"input_ids", "loss_mask"}` rows and samples the blocks to train on.

The anchors of a row are a function of the seed, the epoch and the row alone, so a resumed run, dataloader workers and
other processes draw exactly the anchors of an uninterrupted single-process run."""

import hashlib
from dataclasses import dataclass

import torch

from .arguments import XPressTrainingArguments, check_int

# Label of a block position that is not trained on (past the sequence or outside the response).
IGNORE_INDEX = -100


@dataclass
class XPressDataCollator:
    """Batches `{"input_ids", "loss_mask"}` rows and samples the blocks to train on.

    An anchor is a position t with `loss_mask[t] == loss_mask[t+1] == 1` (inside a response, with at least one
    response token after it). Up to `anchors_per_sequence` distinct anchors are drawn per sequence, uniformly and
    without replacement, from a generator seeded with a hash of (`seed`, `epoch`, the row's tokens and loss mask).
    The anchors of a row are thus a function of the row and the epoch alone, not of how many batches were collated
    before: a resumed run (whose Trainer skips the batches already trained, for a map-style dataset without collating
    them), dataloader workers (each with its own copy of the collator) and other processes all draw exactly the anchors
    of an uninterrupted single-process run. `XPressTrainer` calls `set_epoch` at the start of every epoch, so a row
    seen again gets a fresh draw. (Identical rows in one epoch get identical anchors.)

    A row may carry `anchor_weights` (one number ≥ 0 per token): its anchors are then drawn without replacement with
    probability proportional to the weight of the position (0: never an anchor), e.g. to train on the blocks greedy
    decoding visits rather than on every position alike.

    Returns right-padded `input_ids` / `attention_mask` (b, T); `anchors` (b, m) positions and `anchor_mask` (b, m)
    (False on the padding slots of sequences with fewer than m anchors); `labels` (b, m, n): block position k of the
    block anchored at t is labelled with token t+k, or -100 from the first position that runs past the sequence or
    leaves the response (a draft past a non-response token can never be accepted as a continuation of it).
    """

    block_size: int
    anchors_per_sequence: int = XPressTrainingArguments.anchors_per_sequence  # declared (and documented) once, there
    pad_token_id: int = 0
    max_length: int | None = None
    seed: int = 0
    # The Trainer's pass over the data, part of every row's anchor seed; set by `set_epoch`.
    epoch: int = 0

    def __post_init__(self):
        check_int("block_size", self.block_size, 2)
        check_int("anchors_per_sequence", self.anchors_per_sequence, 1)
        if self.max_length is not None:
            check_int("max_length", self.max_length, 2)
        check_int("seed", self.seed)
        check_int("epoch", self.epoch, 0)

    def set_epoch(self, epoch: int) -> None:
        """Draw the anchors of `epoch` from now on (`XPressTrainer` calls this at the start of every epoch)."""
        check_int("epoch", epoch, 0)
        self.epoch = int(epoch)

    def row_generator(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Generator:
        """The generator a row's anchors are drawn from: seeded by (seed, epoch, the row's tokens and loss mask)."""
        digest = hashlib.blake2b(f"{self.seed}:{self.epoch}:".encode(), digest_size=8)
        digest.update(ids.cpu().numpy().tobytes())
        digest.update(mask.cpu().numpy().tobytes())
        return torch.Generator().manual_seed(int.from_bytes(digest.digest(), "little"))

    @staticmethod
    def row_anchor_weights(i: int, row: dict, tokens: int) -> torch.Tensor | None:
        """Row `i`'s `anchor_weights` (float64, one per each of its `tokens`), or None when it has none."""
        if row.get("anchor_weights") is None:
            return None
        weights = torch.as_tensor(row["anchor_weights"], dtype=torch.float64).flatten()
        if len(weights) != tokens:
            raise ValueError(
                f"row {i}: anchor_weights has {len(weights)} values but input_ids has {tokens} tokens: give one "
                "weight per token"
            )
        if not (torch.isfinite(weights).all() and (weights >= 0).all()):
            raise ValueError(f"row {i}: anchor_weights must be finite and >= 0 (0: never an anchor)")
        return weights

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if len(features) == 0:
            raise ValueError(
                "XPressDataCollator got an empty batch (no rows): pass at least one row with input_ids and loss_mask"
            )
        rows = []
        for i, row in enumerate(features):
            ids = torch.as_tensor(row["input_ids"], dtype=torch.long).flatten()
            mask = torch.as_tensor(row["loss_mask"]).flatten().bool()
            if len(ids) != len(mask):
                raise ValueError(f"row {i}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
            weights = self.row_anchor_weights(i, row, len(ids))
            if self.max_length is not None:
                ids, mask = ids[: self.max_length], mask[: self.max_length]
                weights = None if weights is None else weights[: self.max_length]
            rows.append((ids, mask, weights))
        b, t_max = len(rows), max(len(ids) for ids, _, _ in rows)
        if t_max == 0:
            raise ValueError(
                f"every row of this batch of {b} has 0 tokens: there is nothing to train on. Drop empty rows from the "
                "dataset (e.g. dataset.filter(lambda row: len(row['input_ids']) > 1))"
            )
        m, n = self.anchors_per_sequence, self.block_size - 1

        input_ids = torch.full((b, t_max), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(b, t_max, dtype=torch.long)
        in_response = torch.zeros(b, t_max, dtype=torch.bool)
        anchors = torch.zeros(b, m, dtype=torch.long)
        anchor_mask = torch.zeros(b, m, dtype=torch.bool)
        for i, (ids, mask, weights) in enumerate(rows):
            input_ids[i, : len(ids)] = ids
            attention_mask[i, : len(ids)] = 1
            in_response[i, : len(ids)] = mask
            eligible = (mask[:-1] & mask[1:]).nonzero().flatten()  # t with loss_mask[t] == loss_mask[t+1] == 1
            generator = self.row_generator(ids, mask)
            if weights is None:
                pick = torch.randperm(len(eligible), generator=generator)[:m]
            else:
                w = weights[eligible]
                drawn = min(m, int((w > 0).sum()))
                pick = torch.multinomial(w, drawn, generator=generator) if drawn else eligible[:0]
            chosen = eligible[pick].sort().values
            anchors[i, : len(chosen)] = chosen
            anchor_mask[i, : len(chosen)] = True

        # Label of block position k (1..n) is the token at anchor + k while every token up to it is a response token.
        offsets = torch.arange(1, n + 1)
        positions = anchors[..., None] + offsets  # (b, m, n)
        inside = positions < t_max
        clamped = positions.clamp(max=t_max - 1)
        gathered_ok = torch.gather(in_response[:, None, :].expand(-1, m, -1), 2, clamped) & inside
        valid = gathered_ok.long().cumprod(dim=-1).bool() & anchor_mask[..., None]
        tokens = torch.gather(input_ids[:, None, :].expand(-1, m, -1), 2, clamped)
        labels = torch.where(valid, tokens, torch.full_like(tokens, IGNORE_INDEX))
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "anchors": anchors,
            "anchor_mask": anchor_mask,
            "labels": labels,
        }
