"""A saved xPress folder is a self-contained Hub checkpoint: it loads with AutoModel in a process where the package
cannot be imported, reproduces outputs, and carries the custom_generate recipe and a model card."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LlamaConfig, LlamaForCausalLM

import modeling_xpress.custom_generate.generate as recipe_module
from modeling_xpress import XPressModel
from modeling_xpress.bench.demo import BUNDLED_CHECKPOINT
from modeling_xpress.hub_files import RECIPE
from tests.builders import tiny_llama, tiny_xpress

FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    sys.modules["modeling_xpress"] = None  # `import modeling_xpress` now fails: only the folder's code may be used
    try:
        import modeling_xpress
        raise SystemExit("modeling_xpress is importable; the round trip would not prove anything")
    except ImportError:
        pass
    import torch
    from transformers import AutoModel, LlamaForCausalLM
    torch.set_num_threads(1)  # as in the test process (tests/conftest.py): same kernels, bit-identical outputs
    folder, target_dir, inputs_path, out_path = sys.argv[1:5]
    xpress = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    target = LlamaForCausalLM.from_pretrained(target_dir).eval()
    data = torch.load(inputs_path)
    with torch.no_grad():
        hidden = xpress(noise_embeds=data["noise_embeds"], context_hidden_states=data["context"]).last_hidden_state
    greedy = target.generate(data["ids"], max_new_tokens=30, do_sample=False, assistant_model=xpress)
    plain = target.generate(data["ids"], max_new_tokens=30, do_sample=False)
    torch.save({"hidden": hidden, "greedy": greedy, "plain": plain, "class": type(xpress).__module__,
                "tau": xpress.generation_stats.mean_tau}, out_path)
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    target = tiny_llama()
    target.save_pretrained(root / "target")
    xpress = tiny_xpress(target, refiner="xpress")
    xpress.save_pretrained(root / "xpress")
    return root, target, xpress


def test_folder_layout(saved):
    root, _, _ = saved
    folder = root / "xpress"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "xpress"
    assert config["auto_map"]["AutoModel"].endswith("modeling_xpress.XPressModel")
    assert config["auto_map"]["AutoConfig"].endswith("configuration_xpress.XPressConfig")
    for name in ("model.safetensors", "modeling_xpress.py", "configuration_xpress.py", "refinement.py",
                 "generation.py", "compiled.py", "draft_cap.py", "conversion.py", "hub_files.py", "custom_generate/generate.py",
                 "README.md"):  # fmt: skip
        assert (folder / name).is_file(), name
    card = (folder / "README.md").read_text()
    assert "library_name: transformers" in card and "xPress" in card and "| block size | 8 |" in card
    # The recipe is the package's own, naming no path: it finds the folder it runs from when it is called.
    assert (folder / RECIPE).read_text() == (Path(recipe_module.__file__)).read_text()
    assert str(root) not in (folder / RECIPE).read_text()


def test_card_names_the_target_and_the_folder(saved, tmp_path):
    """The card of a drafter built for a loaded target names that target and the saved folder: no placeholders."""
    root, _, _ = saved
    target = LlamaForCausalLM.from_pretrained(root / "target")
    tiny_xpress(target).save_pretrained(tmp_path / "my-xpress")
    card = ModelCard.load(tmp_path / "my-xpress" / "README.md")
    assert f"drafter for `{root / 'target'}`" in card.text and "the target model" not in card.text
    assert 'AutoModel.from_pretrained("my-xpress", trust_remote_code=True)' in card.text
    assert "<this-repo>" not in card.text and "<your-org>" not in card.text
    assert card.data.base_model is None  # a local path is no Hub repo id
    target.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # as if loaded from the Hub
    tiny_xpress(target).save_pretrained(tmp_path / "from-hub")
    card = ModelCard.load(tmp_path / "from-hub" / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert 'AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")' in card.text


def test_traveling_files_import_only_torch_and_transformers(saved):
    """Besides the standard library, the checkpoint's code needs nothing but torch and transformers."""
    from transformers.dynamic_module_utils import get_imports

    root, _, _ = saved
    for path in (root / "xpress").glob("*.py"):
        third_party = set(get_imports(path)) - set(sys.stdlib_module_names)
        assert third_party <= {"torch", "transformers"}, path.name


def test_fresh_process_automodel_round_trip(saved, tmp_path):
    root, target, xpress = saved
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    context = torch.cat([hs[i + 1] for i in xpress.config.target_layer_ids], -1)
    noise_embeds = xpress.embed_blocks(ids[:, -1:], target.get_input_embeddings())
    torch.save({"ids": ids, "context": context, "noise_embeds": noise_embeds}, tmp_path / "inputs.pt")
    subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(root / "xpress"), str(root / "target"), str(tmp_path / "inputs.pt"),
         str(tmp_path / "out.pt")],
        check=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    out = torch.load(tmp_path / "out.pt")
    assert out["class"].startswith("transformers_modules")  # the folder's code, not the package
    with torch.no_grad():
        expected = xpress(noise_embeds=noise_embeds, context_hidden_states=context).last_hidden_state
    assert torch.equal(out["hidden"], expected)
    assert torch.equal(out["greedy"], out["plain"])
    assert out["tau"] >= 1.0


