"""Build the GPU kit's wheelhouse (docs/gpu.md): binary wheels for CPython 3.12 manylinux
x86_64 of every runtime dependency of kvtier that the lent GPU machines lack, to travel
with the working tree (they have no package index).

What to fetch is read from pyproject.toml (the runtime dependencies, without torch and
triton) plus the build backend (setuptools, wheel; the kit installs with no build
isolation), resolved with their own dependencies by ``pip download``. Wheels of what the
GPU image provides and must never be replaced there (torch, triton, the CUDA libraries,
numpy) are dropped; the other small ones stay, so pip can use them where the image's
version does not satisfy a requirement. ``--list`` prints the requirements and exits.

The GPU machines have no ``redis-server`` either: where this machine has one, it is bundled
too (``redis/``: the binary, the shared libraries it links beyond glibc, and a wrapper that
points it at them and nothing else), so the kit's Redis rows run there.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
ON_THE_MACHINE = re.compile(r"^(torch|triton|numpy|nvidia[-_].*|cuda[-_].*)$")
"""Provided by the GPU image (torch 2.11 + CUDA 13, Triton 3.6, numpy): never carried."""
BUILD = ("setuptools>=77", "wheel")
MAX_BYTES = 48 << 20
"""The working tree and what it carries travel within 64 MiB; the wheels keep to 48."""


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """kvtier's runtime dependencies less the machine's own, plus the build backend."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [d for d in deps if not ON_THE_MACHINE.match(_name(d))] + list(BUILD)


def download(reqs: list[str], dest: Path, python: str = "3.12") -> list[Path]:
    """``pip download`` of ``reqs`` and their dependencies as binary wheels for the GPU
    machine's interpreter into ``dest`` (emptied first), then the machine's own dropped."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp",
               "--abi", f"cp{python.replace('.', '')}", "--abi", "abi3", "--abi", "none",
               "--dest", tmp]
        for plat in (*PLATFORMS, "any"):
            cmd += ["--platform", plat]
        subprocess.run([*cmd, *reqs], check=True)
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        kept = []
        for whl in sorted(Path(tmp).glob("*.whl")):
            if ON_THE_MACHINE.match(_name(whl.name.split("-", 1)[0])):
                continue
            kept.append(Path(shutil.copy2(whl, dest / whl.name)))
    return kept


GLIBC = re.compile(r"^(linux-vdso|libc|libm|libdl|librt|libpthread|ld-linux[-\w]*)\.so")
"""Libraries of glibc itself, which the GPU image has (and must keep its own of)."""


def bundle_redis(dest: Path) -> Path | None:
    """Copy this machine's ``redis-server`` with its non-glibc shared libraries into
    ``dest/redis`` behind a wrapper script; None where there is no redis-server here."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    real = Path(exe).resolve()
    out = dest / "redis"
    (out / "lib").mkdir(parents=True, exist_ok=True)
    shutil.copy2(real, out / "lib" / "redis-server.bin")
    ldd = subprocess.run(["ldd", str(real)], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m and not GLIBC.match(m.group(1)):
            shutil.copy2(m.group(2), out / "lib" / m.group(1))
    wrapper = out / "redis-server"
    wrapper.write_text('#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\n'
                       'LD_LIBRARY_PATH="$here/lib" exec "$here/lib/redis-server.bin" "$@"\n')
    wrapper.chmod(0o755)
    return out


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".gpu-wheels")
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (default 3.12)")
    ap.add_argument("--list", action="store_true", help="print the requirements and exit")
    args = ap.parse_args()
    reqs = requirements()
    if args.list:
        print("\n".join(reqs))
        return 0
    kept = download(reqs, args.dest, args.python)
    total = sum(p.stat().st_size for p in kept)
    for p in kept:
        print(f"{p.stat().st_size / 2**20:7.2f} MiB  {p.name}")
    print(f"{len(kept)} wheels, {total / 2**20:.1f} MiB in {args.dest}")
    redis = bundle_redis(args.dest)
    if redis is None:
        print("no redis-server here: the kit's Redis rows will not run on the GPU machine")
    else:
        total += _size(redis)
        print(f"redis-server bundled: {_size(redis) / 2**20:.1f} MiB in {redis}")
    if total > MAX_BYTES:
        print(f"gpu_wheels: {total / 2**20:.1f} MiB is over the {MAX_BYTES >> 20} MiB the "
              "working tree can carry beside itself", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
