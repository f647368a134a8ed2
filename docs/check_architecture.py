"""Keep docs/architecture.md true: every module and every import-linter contract is named in it; and the
README's Layout names every room (a package folder under flows/, tasks/, settings/ or infra/).

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


def rooms(root: Path) -> list[str]:
    """Every package folder under the four packages, as the README's Layout shows it (`collect/`)."""
    found = {init.parent for package in PACKAGES for init in (root / package).rglob("__init__.py")}
    return sorted(
        p.relative_to(root).as_posix() for p in found if p.relative_to(root).as_posix() not in PACKAGES
    )


def layout(readme: str) -> str:
    """The README's Layout section (up to the next heading), or "" without one."""
    start = readme.find("\n## Layout")
    if start < 0:
        return ""
    end = readme.find("\n## ", start + 1)
    return readme[start : end if end >= 0 else len(readme)]


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
    tree = layout((root / "README.md").read_text(encoding="utf-8")).replace("\n", " \n")
    for room in rooms(root):
        parent, leaf = room.rsplit("/", 1)
        if f" {leaf}/ " not in tree:
            lines.append(
                f"README.md: the Layout section does not show {room}/; "
                f"add '{leaf}/' and a few words under {parent}/"
            )
    return lines


def main() -> int:
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    if found:
        print(
            f"{len(found)} missing: docs/architecture.md names every module of flows/, tasks/, settings/ and "
            "infra/ and every import-linter contract, and the README's Layout every room, so both stay true.",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
