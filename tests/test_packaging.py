"""The package installed from its wheel, not from this checkout: its package data (the `custom_generate` recipe and
the model card template) ships, so `save_pretrained` writes a complete folder that loads back."""

import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DATA = ("modeling_xpress/custom_generate/generate.py", "modeling_xpress/hub_cards/xpress_model_card.md")

FROM_THE_WHEEL = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    site_packages, repo, folder = sys.argv[1:4]
    assert repo not in sys.path and "" not in sys.path, sys.path  # -I: nothing can come from the checkout
    import modeling_xpress
    assert Path(modeling_xpress.__file__).is_relative_to(site_packages), modeling_xpress.__file__

    import torch
    from transformers import LlamaConfig
    from modeling_xpress import XPressConfig, XPressModel

    target = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    model = XPressModel(XPressConfig.from_target_config(target, num_hidden_layers=1, refiner_rank=8, block_size=4))
    model.save_pretrained(folder)
    loaded = XPressModel.from_pretrained(folder)
    assert all(torch.equal(t, loaded.state_dict()[k]) for k, t in model.state_dict().items())
    """
)


@pytest.mark.slow
def test_wheel_install_saves_a_checkpoint_with_its_card(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel offline (--no-build-isolation) needs setuptools")
    # Build from a copy: building in the checkout would leave build/ and egg-info behind, under others' feet.
    source = tmp_path / "source"
    shutil.copytree(REPO / "modeling_xpress", source / "modeling_xpress", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir",
                    str(tmp_path / "dist"), str(source)], check=True, timeout=120)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("modeling_xpress-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert set(PACKAGE_DATA) <= set(archive.namelist())

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_packages = subprocess.run([python, "-c", query], check=True, capture_output=True, text=True).stdout.strip()
    # torch and transformers come from this environment's site-packages, added as plain paths: their .pth files
    # (among them the editable install of this checkout) are not run. `venv --system-site-packages` would not do:
    # from inside a virtualenv it exposes the base interpreter's packages, not this environment's.
    (Path(site_packages) / "test_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=120)  # fmt: skip

    folder = tmp_path / "saved"
    # -I (isolated): neither the working directory nor PYTHONPATH go on sys.path.
    subprocess.run([python, "-I", "-c", FROM_THE_WHEEL, site_packages, str(REPO), str(folder)], check=True,
                   cwd=tmp_path, timeout=300)  # fmt: skip
    assert "library_name: transformers" in (folder / "README.md").read_text()  # the card, rendered from the wheel
    assert (folder / "custom_generate" / "generate.py").read_text() == (REPO / PACKAGE_DATA[0]).read_text()
