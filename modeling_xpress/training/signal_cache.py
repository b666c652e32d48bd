"""The frozen target's training signals, computed once and read back by every training run.

Every training step needs two things from the frozen target: the context features at the drafter's
`target_layer_ids` and the teacher distribution p^t at each labelled position. They do not depend on the drafter, so
the drafter stage and every head stage trained on the same data (and every epoch) would recompute the same target
forward, about half of a CPU training step. This module writes them once:

1. `cache_target_signals` runs the target over a `{"input_ids", "loss_mask"}` dataset and writes, per row, the
   features at the chosen layers (bf16 by default) and p^t as its `top_k` largest probabilities plus the mass left
   over (the tail), in resumable shards.
2. `load_signal_cache` reads the shards back as one memory-mapped `datasets.Dataset`.
3. `XPressTrainer` recognises such a dataset (`signal_cache_settings`), checks it was made for this drafter's layers
   and this target (`check_signal_cache`), and collates it with `SignalCacheCollator`: the batch carries the features
   and the block positions' teacher rows, and `XPressObjective` then runs no target forward at all.

Folder layout: `manifest.json` (what the cache was made from, see `regeneration.SHARD_MANIFEST`) and
`shard-NNNNN.arrow`, each an Arrow IPC stream (the format of `datasets`' own cache files, memory-mapped by
`datasets.Dataset.from_file`) of `shard_size` consecutive dataset rows, in dataset order. A row of T tokens holds:

| column       | stored            | meaning                                                                          |
|--------------|-------------------|----------------------------------------------------------------------------------|
| `input_ids`  | int32 (T,)        | the row's tokens (cut to `max_length`)                                           |
| `loss_mask`  | int8 (T,)         | 1 on response tokens                                                             |
| `features`   | (T·L·H,) flat     | `cat(hidden_states[i + 1] for i in layer_ids)`, row-major (T, L·H); bfloat16 is  |
|              |                   | stored as its int16 bit pattern (Arrow has no bfloat16), float16/32 as such      |
| `topk_ids`   | int32 (T·k,)      | per position t, the k likeliest next tokens under p^t(· | x_≤t), likeliest first |
| `topk_probs` | float32 (T·k,)    | their probabilities                                                              |
| `tail`       | float32 (T,)      | 1 − Σ topk_probs: the mass of p^t outside the top k                               |

The teacher columns are filled only at positions t whose next token is labelled (`loss_mask[t + 1] == 1`, the only
positions a block ever reads p^t at) and are zero elsewhere. Bytes per token: 2·L·H (bf16 features) + 8·k + 9.

This file does not travel with checkpoints (it imports `datasets` and the training code).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..configuration_xpress import is_integer
from .collator import IGNORE_INDEX, XPressDataCollator
from .regeneration import SHARD_MANIFEST, _model_fingerprint, _open_shard_dir, _run_fingerprint, _write_json_atomic

CACHE_FORMAT = "xpress-signal-cache-v1"
CACHE_COLUMNS = ("features", "topk_ids", "topk_probs", "tail")
"""The columns a signal-cache row adds to `input_ids` and `loss_mask`."""

# How each feature dtype is stored: Arrow has no bfloat16, so its 16 bits travel as an int16 (viewed back, not cast).
_STORED_FEATURE_TYPE = {torch.bfloat16: "int16", torch.float16: "float16", torch.float32: "float32"}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _cache_features(dtype: torch.dtype) -> datasets.Features:
    return datasets.Features({
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "features": datasets.List(datasets.Value(_STORED_FEATURE_TYPE[dtype])),
        "topk_ids": datasets.List(datasets.Value("int32")),
        "topk_probs": datasets.List(datasets.Value("float32")),
        "tail": datasets.List(datasets.Value("float32")),
    })  # fmt: skip


def _shard_path(folder: Path, shard: int) -> Path:
    return folder / f"shard-{shard:05d}.arrow"


def target_identity(target: PreTrainedModel) -> str:
    """The target a cache belongs to: `regeneration`'s fingerprint (class, head dtype, shape, checksum) plus a checksum
    of every parameter, so a target with the same head but other layers is told apart."""
    checksum = sum(float(p.detach().double().sum()) for p in target.parameters())
    return f"{_model_fingerprint(target)}|parameters {checksum:.6e}"


def _rows_digest(rows: list[tuple[np.ndarray, np.ndarray]]) -> str:
    digest = hashlib.sha256()
    for ids, mask in rows:
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(ids.astype(np.int64).tobytes())
        digest.update(mask.astype(np.int8).tobytes())
    return digest.hexdigest()


def _read_rows(dataset, max_length: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, loss_mask) of every row, cut to `max_length`, as numpy arrays."""
    rows = []
    for i in range(len(dataset)):
        row = dataset[i]
        ids = np.asarray(row["input_ids"], dtype=np.int64).reshape(-1)
        mask = np.asarray(row["loss_mask"]).reshape(-1).astype(np.int8)
        if len(ids) != len(mask):
            raise ValueError(f"row {i}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}")
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        rows.append((ids, mask))
    return rows


