"""Evaluation harness: τ, the Jacobi K sweep, refiner latency and end-to-end speed, all measured in one run.

What one `run_benchmark` call measures, for a target and a set of named xPress checkpoints (any mix of
`refiner="none"` / `"markov"` / `"xpress"`), on named prompt sets, at each temperature:

1. Per prompt, side by side and in a rotating order so machine noise hits every entry alike: plain
   `target.generate`, `target.generate(assistant_model=method)` and `spec_generate(method, ...)` for every method.
   This gives τ (from `spec_generate`), the end-to-end throughput ratio against plain decoding for both entry points,
   the greedy-identity count (T=0) and the draft-step timers (drafter / lm_head / refiner).
2. For every method with an xPress refiner, the Jacobi sweep: fixed K (early exit off) and "adaptive"
   (K = block_size - 1 with early exit), each through `spec_generate` on the same prompts.
3. A microbenchmark of `model.refine` on real drafter outputs captured from a short run: median latency per block
   versus K for xPress (early exit off), the Markov head's serial decode and the plain argmax.

Nothing is invented: `run_benchmark` returns raw per-prompt records, `summarize` derives every table from them (so it
can be rerun on a saved JSON), and `write_results` writes the JSON, a Markdown report and PNG plots.

τ is pooled: committed tokens / target verifications over all steps of a group (SPEC §7); the per-prompt means are in
the raw records. Speed is a ratio of tokens/s measured in the same run; absolute seconds are raw data only.
Sampling (T > 0) is pure temperature sampling (no top-k / top-p) for both the plain and the speculative entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from .generation import WallClock, spec_generate

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ENTRIES = ("generate", "spec_generate")  # the two speculative entry points; "plain" is target.generate alone
CONFIG_SETTING = "config"  # label of runs with the checkpoint's own Jacobi settings
ADAPTIVE_SETTING = "adaptive"


# ---------------------------------------------------------------------------------------------------------------------
# Settings and inputs
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class BenchmarkSettings:
    """Everything that decides what a run measures. Stored verbatim in the results JSON."""

    max_new_tokens: int = 256  # new tokens per generation, at most (EOS may stop earlier)
    temperatures: tuple[float, ...] = (0.0, 1.0)  # 0 = greedy; > 0 = temperature sampling with a fixed seed per prompt
    k_values: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)  # fixed Jacobi iteration counts of the sweep; () = no sweep
    adaptive: bool = True  # also sweep K = block_size - 1 with early exit
    limit: int | None = None  # first N prompts of each set; None = all
    seed: int = 0  # base seed of the per-prompt sampling generators
    latency_blocks: int = 8  # real drafter blocks captured per method for the refiner microbenchmark
    latency_repeats: int = 30  # timed repeats of each block and setting (the median is reported)

    def __post_init__(self) -> None:
        self.temperatures = tuple(float(t) for t in self.temperatures)
        self.k_values = tuple(int(k) for k in self.k_values)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperatures:
            raise ValueError("temperatures is empty: give at least one (0 = greedy)")
        if any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be >= 0, got {list(self.temperatures)}")
        if any(k < 1 for k in self.k_values):
            raise ValueError(f"k_values must be >= 1 (Jacobi iterations), got {list(self.k_values)}")
        if len(set(self.k_values)) != len(self.k_values):
            raise ValueError(f"k_values has duplicates: {list(self.k_values)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 prompt per dataset (or None for all), got {self.limit}")
        if self.latency_blocks < 1 or self.latency_repeats < 1:
            raise ValueError(
                f"latency_blocks and latency_repeats must be >= 1, got {self.latency_blocks} and {self.latency_repeats}"
            )


@dataclass
class PromptSet:
    """A named evaluation set: token ids (1, T) per prompt, and a stable id per prompt for the raw records."""

    input_ids: list[torch.Tensor]
    ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.input_ids = [torch.as_tensor(x, dtype=torch.long).reshape(1, -1) for x in self.input_ids]
        if not self.ids:
            self.ids = [str(i) for i in range(len(self.input_ids))]
        if len(self.ids) != len(self.input_ids):
            raise ValueError(f"PromptSet has {len(self.input_ids)} prompts but {len(self.ids)} ids")
        if any(x.shape[1] == 0 for x in self.input_ids):
            raise ValueError("PromptSet contains an empty prompt")

    def head(self, limit: int | None) -> "PromptSet":
        """The first `limit` prompts (all when None)."""
        return PromptSet(self.input_ids[:limit], self.ids[:limit])


def parse_dtype(name: str) -> torch.dtype:
    """'float32' / 'bfloat16' → torch dtype."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_method_spec(spec: str) -> tuple[str, str]:
    """'name=path' → (name, path), e.g. 'xpress=checkpoints/xpress'."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"a method is given as name=path (e.g. xpress=checkpoints/xpress), got {spec!r}")
    return name, path


def load_methods(
    paths: Mapping[str, str | os.PathLike],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    trust_remote_code: bool = False,
) -> dict[str, torch.nn.Module]:
    """Load each named checkpoint folder, in eval mode, with the package class or (`trust_remote_code`) with
    `AutoModel`, i.e. the code files shipped inside the folder."""
    if not paths:
        raise ValueError("no methods given: pass at least one name=path checkpoint")
    methods = {}
    for name, path in paths.items():
        if not Path(path, "config.json").is_file():
            raise ValueError(f"method {name!r}: {path} is not a saved xPress folder (no config.json)")
        if trust_remote_code:
            from transformers import AutoModel

            model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=True)
        else:
            from .modeling_xpress import XPressModel

            model = XPressModel.from_pretrained(path, dtype=dtype)
        methods[name] = model.to(device).eval()
    return methods


def chat_prompt_ids(tokenizer, texts: Sequence[str]) -> list[torch.Tensor]:
    """Each text as one user turn in the tokenizer's chat template, ready for the assistant's reply: (1, T) ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; evaluation prompts must be chat-formatted as in tuning")
    out = []
    for text in texts:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        out.append(encoded["input_ids"])
    return out


