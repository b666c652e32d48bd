"""Evaluation harness: τ, the Jacobi K sweep, refiner latency and end-to-end speed, all measured in one run.

What one `run_benchmark` call measures, for a target and a set of named xPress checkpoints (any mix of
`refiner="none"` / `"markov"` / `"xpress"`), on named prompt sets, at each temperature:

1. Per prompt, side by side and in a rotating order so machine noise hits every entry alike: the two plain baselines
   — eager `target.generate` and the fastest plain decoding a user of the device would pick, `target.generate` with a
   static cache and `torch.compile` (`compiled_plain_kwargs`; compiled once, during the warm-up, and that time is
   recorded) — then `target.generate(assistant_model=method)` and `spec_generate(method, ...)` for every method.
   This gives τ (from `spec_generate`), the end-to-end throughput ratio of every entry against both baselines, the
   greedy-identity count (T=0; the compiled baseline is checked against the eager one too) and the draft-step timers
   (drafter / lm_head / refiner).
2. For every method with an xPress refiner, the Jacobi sweep: fixed K (early exit off) and "adaptive"
   (K = block_size - 1 with early exit), each through `spec_generate` on the same prompts.
3. A microbenchmark of `model.refine` on real drafter outputs captured from a short run (`latency.py`): median
   latency per block versus K for xPress (early exit off), the Markov head's serial decode and the plain argmax.

Nothing is invented: `run_benchmark` returns raw per-prompt records, `reports.summarize` derives every table from them
(so it can be rerun on a saved JSON), and `write_results` writes the JSON, a Markdown report (`reports.py`) and PNG
plots (`plots.py`). What a run measures, and the labels of its records, are `settings.py`.

Sampling (T > 0) is pure temperature sampling (no top-k / top-p) for both the plain and the speculative entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers
from transformers import CompileConfig
from tqdm.auto import tqdm

from ..compiled import cache_length
from ..decoding import spec_generate
from ..stats import WallClock
from .latency import capture_blocks, measure_refine_latency
from .plots import plot_draft_breakdown, plot_refiner_latency, plot_tau_vs_k
from .reports import markdown_report, summarize
from .settings import COMPILED_PLAIN, COMPILED_SPEC, CONFIG_SETTING, PLAIN, BenchmarkSettings, sweep_settings


# ---------------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------------


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
            from ..modeling_xpress import XPressModel

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


def prompt_ids(tokenizer, texts: Sequence[str], *, chat: bool = True) -> list[torch.Tensor]:
    """(1, T) ids per text: a user turn in the chat template for an instruct model (`chat_prompt_ids`), or, for a
    pretrained base model (`chat=False`), plain text to continue with the tokenizer's own special tokens (BOS)."""
    if chat:
        return chat_prompt_ids(tokenizer, texts)
    return [torch.tensor([tokenizer(text)["input_ids"]]) for text in texts]


def evaluation_prompt_sets(tokenizer, limit: int | None = None, *, chat: bool = True) -> dict[str, PromptSet]:
    """The first `limit` of each evaluation set. An instruct model (`chat`): HumanEval tasks and MT-Bench first turns,
    chat-templated. A pretrained base model: HumanEval's raw tasks, completed as they are (MT-Bench's questions are
    chat turns, not text a base model continues)."""
    from .assets import humaneval_prompts, mtbench_prompts

    loaders = {"humaneval": lambda: humaneval_prompts(chat=chat)}
    if chat:
        loaders["mtbench"] = mtbench_prompts
    sets = {}
    for name, loader in loaders.items():
        rows = loader()
        rows = rows.select(range(min(limit, len(rows)))) if limit is not None else rows
        sets[name] = PromptSet(prompt_ids(tokenizer, rows["prompt"], chat=chat), list(rows["id"]))
    return sets


# ---------------------------------------------------------------------------------------------------------------------
# Measuring primitives
# ---------------------------------------------------------------------------------------------------------------------


def _now(device: torch.device) -> float:
    return WallClock(device).now()


