"""The package installed from its wheel, not from this checkout: its package data (the `custom_generate` recipe and
the model card template) ships, so `save_pretrained` writes a complete folder that loads back; and its dependencies
by use: `install_requires` is what decoding needs (a fresh virtualenv with the wheel and no extras decodes), each
extra covers what its scripts import."""

import ast
import configparser
import importlib.metadata
import os
import re
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


def build_wheel(tmp_path: Path) -> Path:
    """The project's wheel, built offline (`pip wheel --no-deps --no-build-isolation`) into `tmp_path / "dist"`."""
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
    return wheel


@pytest.mark.slow
def test_wheel_install_saves_a_checkpoint_with_its_card(tmp_path):
    wheel = build_wheel(tmp_path)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
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


# --- Dependencies by use -------------------------------------------------------------------------------------------

RUNTIME = ("__init__", "configuration_xpress", "modeling_xpress", "heads", "refinement", "stats", "processors",
           "drafting", "policy", "layout_policy", "cpu_layouts", "draft_cap", "compiled", "compiled_loop", "trees",
           "attention_masks", "tuning",
           "decoding", "generation",
           "conversion", "dflash_formats", "hub_files", "custom_generate/generate")  # fmt: skip
"""The modules decoding runs: `import modeling_xpress`, a checkpoint's trust_remote_code copy, `save_pretrained`."""


def _module(*names: str) -> str:
    """The package module of that name (the first name that exists; wherever it lies in the package's folders)."""
    for name in names:
        found = sorted((REPO / "modeling_xpress").rglob(f"{name}.py"))
        if found:
            assert len(found) == 1, found
            return str(found[0].relative_to(REPO))
    raise AssertionError(f"no module {' or '.join(names)} under modeling_xpress/")


def _uses() -> dict[str, list[str]]:
    """The files each extra is for: the entry points (their own imports, lazy ones too, and the module-level imports
    of the package modules they reach). `dev` is the test suite, so it covers every file."""
    return {
        "real": [_module("assets"), "examples/demo.py"],
        "bench": [_module("benchmark"), _module("plots"), _module("latency"), _module("reports"), _module("demo"),
                  "examples/benchmark.py"],
        "train": [_module("trainer", "training"), _module("signal_cache"), _module("regeneration"), _module("prompts"),
                  _module("target_init"), _module("run"), "examples/train_refiner.py", "examples/make_training_data.py",
                  _module("stages"), _module("vllm_engine"), _module("plots")],  # the pipeline draws training curves
        "dev": sorted(str(path.relative_to(REPO)) for folder in ("tests", "examples", "modeling_xpress")
                      for path in (REPO / folder).rglob("*.py")),
    }  # fmt: skip


NOT_IN_A_DECODE_ONLY_INSTALL = ("datasets", "peft", "accelerate", "gguf", "sentencepiece", "matplotlib", "pyarrow")


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def _name(requirement: str) -> str:
    """A requirement's distribution name (PEP 508: the leading name), normalized as an import name."""
    return re.match(r"[A-Za-z0-9._-]+", requirement).group().lower().replace("-", "_")


def _requirements() -> dict[str, set[str]]:
    """Top-level import names of `install_requires` (key "") and of each extra, read from setup.cfg."""
    config = _setup_cfg()

    def names(value: str) -> set[str]:
        return {_name(line) for line in _lines(value)}

    extras = {extra: names(value) for extra, value in config["options.extras_require"].items()}
    return {"": names(config["options"]["install_requires"]), **extras}


def _import_nodes(node: ast.AST, lazy: bool):
    """The import statements under `node`; with `lazy=False` not those inside functions or `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not lazy and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        elif not lazy and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            yield from (n for orelse in child.orelse for n in _import_nodes(ast.Module([orelse], []), lazy))
        else:
            yield from _import_nodes(child, lazy)


def _source(module: Path) -> Path:
    """The file of a module given as a path without suffix: `<module>.py`, or a package's `__init__.py`."""
    return module / "__init__.py" if module.is_dir() else module.with_suffix(".py")


def _imports(path: Path, lazy: bool) -> tuple[set[str], set[Path]]:
    """(third-party top-level names, package modules) that `path` imports: all of them, or with `lazy=False` only
    those that importing it runs."""
    external, internal = set(), set()
    package = REPO / "modeling_xpress"
    for node in _import_nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            parts = node.module.split(".") if node.module else []
            candidates = [base.joinpath(*parts)] if parts else [base / alias.name for alias in node.names]
            internal |= {_source(candidate) for candidate in candidates}
            continue
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for module in modules:
            root, *rest = module.split(".")
            if root == "modeling_xpress":
                internal.add(_source(package.joinpath(*rest)))
            elif root not in sys.stdlib_module_names and root not in ("__future__", "tests", "xpress_vllm"):
                external.add(root)
    return external, {module for module in internal if module.is_file()}


