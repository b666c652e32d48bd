"""Side-by-side runs of plain `target.generate` and xPress speculative decoding, measured in the same process."""

from dataclasses import dataclass
from pathlib import Path

import torch

from .generation import WallClock

# The trained checkpoint bundled with the repository (issue 4), and the prompts of `make demo` and its CI test:
# written here, in none of the training or evaluation sets.
BUNDLED_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "xpress-smollm2-135m-instruct"
DEMO_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "A train travels 180 km in 2 hours. What is its average speed? Explain briefly.",
    "Give me three tips for staying focused while studying.",
]


@dataclass
class ComparisonRow:
    prompt_tokens: int
    new_tokens: int
    identical: bool  # xPress output == the target's own greedy output, token for token
    mean_tau: float
    plain_seconds: float
    xpress_seconds: float
    text: str | None = None

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.xpress_seconds


@torch.inference_mode()
def compare_greedy(target, xpress, prompts: list[torch.Tensor], *, max_new_tokens: int = 64, tokenizer=None,
                   warmup: bool = True) -> list[ComparisonRow]:  # fmt: skip
    """Greedy-decode each prompt (1, T) with the target alone and with `assistant_model=xpress`, alternating the two
    so machine noise hits both alike. Returns one row per prompt; the ratio of summed times is the speedup."""
    if warmup and prompts:
        target.generate(prompts[0], max_new_tokens=4, do_sample=False)
        target.generate(prompts[0], max_new_tokens=4, do_sample=False, assistant_model=xpress)
    rows = []
    clock = WallClock(target.device)  # synchronises CUDA, so GPU times are real
    for ids in prompts:
        t0 = clock.now()
        plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        t1 = clock.now()
        fast = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=xpress)
        t2 = clock.now()
        new = fast[0, ids.shape[1] :]
        rows.append(
            ComparisonRow(
                prompt_tokens=ids.shape[1],
                new_tokens=new.shape[0],
                identical=torch.equal(plain, fast),
                mean_tau=xpress.generation_stats.mean_tau,
                plain_seconds=t1 - t0,
                xpress_seconds=t2 - t1,
                text=tokenizer.decode(new, skip_special_tokens=True) if tokenizer is not None else None,
            )
        )
    return rows


def summary(rows: list[ComparisonRow]) -> dict:
    plain = sum(r.plain_seconds for r in rows)
    fast = sum(r.xpress_seconds for r in rows)
    taus = [r.mean_tau for r in rows]
    return {
        "prompts": len(rows),
        "identical": sum(r.identical for r in rows),
        "mean_tau": sum(taus) / max(len(taus), 1),
        "speedup_vs_plain": plain / fast if fast else float("nan"),
        "plain_tokens_per_s": sum(r.new_tokens for r in rows) / plain if plain else float("nan"),
        "xpress_tokens_per_s": sum(r.new_tokens for r in rows) / fast if fast else float("nan"),
    }