def evaluation_prompt_sets(tokenizer, limit: int | None = None) -> dict[str, PromptSet]:
    """HumanEval and MT-Bench first turns (SPEC §6), chat-templated; the first `limit` of each."""
    from .assets import humaneval_prompts, mtbench_prompts

    sets = {}
    for name, loader in (("humaneval", humaneval_prompts), ("mtbench", mtbench_prompts)):
        rows = loader()
        rows = rows.select(range(min(limit, len(rows)))) if limit is not None else rows
        sets[name] = PromptSet(chat_prompt_ids(tokenizer, rows["prompt"]), list(rows["id"]))
    return sets


# ---------------------------------------------------------------------------------------------------------------------
# Measuring primitives
# ---------------------------------------------------------------------------------------------------------------------


def _now(device: torch.device) -> float:
    return WallClock(device).now()


@contextlib.contextmanager
def jacobi_setting(model, max_iters: int, early_exit: bool) -> Iterator[None]:
    """Temporarily set `config.jacobi_max_iters` / `jacobi_early_exit` (what `refine` reads); always restored."""
    saved = (model.config.jacobi_max_iters, model.config.jacobi_early_exit)
    model.config.jacobi_max_iters, model.config.jacobi_early_exit = max_iters, early_exit
    try:
        yield
    finally:
        model.config.jacobi_max_iters, model.config.jacobi_early_exit = saved


def sweep_settings(model, settings: BenchmarkSettings) -> list[tuple[str, int, bool]]:
    """(label, max_iters, early_exit) of the K sweep for one xPress model: fixed K without early exit, then adaptive."""
    rows = [(f"K={k}", k, False) for k in settings.k_values]
    if settings.adaptive:
        rows.append((ADAPTIVE_SETTING, model.config.block_size - 1, True))
    return rows


