"""What the git checkout may hold: no pickled files, and no large binaries except the bundled checkpoint's weights.

The training snapshots that used to live under `checkpoints/training/` are recorded as text under `docs/runs/`. The
weights still tracked there are listed in `LEGACY_SNAPSHOTS` until they are removed."""

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
MAX_BYTES = 5_000_000  # 5 MB
BUNDLED_WEIGHTS = "checkpoints/xpress-smollm2-135m-instruct/model.safetensors"

# Training-snapshot weights (> 5 MB each) still tracked under checkpoints/training. They are scheduled for removal:
# one submission may carry at most ~256 MiB of diffs and a deleted binary counts with its full size, so they go in
# later submissions, ~150 MB at a time, whole folders oldest first (their text record is already in docs/runs/).
# This list may only shrink: remove a path from it when you `git rm` the file, and never add one.
LEGACY_SNAPSHOTS = frozenset(
    f"checkpoints/training/{folder}/{stage}/model.safetensors"
    for folder, stages in {
        "smollm2-v9": ("drafter", "markov", "xpress"),
    }.items()
    for stage in stages
)


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
        if path == BUNDLED_WEIGHTS or path in LEGACY_SNAPSHOTS:
            continue
        file = REPO / path
        if file.is_file() and not file.is_symlink() and file.stat().st_size > MAX_BYTES:
            too_large[path] = file.stat().st_size
    assert not too_large, (
        f"tracked files over {MAX_BYTES:,} bytes: {dict(sorted(too_large.items()))}. Only the bundled checkpoint's "
        f"{BUNDLED_WEIGHTS} may be that large. Do not commit checkpoints, caches or results this big: keep them out "
        "of the tree (runs/, cache/ are ignored) and record runs as text under docs/runs/. Do not add paths to "
        "LEGACY_SNAPSHOTS."
    )


def test_legacy_snapshots_are_still_tracked():
    tracked = set(tracked_files())
    gone = sorted(LEGACY_SNAPSHOTS - tracked)
    assert not gone, (
        f"LEGACY_SNAPSHOTS lists files that are no longer tracked: {gone}. Remove them from LEGACY_SNAPSHOTS in "
        "tests/test_repository.py (the list only shrinks), and check that their run is recorded under docs/runs/."
    )
    elsewhere = sorted(path for path in LEGACY_SNAPSHOTS if not path.startswith("checkpoints/training/"))
    assert not elsewhere, (
        f"LEGACY_SNAPSHOTS may only hold old training snapshots under checkpoints/training/, not {elsewhere}. Remove "
        "them from the list and keep those files out of git."
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