@torch.no_grad()
def _batch_signals(
    target: PreTrainedModel,
    rows: list[tuple[np.ndarray, np.ndarray]],
    layer_ids: list[int],
    top_k: int,
    dtype: torch.dtype,
) -> list[dict[str, np.ndarray]]:
    """One target forward over a right-padded batch (the call `objective.target_signals` makes) → each row's columns."""
    device = target.device
    b, t_max = len(rows), max(len(ids) for ids, _ in rows)
    input_ids = torch.zeros(b, t_max, dtype=torch.long)
    attention_mask = torch.zeros(b, t_max, dtype=torch.long)
    labelled = []  # per row, the positions t with loss_mask[t + 1] == 1: where p^t is needed
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.from_numpy(ids)
        attention_mask[i, : len(ids)] = 1
        labelled.append(torch.from_numpy(np.flatnonzero(mask[1:])))
    keep = torch.unique(torch.cat(labelled)) if any(len(p) for p in labelled) else torch.zeros(1, dtype=torch.long)
    out = target(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        output_hidden_states=[i + 1 for i in layer_ids],
        logits_to_keep=keep.to(device),
    )
    context = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (b, T, L·H)
    results = []
    for i, (ids, mask) in enumerate(rows):
        length, positions = len(ids), labelled[i]
        topk_ids = torch.zeros(length, top_k, dtype=torch.int32)
        topk_probs = torch.zeros(length, top_k, dtype=torch.float32)
        tail = torch.zeros(length, dtype=torch.float32)
        if len(positions):
            logits = out.logits[i, torch.searchsorted(keep, positions).to(device)]  # (P, V)
            probs = logits.float().softmax(dim=-1)  # exactly what the live objective uses as p^t
            values, indices = probs.topk(top_k, dim=-1)
            topk_ids[positions] = indices.to("cpu", torch.int32)
            topk_probs[positions] = values.cpu()
            tail[positions] = (1.0 - values.sum(dim=-1)).clamp(min=0.0).cpu()
        features = context[i, :length].to(dtype).cpu().contiguous()
        if dtype == torch.bfloat16:
            features = features.view(torch.int16)
        results.append({
            "input_ids": ids.astype(np.int32), "loss_mask": mask, "features": features.numpy().reshape(-1),
            "topk_ids": topk_ids.numpy().reshape(-1), "topk_probs": topk_probs.numpy().reshape(-1),
            "tail": tail.numpy(),
        })  # fmt: skip
    return results