def _sampling_kwargs(temperature: float) -> dict:
    """generate() arguments for pure temperature sampling; top_k=0 switches off transformers' default top-k of 50,
    which `spec_generate` does not apply."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _prompt_seed(settings: BenchmarkSettings, dataset_index: int, prompt_index: int) -> int:
    """One seed per (dataset, prompt), shared by every method so they sample under the same randomness."""
    return settings.seed * 1_000_003 + dataset_index * 10_007 + prompt_index


def run_plain(target, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int):
    """Plain `target.generate`; returns (sequences, seconds)."""
    torch.manual_seed(seed)  # generate samples from the global RNG
    start = _now(ids.device)
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **_sampling_kwargs(temperature)
    )
    return out, _now(ids.device) - start


def run_assisted(target, model, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int):
    """`target.generate(..., assistant_model=model)`; returns (sequences, seconds, stats)."""
    torch.manual_seed(seed)
    start = _now(ids.device)
    out = target.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        assistant_model=model,
        **_sampling_kwargs(temperature),
    )
    return out, _now(ids.device) - start, model.generation_stats


def run_spec(target, model, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int):
    """`spec_generate(model, target, ...)`, generator seeded for this prompt; returns (sequences, seconds, stats)."""
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    start = _now(ids.device)
    out = spec_generate(model, target, ids, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator)
    return out.sequences, _now(ids.device) - start, out.stats


def _record(context: dict, entry: str, method: str | None, setting: str | None, sequences: torch.Tensor,
            seconds: float, stats, reference: torch.Tensor | None) -> dict:  # fmt: skip
    """One raw record: every number one generation call produced."""
    return {
        **context,
        "entry": entry,
        "method": method,
        "setting": setting,
        "new_tokens": int(sequences.shape[1] - context["prompt_tokens"]),
        "seconds": seconds,
        # Greedy identity is only defined at T=0, against the plain run of the same prompt.
        "identical_to_plain": None if reference is None else bool(torch.equal(sequences, reference)),
        "stats": None if stats is None else stats.as_dict(),
    }


def measure_prompt(target, methods: Mapping[str, torch.nn.Module], ids: torch.Tensor, context: dict,
                   settings: BenchmarkSettings, seed: int, rotation: int) -> list[dict]:  # fmt: skip
    """Every run for one prompt at one temperature.

    The timed entries (plain, then generate and spec_generate per method) run back to back in an order rotated by
    `rotation`, so slow drifts of machine load do not always hit the same entry. The K sweep follows; its outputs are
    checked against the plain run too (T=0), a free extra exactness check.
    """
    temperature, n = context["temperature"], settings.max_new_tokens
    jobs: list[tuple[str, str | None]] = [("plain", None)] + [(e, m) for m in methods for e in ENTRIES]
    shift = rotation % len(jobs)
    jobs = jobs[shift:] + jobs[:shift]
    done: dict[tuple[str, str | None], tuple] = {}
    for entry, name in jobs:
        if entry == "plain":
            sequences, seconds = run_plain(target, ids, n, temperature, seed)
            done[(entry, name)] = (sequences, seconds, None)
        elif entry == "generate":
            done[(entry, name)] = run_assisted(target, methods[name], ids, n, temperature, seed)
        else:
            done[(entry, name)] = run_spec(target, methods[name], ids, n, temperature, seed)
    reference = done[("plain", None)][0] if temperature == 0 else None
    records = [
        _record(context, entry, name, None if entry == "plain" else CONFIG_SETTING, *done[(entry, name)],
                None if entry == "plain" else reference)  # fmt: skip
        for entry, name in [("plain", None)] + [(e, m) for m in methods for e in ENTRIES]
    ]
    for name, model in methods.items():
        if model.config.refiner != "xpress":
            continue
        for label, max_iters, early_exit in sweep_settings(model, settings):
            with jacobi_setting(model, max_iters, early_exit):
                sequences, seconds, stats = run_spec(target, model, ids, n, temperature, seed)
            records.append(_record(context, "spec_generate", name, label, sequences, seconds, stats, reference))
    return records


def warm_up(target, methods: Mapping[str, torch.nn.Module], ids: torch.Tensor) -> None:
    """One short run of every entry, so one-off costs (allocations, lazy init, folded refiner) are not charged to
    the first measured prompt."""
    tokens = 2 * max((m.config.block_size for m in methods.values()), default=2)
    run_plain(target, ids, tokens, 0.0, 0)
    for model in methods.values():
        run_assisted(target, model, ids, tokens, 0.0, 0)
        run_spec(target, model, ids, tokens, 0.0, 0)


# ---------------------------------------------------------------------------------------------------------------------
# Refiner microbenchmark
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class CapturedBlock:
    """What `refine` received for one real drafted block."""

    hidden: torch.Tensor  # (1, n, H) drafter states of the draft positions
    base_logits: torch.Tensor  # (1, n, V)
    anchor_ids: torch.Tensor  # (1,)


class _EnoughBlocks(Exception):
    """Raised inside `refine` once enough blocks are recorded, to end the capture run early."""


@contextlib.contextmanager
def recording_refine_inputs(model, limit: int) -> Iterator[list[CapturedBlock]]:
    """Record the inputs of the model's next `limit` `refine` calls, then raise `_EnoughBlocks` out of the caller.
    An instance attribute shadows the method while recording."""
    captured: list[CapturedBlock] = []
    original = model.refine

    def recording(hidden, base_logits, anchor_ids, **kwargs):
        captured.append(CapturedBlock(hidden.detach().clone(), base_logits.detach().clone(), anchor_ids.clone()))
        if len(captured) >= limit:
            raise _EnoughBlocks
        return original(hidden, base_logits, anchor_ids, **kwargs)

    model.refine = recording
    try:
        yield captured
    finally:
        del model.refine  # the class method is visible again


def capture_blocks(target, model, prompts: Sequence[torch.Tensor], num_blocks: int, max_new_tokens: int):
    """Real drafter outputs for `num_blocks` blocks: greedy `spec_generate` over the prompts, stopped as soon as
    enough were drafted. Not timed (copying the inputs would distort the refiner timer)."""
    with recording_refine_inputs(model, num_blocks) as captured:
        for ids in prompts:
            try:
                spec_generate(model, target, ids, max_new_tokens=max_new_tokens)
            except _EnoughBlocks:
                break
    return captured


def _refine_call(model, block: CapturedBlock, max_iters: int | None, early_exit: bool | None) -> Callable[[], object]:
    if model.config.refiner == "xpress":
        return lambda: model.refine(block.hidden, block.base_logits, block.anchor_ids, max_iters=max_iters,
                                    early_exit=early_exit)  # fmt: skip
    return lambda: model.refine(block.hidden, block.base_logits, block.anchor_ids)


def refine_latency_settings(model, settings: BenchmarkSettings) -> list[tuple[str, int | None, bool | None]]:
    """What to time for one model: each fixed K (early exit off) and adaptive for xPress; the one fixed decode
    (Markov serial / plain argmax) otherwise."""
    if model.config.refiner == "xpress":
        return sweep_settings(model, settings)
    return [("serial" if model.config.refiner == "markov" else "argmax", None, None)]


@torch.inference_mode()
def measure_refine_latency(model, blocks: Sequence[CapturedBlock], settings: BenchmarkSettings) -> list[dict]:
    """Seconds per `refine` call on real blocks, per setting. Settings are interleaved within each repeat so that a
    load spike hits all of them; the median over repeats × blocks is what the summary reports."""
    if not blocks:
        return []
    device = blocks[0].base_logits.device
    plan = refine_latency_settings(model, settings)
    samples: dict[str, list[float]] = {label: [] for label, _, _ in plan}
    calls = {label: [_refine_call(model, b, k, e) for b in blocks] for label, k, e in plan}
    for fns in calls.values():  # untimed first call: builds the folded operators
        fns[0]()
    for _ in range(settings.latency_repeats):
        for label, fns in calls.items():
            for fn in fns:
                start = _now(device)
                fn()
                samples[label].append(_now(device) - start)
    return [{"setting": label, "refiner": model.config.refiner, "seconds": samples[label]} for label, _, _ in plan]


# ---------------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    """Output of a git command in this package's checkout; None when it is not a checkout or git is missing."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        result = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent)  # fmt: skip
        if result.returncode == 0:
            return result.stdout.strip()
    return None


