"""The trainer tests need nothing outside the repository: they pass in a copy with no shared/ data beside it."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
THIS_TEST = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()
IGNORED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "runs", ".cache"}


def git_listed_files() -> list[str] | None:
    # Untracked, non-ignored files count too: they are what the next commit (and so a fresh clone) holds.
    command = ["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    try:
        listed = subprocess.run(command, capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return [name for name in listed.split("\0") if name]


def walked_files() -> list[str]:
    """Without git (e.g. an unpacked sdist): the source tree minus what .gitignore leaves out."""
    names = []
    for directory, subdirs, files in os.walk(REPO_ROOT):
        subdirs[:] = [d for d in subdirs if d not in IGNORED_DIRS and not d.endswith(".egg-info")]
        names += [os.path.relpath(os.path.join(directory, f), REPO_ROOT) for f in files if not f.endswith(".pyc")]
    return names


def copy_source_tree(dest: Path) -> Path:
    for name in git_listed_files() or walked_files():
        source = REPO_ROOT / name
        if source.is_file():  # listed but deleted in the working tree
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run_in(copy: Path, *args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(copy)}
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


def test_trainer_tests_pass_in_a_copy_without_shared_beside_it(tmp_path):
    copy = copy_source_tree(tmp_path / "checkout")
    assert not (copy.parent / "shared").exists()
    origin = run_in(copy, "-c", "import importlib.util; print(importlib.util.find_spec('pagedmoe').origin)")
    assert Path(origin.stdout.strip()).is_relative_to(copy), origin.stdout + origin.stderr
    # No -q: pyproject's addopts already has one, and -qq would hide the "N passed" summary.
    result = run_in(copy, "-m", "pytest", "-p", "no:cacheprovider", "tests/train", f"--ignore={THIS_TEST}")
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error", summary), summary


def test_walked_file_list_holds_the_sources_and_skips_ignored_dirs():
    names = set(walked_files())
    expected = {"pyproject.toml", "pagedmoe/__init__.py", "tests/conftest.py", "tests/data/shakespeare_excerpt.txt"}
    assert expected <= names
    assert not [name for name in names if name.startswith((".git/", ".venv/")) or "__pycache__" in name]