def _record_batch(results: list[dict[str, np.ndarray]], columns: datasets.Features) -> pa.RecordBatch:
    """Rows of numpy columns → one Arrow record batch (list columns built from offsets, no Python lists)."""
    schema = columns.arrow_schema
    arrays = []
    for field in schema:
        values = [row[field.name] for row in results]
        offsets = np.concatenate([[0], np.cumsum([len(v) for v in values], dtype=np.int64)])
        if offsets[-1] >= 2**31:
            raise ValueError(
                f"{offsets[-1]} {field.name} values in one record batch exceed Arrow's 32-bit list offsets: pass a "
                "smaller batch_size"
            )
        offsets = offsets.astype(np.int32)
        item = field.type.value_type
        flat = np.concatenate(values).astype(item.to_pandas_dtype(), copy=False)  # an empty row's columns are float64
        arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat, type=item)))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _write_shard_atomic(path: Path, batches: list[pa.RecordBatch], schema: pa.Schema) -> None:
    """Write an Arrow stream under a temporary name and rename it: a killed run never leaves a truncated shard that a
    resume would take for a finished one."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def cache_target_signals(
    target: PreTrainedModel,
    dataset,
    layer_ids: list[int],
    folder: str | os.PathLike,
    *,
    top_k: int = 64,
    batch_size: int = 4,
    shard_size: int = 256,
    dtype: torch.dtype = torch.bfloat16,
    max_length: int | None = None,
    progress: bool = True,
) -> datasets.Dataset:
    """Run the frozen target over `dataset` once and write its training signals to `folder`; return the cache.

    Args:
        target: the frozen target (eval mode), on the device to run it on.
        dataset: rows with `input_ids` and `loss_mask` (a `datasets.Dataset` or a list of dicts), e.g. from
            `regeneration.regenerate_responses`.
        layer_ids: target layers whose outputs the drafter reads: its `config.target_layer_ids`. One cache serves
            every stage (drafter alone, each head) of drafters with these layers.
        folder: shard folder. Calling again with the same arguments skips finished shards (an interrupted run resumes);
            a folder made from other rows, another target or other settings is refused.
        top_k: how many of p^t's largest probabilities are kept per position; the rest is one number, the tail. The
            L1 term trained from the cache exceeds the live one by at most 2 × tail (docs/training.md).
        batch_size: rows per target forward. Does not change the result beyond float rounding; may change on resume.
        shard_size: rows per shard file; the writer holds one shard's signals in memory.
        dtype: dtype the features are stored in: bfloat16 (what `--bf16` training feeds the drafter anyway), float16
            or float32 (exact).
        max_length: cut rows to this many tokens (the training run's `max_seq_length`), saving the space of the rest.
        progress: show a tqdm bar over rows.

    Returns:
        `load_signal_cache(folder)`.
    """
    if target.training:
        raise ValueError("The target is in training mode; call `target.eval()` before caching its signals.")
    if dtype not in _STORED_FEATURE_TYPE:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if not is_integer(top_k) or not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be an integer between 1 and the vocabulary size {vocab_size}, got {top_k!r}")
    for name, value in (("batch_size", batch_size), ("shard_size", shard_size)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_length is not None and (not is_integer(max_length) or max_length < 2):
        raise ValueError(f"max_length must be an integer >= 2 or None, got {max_length!r}")
    num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    if not all(is_integer(i) for i in layer_ids):
        raise ValueError(f"layer_ids must be integer target layer indices, got {list(layer_ids)}")
    layer_ids = [int(i) for i in layer_ids]
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"layer_ids must be target layers in [0, {num_layers}), got {layer_ids}")
    rows = _read_rows(dataset, max_length)
    if not rows:
        raise ValueError("the dataset has no rows: there is nothing to cache")

    hidden_size = target.config.get_text_config(decoder=True).hidden_size
    settings = {
        "format": CACHE_FORMAT, "layer_ids": layer_ids, "top_k": top_k, "dtype": _DTYPE_NAMES[dtype],
        "feature_width": len(layer_ids) * hidden_size, "vocab_size": vocab_size, "max_length": max_length,
        "shard_size": shard_size, "num_rows": len(rows), "rows_sha256": _rows_digest(rows),
        "target": target_identity(target),
    }  # fmt: skip
    folder = Path(folder)
    # The rows enter through their digest, so the fingerprint hashes no token lists of its own.
    manifest = _open_shard_dir(folder, _run_fingerprint([], settings, target), settings, len(rows))

    columns = _cache_features(dtype)
    num_shards = math.ceil(len(rows) / shard_size)
    finished = {s for s in range(num_shards) if _shard_path(folder, s).is_file()}
    done = sum(len(range(s * shard_size, min((s + 1) * shard_size, len(rows)))) for s in finished)
    bar = tqdm(total=len(rows), initial=done, unit="row", desc="caching target signals", disable=not progress)
    for shard in range(num_shards):
        if shard in finished:
            continue
        start_time = time.perf_counter()
        indices = list(range(shard * shard_size, min((shard + 1) * shard_size, len(rows))))
        # Longest rows first, so a target batch carries little padding; written back in dataset order.
        by_length = sorted(indices, key=lambda i: -len(rows[i][0]))
        results: dict[int, dict[str, np.ndarray]] = {}
        for start in range(0, len(by_length), batch_size):
            batch = [i for i in by_length[start : start + batch_size] if len(rows[i][0]) > 0]
            if batch:
                results.update(zip(batch, _batch_signals(target, [rows[i] for i in batch], layer_ids, top_k, dtype)))
            bar.update(len(by_length[start : start + batch_size]))
        for i in indices:  # an empty row has empty columns
            if i not in results:
                empty = {name: np.zeros(0) for name in columns}
                results[i] = empty | {"input_ids": rows[i][0].astype(np.int32), "loss_mask": rows[i][1]}
        # One record batch per `batch_size` rows: Arrow's 32-bit list offsets bound a batch, not the shard.
        batches = [
            _record_batch([results[i] for i in indices[start : start + batch_size]], columns)
            for start in range(0, len(indices), batch_size)
        ]
        _write_shard_atomic(_shard_path(folder, shard), batches, columns.arrow_schema)
        manifest["shards"][f"{shard:05d}"] = {
            "rows": len(indices), "tokens": int(sum(len(rows[i][0]) for i in indices)),
            "bytes": _shard_path(folder, shard).stat().st_size, "seconds": round(time.perf_counter() - start_time, 3),
        }  # fmt: skip
        _write_json_atomic(folder / SHARD_MANIFEST, manifest)
    bar.close()
    return load_signal_cache(folder)


def load_signal_cache(folder: str | os.PathLike) -> datasets.Dataset:
    """The rows of a finished cache folder, in dataset order, as one memory-mapped `datasets.Dataset` in torch format
    (columns keep their stored dtypes). Its `info.description` carries the cache's settings, which `XPressTrainer`
    checks against the drafter and the target (`signal_cache_settings`)."""
    folder = Path(folder)
    manifest_path = folder / SHARD_MANIFEST
    if not manifest_path.is_file():
        raise ValueError(
            f"{folder} has no {SHARD_MANIFEST}: it is not a signal cache. Write one with cache_target_signals"
        )
    settings = json.loads(manifest_path.read_text()).get("settings", {})
    if settings.get("format") != CACHE_FORMAT:
        raise ValueError(
            f"{folder} is not a signal cache (format {settings.get('format')!r}, expected {CACHE_FORMAT!r})"
        )
    num_shards = math.ceil(settings["num_rows"] / settings["shard_size"])
    missing = [s for s in range(num_shards) if not _shard_path(folder, s).is_file()]
    if missing:
        raise ValueError(
            f"{folder} is unfinished: {len(missing)} of {num_shards} shards are missing (first: {missing[0]}). Run "
            "cache_target_signals again with the same arguments to finish it."
        )
    shards = [datasets.Dataset.from_file(str(_shard_path(folder, s))) for s in range(num_shards)]
    info = datasets.DatasetInfo(description=json.dumps({CACHE_FORMAT: settings}))
    cache = datasets.concatenate_datasets(shards, info=info)
    # torch format, but without datasets' default upcast of every integer column to int64 (features would quadruple).
    return cache.with_format("torch", dtype=None)


def signal_cache_settings(dataset) -> dict | None:
    """The settings of a dataset loaded with `load_signal_cache`; None for plain `{"input_ids", "loss_mask"}` rows."""
    columns = getattr(dataset, "column_names", None)
    if columns is None or not set(CACHE_COLUMNS) <= set(columns):
        return None
    try:
        return json.loads(dataset.info.description)[CACHE_FORMAT]
    except (AttributeError, TypeError, ValueError, KeyError):
        raise ValueError(
            "this dataset has the columns of a signal cache but not its settings (layer ids, target): load the cache "
            "with modeling_xpress.training.signal_cache.load_signal_cache(folder)"
        ) from None


def check_signal_cache(settings: dict, config, target: PreTrainedModel) -> None:
    """Raise a `ValueError` unless the cache with `settings` holds the features the drafter with `config` reads, made
    by `target`."""
    if list(settings["layer_ids"]) != list(config.target_layer_ids):
        raise ValueError(
            f"the signal cache holds target layers {settings['layer_ids']} but this drafter reads "
            f"{list(config.target_layer_ids)} (config.target_layer_ids): build a cache with "
            "layer_ids=config.target_layer_ids"
        )
    identity = target_identity(target)
    if settings["target"] != identity:
        raise ValueError(
            f"the signal cache was made by another target (or the same in another dtype): {settings['target']}; the "
            f"trainer's target is {identity}. Train with the target that made the cache, or build a new cache"
        )


def _as_tensor(values) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))


@dataclass
class SignalCacheCollator(XPressDataCollator):
    """`XPressDataCollator` for signal-cache rows: the same batch, the same anchors (drawn by the parent, from the
    row's tokens, seed and epoch alone, so a row gets exactly the blocks its live twin gets), plus what the objective
    would otherwise ask the target for:

    - `features` (b, T, L·H): the context features, zero-padded, in the stored dtype;
    - `teacher_ids` / `teacher_probs` (b, m, n, k) and `teacher_tail` (b, m, n): p^t of block position k of each
      anchor t (the distribution at position t + k − 1) as top-k target ids, their probabilities and the tail mass;
      zero where the position is not labelled.

    Rows without the cache's columns (e.g. a live evaluation set) are collated exactly as by the parent.
    """

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(rows)
        cached = ["features" in row for row in rows]
        if not any(cached):
            return batch
        if not all(cached):
            raise ValueError("this batch mixes signal-cache rows with plain rows; collate one kind at a time")
        b, t_max = batch["input_ids"].shape
        anchors, n = batch["anchors"], self.block_size - 1
        lengths = batch["attention_mask"].sum(dim=1).tolist()  # after the parent's max_length cut
        columns = []  # per row: features (T, L·H), topk ids (T, k), probs (T, k), tail (T,)
        for row, length in zip(rows, lengths):
            full = len(row["input_ids"])  # the stored length; the parent may have cut it to `length`
            if full == 0:
                columns.append(None)
                continue
            features = _as_tensor(row["features"])
            if features.dtype == torch.int16:  # bfloat16 bits (Arrow has no bfloat16)
                features = features.view(torch.bfloat16)
            columns.append((
                features.view(full, -1)[:length], _as_tensor(row["topk_ids"]).view(full, -1)[:length],
                _as_tensor(row["topk_probs"]).view(full, -1)[:length], _as_tensor(row["tail"])[:length],
            ))  # fmt: skip
        first = next(c for c in columns if c is not None)  # the parent refused a batch of empty rows
        width, k = first[0].shape[1], first[1].shape[1]
        context = torch.zeros(b, t_max, width, dtype=first[0].dtype)
        ids = torch.zeros(b, t_max, k, dtype=torch.long)
        probs = torch.zeros(b, t_max, k, dtype=torch.float32)
        tail = torch.zeros(b, t_max, dtype=torch.float32)
        for i, column in enumerate(columns):
            if column is not None:
                length = column[0].shape[0]
                context[i, :length], ids[i, :length], probs[i, :length], tail[i, :length] = column

        # p^t of block position k (1..n) of the block anchored at t is the distribution at position t + k − 1.
        positions = (anchors[..., None] + torch.arange(n)).clamp(max=t_max - 1).view(b, -1)  # (b, m·n)
        labelled = (batch["labels"] != IGNORE_INDEX).view(b, -1)  # (b, m·n)

        def gather(values: torch.Tensor) -> torch.Tensor:  # (b, T, ...) → (b, m, n, ...), 0 where unlabelled
            index = positions.view(b, -1, *[1] * (values.dim() - 2)).expand(-1, -1, *values.shape[2:])
            taken = torch.gather(values, 1, index)
            taken = taken * labelled.view(b, -1, *[1] * (values.dim() - 2)).to(taken.dtype)
            return taken.view(*anchors.shape, n, *values.shape[2:])

        batch.update(features=context, teacher_ids=gather(ids), teacher_probs=gather(probs), teacher_tail=gather(tail))
        return batch


__all__ = [
    "CACHE_COLUMNS",
    "SignalCacheCollator",
    "cache_target_signals",
    "check_signal_cache",
    "load_signal_cache",
    "signal_cache_settings",
    "target_identity",
]
