"""The README's code runs as written.

Its Python blocks run in order, as one user script, in a fresh process (on the real SmolLM2 target and the bundled
checkpoint, so this is a slow test); its shell commands name Makefile targets that exist and example scripts (or
`python -m` modules of the package) that accept the arguments shown (each script is started with its own argument
parser, which stops the script once the arguments parsed).
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)

# Runs an example script until its arguments are parsed: exit status 0 when they parse, argparse's 2 when they do not,
# 3 when the script never parsed any.
PARSE_ONLY = """
import argparse, runpy, sys

def stop_after(method):
    def parsed(self, *args, **kwargs):
        method(self, *args, **kwargs)
        raise SystemExit(0)
    return parsed

from transformers import HfArgumentParser

argparse.ArgumentParser.parse_args = stop_after(argparse.ArgumentParser.parse_args)
HfArgumentParser.parse_args_into_dataclasses = stop_after(HfArgumentParser.parse_args_into_dataclasses)
if sys.argv[1] == "-m":  # python -m package.module ...
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
raise SystemExit(3)
"""


def shell_commands() -> list[list[str]]:
    commands = []
    for language, body in BLOCKS:
        if language == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    commands.append(words)
    return commands


def test_readme_has_the_blocks_this_test_runs():
    languages = [language for language, _ in BLOCKS]
    assert languages.count("python") >= 4 and languages.count("bash") >= 4, languages
    assert ["make", "demo"] in shell_commands() and ["make", "test"] in shell_commands()


@pytest.mark.parametrize("words", shell_commands(), ids=lambda words: " ".join(words)[:60])
def test_readme_shell_command(words):
    if words[0] == "make":
        makefile = (REPO / "Makefile").read_text()
        for target in words[1:]:
            assert re.search(rf"^{re.escape(target)}\s*:", makefile, flags=re.MULTILINE), (
                f"README runs `make {target}`, which the Makefile does not define"
            )
        return
    module = words[2] if words[1:2] == ["-m"] else None
    assert words[0] in ("python", ".venv/bin/python") and (
        words[1].startswith("examples/") or (module or "").startswith("modeling_xpress.")
    ), (
        f"README shows `{shlex.join(words)}`: this test knows make targets, `python examples/<script>.py` and "
        "`python -m modeling_xpress.<module>` lines; teach it how to check this one"
    )
    if module is not None:
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"README runs {module}: no such module"
    else:
        assert (REPO / words[1]).is_file(), f"README runs {words[1]}, which does not exist"
    run = subprocess.run([sys.executable, "-c", PARSE_ONLY, *words[1:]], cwd=REPO, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, (
        f"`{shlex.join(words)}` from the README does not parse (exit {run.returncode}):\n{run.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path):
    """Every ```python block, in order, as one script: the Use, compiled and tree examples on the real target and the
    bundled checkpoint, then making a drafter (it writes my-dflash/ and my-xpress/ into the working directory)."""
    script = "\n".join(body for language, body in BLOCKS if language == "python")
    (tmp_path / "readme.py").write_text(script)
    (tmp_path / "checkpoints").symlink_to(REPO / "checkpoints")  # CHECKPOINT is a path relative to the repository
    run = subprocess.run([sys.executable, "readme.py"], cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"the README's Python blocks failed:\n{run.stderr[-6000:]}"
    assert (tmp_path / "my-xpress" / "config.json").is_file()  # the last line of the last block ran
