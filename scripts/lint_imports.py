"""Check the import layers of pyproject.toml ([tool.importlinter]) with `lint-imports`.

The top-level folders install as subpackages of ``kvtier`` through setuptools'
``package-dir``, so the import graph cannot be read from the source tree as it lies (the
editable install maps paths at import time; import-linter walks folders). This lays the
package out as it installs, in a temporary folder, and runs ``lint-imports`` on that.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def lay_out(dest: Path) -> None:
    """Copy every package's own .py files to where the installed package keeps them."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for package, folder in mapping.items():
        target = dest.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            shutil.copy2(source, target / source.name)


def main() -> int:
    lint = Path(sys.executable).with_name("lint-imports")
    with tempfile.TemporaryDirectory(prefix="kvtier-lint-") as tmp:
        lay_out(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        # Run from the laid-out folder: lint-imports puts its working directory first on
        # sys.path, and the checkout's kvtier/ would shadow the laid-out package.
        args = ["--config", str(ROOT / "pyproject.toml"), "--no-cache", *sys.argv[1:]]
        return subprocess.call([str(lint), *args], cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
