"""The package's layout: the runtime a Hub checkpoint carries at the top of `modeling_xpress/`, training and data in
`modeling_xpress/training/`, measuring in `modeling_xpress/bench/`, and the pipeline that runs both for a target in
`modeling_xpress/pipeline/`.

Read from the source (`ast`), so it runs in a second: no import cycle among the package's modules (counting imports
inside functions and under `if TYPE_CHECKING:` too), the runtime imports no subpackage, `bench` and `training`
import each other nowhere, only the pipeline imports both and nothing imports the pipeline, and no module grows past
`MAX_LINES`. One test imports the package in a subprocess to check
what `import modeling_xpress` (and its subpackages) loads.
"""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "modeling_xpress"
SUBPACKAGES = ("training", "bench", "pipeline")
ALLOWED = {"pipeline": {"training", "bench"}}
"""The subpackages a subpackage may import besides the runtime and itself."""
MAX_LINES = 600



def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (subpackages and `custom_generate` included)."""
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in path.parts}


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its source: at the top, in functions, under TYPE_CHECKING."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # `from a import b` imports the module a.b when there is one, else the name b of module a
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for target in targets:
            # `import a.b.c` where only a.b is a module of ours (c a name, or a module we do not have)
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = package_files()
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of modules in a cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(name: str) -> str:
    """'training', 'bench', 'pipeline', or 'runtime' (everything at the top of the package, `custom_generate`
    included)."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in SUBPACKAGES else "runtime"


def test_the_graph_sees_every_kind_of_import():
    """The checks below are only as good as the graph: it must see relative, absolute, function-local and submodule
    imports (known edges of the package, one of each)."""
    graph = import_graph()
    assert "modeling_xpress.training.collator" in graph["modeling_xpress.training.signal_cache"]  # from .collator
    assert "modeling_xpress.configuration_xpress" in graph["modeling_xpress.training.signal_cache"]  # from ..
    assert "modeling_xpress.cards" in graph["modeling_xpress.hub_files"]  # absolute, inside a function
    assert "modeling_xpress.training.general_prompts" in graph["modeling_xpress.training.prompts"]  # from . import x
    assert "modeling_xpress" in graph["modeling_xpress.bench.benchmark"]  # from .. import __version__


def test_no_import_cycle():
    found = [sorted(c) for c in cycles(import_graph())]
    assert not found, (
        f"import cycles among the package's modules: {found}. Move what both sides need into the module that owns it "
        "(or a new one both import); an import inside a function hides a cycle, it does not remove it."
    )


def test_the_runtime_imports_neither_training_nor_bench():
    """A saved checkpoint carries the runtime's files alone, so the runtime must never need the subpackages; training
    and bench stay independent of each other; the pipeline, which runs both for a target, is imported by neither."""
    graph = import_graph()
    wrong = sorted(
        f"{name} imports {other}"
        for name, imports in graph.items()
        for other in imports
        if layer(other) not in ("runtime", layer(name), *ALLOWED.get(layer(name), ()))
    )
    assert not wrong, f"imports across the layers: {wrong}"
    assert "modeling_xpress.training.run" in graph["modeling_xpress.pipeline.stages"]  # the allowed edge is seen


def test_no_module_over_max_lines():
    files = package_files().values()
    lengths = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in files}
    too_long = {path: n for path, n in sorted(lengths.items()) if n > MAX_LINES}
    assert not too_long, (
        f"modules over {MAX_LINES} lines: {too_long}. Split them by concern into modules a reader can find by name."
    )


IMPORT_CHECK = """
import sys
from transformers import PreTrainedModel  # what transformers itself loads (it imports accelerate when installed)
before = set(sys.modules)
import modeling_xpress, modeling_xpress.training, modeling_xpress.bench
heavy = ("datasets", "peft", "accelerate", "pyarrow", "matplotlib")
print(sorted(m for m in heavy if m in sys.modules and m not in before))
"""


def test_importing_the_package_loads_no_training_dependencies():
    """`import modeling_xpress` (a checkpoint's code) and the subpackages' `__init__` load nothing heavy beyond what
    transformers itself does: no datasets, peft or matplotlib; accelerate only through transformers."""
    out = subprocess.run([sys.executable, "-c", IMPORT_CHECK], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=300)  # fmt: skip
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


SEAM_CHECK = """
import sys
import torch
import modeling_xpress
from modeling_xpress.layout_policy import linear_policy
from modeling_xpress.policy import LinearPolicy

assert "modeling_xpress.cpu_layouts" not in sys.modules, "import modeling_xpress loaded the CPU tuning"
policy = linear_policy("auto", {"verify": [torch.empty(8, 4, device="meta")]})  # a device that is not a CPU
assert type(policy) is LinearPolicy and policy.kind("verify", 3) == "input_major"
assert "modeling_xpress.cpu_layouts" not in sys.modules, "a non-CPU device loaded the CPU tuning"
policy = linear_policy("auto", {"verify": [torch.empty(8, 4)]})
assert type(policy).__name__ == "CpuLinearPolicy" and "modeling_xpress.cpu_layouts" in sys.modules
print("ok")
"""


def test_cpu_tuning_is_loaded_for_a_cpu_only():
    """The hardware seam: `import modeling_xpress` and a policy for a device that is not a CPU (a GPU running "auto")
    never import `cpu_layouts`; a CPU's policy is its `CpuLinearPolicy`."""
    out = subprocess.run([sys.executable, "-c", SEAM_CHECK], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
