"""Training responses written by the target itself, and the resumable shards they are written to.

A drafter is trained to predict what *its target* would say next, so the responses must come from
the target (paper section 4.3), not from some other model's dataset:

1. :func:`regenerate_responses` formats each prompt (e.g. from
   :func:`modeling_xpress.training.prompts.training_prompts`) with the target's chat template, lets the
   target answer it (batched, left-padded, greedy by default) and returns token ids plus a loss
   mask that is 1 exactly on the target's own response tokens. On CPU this takes the better part
   of an hour, so it can write shards as it goes and resume after an interruption.
2. :func:`load_responses` reads back either the shards or a finished parquet file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .prompts import COMPLETION_KINDS, MINED_KINDS, PROMPT_KINDS, TASK_KINDS, training_prompts

RESPONSE_FEATURES = datasets.Features({
    "input_ids": datasets.List(datasets.Value("int32")),
    "loss_mask": datasets.List(datasets.Value("int8")),
})
"""Columns of a regenerated dataset. int32/int8 keep the parquet file small; they read back as ints."""

SHARD_MANIFEST = "manifest.json"
"""File in a shard folder that records what the shards were made from (so a resume with other
prompts or settings is refused) and, per finished shard, its prompts, new tokens and seconds."""


def _conversation(row: dict, system_prompt: str | None) -> list[dict[str, str]]:
    """The chat messages for one dataset row (a ``prompt`` string or a ``messages`` list)."""
    if "messages" in row and row["messages"] is not None:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    else:
        messages = [{"role": "user", "content": row["prompt"]}]
    if system_prompt is not None:
        if messages and messages[0]["role"] == "system":
            raise ValueError(
                "A row already starts with a system message and `system_prompt` was given too; "
                "pass system_prompt=None or drop the system message from the data."
            )
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(f"The conversation must end with a user message for the target to answer, got {messages}.")
    return messages


def prompt_token_ids(
    tokenizer: PreTrainedTokenizerBase, prompts: datasets.Dataset | Sequence[str], system_prompt: str | None = None,
    chat_template: bool = True,
) -> list[list[int]]:
    """The token ids the target continues, one list per prompt (a `prompt`/`messages` dataset or plain strings).

    With `chat_template` (an instruct model) every row is chat-templated, ending with the assistant turn opener;
    without (a pretrained base model) a `prompt` is plain text to continue, tokenized with the tokenizer's own special
    tokens (e.g. Gemma's BOS)."""
    if not isinstance(prompts, datasets.Dataset):
        prompts = datasets.Dataset.from_dict({"prompt": list(prompts)})
    if "prompt" not in prompts.column_names and "messages" not in prompts.column_names:
        raise ValueError(
            f"The prompts dataset needs a `prompt` (str) or a `messages` (list of {{role, content}}) "
            f"column; it has {prompts.column_names}."
        )
    if not chat_template:
        if "prompt" not in prompts.column_names or system_prompt is not None:
            raise ValueError(
                "Without a chat template a prompt is plain text to continue: give a `prompt` column and no "
                "system_prompt (chat `messages` and system prompts need chat_template=True)."
            )
        return [list(tokenizer(text)["input_ids"]) for text in prompts["prompt"]]
    if not tokenizer.chat_template:
        raise ValueError(
            "The tokenizer has no chat template; set `tokenizer.chat_template`, or pass chat_template=False to give a "
            "base model its prompts as plain text to continue."
        )
    return [
        list(tokenizer.apply_chat_template(
            _conversation(row, system_prompt), add_generation_prompt=True, tokenize=True, return_dict=False
        ))
        for row in prompts
    ]


def stop_token_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end a response: the target's generation config first, the tokenizer's EOS otherwise."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("Neither the target's generation_config nor the tokenizer defines an EOS token.")
    return sorted({eos} if isinstance(eos, int) else set(eos))


def _left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into (input_ids, attention_mask), padding on the left.

    Left padding puts every prompt's last token in the last column, so new tokens of all rows are
    appended at the same position; the attention mask hides the padding from the model.
    """
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)  # (N, T)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)  # (N, T)
    for row, seq in enumerate(sequences):
        input_ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, width - len(seq):] = 1
    return input_ids, attention_mask


def _trim_response(tokens: list[int], stop_ids: Sequence[int]) -> list[int]:
    """Keep a generated row up to and including its first stop token.

    ``generate`` fills rows that finished early with padding until the whole batch is done; all of
    that comes after the row's first stop token. A row without a stop token ran to
    ``max_new_tokens`` and is kept whole.
    """
    for position, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: position + 1]
    return tokens


def _generate_batch(
    target: PreTrainedModel,
    prompt_ids: list[list[int]],
    generation_config: GenerationConfig,
    stop_ids: Sequence[int],
) -> list[list[int]]:
    """Generate responses for a batch of prompts; returns each row's response tokens, trimmed."""
    input_ids, attention_mask = _left_pad(prompt_ids, generation_config.pad_token_id)
    with torch.inference_mode():
        output = target.generate(
            input_ids=input_ids.to(target.device),
            attention_mask=attention_mask.to(target.device),
            generation_config=generation_config,
        )
    new_tokens = output[:, input_ids.shape[1]:].tolist()  # (N, new) - generate returns prompt + new tokens
    return [_trim_response(row, stop_ids) for row in new_tokens]


def _model_fingerprint(target: PreTrainedModel) -> str:
    """A cheap identity for the target: class, dtype and a checksum of its output head."""
    head = target.get_output_embeddings().weight
    checksum = float(head.detach().double().sum())
    return f"{type(target).__name__}|{head.dtype}|{tuple(head.shape)}|{checksum:.6e}"


def _run_fingerprint(prompt_ids: list[list[int]], settings: dict, target: PreTrainedModel) -> str:
    """Hash of everything that decides the shards' contents (batch size deliberately excluded)."""
    payload = json.dumps({"prompt_ids": prompt_ids, "settings": settings, "model": _model_fingerprint(target)})
    return hashlib.sha256(payload.encode()).hexdigest()


def _write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _write_parquet_atomic(path: Path, table: pa.Table) -> None:
    """Write a parquet file under a temporary name and rename it, so a killed run never leaves a
    truncated shard that a resume would mistake for a finished one."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        pass
    try:
        pq.write_table(table, tmp.name)
        os.chmod(tmp.name, 0o644)  # NamedTemporaryFile makes it private; a shard is ordinary data
        os.replace(tmp.name, path)
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise


def _rows_table(indices: list[int], input_ids: list[list[int]], loss_mask: list[list[int]]) -> pa.Table:
    """An arrow table of finished rows; ``index`` is the row's position in the caller's prompts."""
    features = datasets.Features({"index": datasets.Value("int64"), **RESPONSE_FEATURES})
    return pa.table(
        {"index": indices, "input_ids": input_ids, "loss_mask": loss_mask}, schema=features.arrow_schema
    )


def _shard_path(shard_dir: Path, shard: int) -> Path:
    return shard_dir / f"shard-{shard:05d}.parquet"


def _open_shard_dir(shard_dir: Path, fingerprint: str, settings: dict, num_prompts: int) -> dict:
    """Create or reopen a shard folder; refuse one that was made from other prompts or settings."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = shard_dir / SHARD_MANIFEST
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") != fingerprint:
            raise ValueError(
                f"{shard_dir} holds shards of a different run (other prompts, model, chat template or "
                f"settings; it was made with {manifest.get('settings')}). Use a new shard_dir, or delete "
                f"this one to start over."
            )
        return manifest
    manifest = {"fingerprint": fingerprint, "settings": settings, "num_prompts": num_prompts, "shards": {}}
    _write_json_atomic(manifest_path, manifest)
    return manifest


def _table_to_dataset(table: pa.Table) -> datasets.Dataset:
    """Rows back in the caller's prompt order, without the bookkeeping ``index`` column."""
    table = table.sort_by("index").drop_columns(["index"])
    return datasets.Dataset(table.cast(RESPONSE_FEATURES.arrow_schema))


def regenerate_responses(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: datasets.Dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    do_sample: bool = False,
    temperature: float = 1.0,
    shard_dir: str | os.PathLike | None = None,
    shard_size: int = 64,
    system_prompt: str | None = None,
    seed: int = 0,
    progress: bool = True,
    chat_template: bool = True,
    generate_fn: Callable[[list[list[int]]], list[list[int]]] | None = None,
) -> datasets.Dataset:
    """Let the target answer every prompt and return token ids with a response-only loss mask.

    Each row of ``prompts`` is either a ``prompt`` string (one user message) or ``messages`` (a
    list of ``{"role", "content"}`` ending with a user turn). It is formatted with the tokenizer's
    chat template (``add_generation_prompt=True``; with ``chat_template=False`` a ``prompt`` is plain
    text, for a base model: :func:`prompt_token_ids`) and the target continues it. Prompts are sorted
    by length so batches carry little padding, padded on the left, and generated in batches; each
    response is cut after its first EOS (padding that ``generate`` adds to finished rows goes too).

    With ``shard_dir``, prompts are processed in shards of ``shard_size`` and every finished shard
    is written at once as ``shard-NNNNN.parquet``; calling again with the same arguments skips the
    finished shards, so an interrupted run resumes where it stopped. A shard folder made from other
    prompts, model or settings is refused rather than silently mixed in.

    Args:
        target: the causal LM whose responses we want, in eval mode.
        tokenizer: its tokenizer, with a chat template. It is not modified.
        prompts: dataset with a ``prompt`` or a ``messages`` column (other columns are ignored).
        max_new_tokens: longest response; a response that hits it has no EOS at the end.
        batch_size: prompts per ``generate`` call. Does not change greedy results (up to float
            near-ties), so it may differ between a run and its resume.
        do_sample: sample instead of greedy decoding (pure temperature sampling, no top-k/top-p).
        temperature: sampling temperature; used only when ``do_sample``.
        shard_dir: folder for resumable shards; ``None`` keeps everything in memory.
        shard_size: prompts per shard (a multiple of ``batch_size`` wastes no batch slots).
        system_prompt: system message put before every conversation; ``None`` leaves the chat
            template's own default (SmolLM2 adds one of its own).
        seed: with ``do_sample``, shard ``i`` is sampled under ``torch.manual_seed(seed + i)``, so a
            resumed run draws the same samples; the caller's RNG state is left untouched.
        progress: show a tqdm bar over prompts.
        chat_template: format prompts with the tokenizer's chat template (an instruct model), or give them
            as plain text to continue (a pretrained base model).
        generate_fn: answers a batch of prompts (token id lists) with each response's new tokens, in
            place of ``target.generate`` (e.g. the pipeline's vLLM engine); its ``name`` attribute is
            recorded in the shard folder's settings, so shards of two engines are never mixed. Greedy by
            default like ``target.generate``; it must honour ``max_new_tokens`` and the stop ids itself.

    Returns:
        A dataset in the order of ``prompts`` with columns ``input_ids`` (prompt tokens followed by
        the response, ending with EOS if the target stopped) and ``loss_mask`` (1 on response tokens,
        EOS included; 0 on prompt and chat-template tokens).
    """
    if target.training:
        raise ValueError("The target is in training mode; call `target.eval()` before regenerating responses.")
    if batch_size < 1 or shard_size < 1 or max_new_tokens < 1:
        raise ValueError(
            f"batch_size, shard_size and max_new_tokens must be positive, got {batch_size}, {shard_size}, {max_new_tokens}."
        )
    if do_sample and temperature <= 0:
        raise ValueError(f"Sampling needs temperature > 0, got {temperature}; use do_sample=False for greedy.")

    prompt_ids = prompt_token_ids(tokenizer, prompts, system_prompt, chat_template=chat_template)
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_k=0 if do_sample else None,  # the training data should follow the target's full distribution
        top_p=1.0 if do_sample else None,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )
    settings = {
        "max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature if do_sample else None,
        "seed": seed if do_sample else None, "shard_size": shard_size, "system_prompt": system_prompt,
        "stop_ids": stop_ids,
    }
    if generate_fn is not None:  # (absent for target.generate, so shard folders of earlier runs still resume)
        settings["engine"] = getattr(generate_fn, "name", type(generate_fn).__name__)

    # Longest prompts first: similar lengths share a batch, and an out-of-memory shows up at once.
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    shards = [order[start:start + shard_size] for start in range(0, len(order), shard_size)]

    folder = Path(shard_dir) if shard_dir is not None else None
    manifest = None
    if folder is not None:
        fingerprint = _run_fingerprint(prompt_ids, settings, target)
        manifest = _open_shard_dir(folder, fingerprint, settings, len(prompt_ids))

    finished = [] if folder is None else [s for s in range(len(shards)) if _shard_path(folder, s).is_file()]
    done_prompts = sum(len(shards[s]) for s in finished)
    bar = tqdm(total=len(prompt_ids), initial=done_prompts, unit="prompt", desc="regenerating", disable=not progress)
    tables: list[pa.Table] = []
    total_new_tokens, total_seconds = 0, 0.0
    for shard, indices in enumerate(shards):
        if folder is not None and _shard_path(folder, shard).is_file():
            tables.append(pq.read_table(_shard_path(folder, shard)))
            continue
        shard_start = time.perf_counter()
        responses: list[list[int]] = []
        # Fork the RNG so seeding per shard leaves the caller's random state as it was.
        rng_devices = [target.device.index or 0] if target.device.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices, enabled=do_sample):
            if do_sample:
                torch.manual_seed(seed + shard)
            for batch_start in range(0, len(indices), batch_size):
                batch_start_time = time.perf_counter()
                batch = [prompt_ids[i] for i in indices[batch_start:batch_start + batch_size]]
                if generate_fn is None:
                    batch_responses = _generate_batch(target, batch, generation_config, stop_ids)
                else:
                    batch_responses = [_trim_response(r, stop_ids) for r in generate_fn(batch)]
                responses.extend(batch_responses)
                total_new_tokens += sum(len(r) for r in batch_responses)
                total_seconds += time.perf_counter() - batch_start_time
                bar.update(len(batch))
                bar.set_postfix(new_tok_per_s=f"{total_new_tokens / total_seconds:.0f}")
        seconds = time.perf_counter() - shard_start

        table = _rows_table(
            indices,
            [prompt_ids[i] + r for i, r in zip(indices, responses)],
            [[0] * len(prompt_ids[i]) + [1] * len(r) for i, r in zip(indices, responses)],
        )
        tables.append(table)
        if folder is not None:
            _write_parquet_atomic(_shard_path(folder, shard), table)
            manifest["shards"][f"{shard:05d}"] = {
                "prompts": len(indices), "new_tokens": sum(len(r) for r in responses), "seconds": round(seconds, 3),
            }
            _write_json_atomic(folder / SHARD_MANIFEST, manifest)
    bar.close()
    return _table_to_dataset(pa.concat_tables(tables))


