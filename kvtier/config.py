"""The typed configuration of kvtier, loaded from a YAML file and ``KVTIER_*`` variables.

One object, validated once at start-up, so a typo or an impossible size fails before any
memory is allocated. Precedence (lowest first): defaults, the YAML file, environment
variables, explicit overrides. Nested fields use ``__`` in variable names:
``KVTIER_POOL__BLOCK_SIZE=32`` sets ``pool.block_size``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"
ENV_NESTED = "__"

DTypeName = Literal["float32", "float16", "bfloat16"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PoolConfig(_Section):
    """The paged GPU KV pool: its block size and how much memory it takes."""

    block_size: int = 16
    """Tokens per block; a power of two."""
    num_blocks: int | None = None
    """Blocks in the pool. Exactly one of num_blocks / memory_bytes sizes the pool."""
    memory_bytes: int | None = None
    """Byte budget for the KV tensors; the pool takes as many whole blocks as fit."""
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: DTypeName = "float16"
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when present)."""
    enable_prefix_caching: bool = True

    @field_validator("block_size")
    @classmethod
    def _block_size_pow2(cls, v: int) -> int:
        if not is_power_of_two(v):
            raise ValueError(f"block_size must be a power of two (1, 2, 4 ... 128), got {v}")
        return v

    @field_validator("num_blocks", "memory_bytes", "num_layers", "num_kv_heads", "head_dim")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"must be a positive integer, got {v}")
        return v

    @model_validator(mode="after")
    def _one_size(self) -> PoolConfig:
        if self.num_blocks is not None and self.memory_bytes is not None:
            raise ValueError("set either num_blocks or memory_bytes for the pool, not both")
        return self


class TiersConfig(_Section):
    """The lower tiers. With nothing set, an engine runs with a CPU arena and a local disk
    directory; Redis joins when ``redis_url`` is set."""

    cpu_bytes: int = 1 << 30
    """Size of the CPU arena (pinned when CUDA is present); 0 disables the CPU tier."""
    disk_dir: str | None = None
    """Chunk directory; default ``$XDG_CACHE_HOME/kvtier/chunks`` (``~/.cache/...``)."""
    disk_bytes: int | None = 16 << 30
    """Disk tier capacity; 0 disables the disk tier, None leaves it unbounded."""
    disk_fsync: bool = True
    disk_o_direct: bool = False
    redis_url: str | None = None
    """``redis://host:port/db`` or a cluster URL; unset: no Redis tier."""
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 1.0
    write_policy: Literal["write_through", "write_back"] = "write_back"
    cpu_eviction: str = "session-aware"
    """Which chunk a full CPU tier gives up: lru, slru, lfu, arc, cost-aware,
    session-aware (kvtier's: whole sessions, tail first, those predicted to stay away
    longest first; chunks with no session are evicted LRU) or a dotted path."""
    disk_eviction: str = "session-aware"

    @field_validator("cpu_bytes")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0 (0 disables the tier), got {v}")
        return v


class ServerConfig(_Section):
    """``kvtier serve``: where it listens, who may call it, how big a request may be."""

    host: str = "127.0.0.1"
    port: int = 8100
    auth_token: str | None = None
    """Bearer token every route but ``/healthz`` asks for; unset: no auth (loopback use)."""
    max_body_bytes: int = 256 << 20
    """Largest request body accepted; larger ones get 413 before anything is read into a tier."""
    chunk_slot_bytes: int = 4 << 20
    """Sidecar mode (no ``--model``): the CPU arena's slot size, the largest chunk it holds
    (bigger chunks go to the disk tier). Engine mode sizes slots from the model."""
    max_tokens_default: int = 256
    """``/v1/chat/completions``: output tokens when a request names no ``max_tokens``."""

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"port must be in 0..65535, got {v}")
        return v

    @field_validator("max_body_bytes", "chunk_slot_bytes", "max_tokens_default")
    @classmethod
    def _positive_size(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"must be a positive integer, got {v}")
        return v


class KVTierConfig(_Section):
    """Root configuration object."""

    pool: PoolConfig = PoolConfig()
    tiers: TiersConfig = TiersConfig()
    server: ServerConfig = ServerConfig()
    chunk_tokens: int = 256
    """Tokens per chunk in the lower tiers; a multiple of pool.block_size."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _chunk_multiple_of_block(self) -> KVTierConfig:
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.pool.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must be a positive multiple of "
                f"pool.block_size ({self.pool.block_size})"
            )
        return self


def _deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Turn ``KVTIER_A__B=v`` variables into ``{"a": {"b": "v"}}``."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split(ENV_NESTED)]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty name segment")
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"environment variable {name} conflicts with another KVTIER_ variable"
                )
        if isinstance(node.get(path[-1]), dict):  # the same conflict, met in the other order
            raise ConfigError(
                f"environment variable {name} conflicts with another KVTIER_ variable"
            )
        node[path[-1]] = None if value.strip().lower() in ("", "none", "null") else value
    return tree


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> KVTierConfig:
    """Build the config from defaults, a YAML file, ``KVTIER_*`` variables and overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_yaml(Path(path))
    data = _deep_merge(data, env_overrides(os.environ if environ is None else environ))
    if overrides:
        data = _deep_merge(data, overrides)
    try:
        return KVTierConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()
        )
        source = f" (file {path} and KVTIER_* variables)" if path else " (KVTIER_* variables)"
        raise ConfigError(f"invalid configuration{source}: {problems}") from None
