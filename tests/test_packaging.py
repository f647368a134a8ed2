"""One import package: `rollflow` imports from anywhere, the folders are not top-level names, and every
package folder is in pyproject's explicit packages list (discovery cannot see through package-dir)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _import(name: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = f"import {name}; print({name}.__name__)"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rollflow_imports_from_an_empty_directory(tmp_path: Path) -> None:
    done = _import("rollflow.flows.pipeline", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "rollflow.flows.pipeline"


@pytest.mark.parametrize("name", ["flows", "tasks", "settings", "infra"])
def test_folders_are_not_top_level_packages(tmp_path: Path, name: str) -> None:
    done = _import(name, tmp_path)
    assert done.returncode != 0
    assert f"No module named '{name}'" in done.stderr


def test_every_package_folder_is_listed() -> None:
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = {"rollflow"}
    for package, folder in tool["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *rel)))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"
