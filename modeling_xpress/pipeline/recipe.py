"""A pipeline recipe: everything that decides what the pipeline makes for a target, in one JSON file.

Recipes are JSON (the standard library reads it; the project's configs and records are JSON too), one object whose
keys are the fields of `Recipe` below, each documented where it is declared. `"extends": "<recipe>"` starts from
another recipe (a name in the same folder, or a path) and overrides its keys, as SmolLM2's v7 continued v6. A key the
recipe does not know, or a value a field cannot take, is a `ValueError` that names it. The repository's recipes are
in `recipes/` at its root (beside `data/` and `checkpoints/`, which the SmolLM2 recipes name by relative paths: every
relative path in a recipe is relative to the directory the pipeline runs in, the repository root).

`load_recipe("gemma3-270m")` reads `recipes/gemma3-270m.json`; `load_recipe("path/to/mine.json")` any file;
`overrides` (the command's `--set key=value`) change single fields after loading.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

RECIPE_FOLDER = Path("recipes")
"""Where `load_recipe` looks for a recipe given by name (relative to the working directory, the repository root)."""

TRAINING_STAGES = ("drafter", "dflash", "markov", "xpress")
"""The training stages: the drafter alone (dFlash's objective), then heads on it: none (the drafter continued with
the same budget, a baseline), DSpark's Markov head, the xPress head."""

HEAD_REFINER = {"dflash": "none", "markov": "markov", "xpress": "xpress"}
"""The `refiner` each head stage trains."""

GENERATOR_NAMES = ("default", "task", "mined", "completion")
"""`training.prompts.GENERATORS`' names (checked against it when the prompts stage runs)."""


@dataclass
class PromptSet:
    """Prompts `first..n-1` of `training.prompts.training_prompts(n, seed, kinds=GENERATORS[kinds])`: the generator is
    prefix-stable, so a larger set extends a smaller one."""

    kinds: str
    n: int
    first: int = 0

    def name(self) -> str:
        """The folder name of this set's responses."""
        return f"{self.kinds}-{self.first}-{self.n}"


