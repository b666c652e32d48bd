"""Side-by-side runs of plain `target.generate` and xPress speculative decoding, measured in the same process."""

from dataclasses import dataclass
from pathlib import Path

import torch

from ..stats import WallClock

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"

# The trained checkpoint bundled with the repository, and the prompts of `make demo` and its CI test:
# written here, in none of the training or evaluation sets.
BUNDLED_CHECKPOINT = CHECKPOINTS / "xpress-smollm2-135m-instruct"
DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "A train travels 180 km in 2 hours. What is its average speed? Explain briefly.",
    "Give me three tips for staying focused while studying.",
]
# Gemma-3-270M is a pretrained base model: its prompts are text to continue (written here, in none of the sets).
COMPLETION_DEMO_PROMPTS = [
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same forwards and backwards,\n'
    '    ignoring case and spaces."""\n',
    "Question: A train travels 180 km in 2 hours. What is its average speed?\nAnswer:",
    "Three tips for staying focused while studying:\n1.",
]


@dataclass(frozen=True)
class BundledPair:
    """A real target (a GGUF package of `bench.assets.GGUF_PACKAGES`) and the checkpoint bundled for it: what `make
    demo TARGET=<name>` and the measuring scripts' `--target <name>` run."""

    target: str
    checkpoint: Path
    prompts: tuple[str, ...]
    # `training.prompts.GENERATORS` names: whose held-out prompts `make demo --held-out` decodes, and whose held-out
    # prompts the measuring scripts (`choose_draft_length.py`, `compiled_cpu_benchmark.py`) read by default.
    held_out_kinds: str
    settings_kinds: str
    # The most the repository allows the bundled folder (`examples/bundle_checkpoint.py` refuses more).
    size_limit_mb: int

    @property
    def chat(self) -> bool:
        """An instruct target (prompts are chat turns) or a base model (prompts are text to continue)."""
        from .assets import gguf_package

        return gguf_package(self.target).chat

    @property
    def hub_id(self) -> str:
        """The target's Hub repository, which the bundled folder's config and card name."""
        from .assets import gguf_package

        return gguf_package(self.target).hub_id


BUNDLED = {
    "smollm2": BundledPair("smollm2-135m-instruct", BUNDLED_CHECKPOINT, tuple(DEMO_PROMPTS), "task", "default", 50),
    "gemma": BundledPair("gemma3-270m", CHECKPOINTS / "xpress-gemma3-270m", tuple(COMPLETION_DEMO_PROMPTS), "completion",
                         "completion", 60),
}  # fmt: skip
"""The bundled pairs by the name `--target` / `make demo TARGET=` takes."""


def bundled_pair(name: str) -> BundledPair:
    """`BUNDLED[name]`, or a ValueError naming the known pairs."""
    if name not in BUNDLED:
        raise ValueError(f"--target {name!r} is not a bundled pair; choose one of {sorted(BUNDLED)}")
    return BUNDLED[name]


@dataclass
class ComparisonRow:
    prompt_tokens: int
    new_tokens: int
    identical: bool  # xPress output == the target's own greedy output, token for token
    mean_tau: float
    plain_seconds: float
    xpress_seconds: float
    text: str | None = None
    # spec_generate(compile=True) on the same prompt, when measured: output identical to the target's, its τ, seconds
    compiled_identical: bool | None = None
    compiled_tau: float | None = None
    compiled_seconds: float | None = None
    compiled_new_tokens: int | None = None
    compiled_compile_seconds: float | None = None  # compilation inside this timed call (0 once the warm-up compiled)

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.xpress_seconds

    @property
    def compiled_speedup(self) -> float | None:
        return None if self.compiled_seconds is None else self.plain_seconds / self.compiled_seconds


@torch.inference_mode()
def compile_cache_length(xpress, prompts: list[torch.Tensor], max_new_tokens: int) -> int:
    """One static cache length for every prompt, so `spec_generate(compile=True)` compiles once for all of them."""
    from ..compiled import cache_length

    widest_tree = max(getattr(xpress.config, "tree_acceptance", None) or [0])  # room for the tree "auto" may pick
    return cache_length(max(int(p.shape[1]) for p in prompts), max_new_tokens + widest_tree, xpress.config.block_size)


