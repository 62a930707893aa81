"""The ``kvtier`` command as a user runs it: installed console script, exit codes, messages;
and the packaging promise that every package folder installs under ``kvtier.*``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvtier.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("kvtier", path=str(Path(sys.executable).parent)) or "kvtier"
    return subprocess.run(
        [exe, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_console_script_lists_commands():
    out = _kvtier("--help")
    assert out.returncode == 0, out.stderr
    assert "bench" in out.stdout and "config" in out.stdout
    bench = _kvtier("bench", "--help")
    for suite in ("fragmentation", "allocator", "kernels"):
        assert suite in bench.stdout


def test_config_command_merges_file_and_environment(tmp_path):
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("pool:\n  block_size: 32\n  num_blocks: 100\nchunk_tokens: 512\n")
    out = _kvtier("config", "--config", str(cfg), env={"KVTIER_POOL__DTYPE": "bfloat16"})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["pool"]["block_size"] == 32 and doc["pool"]["num_blocks"] == 100
    assert doc["pool"]["dtype"] == "bfloat16" and doc["chunk_tokens"] == 512


def test_user_errors_exit_2_with_a_message(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("pool:\n  block_size: 24\n")
    assert main(["config", "--config", str(cfg)]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err
    assert main(["bench", "fragmentation", "--workloads", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_unknown_subcommand_is_an_argparse_error():
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_every_package_folder_is_installed_under_kvtier():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = conf["package-dir"]
    assert set(conf["packages"]) == set(mapping)
    for folder in ("gpu_pool", "connectors", "policies", "server", "benchmarks", "kvtier"):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).as_posix()
            assert rel in mapping.values(), f"{rel} is a package folder missing from pyproject"
    for name in ("server", "connectors", "gpu_pool", "policies", "benchmarks"):
        assert name not in {p.split(".")[0] for p in mapping}, f"top-level {name} would leak"


def test_log_level_governs_kvtier_logs_and_verbose_wins():
    import argparse
    import logging

    from kvtier.cli.options import apply_log_level, config_from_args

    logger = logging.getLogger("kvtier")
    before = logger.level
    try:
        args = argparse.Namespace(config=None, log_level=None, verbose=False)
        config = config_from_args(args, log_level="WARNING")
        apply_log_level(config, args)
        assert logger.getEffectiveLevel() == logging.WARNING
        apply_log_level(config, argparse.Namespace(verbose=True))
        assert logger.getEffectiveLevel() == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_engine_flags_override_the_config_and_unset_flags_leave_it(tmp_path, monkeypatch):
    import argparse

    from kvtier.cli.options import config_from_args

    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("pool:\n  num_blocks: 64\n  dtype: float16\nengine:\n  num_threads: 3\n")
    monkeypatch.setenv("KVTIER_POOL__DEVICE", "cpu")
    flags = argparse.Namespace(config=str(cfg), dtype=None, device=None, kv_memory_mib=None, threads=None)
    c = config_from_args(flags)
    assert (c.pool.num_blocks, c.pool.dtype, c.pool.device, c.engine.num_threads) == (64, "float16", "cpu", 3)
    flags = argparse.Namespace(config=str(cfg), dtype="bfloat16", device=None, kv_memory_mib=8, threads=1)
    c = config_from_args(flags)
    assert (c.pool.num_blocks, c.pool.memory_bytes) == (None, 8 << 20)  # the size flag replaces num_blocks
    assert (c.pool.dtype, c.pool.device, c.engine.num_threads) == ("bfloat16", "cpu", 1)