def environment_info(target) -> dict:
    """Versions and machine facts stored with every result."""
    from . import __version__

    cpu = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain", "--untracked-files=no")
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "modeling_xpress": __version__,
        "git_commit": commit,
        "git_dirty": None if dirty is None else bool(dirty),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(target.device),
        "cuda_device": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else None,
        "target_dtype": str(target.dtype).removeprefix("torch."),
        "target_model": getattr(target.config, "_name_or_path", None),
    }


def method_info(model) -> dict:
    """The config fields that decide what a method does."""
    c = model.config
    return {
        "refiner": c.refiner, "block_size": c.block_size, "refiner_rank": c.refiner_rank,
        "num_hidden_layers": c.num_hidden_layers, "jacobi_max_iters": c.jacobi_max_iters,
        "jacobi_early_exit": c.jacobi_early_exit, "dtype": str(model.dtype).removeprefix("torch."),
        "path": getattr(c, "_name_or_path", None),
    }  # fmt: skip


def run_benchmark(
    target,
    methods: Mapping[str, torch.nn.Module],
    prompt_sets: Mapping[str, PromptSet | Sequence],
    settings: BenchmarkSettings | None = None,
    *,
    metadata: dict | None = None,
    progress: bool = True,
) -> dict:
    """Measure everything (see the module docstring) and return `{"settings", "environment", "methods", "datasets",
    "records", "latency", "summary", "wall_time_s", ...}`; `metadata` is stored as given (e.g. checkpoint paths)."""
    settings = settings or BenchmarkSettings()
    if not methods:
        raise ValueError("no methods given: pass at least one xPress checkpoint")
    if not prompt_sets:
        raise ValueError("no prompt sets given")
    for name, model in methods.items():
        model.config.check_target(target.config)
        if name == "plain":
            raise ValueError("'plain' names the target-alone baseline; give the method another name")
    sets = {name: (s if isinstance(s, PromptSet) else PromptSet(list(s))).head(settings.limit)
            for name, s in prompt_sets.items()}  # fmt: skip
    empty = [name for name, s in sets.items() if not s.input_ids]
    if empty:
        raise ValueError(f"prompt sets {empty} are empty")
    device = target.device
    sets = {name: PromptSet([x.to(device) for x in s.input_ids], s.ids) for name, s in sets.items()}
    started, wall_start = datetime.now(timezone.utc), time.perf_counter()

    first = next(iter(sets.values())).input_ids[0]
    warm_up(target, methods, first)
    all_prompts = [x for s in sets.values() for x in s.input_ids]
    latency = {}
    for name, model in tqdm(methods.items(), desc="refiner latency", disable=not progress):
        blocks = capture_blocks(target, model, all_prompts, settings.latency_blocks, settings.max_new_tokens)
        latency[name] = {"blocks": len(blocks), "results": measure_refine_latency(model, blocks, settings)}

    records = []
    for d_index, (dataset, prompt_set) in enumerate(sets.items()):
        for temperature in settings.temperatures:
            bar = tqdm(total=len(prompt_set.input_ids), desc=f"{dataset} T={temperature:g}", disable=not progress)
            for p_index, (pid, ids) in enumerate(zip(prompt_set.ids, prompt_set.input_ids)):
                context = {"dataset": dataset, "temperature": temperature, "prompt_index": p_index, "prompt_id": pid,
                           "prompt_tokens": int(ids.shape[1])}  # fmt: skip
                seed = _prompt_seed(settings, d_index, p_index)
                records += measure_prompt(target, methods, ids, context, settings, seed, rotation=p_index)
                bar.update(1)
            bar.close()

    results = {
        "started_utc": started.isoformat(timespec="seconds"),
        "wall_time_s": time.perf_counter() - wall_start,
        "settings": asdict(settings),
        "environment": environment_info(target),
        "methods": {name: method_info(model) for name, model in methods.items()},
        "datasets": {name: {"prompts": len(s.ids), "prompt_ids": s.ids,
                            "prompt_tokens": [int(x.shape[1]) for x in s.input_ids]}
                     for name, s in sets.items()},  # fmt: skip
        "metadata": metadata or {},
        "records": records,
        "latency": latency,
    }
    results["summary"] = summarize(results)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Summaries (pure functions of the raw results)