@dataclass
class Recipe:
    # What the recipe is for and why its settings are what they are (shown in the records and the model card).
    description: str = ""

    # --- prompts and the target's responses -------------------------------------------------------------------------
    # Apply the target's chat template to the prompts: true for an instruct model (prompts are user turns), false
    # for a pretrained base model (prompts are plain text to continue: use the "completion" generator).
    chat_template: bool = True
    # System message before every prompt (chat template only); null leaves the template's own default.
    system_prompt: str | None = None
    # The prompt sets the target answers: {"kinds": generator name, "n": end, "first": start}. Generators: "default"
    # (code, math, chat), "task" (task-shaped), "mined" (from the standard library), "completion" (text to continue).
    prompt_sets: list[PromptSet] = field(default_factory=lambda: [PromptSet("default", 2400)])
    # Response sets written earlier (folders with responses.parquet and meta.json: this pipeline's responses stage,
    # examples/make_training_data.py) to train on instead: then the prompts and responses stages are given, not run.
    data: list[str] = field(default_factory=list)
    # Longest response, in tokens.
    max_new_tokens: int = 256
    # Prompts per generation batch (transformers' generate) and per resumable shard.
    generation_batch_size: int = 32
    shard_size: int = 64
    # Greedy responses (the default), or sampled at `temperature`.
    do_sample: bool = False
    temperature: float = 1.0
    # Who writes the responses: "auto" (vLLM when its virtualenv exists, `--vllm-python`, default
    # .venv-vllm/bin/python; else transformers), "vllm" or "transformers".
    engine: str = "auto"

    # --- the drafter ------------------------------------------------------------------------------------------------
    # Decoder layers of a fresh drafter, and the target layers it reads (null: dFlash's rule for that many layers).
    num_draft_layers: int = 4
    target_layer_ids: list[int] | None = None
    # Tokens per block, anchor included.
    block_size: int = 16
    # Where a fresh drafter's layers start: "target" (the target's last layers, `training.target_init`; Llama,
    # Mistral and Qwen3 targets), "scratch" (random), "auto" (the target's where the architecture allows).
    drafter_init: str = "auto"
    # A fresh drafter reads out only the N most frequent response tokens of the training rows (null: the whole
    # vocabulary). Verification stays lossless.
    draft_vocab_size: int | None = 4096
    # The drafter stage continues this trained drafter (its architecture and vocabulary come with it; with
    # `target_layer_ids`, the layers it reads plus more) instead of building a fresh one.
    continue_from: str | None = None
    # The head stages start from this drafter instead of the drafter stage's.
    drafter_from: str | None = None

    # --- training ---------------------------------------------------------------------------------------------------
    # The training stages to run, in order: "drafter", then any of "dflash", "markov", "xpress".
    stages: list[str] = field(default_factory=lambda: ["drafter", "xpress"])
    # The target's dtype and the training's autocast: "bfloat16" (`--bf16`) or "float32" (a CPU without native bf16).
    precision: str = "bfloat16"
    # torch threads (null: torch's default). 1 on a CPU shared with other jobs.
    threads: int | None = None
    # The target's signals computed once and read by every training stage: true (`<out>/signals`), a folder (shared
    # between runs with the same rows and drafter layers), or false (train against the live target).
    signal_cache: bool | str = True
    signal_cache_top_k: int = 64
    # Rows per batch, random blocks per row, longest row in tokens.
    batch_size: int = 4
    anchors: int = 32
    max_seq_length: int = 640
    # The drafter stage: at most this many steps (early stopping may end it sooner), its peak learning rate and
    # warm-up; a cosine schedule.
    drafter_steps: int = 1000
    learning_rate: float = 6e-4
    warmup_steps: int = 20
    # The head stages: steps each (an equal budget), their learning rate (null: `learning_rate`), what they train
    # ("full": the head and the drafter, the authors' co-training; "refiner": the head on the frozen drafter), the
    # head's rank, and a seeded subset of the training rows shared by every head stage (null: every row).
    head_steps: int = 150
    head_learning_rate: float | None = None
    head_train_mode: str = "full"
    refiner_rank: int = 256
    head_train_rows: int | None = None
    # More examples/train_refiner.py flags, passed through as they are (e.g. {"consistency_weight": 0.3}):
    # for the drafter stage, and for every head stage.
    drafter_args: dict[str, Any] = field(default_factory=dict)
    head_args: dict[str, Any] = field(default_factory=dict)
    # Held-out rows scored every `save_steps` (0: none): the first N held-out prompts of each prompt set's generator
    # are answered too, and the best checkpoint by eval_tau_estimate is kept, stopping after `patience` evaluations
    # without improvement. `eval_on_start`: also before the first step (the figure of a continued drafter).
    eval_held_out: int = 0
    eval_on_start: bool = False
    patience: int = 4
    save_steps: int = 50
    seed: int = 0
    # Snapshots of the training stages without optimizer state (`--write-snapshots` writes them, e.g. to commit): a
    # stage with no local checkpoint resumes from `<snapshots>/<stage>` (another session, another machine).
    snapshots: str | None = None
    snapshot_dtype: str = "float32"

    # --- measuring and saving ---------------------------------------------------------------------------------------
    # Held-out prompts decoded greedily to measure `draft_acceptance` and `tree_acceptance`: the first N held-out
    # prompts of this generator (null: the first prompt set's), at most `measure_max_new_tokens` new tokens each, in
    # `measure_dtype`; trees of each of `tree_nodes` nodes.
    measure_prompts: int = 10
    measure_kinds: str | None = None
    measure_max_new_tokens: int = 96
    measure_dtype: str = "float32"
    tree_nodes: list[int] = field(default_factory=lambda: [4, 8, 16])
    # The training stage whose model is measured and saved (null: the last of `stages`).
    final: str | None = None
    # The saved model's dtype.
    save_dtype: str = "bfloat16"
    # Measure and save the head with its token table over the draft vocabulary (`XPressModel.compact_token_table`):
    # for a large vocabulary (Gemma-3's 262,144 tokens at r = 256: 67M parameters, 134 MB in bf16) that table is most
    # of the folder, and only a block's committed tokens outside the draft vocabulary fall on its shared row.
    compact_token_table: bool = False

    def __post_init__(self):
        self.prompt_sets = [p if isinstance(p, PromptSet) else _prompt_set(p) for p in self.prompt_sets]
        self.validate()

    def validate(self) -> None:
        """Raise a `ValueError` naming the first field whose value cannot work."""
        _check_type(self)
        choices = {"engine": ("auto", "vllm", "transformers"), "drafter_init": ("auto", "target", "scratch"),
                   "precision": ("bfloat16", "float32"), "head_train_mode": ("full", "refiner"),
                   "snapshot_dtype": ("bfloat16", "float32"), "measure_dtype": ("bfloat16", "float32"),
                   "save_dtype": ("bfloat16", "float32")}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"recipe field {name} must be one of {allowed}, got {getattr(self, name)!r}")
        positive = ("max_new_tokens", "generation_batch_size", "shard_size", "num_draft_layers", "signal_cache_top_k",
                    "batch_size", "anchors", "drafter_steps", "head_steps", "refiner_rank", "patience", "save_steps",
                    "measure_prompts", "measure_max_new_tokens")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"recipe field {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.block_size < 2 or self.max_seq_length < 2:
            raise ValueError(f"block_size and max_seq_length must be >= 2, got {self.block_size}, {self.max_seq_length}")
        for name in ("draft_vocab_size", "head_train_rows", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"recipe field {name} must be null or a positive integer, got {value!r}")
        if self.eval_held_out < 0 or self.warmup_steps < 0:
            raise ValueError(f"eval_held_out and warmup_steps must be >= 0, got {self.eval_held_out}, {self.warmup_steps}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"do_sample needs temperature > 0, got {self.temperature}; set do_sample false for greedy")
        if not self.stages or any(s not in TRAINING_STAGES for s in self.stages) or len(set(self.stages)) < len(self.stages):
            raise ValueError(f"recipe field stages must list training stages of {TRAINING_STAGES} once each, got "
                             f"{self.stages!r}")  # fmt: skip
        if "drafter" in self.stages and self.stages[0] != "drafter":
            raise ValueError(f"the drafter stage comes before the heads trained on it: stages {self.stages!r}")
        if self.head_train_mode == "refiner" and "dflash" in self.stages:
            raise ValueError(
                "head_train_mode 'refiner' freezes the drafter, so the dflash stage would train nothing: its baseline "
                "is the drafter itself; leave dflash out of stages"
            )
        if "drafter" not in self.stages and self.drafter_from is None:
            raise ValueError("without a drafter stage the heads need a drafter to start from: set drafter_from")
        if "drafter" in self.stages and self.drafter_from is not None:
            raise ValueError("drafter_from replaces the drafter stage's output: leave drafter out of stages, or drop it")
        if self.final is not None and self.final not in self.stages:
            raise ValueError(f"final must be one of the stages {self.stages}, got {self.final!r}")
        if not self.data and not self.prompt_sets:
            raise ValueError("a recipe needs prompt_sets (prompts the target answers) or data (response sets)")
        for prompt_set in self.prompt_sets:
            if prompt_set.kinds not in GENERATOR_NAMES or not 0 <= prompt_set.first < prompt_set.n:
                raise ValueError(f"a prompt set needs kinds in {GENERATOR_NAMES} and 0 <= first < n, got {prompt_set}")
        if self.measure_kinds is not None and self.measure_kinds not in GENERATOR_NAMES:
            raise ValueError(f"measure_kinds must be null or one of {GENERATOR_NAMES}, got {self.measure_kinds!r}")
        if self.data and self.measure_kinds is None:
            raise ValueError("with given data, name the generator whose held-out prompts measure the model: measure_kinds")
        if not self.tree_nodes or any(not isinstance(n, int) or n < 1 for n in self.tree_nodes):
            raise ValueError(f"tree_nodes must list positive node budgets, got {self.tree_nodes!r}")
        if self.signal_cache == "":
            raise ValueError("signal_cache must be true, false or a folder; '' is none of them (false: no cache)")

    @property
    def final_stage(self) -> str:
        return self.final or self.stages[-1]

    @property
    def measure_generator(self) -> str:
        return self.measure_kinds or self.prompt_sets[0].kinds

    def as_dict(self) -> dict:
        return asdict(self)


def _prompt_set(value) -> PromptSet:
    if not isinstance(value, dict) or set(value) - {"kinds", "n", "first"} or not {"kinds", "n"} <= set(value):
        raise ValueError(f"a prompt set is {{'kinds': generator, 'n': end, 'first': start (optional)}}, got {value!r}")
    return PromptSet(**value)


# What each field holds, for the type check: JSON gives ints, floats, strings, bools, lists and objects.
def _accepts(value, annotation: str) -> bool:
    if value is None:
        return "None" in annotation
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "list[PromptSet]": lambda v: isinstance(v, list),
        "dict[str, Any]": lambda v: isinstance(v, dict),
    }
    return any(checks[part.strip()](value) for part in annotation.split("|") if part.strip() in checks)