def _needs(entry_points: list[Path], follow_lazy: bool = False) -> dict[str, set[str]]:
    """Third-party import name -> the files that import it: `entry_points` (all their imports) and the package
    modules they reach (what importing them runs; with `follow_lazy`, their lazy imports too)."""
    needs: dict[str, set[str]] = {}
    seen, todo = set(), [(path, True) for path in entry_points]
    while todo:
        path, lazy = todo.pop()
        if (path, lazy) in seen:
            continue
        seen.add((path, lazy))
        external, internal = _imports(path, lazy)
        for name in external:
            needs.setdefault(name, set()).add(str(path.relative_to(REPO)))
        todo += [(module, follow_lazy) for module in internal]
    return needs


def test_install_requires_is_what_decoding_imports():
    """Every module decoding runs (with its lazy imports: compiled decoding, draft caps, conversion, saving with its
    card) imports nothing beyond `install_requires`, which holds no training, benchmark or GGUF package."""
    requirements = _requirements()
    runtime = [REPO / "modeling_xpress" / f"{name}.py" for name in RUNTIME]
    needs = _needs(runtime, follow_lazy=True)
    assert {path for paths in needs.values() for path in paths} <= {str(p.relative_to(REPO)) for p in runtime} | {
        "modeling_xpress/cards.py"}, needs  # nothing outside the runtime but the card renderer
    missing = {name: paths for name, paths in needs.items() if name not in requirements[""]}
    assert not missing, f"imported by decoding but not in install_requires: {missing}"
    assert {"torch", "transformers", "huggingface_hub", "safetensors"} <= requirements[""]
    assert "jinja2" in requirements[""]  # not an import: huggingface_hub's ModelCard.from_template renders with it
    assert not requirements[""] & set(NOT_IN_A_DECODE_ONLY_INSTALL)


# Scripts whose commands run in .venv-vllm (`make vllm`: vLLM, speculators and this package without dependencies), not
# in .venv (the pipeline's vLLM engine: its `serve` side, which the pipeline starts with .venv-vllm's Python); and the
# packages only they import.
VLLM_SIDE = {
    "examples/vllm_benchmark.py", "tests/vllm_sampling_engine.py", "tests/vllm_seed_engine.py",
    "tests/vllm_drafts_engine.py", "tests/speculators_reference.py", "modeling_xpress/pipeline/vllm_engine.py",
}  # fmt: skip
VLLM_SIDE_PACKAGES = ("vllm", "speculators")
# Reference implementations the tests compare with, installed by the Makefile without dependencies (their extras pin
# another transformers), so in no extra: package -> the tests that import it.
MAKEFILE_REFERENCES = {"dflash": {"tests/test_dflash_releases.py"}}


@pytest.mark.parametrize("extra", ["real", "bench", "train", "dev"])
def test_each_extra_covers_what_its_scripts_import(extra):
    requirements = _requirements()
    needs = _needs([REPO / path for path in _uses()[extra]])
    for package in VLLM_SIDE_PACKAGES:
        if needs.get(package, set()) <= VLLM_SIDE:
            needs.pop(package, None)
    for package, users in MAKEFILE_REFERENCES.items():
        if needs.get(package, set()) <= users:
            needs.pop(package, None)
            assert re.search(rf"pip install .*--no-deps {package}==", (REPO / "Makefile").read_text()), package
    missing = {name: paths for name, paths in needs.items() if name not in requirements[""] | requirements[extra]}
    assert not missing, f"imported by the scripts of [{extra}] but not in install_requires or [{extra}]: {missing}"
    assert requirements["dev"] >= requirements["real"] | requirements["bench"] | requirements["train"] | {"pytest"}


def test_the_vllm_plugin_imports_only_vllm_and_the_runtime():
    """xpress_vllm runs in .venv-vllm, where this package is installed without dependencies: beyond vLLM it may use
    only what decoding needs (no training or benchmark package), and modeling_xpress never imports it."""
    plugin = sorted((REPO / "xpress_vllm").glob("*.py"))
    needs = _needs(plugin, follow_lazy=True)
    extra = set(needs) - _requirements()[""] - {"vllm"}
    assert not extra, f"xpress_vllm (or the runtime it reaches) imports {extra}: not in .venv-vllm"
    runtime = {path for path in (REPO / "modeling_xpress").rglob("*.py") if "xpress_vllm" in path.read_text()}
    assert not runtime, f"modeling_xpress must not import the vLLM plugin: {sorted(map(str, runtime))}"


