"""speculators' DFlash format (vLLM's training library) against the package itself, in .venv-vllm (`make vllm`
installs speculators there: it pins a transformers older than ours).

speculators builds, saves and runs its own drafters in a subprocess of .venv-vllm's Python (`speculators_reference.py`):
a drafter it trained loads here with its block logits (full attention, sliding-window layers with a window shorter
than the context, causal and not, a draft vocabulary). `make test` sets
XPRESS_VLLM_TESTS=required, so there a missing .venv-vllm or speculators fails instead of skipping.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from modeling_xpress import XPressModel
from tests.builders import tiny_qwen3

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
REFERENCE = REPO / "tests" / "speculators_reference.py"
REQUIRED = os.environ.get("XPRESS_VLLM_TESTS") == "required"

pytestmark = pytest.mark.slow

# Drafters speculators trains (`speculators_reference.train`): windows are speculators' `sliding_window` (context tokens
# before the anchor), here shorter than the 13-token context.
TRAINED = {
    "full": dict(layer_types=["full_attention", "full_attention"], sliding_window=None, non_causal=False, draft_vocab=None),
    "sliding": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4, non_causal=False,
                    draft_vocab=None),
    "sliding-non-causal": dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3, non_causal=True,
                               draft_vocab=None),
    "draft-vocabulary": dict(layer_types=["full_attention", "full_attention"], sliding_window=None, non_causal=False,
                             draft_vocab=32),
}  # fmt: skip


def skip_or_fail(message: str):
    if REQUIRED:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every speculators-side job in one .venv-vllm process (their torch files in `root`), and the target."""
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} does not exist: build it with `make vllm`")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import speculators"], capture_output=True, text=True)
    if probe.returncode:
        skip_or_fail(f"speculators is not installed in .venv-vllm (`make vllm` installs it): {probe.stderr[-300:]}")
    root = tmp_path_factory.mktemp("speculators")
    target = tiny_qwen3()
    target.save_pretrained(root / "target")
    target = type(target).from_pretrained(root / "target").eval()  # its name_or_path is the folder
    jobs = [{"mode": "train", "folder": str(root / f"trained-{name}"), "target": str(root / "target"),
             "out": str(root / f"trained-{name}.pt"), **fields} for name, fields in TRAINED.items()]  # fmt: skip
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([str(VLLM_PYTHON), str(REFERENCE), str(root / "jobs.json")], capture_output=True, text=True,
                          timeout=900, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return root, target


def our_logits(xpress, target, ids: torch.Tensor, anchor: int) -> torch.Tensor:
    """The drafter's logits of block slots 1..B-1 over its draft vocabulary (the whole one without), for the block
    anchored at `ids[anchor]` after the context `ids[:anchor]`."""
    with torch.no_grad():
        hs = target(ids[:, :anchor], output_hidden_states=True).hidden_states
        context = torch.cat([hs[i + 1] for i in xpress.config.target_layer_ids], -1)
        embeds = xpress.embed_blocks(ids[:, anchor : anchor + 1], target.get_input_embeddings())
        hidden = xpress(noise_embeds=embeds, context_hidden_states=context).last_hidden_state
        return xpress.draft_logits(hidden, target.get_output_embeddings())[0]


@pytest.mark.parametrize("name", list(TRAINED))
def test_a_drafter_trained_with_speculators_loads_with_its_logits(runs, name):
    root, target = runs
    reference = torch.load(root / f"trained-{name}.pt")
    xpress = XPressModel.from_dflash(root / f"trained-{name}").eval()
    assert xpress.config.target_layer_ids == [1, 3] and xpress.config.num_target_layers == 5
    window = TRAINED[name]["sliding_window"]
    expected_windows = None if window is None else [None if t == "full_attention" else window + 1
                                                    for t in TRAINED[name]["layer_types"]]  # fmt: skip
    assert xpress.config.attention_windows == expected_windows
    expected = reference["logits"][1:]  # slot 0 is the anchor
    assert expected.std() > 0.1
    torch.testing.assert_close(our_logits(xpress, target, reference["ids"], reference["anchor"]), expected,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_sliding_windows_change_speculators_function(runs):
    """Not a no-op: the windowed drafters loaded as full-attention ones compute something else."""
    root, target = runs
    for name in ("sliding", "sliding-non-causal"):
        reference = torch.load(root / f"trained-{name}.pt")
        full = XPressModel.from_dflash(root / f"trained-{name}", attention_windows=None).eval()
        assert (our_logits(full, target, reference["ids"], reference["anchor"]) - reference["logits"][1:]).abs().max() > 0.05


