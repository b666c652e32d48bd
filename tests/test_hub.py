"""A saved xPress folder is a self-contained Hub checkpoint: it loads with AutoModel in a process where the package
cannot be imported, reproduces outputs, and carries the custom_generate recipe and a model card."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from modeling_xpress import XPressModel
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
                 "generation.py", "conversion.py", "hub_files.py", "custom_generate/generate.py", "README.md"):  # fmt: skip
        assert (folder / name).is_file(), name
    card = (folder / "README.md").read_text()
    assert "library_name: transformers" in card and "xPress" in card and "| block size | 8 |" in card
    recipe = (folder / "custom_generate" / "generate.py").read_text()
    assert f"XPRESS_CHECKPOINT: str | None = {str(folder.resolve())!r}" in recipe


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


def test_custom_generate_folder_runs_xpress(saved):
    root, target, _ = saved
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(2))
    expected = target.generate(ids, max_new_tokens=25, do_sample=False)
    got = target.generate(ids, max_new_tokens=25, do_sample=False, custom_generate=str(root / "xpress"),
                          trust_remote_code=True)  # fmt: skip
    assert torch.equal(got, expected)


def test_custom_generate_without_checkpoint_explains(tmp_path):
    from modeling_xpress.custom_generate.generate import generate

    with pytest.raises(ValueError, match="does not know which xPress checkpoint to load"):
        generate(tiny_llama(), torch.tensor([[1, 2]]))
