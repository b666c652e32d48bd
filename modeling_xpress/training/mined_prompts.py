"""Prompts mined from local text (`prompts.MINED_KINDS`): the Python standard library of the running interpreter.

Its documented functions and methods become stubs to complete (signature and docstring) or code to explain, and the
prose of its documentation (pydoc's topic texts, module and class docstrings) passages to summarize, explain or extract
from. The templates of `general_prompts` and `task_prompts` vary only over small vocabularies; this text is written by
many people about many things. Which prompts come out depends on the Python version (`mined_corpus_version`), so a data
set records it.
"""

from __future__ import annotations

import ast
import copy
import functools
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

from .general_prompts import pick


_SKIPPED_STDLIB_PARTS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                         "dist-packages", "pydoc_data", "__pycache__", "__phello__"}


def mined_corpus_version() -> str:
    """The interpreter whose standard library the mined prompts come from (recorded with a data set)."""
    return f"CPython {sys.version.split()[0]}" if sys.implementation.name == "cpython" else sys.version.split()[0]


def _stdlib_modules() -> list[tuple[str, Path]]:
    """(dotted module name, file) of the standard library's Python files, skipped folders left out, in name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [path.relative_to(root) for path in root.rglob("*.py")]
    files = sorted((path for path in files if not _SKIPPED_STDLIB_PARTS & set(path.parts)), key=Path.as_posix)
    return [(".".join(path.with_suffix("").parts).removesuffix(".__init__"), root / path) for path in files]


def _prose(text: str | None, min_chars: int = 300, max_chars: int = 1400) -> list[str]:
    """Passages of a documentation text: runs of plain paragraphs (no code, no tables, no doctest lines) cut to at
    most `max_chars`, keeping only those of at least `min_chars`."""
    if not text:
        return []
    passages, current = [], []
    for paragraph in text.split("\n\n"):
        lines = [line.strip() for line in paragraph.strip().splitlines()]
        plain = lines and not any(line.startswith((">>>", "...", "+", "|", "$", "%")) for line in lines)
        plain = plain and sum(c.isalpha() or c.isspace() for c in paragraph) > 0.85 * len(paragraph)
        if plain and sum(map(len, current)) + len(paragraph) <= max_chars:
            current.append(" ".join(lines))
            continue
        if sum(map(len, current)) >= min_chars:
            passages.append("\n\n".join(current))
        current = [" ".join(lines)] if plain and len(paragraph) <= max_chars else []
    if sum(map(len, current)) >= min_chars:
        passages.append("\n\n".join(current))
    return passages


@functools.lru_cache(maxsize=1)
def _stdlib_corpus() -> tuple[tuple, tuple, tuple]:
    """(stubs, sources, passages) of the standard library, in a fixed order: stubs are (module, class or None,
    signature-and-docstring source), sources (module, whole function source of 4..40 lines), passages (source name,
    text)."""
    stubs, sources, passages = [], [], []
    try:
        from pydoc_data.topics import topics
    except ImportError:  # an interpreter built without pydoc's data; the docstrings remain
        topics = {}
    for name in sorted(topics):
        passages += [(f"the Python language reference, topic '{name}'", p) for p in _prose(topics[name])]
    for module, path in _stdlib_modules():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
            lines = source.splitlines()
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        passages += [(f"the documentation of the Python module {module}", p) for p in _prose(ast.get_docstring(tree))]
        owners = [(None, tree)] + [(node.name, node) for node in tree.body
                                   if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
        for owner, parent in owners:
            if owner is not None:
                passages += [(f"the documentation of {module}.{owner}", p) for p in _prose(ast.get_docstring(parent))]
            for node in parent.body:
                docstring = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
                if not docstring or node.name.startswith("_") or not 60 <= len(docstring) <= 1200:
                    continue
                length = node.end_lineno - node.lineno + 1
                if not 4 <= length <= 40 or len(node.body) < 2 or node.decorator_list:  # a body beyond the docstring
                    continue
                stub = copy.copy(node)
                stub.body = node.body[:1]  # the docstring
                stubs.append((module, owner, ast.unparse(stub)))
                sources.append((module, owner, textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))))
    return tuple(stubs), tuple(sources), tuple(passages)


_SOURCE_STUB_ASKS = [
    "Complete the following Python function:", "Implement this function from the Python standard library's {module} "
    "module:", "Write the body of this Python function so that it does what its docstring says:",
    "Here is a function signature with its docstring. Implement it in Python:",
    "Fill in the implementation, and explain briefly how it works:",
]
_SOURCE_EXPLAIN_ASKS = [
    "Explain what this Python function does, step by step:", "What does the following code from the {module} module "
    "do? Describe its inputs, its output and any edge cases.", "Review this Python function: is there anything you "
    "would improve?", "Write three example calls of this function and say what each returns:",
    "Explain this code to a beginner:", "Rewrite this function in a simpler style and explain the changes:",
]
_PASSAGE_ASKS = [
    "Summarize the passage above in three bullet points.", "Explain the passage above to someone new to programming.",
    "What are the key facts in the passage above? List them.", "Write a short example that illustrates the passage "
    "above.", "Turn the passage above into three quiz questions with their answers.",
    "Rewrite the passage above in plain English, in one paragraph.", "What is the most important point of the "
    "passage above, and why?",
]


def source_stub_prompt(rng: random.Random) -> str:
    """A documented standard-library function (or method, inside its class) to implement from its docstring."""
    module, owner, stub = pick(rng, _stdlib_corpus()[0])
    if owner is not None:
        stub = f"class {owner}:\n    ...\n\n" + "\n".join(f"    {line}" if line else line for line in stub.splitlines())
    return f"{pick(rng, _SOURCE_STUB_ASKS).format(module=module)}\n```python\n{stub}\n```"


def source_explain_prompt(rng: random.Random) -> str:
    module, owner, source = pick(rng, _stdlib_corpus()[1])
    where = f"# from {module}" + (f", class {owner}" if owner else "")
    return f"{pick(rng, _SOURCE_EXPLAIN_ASKS).format(module=module)}\n```python\n{where}\n{source}\n```"


def doc_passage_prompt(rng: random.Random) -> str:
    source, passage = pick(rng, _stdlib_corpus()[2])
    return f"The following passage is from {source}:\n\n{passage}\n\n{pick(rng, _PASSAGE_ASKS)}"

