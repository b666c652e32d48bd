"""What the git checkout may hold: no pickled files, no large binaries, and no checkpoints but the bundled ones.

The training snapshots that used to live under `checkpoints/training/` are recorded as text under `docs/runs/` (their
weights are in git history)."""

import subprocess
from pathlib import Path

import pytest

from modeling_xpress.bench.demo import BUNDLED as BUNDLED_PAIRS

REPO = Path(__file__).resolve().parent.parent
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
MAX_BYTES = 5_000_000  # 5 MB
BUNDLED = [f"checkpoints/{pair.checkpoint.name}/" for pair in BUNDLED_PAIRS.values()]  # `make demo TARGET=` folders
BUNDLED_WEIGHTS = [folder + "model.safetensors" for folder in BUNDLED]


def tracked_files() -> list[str]:
    """`git ls-files` of this checkout (paths relative to the repository root); skips outside a git work tree."""
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=REPO, capture_output=True, text=True, timeout=60
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"git is not usable here ({error}): these checks need the repository's git work tree")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO:
        pytest.skip(f"{REPO} is not the root of a git work tree (an sdist or an installed copy): nothing to check")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True, timeout=60
    )
    return [path for path in listing.stdout.split("\0") if path]


def test_no_pickled_file_is_tracked():
    pickled = sorted(path for path in tracked_files() if path.lower().endswith(PICKLE_SUFFIXES))
    assert not pickled, (
        f"pickled files are tracked: {pickled}. Pickles run code when loaded and are binary, so they do not belong in "
        "git: `git rm` them, keep weights as .safetensors and states as JSON, and record what matters as text under "
        "docs/runs/."
    )


def test_no_large_file_is_tracked():
    too_large = {}
    for path in tracked_files():
        if path in BUNDLED_WEIGHTS:
            continue
        file = REPO / path
        if file.is_file() and not file.is_symlink() and file.stat().st_size > MAX_BYTES:
            too_large[path] = file.stat().st_size
    assert not too_large, (
        f"tracked files over {MAX_BYTES:,} bytes: {dict(sorted(too_large.items()))}. Only the bundled checkpoints' "
        f"{BUNDLED_WEIGHTS} may be that large. Do not commit checkpoints, caches or results this big: keep them out "
        "of the tree (runs/, cache/, checkpoints/training/ are ignored) and record runs as text under docs/runs/."
    )


def test_only_the_bundled_checkpoints_are_under_checkpoints():
    tracked = tracked_files()
    missing = [weights for weights in BUNDLED_WEIGHTS if weights not in tracked]
    assert not missing, f"the bundled checkpoints' weights {missing} are not tracked (bench.demo.BUNDLED names them)"
    others = sorted(path for path in tracked if path.startswith("checkpoints/") and not path.startswith(tuple(BUNDLED)))
    assert not others, (
        f"checkpoints/ holds tracked files outside the bundled checkpoints {BUNDLED}: {others[:10]}"
        f"{' ...' if len(others) > 10 else ''}. Training snapshots do not belong in git: `git rm` them and record the "
        "run as text (recipe, config, curves JSON, one plot) under docs/runs/."
    )


def test_readme_is_a_users_guide():
    """At most 300 lines, and nothing that points outside the repository (the brief, the paper's draft folder)."""
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 300, (
        f"README.md has {len(readme)} lines; keep it a user's guide of at most 300 and move measurement records and "
        "details to docs/ (results in docs/results.md)."
    )
    outside = [(i + 1, line) for i, line in enumerate(readme) if "../shared" in line or "SPEC §" in line]
    assert not outside, f"README.md refers to documents outside the repository: {outside}"
