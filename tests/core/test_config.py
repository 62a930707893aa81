"""load_config: YAML, KVTIER_* variables, overrides, their precedence, and clear errors.

Every test passes ``environ=`` explicitly so the process environment never leaks in."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.config import KVTierConfig, PoolConfig, env_overrides, is_power_of_two, load_config
from kvtier.errors import ConfigError, KVTierError


def write(tmp_path: Path, text: str, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults() -> None:
    cfg = load_config(environ={})
    assert isinstance(cfg, KVTierConfig)
    assert (cfg.pool.block_size, cfg.pool.num_blocks, cfg.pool.memory_bytes) == (16, None, None)
    assert (cfg.pool.dtype, cfg.pool.device, cfg.pool.enable_prefix_caching) == (
        "auto",
        "auto",
        True,
    )
    assert (cfg.chunk_tokens, cfg.log_level) == (256, "INFO")


def test_yaml_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pool:\n  block_size: 32\n  num_blocks: 100\n  dtype: bfloat16\n"
        "chunk_tokens: 512\nlog_level: DEBUG\n",
    )
    for p in (path, str(path)):
        cfg = load_config(p, environ={})
        assert (cfg.pool.block_size, cfg.pool.num_blocks, cfg.pool.dtype) == (32, 100, "bfloat16")
        assert (cfg.chunk_tokens, cfg.log_level) == (512, "DEBUG")
        assert cfg.pool.head_dim == 64  # untouched fields keep their defaults


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), environ={}) == load_config(environ={})


def test_env_variables_nested_and_typed() -> None:
    env = {
        "KVTIER_POOL__BLOCK_SIZE": "8",
        "KVTIER_POOL__MEMORY_BYTES": "1048576",
        "KVTIER_POOL__ENABLE_PREFIX_CACHING": "false",
        "KVTIER_CHUNK_TOKENS": "64",
        "KVTIER_LOG_LEVEL": "WARNING",
        "PATH": "/usr/bin",  # not ours: ignored
        "KVTIERX_POOL__BLOCK_SIZE": "3",  # not the prefix: ignored
    }
    cfg = load_config(environ=env)
    assert (cfg.pool.block_size, cfg.pool.memory_bytes) == (8, 1048576)
    assert cfg.pool.enable_prefix_caching is False
    assert (cfg.chunk_tokens, cfg.log_level) == (64, "WARNING")


def test_env_none_clears_a_yaml_value(tmp_path: Path) -> None:
    path = write(tmp_path, "pool:\n  num_blocks: 10\n")
    cfg = load_config(
        path, environ={"KVTIER_POOL__NUM_BLOCKS": "none", "KVTIER_POOL__MEMORY_BYTES": "4096"}
    )
    assert (cfg.pool.num_blocks, cfg.pool.memory_bytes) == (None, 4096)


def test_env_overrides_tree() -> None:
    tree = env_overrides({"KVTIER_POOL__HEAD_DIM": "128", "KVTIER_LOG_LEVEL": "null", "X": "1"})
    assert tree == {"pool": {"head_dim": "128"}}  # a top-level "null" leaves the default


def test_precedence_defaults_yaml_env_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "pool:\n  block_size: 32\n  num_blocks: 10\n  head_dim: 32\n  num_layers: 4\n",
    )
    env = {"KVTIER_POOL__BLOCK_SIZE": "64", "KVTIER_POOL__HEAD_DIM": "16"}
    cfg = load_config(path, environ=env, overrides={"pool": {"block_size": 128}})
    assert cfg.pool.block_size == 128  # override beats env beats yaml
    assert cfg.pool.head_dim == 16  # env beats yaml
    assert (cfg.pool.num_blocks, cfg.pool.num_layers) == (10, 4)  # yaml beats defaults
    assert cfg.pool.num_kv_heads == 2  # default
    assert cfg.chunk_tokens == 256
    # Without the override the env value wins; without env the yaml value.
    assert load_config(path, environ=env).pool.block_size == 64
    assert load_config(path, environ={}).pool.block_size == 32


@pytest.mark.parametrize(
    ("yaml_text", "env", "overrides", "key"),
    [
        ("pool:\n  blok_size: 8\n", {}, None, "pool.blok_size"),
        ("chunk_tokenz: 8\n", {}, None, "chunk_tokenz"),
        ("", {"KVTIER_POOL__BOGUS": "1"}, None, "pool.bogus"),
        ("", {"KVTIER_POLICY__WATERMARKS__HIHG": "0.5"}, None, "policy.watermarks.hihg"),
        ("", {}, {"pool": {"heads": 4}}, "pool.heads"),
    ],
)
def test_unknown_keys_are_rejected_by_name(
    tmp_path: Path, yaml_text: str, env: dict[str, str], overrides: dict | None, key: str
) -> None:
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError, match=rf"invalid configuration .*{key}: Extra inputs"):
        load_config(path, environ=env, overrides=overrides)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, "pool: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"config file {path} is not valid YAML"):
        load_config(path, environ={})


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping at the top level"):
        load_config(path, environ={})


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"cannot read config file {path}: No such file"):
        load_config(path, environ={})


@pytest.mark.parametrize("chunk", ["100", "8", "0", "-16"])
def test_chunk_tokens_must_be_a_multiple_of_block_size(chunk: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"chunk_tokens \({chunk}\) must be a positive multiple of pool.block_size \(16\)",
    ):
        load_config(environ={"KVTIER_CHUNK_TOKENS": chunk})
    assert load_config(environ={"KVTIER_CHUNK_TOKENS": "48"}).chunk_tokens == 48


@pytest.mark.parametrize("bs", ["3", "12", "0", "-8"])
def test_block_size_must_be_a_power_of_two(tmp_path: Path, bs: str) -> None:
    path = write(tmp_path, f"pool:\n  block_size: {bs}\n")
    with pytest.raises(ConfigError, match=r"pool.block_size: .*power of two") as exc:
        load_config(path, environ={})
    assert str(path) in str(exc.value)  # says where the bad value came from


def test_num_blocks_and_memory_bytes_are_exclusive() -> None:
    env = {"KVTIER_POOL__NUM_BLOCKS": "8", "KVTIER_POOL__MEMORY_BYTES": "4096"}
    with pytest.raises(
        ConfigError, match=r"pool: .*set either num_blocks or memory_bytes for the pool, not both"
    ) as exc:
        load_config(environ=env)
    assert "(KVTIER_* variables)" in str(exc.value)
    with pytest.raises(ValueError, match="not both"):
        PoolConfig(num_blocks=8, memory_bytes=4096)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KVTIER_POOL__BLOCK_SIZE": "abc"}, r"pool.block_size: Input should be a valid integer"),
        ({"KVTIER_POOL__DTYPE": "int8"}, r"pool.dtype: Input should be 'auto', 'float32'"),
        ({"KVTIER_POOL__NUM_BLOCKS": "0"}, r"pool.num_blocks: .*must be a positive integer"),
        ({"KVTIER_LOG_LEVEL": "LOUD"}, r"log_level: Input should be 'DEBUG'"),
        ({"KVTIER_POOL____X": "1"}, r"KVTIER_POOL____X: empty name segment"),
    ],
)
def test_bad_values_name_the_field(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(environ=env)


@pytest.mark.parametrize(
    "env",
    [
        {"KVTIER_POOL": "1", "KVTIER_POOL__BLOCK_SIZE": "8"},
        {"KVTIER_POOL__BLOCK_SIZE": "8", "KVTIER_POOL": "1"},
    ],
)
def test_conflicting_env_variables_in_either_order(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=r"pool: Input should be a valid dictionary"):
        load_config(environ=env)


def test_config_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        load_config(environ={"KVTIER_POOL__BLOCK_SIZE": "3"})
    assert issubclass(ConfigError, KVTierError)


def test_assignment_is_validated() -> None:
    cfg = load_config(environ={})
    with pytest.raises(ValidationError, match="power of two"):
        cfg.pool.block_size = 24
    assert cfg.pool.block_size == 16


def test_is_power_of_two() -> None:
    assert [n for n in range(-4, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_variables_that_are_not_config_are_ignored() -> None:
    """``KVTIER_PORT`` (the demo script's) and ``KVTIER_DEBUG_KERNELS`` (docs/kernels.md)
    share the prefix but name no config field: they must not break any command."""
    env = {"KVTIER_PORT": "8201", "KVTIER_DEBUG_KERNELS": "1", "KVTIER_DEMO_MODEL": "x"}
    assert load_config(environ=env) == load_config(environ={})


@pytest.mark.parametrize(
    ("text", "value"),
    [("4GiB", 4 << 30), ("512 MiB", 512 << 20), ("1GB", 10**9), ("123", 123)],
)
def test_sizes_take_units(text: str, value: int) -> None:
    cfg = load_config(environ={"KVTIER_TIERS__CPU_BYTES": text, "KVTIER_POOL__MEMORY_BYTES": text})
    assert cfg.tiers.cpu_bytes == value and cfg.pool.memory_bytes == value
    with pytest.raises(ConfigError, match=r"tiers.cpu_bytes: .*byte"):
        load_config(environ={"KVTIER_TIERS__CPU_BYTES": "4 parsecs"})


def test_engine_and_policy_sections_from_yaml_and_env(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "engine:\n  max_num_seqs: 8\n  max_inflight_bytes: 64MiB\n"
        "policy:\n  profile: /p.json\n  watermarks:\n    high: 0.8\n",
    )
    env = {"KVTIER_POLICY__WATERMARKS__LOW": "0.6", "KVTIER_ENGINE__STREAM_RESTORE": "true"}
    cfg = load_config(path, environ=env)
    assert (cfg.engine.max_num_seqs, cfg.engine.max_inflight_bytes) == (8, 64 << 20)
    assert cfg.engine.stream_restore is True and cfg.policy.profile == "/p.json"
    assert (cfg.policy.watermarks.high, cfg.policy.watermarks.low) == (0.8, 0.6)
    assert cfg.policy.auto_offload is True  # untouched: its default


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"KVTIER_POLICY__WATERMARKS__LOW": "0.95"}, r"policy.watermarks: .*0 < low <= high"),
        ({"KVTIER_ENGINE__MAX_NUM_SEQS": "0"}, r"engine.max_num_seqs: .*positive"),
        ({"KVTIER_POLICY__CHECK_EVERY_S": "-1"}, r"policy.check_every_s: .*>= 0"),
    ],
)
def test_engine_and_policy_values_are_checked(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(environ=env)