DECODE_ONLY = textwrap.dedent(
    """
    import importlib.util
    import sys
    from pathlib import Path

    site_packages, repo, checkpoint, folder = sys.argv[1:5]
    absent = sys.argv[5].split(",")
    assert repo not in sys.path and "" not in sys.path, sys.path  # -I: nothing can come from the checkout
    installed = [name for name in absent if importlib.util.find_spec(name) is not None]
    assert not installed, f"a decode-only install brought in {installed}"

    import torch
    from transformers import AutoModel, LlamaConfig, LlamaForCausalLM

    import modeling_xpress
    assert Path(modeling_xpress.__file__).is_relative_to(site_packages), modeling_xpress.__file__
    torch.set_num_threads(1)

    # The bundled checkpoint as a Hub user loads it: the code inside the folder.
    xpress = AutoModel.from_pretrained(checkpoint, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(xpress).__module__.startswith("transformers_modules."), type(xpress).__module__
    drafter = xpress.config
    # SmolLM2-135M-Instruct's shape (a LlamaForCausalLM), random weights: vocabulary, width and depth are the
    # checkpoint's (what `check_target` compares), the rest SmolLM2's own config.
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=drafter.vocab_size, hidden_size=drafter.target_hidden_size,
        num_hidden_layers=drafter.num_target_layers, intermediate_size=1536, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # no early stop: all 24 tokens are compared
    )).eval()
    drafter.check_target(target.config)
    assert (drafter.vocab_size, drafter.target_hidden_size, drafter.num_target_layers) == (49152, 576, 30)

    ids = torch.randint(0, drafter.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert expected.shape == (1, 30), expected.shape
    got = target.generate(ids, assistant_model=xpress, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected), (got, expected)
    assert xpress.generation_stats.acceptance_lengths, "the assistant never ran"

    # The installed package's own class decodes the same, and saves a folder with its card (jinja2).
    packaged = modeling_xpress.XPressModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    got = target.generate(ids, assistant_model=packaged, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected), (got, expected)
    packaged.save_pretrained(folder)
    assert "library_name: transformers" in (Path(folder) / "README.md").read_text()

    imported = [name for name in absent if name in sys.modules]
    assert not imported, imported
    print("decode-only install: identical to plain greedy decoding over", expected.shape[1] - 6, "tokens")
    """
)


@pytest.mark.slow
def test_wheel_without_extras_decodes_in_a_fresh_virtualenv(tmp_path):
    """`pip install modeling-xpress` (no extras) into a fresh virtualenv: no training, benchmark or GGUF package comes
    with it, and the bundled checkpoint decodes token for token what the target decodes alone. torch goes in first,
    pinned to this environment's build (on disk, CPU): an open range would fetch a multi-GB CUDA build."""
    pip_options = ["--disable-pip-version-check", "--quiet", "--timeout", "60"]
    install_requires = _lines(_setup_cfg()["options"]["install_requires"])
    (transformers,) = [line for line in install_requires if _name(line) == "transformers"]
    probe = subprocess.run([sys.executable, "-m", "pip", *pip_options, "--retries", "1", "download", "--no-deps",
                            "--dest", str(tmp_path / "downloads"), transformers],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"the package index is out of reach: `pip download {transformers}` failed:\n{probe.stderr[-2000:]}")

    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", *pip_options]
    subprocess.run([*pip, "install", f"torch=={importlib.metadata.version('torch')}"], check=True, timeout=600)
    subprocess.run([*pip, "install", "--find-links", str(tmp_path / "downloads"), str(wheel)], check=True, timeout=600)

    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site_packages = subprocess.run([python, "-c", query], check=True, capture_output=True, text=True).stdout.strip()
    # HF_HOME: the trust_remote_code modules go under tmp_path; offline: nothing is fetched from a hub.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    checkpoint = REPO / "checkpoints" / "xpress-smollm2-135m-instruct"
    run = subprocess.run([python, "-I", "-c", DECODE_ONLY, site_packages, str(REPO), str(checkpoint),
                          str(tmp_path / "saved"), ",".join(NOT_IN_A_DECODE_ONLY_INSTALL)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert "identical to plain greedy decoding over 24 tokens" in run.stdout