# ---------------------------------------------------------------------------------------------------------------------

ALL = "all"  # the pooled pseudo-dataset in summary rows


def _pooled(records: Sequence[dict]) -> dict:
    """Pool the generation stats of several records."""
    lengths = [t for r in records for t in r["stats"]["acceptance_lengths"]]
    iterations = [i for r in records for i in r["stats"]["jacobi_iterations"]]
    blocks = max(len(iterations), 1)
    timer = {k: sum(r["stats"][f"time_{k}"] for r in records) for k in ("drafter", "lm_head", "refiner", "verify")}
    taus = [r["stats"]["mean_tau"] for r in records if r["stats"]["acceptance_lengths"]]
    return {
        "tau": sum(lengths) / len(lengths) if lengths else None,
        # Mean of per-prompt τ over prompts that drafted at all (a prompt ended by EOS at once has no τ).
        "tau_prompt_mean": statistics.fmean(taus) if taus else None,
        "verifications": len(lengths),
        "blocks": len(iterations),
        "mean_jacobi_iterations": sum(iterations) / len(iterations) if iterations else None,
        "drafter_ms_per_block": 1e3 * timer["drafter"] / blocks,
        "lm_head_ms_per_block": 1e3 * timer["lm_head"] / blocks,
        "refiner_ms_per_block": 1e3 * timer["refiner"] / blocks,
        "verify_ms_per_step": 1e3 * timer["verify"] / max(len(lengths), 1),
        "prompts": len(records),
    }