def load_responses(path: str | os.PathLike) -> datasets.Dataset:
    """Read regenerated responses: a ``.parquet`` file, a folder holding ``responses.parquet``, or
    a shard folder of :func:`regenerate_responses` (possibly still being written: you get the
    shards finished so far, in prompt order).

    Returns:
        A dataset with columns ``input_ids`` and ``loss_mask``.
    """
    path = Path(path)
    if path.is_dir() and (path / "responses.parquet").is_file():
        path = path / "responses.parquet"
    if path.is_file() and path.suffix == ".parquet":
        return datasets.Dataset(pq.read_table(path).cast(RESPONSE_FEATURES.arrow_schema))
    shard_files = sorted(path.glob("shard-*.parquet")) if path.is_dir() else []
    if shard_files:
        return _table_to_dataset(pa.concat_tables([pq.read_table(f) for f in shard_files]))
    raise ValueError(
        f"{path} is neither a parquet file, a folder with responses.parquet, nor a shard folder with "
        f"shard-*.parquet files. Run examples/make_training_data.py to create one."
    )


def summarize_responses(
    responses: datasets.Dataset, kinds: Sequence[str], stop_ids: Sequence[int], max_new_tokens: int
) -> dict:
    """Counts and token totals of a regenerated dataset, overall and per prompt kind (`kinds`: one per row)."""
    keys = ["examples", "prompt_tokens", "response_tokens", "stopped_with_eos", "hit_max_new_tokens"]
    per_kind: dict[str, dict[str, int]] = {}
    for row, kind in zip(responses, kinds, strict=True):
        response_tokens = sum(row["loss_mask"])
        stopped = row["input_ids"][-1] in stop_ids and response_tokens > 0
        stats = per_kind.setdefault(kind, dict.fromkeys(keys, 0))
        stats["examples"] += 1
        stats["prompt_tokens"] += len(row["input_ids"]) - response_tokens
        stats["response_tokens"] += response_tokens
        stats["stopped_with_eos"] += stopped
        stats["hit_max_new_tokens"] += response_tokens == max_new_tokens and not stopped
    total = {key: sum(stats[key] for stats in per_kind.values()) for key in keys}
    return {
        **total,
        "mean_response_tokens": round(total["response_tokens"] / max(total["examples"], 1), 1),
        "per_kind": dict(sorted(per_kind.items())),
    }


