"""Completion-style prompts for a pretrained base model (`prompts.COMPLETION_KINDS`): text to continue, not requests.

A base model (e.g. google/gemma-3-270m) was never tuned to answer chat turns: it continues text. So its prompts are
beginnings of what it continues well, with no chat template around them:

- `code_prefix`: a Python function's signature and docstring, whose body is the continuation: our own task stubs
  (worked examples computed by their implementation, `task_prompts.stub_code`) or a documented function of the
  standard library installed here (`mined_prompts`);
- `doc_prefix`: the first sentences of a documentation passage of that standard library, to go on with;
- `question`: a question of the default and task-shaped generators (code, math, reasoning) in a question/answer
  layout, the answer left open.

Never from an evaluation set. Which prompts the standard library gives depends on the Python version
(`mined_prompts.mined_corpus_version`), as for the mined kinds.
"""

from __future__ import annotations

import random
import re

from .general_prompts import code_prompt, math_prompt, pick
from .mined_prompts import _stdlib_corpus
from .task_prompts import reasoning_prompt, stub_code

MIN_DOC_PREFIX_CHARS = 80
"""A documentation prefix this short says too little to continue from (a heading, an abbreviation cut at its dot)."""


def code_prefix_prompt(rng: random.Random) -> str:
    """A function's signature and docstring (one of our stubs, or one of the standard library's), ready for its body."""
    if rng.random() < 0.5:
        return stub_code(rng)
    module, owner, stub = pick(rng, _stdlib_corpus()[0])
    if owner is not None:
        stub = f"class {owner}:\n" + "\n".join(f"    {line}" if line else line for line in stub.splitlines())
    return f"# {module}\n{stub}\n"


def doc_prefix_prompt(rng: random.Random) -> str:
    """The first sentences of a passage of the standard library's documentation, at least `MIN_DOC_PREFIX_CHARS` of
    them and never the last sentence (a random cut, so one passage gives several prompts)."""
    source, passage = pick(rng, _stdlib_corpus()[2])
    cuts = [m.start() for m in re.finditer(r"(?<=[.!?])\s+", passage) if m.start() >= MIN_DOC_PREFIX_CHARS]
    if not cuts:  # one long sentence (or short ones): about its first half, cut between words
        half = len(passage) // 2
        cuts = [passage.rfind(" ", 0, half) if " " in passage[:half] else half]
    return passage[: pick(rng, cuts)]


def question_prompt(rng: random.Random) -> str:
    """A code, math or reasoning question as `Question: ... / Answer:`."""
    question = pick(rng, (code_prompt, math_prompt, reasoning_prompt))(rng)
    return f"Question: {question}\nAnswer:"