def _groups(records: Sequence[dict], fields: Sequence[str], pool_datasets: bool = True) -> dict[tuple, list[dict]]:
    """Group records by the values of `fields`; with `pool_datasets` every record also joins the group whose
    "dataset" is ALL."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[f] for f in fields)].append(r)
        if pool_datasets:
            groups[tuple(ALL if f == "dataset" else r[f] for f in fields)].append(r)
    return groups


def _stat_rows(records: Sequence[dict], fields: Sequence[str], pool_datasets: bool = True) -> list[dict]:
    """One row per group: the grouping fields and the pooled generation stats."""
    return [dict(zip(fields, key)) | _pooled(group) for key, group in _groups(records, fields, pool_datasets).items()]


def _throughput_rows(records: Sequence[dict]) -> list[dict]:
    """tokens/s of each speculative entry over tokens/s of plain generate, per dataset and temperature (and pooled)."""
    rows = []
    groups = _groups(records, ("dataset", "temperature", "entry", "method"))
    for (dataset, temperature, entry, method), group in groups.items():
        if entry == "plain":
            continue
        plain = groups[(dataset, temperature, "plain", None)]
        plain_rate = sum(r["new_tokens"] for r in plain) / sum(r["seconds"] for r in plain)
        rate = sum(r["new_tokens"] for r in group) / sum(r["seconds"] for r in group)
        rows.append({
            "method": method, "entry": entry, "dataset": dataset, "temperature": temperature,
            "tokens_per_s": rate, "plain_tokens_per_s": plain_rate, "speedup": rate / plain_rate,
            "tau": _pooled(group)["tau"], "prompts": len(group),
        })  # fmt: skip
    return rows


def _latency_rows(latency: Mapping[str, dict]) -> list[dict]:
    rows = []
    for method, entry in latency.items():
        for result in entry["results"]:
            s = sorted(result["seconds"])
            q = statistics.quantiles(s, n=10) if len(s) > 1 else [s[0]] * 9
            rows.append({
                "method": method, "refiner": result["refiner"], "setting": result["setting"],
                "median_us": 1e6 * statistics.median(s), "p10_us": 1e6 * q[0], "p90_us": 1e6 * q[-1],
                "samples": len(s), "blocks": entry["blocks"],
            })  # fmt: skip
    return rows


def summarize(results: Mapping) -> dict:
    """Every table of the report, derived from `results["records"]` and `results["latency"]` only."""
    records = results["records"]
    main = [r for r in records if r["setting"] == CONFIG_SETTING]  # the checkpoints as saved
    plain = [r for r in records if r["entry"] == "plain"]
    spec = [r for r in main if r["entry"] == "spec_generate"]
    sweep = [r for r in records if r["entry"] == "spec_generate" and r["setting"] not in (None, CONFIG_SETTING)]
    greedy = [r for r in records if r["identical_to_plain"] is not None]
    fields = ("method", "entry", "setting", "dataset")
    identity = [
        dict(zip(fields, key), identical=sum(r["identical_to_plain"] for r in group), prompts=len(group))
        for key, group in _groups(greedy, fields).items()
    ]
    return {
        "tau": _stat_rows(spec, ("method", "dataset", "temperature")),
        "sweep": _stat_rows(sweep, ("method", "dataset", "temperature", "setting")),
        "throughput": _throughput_rows(main + plain),
        "identity": identity,
        "breakdown": _stat_rows(spec, ("method", "temperature"), pool_datasets=False),
        "latency": _latency_rows(results.get("latency", {})),
    }


def card_rows(summary: Mapping) -> list[dict]:
    """Rows for `cards.render_model_card(config, results=...)`: τ and both speed ratios per method, pooled dataset
    included."""
    speed = {(r["method"], r["entry"], r["dataset"], r["temperature"]): r["speedup"] for r in summary["throughput"]}
    return [
        {"method": r["method"], "dataset": r["dataset"], "temperature": r["temperature"], "tau": r["tau"],
         "speedup_spec_generate": speed.get((r["method"], "spec_generate", r["dataset"], r["temperature"])),
         "speedup_generate": speed.get((r["method"], "generate", r["dataset"], r["temperature"]))}
        for r in summary["tau"]
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# Report: Markdown and plots
# ---------------------------------------------------------------------------------------------------------------------


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]


def _columns(results: Mapping) -> list[tuple[str, float]]:
    """(dataset, temperature) columns in run order, pooled dataset last."""
    datasets = list(results["datasets"]) + [ALL]
    return [(d, t) for t in results["settings"]["temperatures"] for d in datasets]


def _col_name(dataset: str, temperature: float) -> str:
    return f"{dataset} T={temperature:g}"


def _setting_order(label: str) -> tuple[int, int]:
    """Sort key of run settings: checkpoint config, then K=1, K=2, ..., then adaptive."""
    if label == CONFIG_SETTING:
        return (0, 0)
    return (2, 0) if label == ADAPTIVE_SETTING else (1, int(label.removeprefix("K=")))


def _identity_order(key: tuple[str, str, str]) -> tuple:
    method, entry, setting = key
    return (method, entry, _setting_order(setting))


def markdown_report(results: Mapping, plots: Mapping[str, str] | None = None) -> str:
    """The README-ready report: settings, then one table per measurement, then the plots (relative paths)."""
    s, summary, cols = results["settings"], results["summary"], _columns(results)
    env = results["environment"]
    temps = ", ".join(f"{t:g}" for t in s["temperatures"])
    dirty = " (with uncommitted changes)" if env["git_dirty"] else ""
    counts = ", ".join(f"{d} {v['prompts']}" for d, v in results["datasets"].items())
    methods = ", ".join(
        f"`{m}` ({v['refiner']}, block {v['block_size']}, K≤{v['jacobi_max_iters']}"
        + (", early exit)" if v["jacobi_early_exit"] else ")")
        for m, v in results["methods"].items()
    )
    lines = [
        f"# Benchmark `{results.get('run_name', '')}`",
        "",
        f"Target `{env['target_model']}` in {env['target_dtype']} on {env['device']} "
        f"({env['cpu'] or env['cuda_device']}, "
        f"{env['torch_threads']} torch threads); torch {env['torch']}, transformers {env['transformers']}, "
        f"commit `{env['git_commit']}`{dirty}. Started {results['started_utc']}, "
        f"wall time {results['wall_time_s']:.0f} s.",
        "",
        f"Prompts per dataset: {counts} "
        f"(limit {s['limit']}); at most {s['max_new_tokens']} new tokens; temperatures {temps}; "
        f"seed {s['seed']}. Methods: {methods}.",
        "",
        "τ = tokens committed per target verification (bonus included), pooled over all steps; speed = tokens/s "
        "over plain `target.generate` tokens/s measured side by side in this run.",
        "",
        "## Mean acceptance length τ (`spec_generate`, checkpoint settings)",
        "",
    ]  # fmt: skip
    tau = {(r["method"], r["dataset"], r["temperature"]): r["tau"] for r in summary["tau"]}
    lines += _table(["method"] + [_col_name(*c) for c in cols],
                    [[m] + [_fmt(tau.get((m, *c))) for c in cols] for m in results["methods"]])  # fmt: skip

    if summary["sweep"]:
        lines += ["", "## Jacobi sweep: τ (mean iterations to settle) per K", "",
                  "Fixed K runs K passes (early exit off); the iteration count is the passes until the block stopped "
                  "changing (≤ K). Adaptive: K = block_size − 1 with early exit, so the count is the passes run.",
                  ""]  # fmt: skip
        sweep = {(r["method"], r["setting"], r["dataset"], r["temperature"]): r for r in summary["sweep"]}
        labels = sorted({r["setting"] for r in summary["sweep"]}, key=_setting_order)
        for method in sorted({r["method"] for r in summary["sweep"]}):
            rows = []
            for label in labels:
                cells = [sweep.get((method, label, *c)) for c in cols]
                rows.append([label] + [f"{_fmt(r['tau'])} ({_fmt(r['mean_jacobi_iterations'], 1)})" if r else "–"
                                       for r in cells])  # fmt: skip
            lines += [f"`{method}`:", ""] + _table(["K"] + [_col_name(*c) for c in cols], rows) + [""]

    lines += ["", "## End-to-end speed ratio against plain `target.generate` (same run)", ""]
    speed = {(r["method"], r["entry"], r["dataset"], r["temperature"]): r["speedup"] for r in summary["throughput"]}
    lines += _table(["method", "entry"] + [_col_name(*c) for c in cols],
                    [[m, e] + [f"{_fmt(speed.get((m, e, *c)))}×" for c in cols]
                     for m in results["methods"] for e in ENTRIES])  # fmt: skip

    if summary["identity"]:
        datasets = list(results["datasets"]) + [ALL]
        ident = {(r["method"], r["entry"], r["setting"], r["dataset"]): r for r in summary["identity"]}
        keys = sorted({(r["method"], r["entry"], r["setting"]) for r in summary["identity"]}, key=_identity_order)
        lines += ["", "## Greedy identity: outputs equal to the target's greedy output, token for token (T=0)", ""]
        lines += _table(["method", "entry", "setting"] + datasets,
                        [list(k) + [f"{ident[(*k, d)]['identical']}/{ident[(*k, d)]['prompts']}"
                                    if (*k, d) in ident else "–" for d in datasets] for k in keys])  # fmt: skip

    lines += ["", "## Draft step per block (ms, `spec_generate` timers, all datasets)", ""]
    lines += _table(["method", "T", "drafter", "lm_head", "refiner", "verify / step", "blocks"],
                    [[r["method"], _fmt(r["temperature"], 0), _fmt(r["drafter_ms_per_block"], 3),
                      _fmt(r["lm_head_ms_per_block"], 3), _fmt(r["refiner_ms_per_block"], 3),
                      _fmt(r["verify_ms_per_step"], 3), r["blocks"]] for r in summary["breakdown"]])  # fmt: skip

    if summary["latency"]:
        lines += ["", "## Refinement latency per block (µs, median [p10–p90] of `refine` on real drafter outputs)",
                  "",
                  "xPress fixed K: early exit off. Markov: its serial decode. none: the argmax of the drafter's "
                  "marginals.", ""]  # fmt: skip
        lines += _table(["method", "head", "setting", "median", "p10–p90", "samples"],
                        [[r["method"], r["refiner"], r["setting"], _fmt(r["median_us"], 0),
                          f"{_fmt(r['p10_us'], 0)}–{_fmt(r['p90_us'], 0)}", r["samples"]]
                         for r in summary["latency"]])  # fmt: skip
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install 'modeling-xpress[bench]'") from error
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_tau_vs_k(results: Mapping, path: Path) -> Path | None:
    """Paper Fig. 3: τ vs K per dataset (columns) and temperature (rows), adaptive as a separate point, Markov and
    no-head methods as dashed horizontal baselines."""
    summary = results["summary"]
    if not summary["sweep"]:
        return None
    plt = _pyplot()
    datasets, temps = list(results["datasets"]), results["settings"]["temperatures"]
    fig, axes = plt.subplots(len(temps), len(datasets), figsize=(4.5 * len(datasets), 3.4 * len(temps)),
                             squeeze=False, sharey=True)  # fmt: skip
    ks = sorted({_setting_order(r["setting"])[1] for r in summary["sweep"] if r["setting"] != ADAPTIVE_SETTING})
    adaptive_x = (max(ks) if ks else 0) + 1
    baselines = {m: v["refiner"] for m, v in results["methods"].items() if v["refiner"] != "xpress"}
    tau = {(r["method"], r["dataset"], r["temperature"]): r["tau"] for r in summary["tau"]}
    for i, temperature in enumerate(temps):
        for j, dataset in enumerate(datasets):
            ax = axes[i][j]
            rows = [r for r in summary["sweep"] if r["dataset"] == dataset and r["temperature"] == temperature]
            for method in sorted({r["method"] for r in rows}):
                fixed = sorted((_setting_order(r["setting"])[1], r["tau"]) for r in rows
                               if r["method"] == method and r["setting"] != ADAPTIVE_SETTING)  # fmt: skip
                line = ax.plot([k for k, _ in fixed], [t for _, t in fixed], "o-", label=f"{method} (fixed K)")[0]
                adaptive = [r["tau"] for r in rows if r["method"] == method and r["setting"] == ADAPTIVE_SETTING]
                if adaptive:
                    ax.plot([adaptive_x], adaptive, "*", ms=12, color=line.get_color(), label=f"{method} adaptive")
            for c, (method, refiner) in enumerate(baselines.items()):
                value = tau.get((method, dataset, temperature))
                if value is not None:
                    ax.axhline(value, ls="--", color=f"C{c + 3}", label=f"{method} ({refiner})")
            ax.set_xticks(ks + [adaptive_x], [str(k) for k in ks] + ["adapt."])
            ax.set_title(_col_name(dataset, temperature))
            ax.set_xlabel("Jacobi iterations K")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("τ (tokens / verification)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_draft_breakdown(results: Mapping, path: Path) -> Path:
    """Paper Fig. 4: stacked per-block draft cost (drafter forward / lm_head readout / refiner) per method."""
    plt = _pyplot()
    rows = results["summary"]["breakdown"]
    labels = [f"{r['method']}\nT={r['temperature']:g}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(rows) + 1.5), 3.8))
    bottom = [0.0] * len(rows)
    for part in ("drafter", "lm_head", "refiner"):
        values = [r[f"{part}_ms_per_block"] for r in rows]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per drafted block")
    ax.set_title("Draft-step latency breakdown (spec_generate timers)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_refiner_latency(results: Mapping, path: Path) -> Path | None:
    """Paper Table 3 as a plot: xPress refine latency vs K (median, p10–p90 bars), Markov serial decode and the plain
    argmax as horizontal lines."""
    rows = results["summary"]["latency"]
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    fixed_ks = sorted({_setting_order(r["setting"])[1] for r in rows
                       if r["refiner"] == "xpress" and r["setting"] != ADAPTIVE_SETTING})  # fmt: skip
    adaptive_x = (max(fixed_ks) if fixed_ks else 0) + 1
    for method in dict.fromkeys(r["method"] for r in rows if r["refiner"] == "xpress"):
        fixed = [(_setting_order(r["setting"])[1], r) for r in rows
                 if r["method"] == method and r["setting"] != ADAPTIVE_SETTING]  # fmt: skip
        fixed.sort(key=lambda pair: pair[0])
        xs, ys = [k for k, _ in fixed], [r["median_us"] for _, r in fixed]
        err = [[r["median_us"] - r["p10_us"] for _, r in fixed], [r["p90_us"] - r["median_us"] for _, r in fixed]]
        line = ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=f"{method} (K passes)")[0]
        for r in rows:
            if r["method"] == method and r["setting"] == ADAPTIVE_SETTING:
                ax.plot([adaptive_x], [r["median_us"]], "*", ms=12, color=line.get_color(), label=f"{method} adaptive")
    for c, r in enumerate(r for r in rows if r["refiner"] != "xpress"):
        ax.axhline(r["median_us"], ls="--" if r["refiner"] == "markov" else ":", color=f"C{c + 3}",
                   label=f"{r['method']} ({r['setting']})")  # fmt: skip
    if fixed_ks:
        ax.set_xticks(fixed_ks + [adaptive_x], [str(k) for k in fixed_ks] + ["adapt."])
    ax.set_xlabel("Jacobi iterations K")
    ax.set_ylabel("µs per block (median)")
    ax.set_title("Refinement latency per block")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(results: dict, out_dir: str | os.PathLike, run_name: str) -> dict[str, Path]:
    """Write `<run_name>.json` (raw + summary), the PNG plots and `<run_name>.md` into `out_dir`; return the paths."""
    if not run_name or "/" in run_name or run_name.startswith("."):
        raise ValueError(f"run_name must be a plain file stem, got {run_name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results["run_name"] = run_name
    paths: dict[str, Path] = {}
    plotters = {"tau_vs_k": plot_tau_vs_k, "draft_breakdown": plot_draft_breakdown,
                "refiner_latency": plot_refiner_latency}  # fmt: skip
    for name, plot in plotters.items():
        written = plot(results, out / f"{run_name}-{name}.png")
        if written is not None:
            paths[name] = written
    paths["json"] = out / f"{run_name}.json"
    # Compact: the raw records hold every acceptance length of every run.
    paths["json"].write_text(json.dumps(results, separators=(",", ":"), allow_nan=False))
    paths["markdown"] = out / f"{run_name}.md"
    paths["markdown"].write_text(markdown_report(results, {k: p.name for k, p in paths.items() if p.suffix == ".png"}))
    return paths


__all__ = [
    "BenchmarkSettings",
    "PromptSet",
    "card_rows",
    "chat_prompt_ids",
    "evaluation_prompt_sets",
    "load_methods",
    "markdown_report",
    "measure_refine_latency",
    "parse_dtype",
    "parse_method_spec",
    "run_benchmark",
    "summarize",
    "write_results",
]