def shard_seconds(shard_dir: str | os.PathLike) -> float:
    """Generation seconds of every finished shard in a shard folder, those of earlier (interrupted) runs included."""
    manifest = json.loads((Path(shard_dir) / SHARD_MANIFEST).read_text())
    return sum(shard["seconds"] for shard in manifest["shards"].values())


def response_set_meta(
    responses: datasets.Dataset, *, model: dict, prompts: dict, generation: dict, kinds: Sequence[str],
    stop_ids: Sequence[int], shard_dir: str | os.PathLike, wall_seconds: float,
) -> dict:
    """The `meta.json` of a regenerated set: the caller's `model`, `prompts` (generator, kinds, indices, seed) and
    `generation` settings, plus the counts (`summarize_responses`), the timing (every shard's seconds, resumed runs
    included; this run's wall time; threads) and the library versions."""
    import transformers

    counts = summarize_responses(responses, kinds, stop_ids, generation["max_new_tokens"])
    seconds = shard_seconds(shard_dir)
    return {
        "model": model, "prompts": prompts, "generation": generation, "counts": counts,
        "timing": {
            "generation_seconds_all_shards": round(seconds, 1),
            "response_tokens_per_second": round(counts["response_tokens"] / max(seconds, 1e-9), 1),
            "wall_time_s_last_run": round(wall_seconds, 1),
            "threads": torch.get_num_threads(),
        },
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }  # fmt: skip