def test_save_load_reproduces_outputs_in_process(saved):
    root, target, xpress = saved
    loaded = XPressModel.from_pretrained(root / "xpress").eval()
    for name, tensor in xpress.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    a = xpress.spec_generate(target, ids, max_new_tokens=20)
    b = loaded.spec_generate(target, ids, max_new_tokens=20)
    assert torch.equal(a.sequences, b.sequences) and a.stats.acceptance_lengths == b.stats.acceptance_lengths


def loaded_drafters(target, checkpoint: str) -> dict:
    """The drafters the recipe of `checkpoint` has loaded, by (checkpoint, device, dtype): its module-level cache."""
    return target.load_custom_generate(checkpoint, trust_remote_code=True).__globals__["_loaded"]


def test_custom_generate_folder_runs_xpress(saved):
    root, target, _ = saved
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=25, do_sample=False)
    got = target.generate(ids, max_new_tokens=25, do_sample=False, custom_generate=str(root / "xpress"),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(got, expected)
    drafter = loaded_drafters(target, str(root / "xpress"))[(str(root / "xpress"), "cpu", torch.float32)]
    assert drafter.generation_stats.acceptance_lengths  # xPress really drafted


def test_custom_generate_reaches_draft_trees(saved):
    """transformers' assisted decoding verifies a line; `tree_nodes=` in a generate call sends the recipe to the
    drafter's own tree loop, with the call's settings, and names the settings a tree cannot honour."""
    root, target, _ = saved
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = target.generate(ids, max_new_tokens=25, do_sample=False)
    got = target.generate(ids, max_new_tokens=25, do_sample=False, custom_generate=str(root / "xpress"),
                          trust_remote_code=True, tree_nodes=5)  # fmt: skip
    assert torch.equal(got, expected)
    drafter = loaded_drafters(target, str(root / "xpress"))[(str(root / "xpress"), "cpu", torch.float32)]
    assert drafter.generation_stats.draft_lengths and max(drafter.generation_stats.draft_lengths) <= 5
    with pytest.raises(ValueError, match="repetition_penalty"):
        target.generate(ids, max_new_tokens=5, custom_generate=str(root / "xpress"), trust_remote_code=True,
                        tree_nodes=5, repetition_penalty=1.3)  # fmt: skip


def test_custom_generate_runs_from_a_moved_folder(saved, tmp_path):
    """A saved folder names no path of its own: moved (the original gone), the same line loads it from where it is."""
    root, target, xpress = saved
    xpress.save_pretrained(tmp_path / "before")
    moved = shutil.move(tmp_path / "before", tmp_path / "after")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    expected = target.generate(ids, max_new_tokens=25, do_sample=False)
    got = target.generate(ids, max_new_tokens=25, do_sample=False, custom_generate=str(moved), trust_remote_code=True)
    assert torch.equal(got, expected)
    assert loaded_drafters(target, str(moved))[(str(moved), "cpu", torch.float32)].generation_stats.acceptance_lengths


def test_custom_generate_loads_the_repo_it_was_called_with(saved, monkeypatch):
    """For a Hub repo id the recipe loads the drafter by that id, in the target's dtype. (No Hub here: transformers'
    recipe download is replaced by this package's recipe, and the recipe's loader records what it was asked for.)"""
    root, target, xpress = saved
    requests = []

    def from_pretrained(name, **kwargs):
        requests.append((name, kwargs))
        return XPressModel.from_pretrained(root / "xpress", dtype=kwargs["dtype"])

    monkeypatch.setattr(target, "load_custom_generate", lambda name, **kwargs: recipe_module.generate)
    monkeypatch.setattr(recipe_module, "AutoModel", SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setattr(recipe_module, "_loaded", {})
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    got = target.generate(ids, max_new_tokens=20, do_sample=False, custom_generate="some-org/xpress-tiny",
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(got, expected)
    assert requests == [("some-org/xpress-tiny", {"trust_remote_code": True, "dtype": target.dtype})]
    # An explicit xpress_checkpoint= wins over the name the recipe was called with.
    target.generate(ids, max_new_tokens=4, custom_generate="some-org/xpress-tiny", trust_remote_code=True,
                    xpress_checkpoint="other-org/xpress")  # fmt: skip
    assert requests[-1][0] == "other-org/xpress"


def test_custom_generate_runs_the_bundled_checkpoint():
    """The README's line on the bundled folder, with a random target of SmolLM2-135M's shape (the drafter checks
    vocabulary, width and depth); greedy identity on the real target is in tests/test_real_model.py."""
    drafter = json.loads((BUNDLED_CHECKPOINT / "config.json").read_text())
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=drafter["vocab_size"], hidden_size=drafter["target_hidden_size"], intermediate_size=64,
        num_hidden_layers=drafter["num_target_layers"], num_attention_heads=9, num_key_value_heads=3,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )).eval()  # fmt: skip
    ids = torch.randint(0, drafter["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(5))
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    got = target.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=str(BUNDLED_CHECKPOINT),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(got, expected)


def test_custom_generate_without_checkpoint_explains():
    with pytest.raises(ValueError, match="does not know which xPress checkpoint to load") as error:
        recipe_module.generate(tiny_llama(), torch.tensor([[1, 2]]))
    assert "xpress_checkpoint='<folder or repo id>' or xpress_model=" in str(error.value)  # what to pass
