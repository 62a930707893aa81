"""docs/architecture.md's module table names every module of the package, and only those:
the architecture page is read before the code, so it must not drift from it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> set[str]:
    table = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-dir]")[1]
    dirs = dict(re.findall(r'^"([\w.]+)" = "([\w/]+)"$', table.split("\n[")[0], re.M))
    out = set()
    for package, folder in dirs.items():
        for path in (ROOT / folder).glob("*.py"):
            out.add(package if path.name == "__init__.py" else f"{package}.{path.stem}")
    return out


def test_every_module_is_in_the_architecture_table_and_nothing_else():
    listed = set(re.findall(r"^\| `([\w.]+)` \|", (ROOT / "docs/architecture.md").read_text(), re.M))
    modules = _modules()
    assert len(modules) > 100  # the scan found the package
    assert modules - listed == set(), "modules missing from docs/architecture.md"
    assert listed - modules == set(), "docs/architecture.md lists modules that do not exist"
