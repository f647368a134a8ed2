"""Keep docs/architecture.md true: every module and every import-linter contract is named in it.

Run by `make lint` (`python docs/check_architecture.py`). A module is a .py file other than __init__.py
under flows/, tasks/, settings/ or infra/; the doc must name it by its path from the repository root
(`tasks/collect/chunk.py`), since several rooms hold a module of the same name. A contract is named by
its `name` in pyproject.toml. Exits 1 and says what is missing and what to do; 0 when nothing is.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("flows", "tasks", "settings", "infra")


def modules(root: Path) -> list[str]:
    """Every module path the doc must name, sorted."""
    found = []
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            if path.name != "__init__.py" and "__pycache__" not in path.parts:
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def contracts(root: Path) -> list[str]:
    """The names of the import-linter contracts in pyproject.toml."""
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    return [c["name"] for c in config.get("tool", {}).get("importlinter", {}).get("contracts", [])]


def problems(root: Path = ROOT) -> list[str]:
    doc_path = root / "docs" / "architecture.md"
    doc = doc_path.read_text(encoding="utf-8")
    shown = doc_path.relative_to(root).as_posix()
    lines = [
        f"{shown}: module {path} is not named; add the line '- `{path}`: <what it does>' under its room"
        for path in modules(root)
        if f"`{path}`" not in doc
    ]
    lines += [
        f"{shown}: import-linter contract {name!r} (pyproject.toml) is not named; name it under ## Layers"
        for name in contracts(root)
        if name not in " ".join(doc.split())
    ]
    return lines


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(
            f"{len(found)} missing from docs/architecture.md: the doc names every module of flows/, tasks/, "
            "settings/ and infra/ and every import-linter contract, so it stays true.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