@contextlib.contextmanager
def config_setting(model, **fields) -> Iterator[None]:
    """Temporarily set fields of `model.config` (what decoding reads: `jacobi_max_iters`, `num_assistant_tokens`, ...);
    always restored."""
    saved = {name: getattr(model.config, name) for name in fields}
    for name, value in fields.items():
        setattr(model.config, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model.config, name, value)


def jacobi_setting(model, max_iters: int, early_exit: bool):
    """Temporarily set `config.jacobi_max_iters` / `jacobi_early_exit` (what `refine` reads); always restored."""
    return config_setting(model, jacobi_max_iters=max_iters, jacobi_early_exit=early_exit)


def _sampling_kwargs(temperature: float) -> dict:
    """generate() arguments for pure temperature sampling; top_k=0 switches off transformers' default top-k of 50,
    which `spec_generate` does not apply."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def _prompt_seed(settings: BenchmarkSettings, dataset_index: int, prompt_index: int) -> int:
    """One seed per (dataset, prompt), shared by every method so they sample under the same randomness."""
    return settings.seed * 1_000_003 + dataset_index * 10_007 + prompt_index


def compiled_plain_kwargs(max_cache_len: int) -> dict:
    """`generate` arguments of the fastest plain decoding a user would pick: a static cache of a fixed length (so every
    prompt reuses one compiled graph) and transformers' own `torch.compile` of the decoding step, which it applies by
    itself on CUDA and, with `_compile_all_devices`, on any device (inductor on CPU). The first call compiles."""
    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # a class attribute, not a constructor argument
    return {"cache_implementation": "static", "max_cache_len": max_cache_len, "compile_config": compile_config}


def run_plain(target, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int, *,
              compiled: dict | None = None):  # fmt: skip
    """Plain `target.generate` (with `compiled`: the `compiled_plain_kwargs` baseline); returns (sequences, seconds)."""
    torch.manual_seed(seed)  # generate samples from the global RNG
    start = _now(ids.device)
    out = target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **_sampling_kwargs(temperature),
        **(compiled or {}),
    )  # fmt: skip
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


def run_spec(target, model, ids: torch.Tensor, max_new_tokens: int, temperature: float, seed: int,
             compiled_cache_len: int | None = None):  # fmt: skip
    """`spec_generate(model, target, ...)`, generator seeded for this prompt; returns (sequences, seconds, stats).
    With `compiled_cache_len`: `spec_generate(compile=True, max_cache_len=compiled_cache_len)`."""
    generator = torch.Generator(device=ids.device).manual_seed(seed)
    compiled = {} if compiled_cache_len is None else {"compile": True, "max_cache_len": compiled_cache_len}
    start = _now(ids.device)
    out = spec_generate(model, target, ids, max_new_tokens=max_new_tokens, temperature=temperature, generator=generator,
                        **compiled)  # fmt: skip
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
                   settings: BenchmarkSettings, seed: int, rotation: int, compiled: dict | None = None,
                   spec_cache_len: int | None = None) -> list[dict]:  # fmt: skip
    """Every run for one prompt at one temperature (`spec_cache_len`: the static caches' length of the compiled
    speculative entry, one for the whole run).

    The timed entries (plain eager, plain compiled when `compiled` holds its `generate` arguments, then the
    speculative entries per method) run back to back in an order rotated by `rotation`, so slow drifts of machine load
    do not always hit the same entry. The K sweep follows; its outputs are checked against the plain run too (T=0), a
    free extra exactness check.
    """
    temperature, n = context["temperature"], settings.max_new_tokens
    baselines = [(PLAIN, None)] + ([(COMPILED_PLAIN, None)] if compiled is not None else [])
    order: list[tuple[str, str | None]] = baselines + [(e, m) for m in methods for e in settings.entries]
    shift = rotation % len(order)
    done: dict[tuple[str, str | None], tuple] = {}
    for entry, name in order[shift:] + order[:shift]:
        if entry == PLAIN:
            done[(entry, name)] = (*run_plain(target, ids, n, temperature, seed), None)
        elif entry == COMPILED_PLAIN:
            done[(entry, name)] = (*run_plain(target, ids, n, temperature, seed, compiled=compiled), None)
        elif entry == "generate":
            done[(entry, name)] = run_assisted(target, methods[name], ids, n, temperature, seed)
        elif entry == COMPILED_SPEC:
            done[(entry, name)] = run_spec(target, methods[name], ids, n, temperature, seed, spec_cache_len)
        else:
            done[(entry, name)] = run_spec(target, methods[name], ids, n, temperature, seed)
    reference = done[(PLAIN, None)][0] if temperature == 0 else None
    records = [
        _record(context, entry, name, None if entry in (PLAIN, COMPILED_PLAIN) else CONFIG_SETTING,
                *done[(entry, name)], None if entry == PLAIN else reference)  # fmt: skip
        for entry, name in order
    ]
    for name, model in methods.items():
        if not model.refiner.iterative:  # the K sweep applies to Jacobi heads only
            continue
        for label, max_iters, early_exit in sweep_settings(model, settings):
            with jacobi_setting(model, max_iters, early_exit):
                sequences, seconds, stats = run_spec(target, model, ids, n, temperature, seed)
            records.append(_record(context, "spec_generate", name, label, sequences, seconds, stats, reference))
    return records


def warm_up(target, methods: Mapping[str, torch.nn.Module], ids: torch.Tensor, compiled: dict | None = None,
            spec_cache_len: int | None = None, temperatures: Sequence[float] = (0.0,)) -> dict:  # fmt: skip
    """One short run of every entry, so one-off costs (allocations, lazy init, folded refiner, compilation) are not
    charged to the first measured prompt. Returns the seconds of the compiled baseline's first call (its compilation)
    and of a second call (what is left once compiled), under "compiled_plain_first_call_s" / "..._second_call_s";
    with `spec_cache_len` (the compiled speculative entry is measured) each method's compiled decoder is built at every
    temperature of the run, its compile seconds under "spec_compiled_compile_s" per method."""
    tokens = 2 * max((m.config.block_size for m in methods.values()), default=2)
    run_plain(target, ids, tokens, 0.0, 0)
    warm = {}
    if compiled is not None:
        warm["compiled_plain_first_call_s"] = run_plain(target, ids, tokens, 0.0, 0, compiled=compiled)[1]
        warm["compiled_plain_second_call_s"] = run_plain(target, ids, tokens, 0.0, 0, compiled=compiled)[1]
    for name, model in methods.items():
        run_assisted(target, model, ids, tokens, 0.0, 0)
        run_spec(target, model, ids, tokens, 0.0, 0)
        if spec_cache_len is not None:
            seconds = 0.0
            for temperature in temperatures:  # a decoder per sampling setting; the first call of each compiles
                seconds += run_spec(target, model, ids, tokens, temperature, 0, spec_cache_len)[2].time_compile
            warm.setdefault("spec_compiled_compile_s", {})[name] = seconds
    return warm


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


def cpu_name() -> str | None:
    """The CPU's model name (Linux's /proc/cpuinfo), or None where it cannot be read."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def environment_info(target) -> dict:
    """Versions and machine facts stored with every result."""
    from .. import __version__

    cpu = cpu_name()
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
        "jacobi_early_exit": c.jacobi_early_exit, "num_assistant_tokens": c.num_assistant_tokens,
        "draft_confidence_threshold": c.draft_confidence_threshold, "dtype": str(model.dtype).removeprefix("torch."),
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
    "records", "latency", "summary", "wall_time_s", ...}`; `metadata` is stored as given (e.g. checkpoint paths).
    `settings.num_assistant_tokens` caps every method's drafts per block for the run (each config's own value is
    restored afterwards). With "auto" every entry verifies the cap its own loop chooses on this machine, as a user's
    call with the checkpoint's default does: the eager loops (`generate`, `spec_generate`) the eager choice, the
    compiled entry the compiled one (`XPressModel.choose_draft_cap`); the choices are made before the run and stored
    as `results["draft_caps"]` (method -> loop -> choice).
    """
    settings = settings or BenchmarkSettings()
    check_methods(target, methods)
    with contextlib.ExitStack() as caps:
        choices = {}
        if settings.num_assistant_tokens == "auto":
            loops = ("eager", "compiled") if COMPILED_SPEC in settings.entries else ("eager",)
            choices = choose_draft_caps(target, methods, loops=loops)
        for model in methods.values():
            if settings.num_assistant_tokens is not None:  # "auto": None, so that each loop resolves its own choice
                cap = None if choices else settings.num_assistant_tokens
                caps.enter_context(config_setting(model, num_assistant_tokens=cap))
        results = _run_benchmark(target, methods, prompt_sets, settings, metadata, progress)
    if choices:
        results["draft_caps"] = {
            name: {loop: {**asdict(choice), "tokens_per_second": choice.tokens_per_second} for loop, choice in loops.items()}
            for name, loops in choices.items()
        }  # fmt: skip
        for name, loops in choices.items():
            results["methods"][name]["num_assistant_tokens"] = {loop: choice.cap for loop, choice in loops.items()}
    return results


def choose_draft_caps(target, methods: Mapping[str, torch.nn.Module], *, loops: Sequence[str]) -> dict:
    """name → loop ("eager", "compiled") → `DraftCapChoice` for `num_assistant_tokens="auto"`; every method needs its
    own measured acceptance."""
    missing = [name for name, model in methods.items() if getattr(model.config, "draft_acceptance", None) is None]
    if missing:
        raise ValueError(
            f"num_assistant_tokens='auto' chooses each method's drafts per block from its config's draft_acceptance, "
            f"which {missing} lack: measure it on held-out prompts (examples/choose_draft_length.py --thresholds none "
            "reports it; examples/bundle_checkpoint.py --acceptance stores it), or give an integer cap for every method"
        )
    return {
        name: {loop: model.choose_draft_cap(target, compiled=loop == "compiled") for loop in loops}
        for name, model in methods.items()
    }


def check_methods(target, methods: Mapping[str, torch.nn.Module]) -> None:
    """At least one method, each made for this target, none named like the plain baseline."""
    if not methods:
        raise ValueError("no methods given: pass at least one xPress checkpoint")
    for name, model in methods.items():
        model.config.check_target(target.config)
        if name == "plain":
            raise ValueError("'plain' names the target-alone baseline; give the method another name")


def _run_benchmark(target, methods, prompt_sets, settings: BenchmarkSettings, metadata, progress: bool) -> dict:
    if not prompt_sets:
        raise ValueError("no prompt sets given")
    sets = {name: (s if isinstance(s, PromptSet) else PromptSet(list(s))).head(settings.limit)
            for name, s in prompt_sets.items()}  # fmt: skip
    empty = [name for name, s in sets.items() if not s.input_ids]
    if empty:
        raise ValueError(f"prompt sets {empty} are empty")
    device = target.device
    sets = {name: PromptSet([x.to(device) for x in s.input_ids], s.ids) for name, s in sets.items()}
    started, wall_start = datetime.now(timezone.utc), time.perf_counter()

    first = next(iter(sets.values())).input_ids[0]
    # One static cache length for every prompt of the run (and the warm-up): one compiled graph serves them all.
    longest = max(int(x.shape[1]) for s in sets.values() for x in s.input_ids)
    compiled = compiled_plain_kwargs(longest + settings.max_new_tokens) if settings.compiled_plain else None
    block = max(m.config.block_size for m in methods.values())
    spec_cache_len = None  # the compiled speculative entry's cache length, one for the whole run too
    if COMPILED_SPEC in settings.entries:
        spec_cache_len = cache_length(longest, settings.max_new_tokens, block)
    warm = warm_up(target, methods, first, compiled, spec_cache_len, settings.temperatures)
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
                records += measure_prompt(target, methods, ids, context, settings, seed, rotation=p_index,
                                          compiled=compiled, spec_cache_len=spec_cache_len)  # fmt: skip
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
        "warm_up": warm,
    }
    results["summary"] = summarize(results)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Writing the results
# ---------------------------------------------------------------------------------------------------------------------


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
    "PromptSet",
    "chat_prompt_ids",
    "evaluation_prompt_sets",
    "prompt_ids",
    "load_methods",
    "run_benchmark",
    "write_results",
]
