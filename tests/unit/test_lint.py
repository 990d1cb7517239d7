"""`ruff check` passes on every Python folder of the repository, with the rules `[tool.ruff.lint]` selects."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

from conftest import ROOT

FOLDERS = ("src", "tests", "flows", "benchmarks", "scripts")


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff"), "ruff is not installed: pip install -e '.[test]' (make install does)"
    # --no-cache: the test leaves no .ruff_cache in the repository
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *FOLDERS], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, (
        f"ruff check found problems; fix them (`ruff check --fix {' '.join(FOLDERS)}` fixes the ones marked [*]):\n"
        f"{done.stdout}{done.stderr}"
    )