def _check_type(recipe: Recipe) -> None:
    for f in fields(recipe):
        value = getattr(recipe, f.name)
        if not _accepts(value, str(f.type)):
            raise ValueError(f"recipe field {f.name} must be {f.type}, got {value!r}")


def recipe_path(name_or_path: str, folder: Path = RECIPE_FOLDER) -> Path:
    """A recipe file: `name_or_path` itself when it is a file, else `<folder>/<name>.json`."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    named = folder / f"{name_or_path}.json"
    if named.is_file():
        return named
    known = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
    raise ValueError(f"no recipe {name_or_path!r}: not a file, and not a name in {folder}/ (known: {known})")


def _read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A recipe file's keys, its `extends` chain resolved (the file's own keys win)."""
    if path.resolve() in seen:
        raise ValueError(f"recipe {path} extends itself through {[str(p) for p in seen]}")
    try:
        keys = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"recipe {path} is not valid JSON: {error}") from None
    if not isinstance(keys, dict):
        raise ValueError(f"recipe {path} must hold one JSON object, got {type(keys).__name__}")
    parent = keys.pop("extends", None)
    if parent is None:
        return keys
    return _read(recipe_path(parent, path.parent), (*seen, path.resolve())) | keys


def make_recipe(keys: dict) -> Recipe:
    """A `Recipe` from a dict of its fields; an unknown key is a `ValueError` listing the known ones."""
    known = {f.name for f in fields(Recipe)}
    unknown = sorted(set(keys) - known)
    if unknown:
        raise ValueError(f"unknown recipe field(s) {unknown}; the fields are {sorted(known)}")
    return Recipe(**keys)


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` of the command's `--set`: the value read as JSON (`4`, `false`, `null`, `[1, 27]`), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set takes key=value (a recipe field and its JSON value), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def load_recipe(name_or_path: str, overrides: dict | None = None, folder: Path = RECIPE_FOLDER) -> Recipe:
    """The recipe named `name_or_path` (a file, or a name in `folder`), with `overrides` applied to its fields."""
    return make_recipe(_read(recipe_path(name_or_path, folder)) | dict(overrides or {}))
