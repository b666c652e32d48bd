"""Training prompts made by our own code: templates, vocabularies and random numbers, or text mined from the standard
library installed here.

The kinds are built in four modules, one per generator: `general_prompts` (code, math, chat: the default),
`task_prompts` (task-shaped), `mined_prompts` (mined from the standard library) and `completion_prompts` (text to
continue, for a pretrained base model that is not tuned to answer chat turns). This module names them and draws the
prompts.

A drafter is trained on what *its target* answers (paper section 4.3), so the prompts only need to be
varied, not answered: :func:`training_prompts` builds a few thousand of them (code, math, chat; task-shaped kinds;
or kinds mined from the installed standard library's code and documentation). They never come from HumanEval or
MT-Bench, which are the evaluation sets (:mod:`modeling_xpress.bench.assets`). The target's answers are made by
:func:`modeling_xpress.training.regeneration.regenerate_responses`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import datasets

from . import completion_prompts, general_prompts, mined_prompts, task_prompts

PROMPT_KINDS = ("code", "math", "chat")
# Task-shaped kinds (a function stub to complete; roles, passages, puzzles, essays): `training_prompts(kinds=TASK_KINDS)`
TASK_KINDS = ("stub", "roleplay", "extraction", "reasoning", "essay")
# Kinds mined from local text, the Python standard library installed here (`training_prompts(kinds=MINED_KINDS)`): its
# documented functions as stubs to complete or code to explain, its documentation's prose as passages to work from
MINED_KINDS = ("source_stub", "source_explain", "doc_passage")
# Completion-style kinds for a base model, given as plain text (no chat template): a function signature and docstring,
# the start of a documentation passage, a question in a Q/A layout (`training_prompts(kinds=COMPLETION_KINDS)`)
COMPLETION_KINDS = ("code_prefix", "doc_prefix", "question")
# The generators by the name scripts and recipes give them (`make_training_data.py --kinds`, a pipeline recipe's
# prompt sets, `choose_draft_length.py --kinds`)
GENERATORS = {"default": PROMPT_KINDS, "task": TASK_KINDS, "mined": MINED_KINDS, "completion": COMPLETION_KINDS}

_PROMPT_BUILDERS: dict[str, Callable[[random.Random], str]] = {
    "code": general_prompts.code_prompt, "math": general_prompts.math_prompt, "chat": general_prompts.chat_prompt,
    "stub": task_prompts.stub_prompt, "roleplay": task_prompts.roleplay_prompt,
    "extraction": task_prompts.extraction_prompt, "reasoning": task_prompts.reasoning_prompt,
    "essay": task_prompts.essay_prompt, "source_stub": mined_prompts.source_stub_prompt,
    "source_explain": mined_prompts.source_explain_prompt, "doc_passage": mined_prompts.doc_passage_prompt,
    "code_prefix": completion_prompts.code_prefix_prompt, "doc_prefix": completion_prompts.doc_prefix_prompt,
    "question": completion_prompts.question_prompt,
}


def training_prompts(n: int = 2400, seed: int = 0, kinds: Sequence[str] = PROMPT_KINDS) -> datasets.Dataset:
    """Build ``n`` distinct training prompts, an equal share of each of ``kinds`` (default: code, math and chat;
    ``TASK_KINDS``: function stubs, role play, extraction, reasoning puzzles and essays).

    The prompts come from templates filled with our own vocabularies and random numbers, never
    from an evaluation set. The same ``(n, seed, kinds)`` always gives the same prompts in the same order,
    and kinds are interleaved so any prefix is balanced too.

    Returns:
        A dataset with columns ``prompt`` (str) and ``kind`` (one of ``kinds``).
    """
    if n < 1:
        raise ValueError(f"n must be a positive number of prompts, got {n}.")
    unknown = [kind for kind in kinds if kind not in _PROMPT_BUILDERS]
    if not kinds or unknown:
        raise ValueError(f"kinds must be a non-empty list of {sorted(_PROMPT_BUILDERS)}, got {list(kinds)!r}")
    rng = random.Random(seed)
    prompts: list[str] = []
    kind_column: list[str] = []
    seen: set[str] = set()
    max_attempts = 50 * n  # the template space is far larger; running out means a broken vocabulary
    for attempt in range(max_attempts):
        if len(prompts) == n:
            break
        kind = kinds[len(prompts) % len(kinds)]
        prompt = _PROMPT_BUILDERS[kind](rng)
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
            kind_column.append(kind)
    if len(prompts) < n:
        raise RuntimeError(
            f"Only {len(prompts)} distinct prompts after {max_attempts} attempts; ask for fewer than {n} "
            f"or add templates/vocabulary in modeling_xpress/training/*_prompts.py."
        )
    return datasets.Dataset.from_dict({"prompt": prompts, "kind": kind_column})