def write_response_set(out: str | os.PathLike, responses: datasets.Dataset, meta: dict) -> Path:
    """Write a regenerated set as `<out>/responses.parquet` and `<out>/meta.json` (what `load_response_sets` joins:
    `meta["prompts"]` names the generator's `kinds` and the prompt `indices` [first, end) the rows answer, in order).
    Both files are written under temporary names and renamed, the meta last: a set with a meta.json is complete."""
    prompts = meta.get("prompts", {})
    first, end = prompts.get("indices", [0, prompts.get("n")])
    if "kinds" not in prompts or end is None or end - first != len(responses):
        raise ValueError(
            f"meta['prompts'] must name the generator's kinds and the indices [first, end) of the {len(responses)} "
            f"rows; got {prompts}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / ".responses.parquet.partial"
    responses.to_parquet(str(partial))
    os.replace(partial, out / "responses.parquet")
    _write_json_atomic(out / "meta.json", meta)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Several regenerated sets as one training set, with the held-out split kept apart
# ---------------------------------------------------------------------------------------------------------------------

HELD_OUT_PROMPTS = range(7000, 7200)
"""Prompt indices of `training_prompts(n, seed=0)` (any n ≥ 7200: the generator is prefix-stable) reserved as the
held-out split of the SmolLM2 training data: used to choose defaults (draft length) and to decide when training
stops improving, never trained on, and never the evaluation sets (HumanEval, MT-Bench)."""


TASK_HELD_OUT_PROMPTS = range(3000, 3200)
"""The same for the task-shaped prompts, `training_prompts(n, seed=0, kinds=TASK_KINDS)` (any n ≥ 3200)."""

MINED_HELD_OUT_PROMPTS = range(3000, 3200)
"""The same for the prompts mined from the standard library, `training_prompts(n, seed=0, kinds=MINED_KINDS)`."""

COMPLETION_HELD_OUT_PROMPTS = range(3000, 3200)
"""The same for the completion-style prompts of a base model, `training_prompts(n, seed=0, kinds=COMPLETION_KINDS)`."""

TASK_INDEX_OFFSET = 1_000_000
"""Where task-shaped prompt indices start in a joined training set (`load_response_sets`): the generators number
their prompts from 0 each, and a joined set must tell prompt 5 of one from prompt 5 of the other."""

MINED_INDEX_OFFSET = 2_000_000
"""Where the mined prompts' indices start in a joined training set."""

COMPLETION_INDEX_OFFSET = 3_000_000
"""Where the completion-style prompts' indices start in a joined training set."""


def _generators() -> dict[tuple, tuple[int, range]]:
    """Each prompt generator's kinds → (index offset in a joined set, held-out prompt indices), read when called."""
    return {
        PROMPT_KINDS: (0, HELD_OUT_PROMPTS),
        TASK_KINDS: (TASK_INDEX_OFFSET, TASK_HELD_OUT_PROMPTS),
        MINED_KINDS: (MINED_INDEX_OFFSET, MINED_HELD_OUT_PROMPTS),
        COMPLETION_KINDS: (COMPLETION_INDEX_OFFSET, COMPLETION_HELD_OUT_PROMPTS),
    }


def _generator(kinds) -> tuple[int, range]:
    generators = _generators()
    if tuple(kinds) not in generators:
        raise ValueError(
            f"prompt kinds {list(kinds)} are not a known generator: use PROMPT_KINDS, TASK_KINDS, MINED_KINDS or "
            "COMPLETION_KINDS"
        )
    return generators[tuple(kinds)]


def held_out_indices(kinds=None) -> range:
    """The held-out prompt indices of a generator (`PROMPT_KINDS` when None, `TASK_KINDS`, `MINED_KINDS`), numbered
    as that generator numbers them."""
    return _generator(PROMPT_KINDS if kinds is None else kinds)[1]


def held_out_prompts(count: int, kinds=None) -> list[str]:
    """The first `count` held-out prompt texts (`HELD_OUT_PROMPTS` of `training_prompts(seed=0)`, or with
    `kinds=TASK_KINDS` / `MINED_KINDS` `TASK_HELD_OUT_PROMPTS` / `MINED_HELD_OUT_PROMPTS` of that generator): for
    choosing settings and for quick measurements that must not touch the training rows or the evaluation sets."""
    kinds = PROMPT_KINDS if kinds is None else tuple(kinds)
    held = held_out_indices(kinds)
    if not 1 <= count <= len(held):
        raise ValueError(f"count must be between 1 and {len(held)} held-out prompts, got {count}")
    return list(training_prompts(held.start + count, kinds=kinds)["prompt"][held.start :])


def response_prompt_indices(folder: str | os.PathLike) -> range:
    """The prompt indices of a folder written by `examples/make_training_data.py`, from its `meta.json`: rows are in
    prompt order, `prompts.indices` = [first, end) (absent in sets that start at 0), shifted by `TASK_INDEX_OFFSET`
    for task-shaped prompts (`prompts.kinds`; absent in sets of the default kinds)."""
    meta_path = Path(folder) / "meta.json"
    if not meta_path.is_file():
        raise ValueError(f"{folder} has no meta.json: pass a folder written by examples/make_training_data.py")
    prompts = json.loads(meta_path.read_text())["prompts"]
    first, end = prompts.get("indices", [0, prompts["n"]])
    offset = _generator(prompts.get("kinds", PROMPT_KINDS))[0]
    return range(offset + first, offset + end)


def load_response_sets(
    folders: Sequence[str | os.PathLike], held_out: Sequence[int] | None = None
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Regenerated sets (folders of `make_training_data.py`) joined into (train, held_out) by prompt index.

    Each row gains a `prompt_index` column. A prompt index that appears in two folders is refused (the same prompt
    twice would weigh it double and may leak across the split). `held_out` (default `HELD_OUT_PROMPTS`) rows go to
    the second dataset only (and, by default, `TASK_HELD_OUT_PROMPTS` of task-shaped sets and
    `MINED_HELD_OUT_PROMPTS` of mined ones).
    """
    default = {offset + i for offset, held in _generators().values() for i in held}
    held = default if held_out is None else set(held_out)
    parts, seen = [], set()
    for folder in folders:
        indices = response_prompt_indices(folder)
        rows = load_responses(folder)
        if len(rows) != len(indices):
            raise ValueError(
                f"{folder} holds {len(rows)} rows but its meta.json names prompts {indices.start}..{indices.stop - 1}: "
                "an unfinished set? Finish it with make_training_data.py first"
            )
        overlap = seen & set(indices)
        if overlap:
            raise ValueError(f"{folder} repeats prompt indices of an earlier folder (first: {min(overlap)})")
        seen |= set(indices)
        parts.append(rows.add_column("prompt_index", list(indices)))
    if not parts:
        raise ValueError("no folders given")
    joined = datasets.concatenate_datasets(parts)
    is_held = [i in held for i in joined["prompt_index"]]
    train = joined.select([r for r, h in enumerate(is_held) if not h])
    return train, joined.select([r for r, h in enumerate(is_held) if h])