@torch.inference_mode()
def compare_greedy(target, xpress, prompts: list[torch.Tensor], *, max_new_tokens: int = 64, tokenizer=None,
                   warmup: bool = True, compiled: bool = False,
                   num_assistant_tokens: int | None = None, tree_nodes=None) -> list[ComparisonRow]:  # fmt: skip
    """Greedy-decode each prompt (1, T) with the target alone and with `assistant_model=xpress` (and, with `compiled`,
    with `xpress.spec_generate(target, ..., compile=True)`, compiled during the warm-up), one after the other per
    prompt so machine noise hits them alike. Returns one row per prompt; the ratio of summed times is the speedup.
    `num_assistant_tokens`: drafts verified per block by both xPress decoders (None: the xPress config's);
    `tree_nodes`: the compiled decoder's (None: linear blocks; "auto": a tree where one pays on this machine)."""
    cache_len = compile_cache_length(xpress, prompts, max_new_tokens) if compiled and prompts else None
    assisted = {} if num_assistant_tokens is None else {"num_assistant_tokens": num_assistant_tokens}
    if warmup and prompts:
        target.generate(prompts[0], max_new_tokens=4, do_sample=False)
        target.generate(prompts[0], max_new_tokens=4, do_sample=False, assistant_model=xpress, **assisted)
        if compiled:  # two blocks' worth, so every graph of the loop (not only the first step's) is compiled here
            xpress.spec_generate(target, prompts[0], max_new_tokens=2 * xpress.config.block_size, compile=True,
                                 max_cache_len=cache_len, num_assistant_tokens=num_assistant_tokens,
                                 tree_nodes=tree_nodes)  # fmt: skip
    rows = []
    clock = WallClock(target.device)  # synchronises CUDA, so GPU times are real
    for ids in prompts:
        t0 = clock.now()
        plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        t1 = clock.now()
        fast = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=xpress, **assisted)
        t2 = clock.now()
        row = ComparisonRow(
            prompt_tokens=ids.shape[1],
            new_tokens=fast.shape[1] - ids.shape[1],
            identical=torch.equal(plain, fast),
            mean_tau=xpress.generation_stats.mean_tau,
            plain_seconds=t1 - t0,
            xpress_seconds=t2 - t1,
            text=tokenizer.decode(fast[0, ids.shape[1] :], skip_special_tokens=True) if tokenizer is not None else None,
        )
        if compiled:
            t3 = clock.now()
            out = xpress.spec_generate(target, ids, max_new_tokens=max_new_tokens, compile=True,
                                       max_cache_len=cache_len, num_assistant_tokens=num_assistant_tokens,
                                 tree_nodes=tree_nodes)  # fmt: skip
            row.compiled_seconds = clock.now() - t3
            row.compiled_identical = torch.equal(plain, out.sequences)
            row.compiled_tau = out.stats.mean_tau
            row.compiled_new_tokens = out.sequences.shape[1] - ids.shape[1]
            row.compiled_compile_seconds = out.stats.time_compile
        rows.append(row)
    return rows


def summary(rows: list[ComparisonRow]) -> dict:
    plain = sum(r.plain_seconds for r in rows)
    fast = sum(r.xpress_seconds for r in rows)
    taus = [r.mean_tau for r in rows]
    tokens = sum(r.new_tokens for r in rows)
    result = {
        "prompts": len(rows),
        "identical": sum(r.identical for r in rows),
        "mean_tau": sum(taus) / max(len(taus), 1),
        "speedup_vs_plain": plain / fast if fast else float("nan"),
        "plain_tokens_per_s": tokens / plain if plain else float("nan"),
        "xpress_tokens_per_s": tokens / fast if fast else float("nan"),
    }
    if rows and all(r.compiled_seconds is not None for r in rows):
        compiled = sum(r.compiled_seconds for r in rows)
        result.update(
            compiled_identical=sum(r.compiled_identical for r in rows),
            compiled_mean_tau=sum(r.compiled_tau for r in rows) / len(rows),
            # tokens/s of each decoder over its own tokens (fp32 greedy: the same tokens; bf16 near-ties may differ)
            compiled_speedup_vs_plain=(sum(r.compiled_new_tokens for r in rows) / compiled) / (tokens / plain),
            compiled_tokens_per_s=sum(r.compiled_new_tokens for r in rows) / compiled,
        )
    return result
