"""The typed configuration of kvtier, loaded from a YAML file and ``KVTIER_*`` variables.

One object for every part (pool, tiers, engine, policy, server), validated once at
start-up, so a typo or an impossible size fails before any memory is allocated.
Precedence (lowest first): defaults, the YAML file, environment variables, explicit
overrides (command-line flags). Nested fields use ``__`` in variable names:
``KVTIER_POOL__BLOCK_SIZE=32`` sets ``pool.block_size``; sizes take units
(``KVTIER_TIERS__CPU_BYTES=4GiB``). Environment variables are read by pydantic-settings and
only for fields that exist: ``KVTIER_PORT`` or ``KVTIER_DEBUG_KERNELS`` are not config and
are ignored, while a misspelt field inside a section (``KVTIER_POOL__BLOK_SIZE``) is an
error, as a misspelt YAML key is.

This module is a leaf: it imports nothing of kvtier but its errors, so every room may read
it; names that need a registry (eviction policies) are checked where they are used.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict, SettingsError

from kvtier.errors import ConfigError

ENV_PREFIX = "KVTIER_"
ENV_NESTED = "__"
NONE_WORDS = ("", "none", "null")
"""Environment values that mean "unset" (``KVTIER_POOL__NUM_BLOCKS=none`` clears a YAML value)."""

ModelDTypeName = Literal["auto", "float32", "float16", "bfloat16"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


class _Section(BaseModel):
    # Attribute docstrings become field descriptions: `kvtier config --help` lists them.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class PoolConfig(_Section):
    """The paged GPU KV pool: its block size and how much memory it takes."""

    block_size: int = 16
    """Tokens per block; a power of two."""
    num_blocks: int | None = None
    """Blocks in the pool. Exactly one of num_blocks / memory_bytes sizes the pool."""
    memory_bytes: ByteSize | None = None
    """Byte budget for the KV tensors (``256MiB``); the pool takes as many whole blocks as
    fit. Engine mode with neither set: 256 MiB."""
    num_layers: int = 2
    """Standalone pool only (``PagedKVPool.from_config``); an engine takes these three from
    its model."""
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: ModelDTypeName = "auto"
    """KV dtype, which is also the engine's model dtype; ``auto``: bfloat16 on CUDA, float32
    on CPU."""
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


CodecName = Literal["none", "fp8", "int8", "int4", "auto"]


class TiersConfig(_Section):
    """The lower tiers. With nothing set, an engine runs with a CPU arena and a local disk
    directory; Redis joins when ``redis_url`` is set."""

    cpu_bytes: ByteSize = ByteSize(1 << 30)
    """Size of the CPU arena (pinned when CUDA is present); 0 disables the CPU tier."""
    disk_dir: str | None = None
    """Chunk directory; default ``$XDG_CACHE_HOME/kvtier/chunks`` (``~/.cache/...``)."""
    disk_bytes: ByteSize | None = ByteSize(16 << 30)
    """Disk tier capacity; 0 disables the disk tier, None leaves it unbounded."""
    disk_fsync: bool = True
    disk_o_direct: bool = False
    redis_url: str | None = None
    """``redis://host:port/db`` or a cluster URL; unset: no Redis tier."""
    redis_ttl_s: int | None = None
    redis_timeout_s: float = 1.0
    redis_max_connections: int = 32
    """Connections per Redis client; past them a call waits for one (within its deadline)."""
    redis_min_bandwidth: ByteSize = ByteSize(50_000_000)
    """Bytes per second a Redis call is assumed to move at least: its deadline is the
    latency bound plus its bytes at this rate."""
    write_policy: Literal["write_through", "write_back"] = "write_back"
    cpu_free_reserve: float = 0.0
    """Fraction of the CPU arena's units kept free by handing its coldest chunks down in
    the background (a store then waits for its own copy only, not for a disk write or a
    Redis SET). 0: a store into a full arena hands its victim down itself. The vLLM
    connector's own tiers default to 0.05 (vLLM holds a finished request's blocks until its
    saves land); a shared service keeps 0 so that one tenant's stores never push another's
    chunks down early."""
    cpu_eviction: str = "session-aware"
    """Which chunk a full CPU tier gives up: lru, slru, lfu, arc, cost-aware,
    session-aware (kvtier's: whole sessions, tail first, those predicted to stay away
    longest first; chunks with no session are evicted LRU) or a dotted path."""
    disk_eviction: str = "session-aware"
    cpu_codec: CodecName = "none"
    """How chunks are kept in the CPU tier: ``none`` (the KV as computed), ``fp8``,
    ``int8``, ``int4`` (lossy: fewer bytes to hold and move, docs/tiers.md) or ``auto``
    (the codec whose restores from this tier are fastest, within ``policy.max_kv_error``)."""
    disk_codec: CodecName = "none"
    redis_codec: CodecName = "none"
    accept_codecs: list[Literal["none", "fp8", "int8", "int4"]] | None = None
    """The codecs of the stored KV this engine takes (others are misses: it recomputes);
    unset: lossless and the ones its own tiers write. ``[none]``: exact KV only."""

    @field_validator("cpu_free_reserve")
    @classmethod
    def _reserve_fraction(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise ValueError(f"must be in [0, 1), got {v}")
        return v

    @classmethod
    def pool_only(cls) -> TiersConfig:
        """No lower tier at all: an engine keeps KV in its pool only."""
        return cls(cpu_bytes=0, disk_bytes=0)

    @field_validator("cpu_bytes")
    @classmethod
    def _non_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0 (0 disables the tier), got {v}")
        return v


class EngineConfig(_Section):
    """The reference engine (``kvtier serve --model``, ``kvtier chat``): batching limits,
    threads, background stores, layer-wise restore. The pool section sizes its KV pool."""

    max_model_len: int | None = None
    """Longest sequence (prompt + output); default: the model's own limit."""
    max_num_seqs: int = 64
    """Sequences decoded together in one step."""
    max_num_batched_tokens: int = 512
    """Tokens one step computes (prefill chunks + decodes)."""
    num_threads: int | None = None
    """torch CPU threads (small ops are far faster with few threads on a busy machine)."""
    max_inflight_bytes: ByteSize = ByteSize(256 << 20)
    """Cap on KV bytes copied out of the pool and not yet stored (background offloads)."""
    stream_restore: bool | None = None
    """Restores stream layer by layer (layer l computes while layer l+1 loads); unset: on
    CPU for restores of 2048 tokens or more, never on CUDA (slower there: docs/gpu.md)."""
    fingerprint_salt: str | None = None
    """Mixed into the model fingerprint that keys every stored chunk: engines with different
    salts never share KV, even of the same model over shared tiers (as vLLM's
    ``cache_salt``); unset: KV is shared by every engine of the same weights."""
    system_tenant: str | None = None
    """The tenant (namespace) the chunks of sessions that belong to no tenant are stored in
    and charged to (``server.quotas``); a tenant's chat sessions are stored in its own.
    Unset: in none (the engine's own keys, no quota)."""

    @field_validator("system_tenant")
    @classmethod
    def _tenant_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9A-Za-z]{1,32}", v):
            raise ValueError(f"must be 1 to 32 letters or digits (a tenant name), got {v!r}")
        return v

    @field_validator("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_threads")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"must be a positive integer, got {v}")
        return v


class WatermarksConfig(_Section):
    """Pool occupancy (fraction of blocks) that starts offloading idle sessions (high) and
    where it stops (low)."""

    high: float = 0.9
    low: float = 0.75

    @model_validator(mode="after")
    def _ordered(self) -> WatermarksConfig:
        if not 0 < self.low <= self.high <= 1:
            raise ValueError(f"need 0 < low <= high <= 1, got low={self.low} high={self.high}")
        return self


class PolicyConfig(_Section):
    """The engine's offload policy (docs/policies.md)."""

    profile: str | None = None
    """Calibration profile (``kvtier calibrate``); unset: ``<model>/kvtier-profile.json``
    when it exists. Without one every stored prefix is loaded (no restore-vs-recompute
    decision) and offloads go to the fastest tier."""
    auto_offload: bool = True
    """Offload idle sessions when the pool fills past the high watermark."""
    watermarks: WatermarksConfig = WatermarksConfig()
    check_every_s: float = 0.05
    """Least time between two watermark checks (each walks the idle sessions)."""
    max_kv_error: float = 0.01
    """The quality budget of ``tiers.<tier>_codec: auto``: the largest error of a stored KV
    value relative to the largest magnitude of its group a codec may make (fp8 0.0625,
    int8 1/127, int4 1/7; docs/tiers.md). 0: lossless only."""

    @field_validator("check_every_s", "max_kv_error")
    @classmethod
    def _non_negative(cls, v: float) -> float:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v


SCOPES = ("read", "write", "chat", "admin")
DEFAULT_TENANT = "default"
"""The tenant of a caller without a scoped token (``server.auth_token``, or no auth)."""


class TokenConfig(_Section):
    """One bearer token: who holds it (its tenant) and what it may do (its scopes)."""

    token: str
    tenant: str = "default"
    """The namespace its chunks live in: tenants never read or overwrite each other's
    chunks, and no tenant can reach the engine's own. Letters and digits, 1 to 32."""
    scopes: list[Literal["read", "write", "chat", "admin"]] = ["read", "write", "chat"]
    """``read``: get/lookup chunks; ``write``: put/delete chunks; ``chat``: chat
    completions and the model list; ``admin``: sessions, stats, metrics."""

    @field_validator("token")
    @classmethod
    def _token(cls, v: str) -> str:
        if len(v) < 8 or any(c.isspace() for c in v):
            raise ValueError("a token must be at least 8 characters, without whitespace")
        return v

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str) -> str:
        return _check_tenant(v)


class TenantQuota(_Section):
    """Bytes one tenant's chunks may hold in each tier (unset: no bound but the tier's).
    Past it the tenant's own least recently used chunks move down a tier (out of the last
    one): one tenant filling its share never evicts another's KV."""

    cpu: ByteSize | None = None
    disk: ByteSize | None = None
    redis: ByteSize | None = None

    def per_tier(self) -> dict[str, int]:
        return {tier: int(v) for tier, v in self.model_dump().items() if v is not None}


def _check_tenant(v: str) -> str:
    if not (1 <= len(v) <= 32 and v.isascii() and v.isalnum()):
        raise ValueError(f"a tenant name is 1 to 32 letters and digits, got {v!r}")
    return v


class ServerConfig(_Section):
    """``kvtier serve``: where it listens, who may call it, how big a request may be."""

    host: str = "127.0.0.1"
    port: int = 8100
    auth_token: str | None = None
    """Bearer token every route but ``/healthz`` asks for, with every scope, in tenant
    ``default``; unset (and no ``tokens``): no auth (loopback use)."""
    tokens: list[TokenConfig] = []
    """Scoped tokens, each in a tenant (see :class:`TokenConfig`); with ``auth_token``."""
    quotas: dict[str, TenantQuota] = {}
    """tenant -> bytes its chunks may hold per tier, e.g. ``{alice: {cpu: 512MiB, disk:
    4GiB}}`` (see :class:`TenantQuota`)."""
    max_body_bytes: ByteSize = ByteSize(256 << 20)
    """Largest request body accepted; larger ones get 413 before anything is read into a tier."""
    max_inflight_bytes: ByteSize | None = None
    """Request bodies held at once across all requests; past it a request gets 503 with
    ``Retry-After`` (default: an eighth of the machine's memory, at most 2 GiB, never
    below ``max_body_bytes``). A chunked body counts as its pieces arrive. Chunks read
    for clients (replies, batch GETs, reads into regions, prefetches, derives) are held
    to a budget of the same size of their own, and the staging pool keeps at most the
    two budgets' bytes of idle buffers."""
    tenant_inflight_share: float = 0.5
    """The part of ``max_inflight_bytes`` one tenant's bodies (and, apart, its reads) may
    hold at once (never less than one largest body), so one tenant cannot starve the
    others; also the part of ``shm_bytes`` one tenant's regions may hold where
    ``shm_bytes_per_tenant`` is unset. Applies where the tokens name several tenants."""
    body_timeout_s: float = 60.0
    """A request body must arrive within this many seconds in all (else 408)."""
    reply_write_timeout_s: float = 30.0
    """A reply's every write must complete within this many seconds: a client that stops
    reading is cut off and what its reply held (tier leases, budget) is released."""
    body_idle_timeout_s: float = 10.0
    """... and with no pause longer than this between its bytes (else 408): a client that
    declares a body and sends nothing holds budget only this long."""
    shm_dir: str | None = "/dev/shm"
    """Where same-host clients' shared-memory regions are made (a memory filesystem), so
    chunk bytes cross no socket (docs/server.md); None, or a missing directory: none."""
    shm_bytes: ByteSize = ByteSize(1 << 30)
    """Bytes all shared-memory regions may hold together (0: none offered)."""
    shm_regions_per_tenant: int = 8
    """Regions one tenant may hold at once."""
    shm_bytes_per_tenant: ByteSize | None = None
    """Bytes one tenant's regions may hold together (unset: ``tenant_inflight_share`` of
    ``shm_bytes`` where the tokens name several tenants, never below ``max_body_bytes``;
    all of ``shm_bytes`` with a single tenant)."""
    shm_lease_s: float = 600.0
    """A region no request has used (a chunk PUT or GET through it, or a renewal) for this
    many seconds is reclaimed: a client that died without deleting its regions does not
    hold their memory for the life of the server."""
    chunk_slot_bytes: ByteSize = ByteSize(64 << 10)
    """Sidecar mode (no ``--model``): the CPU arena's allocation unit (rounded up to a
    page). A chunk of any size takes a contiguous run of as many units as it needs, so
    this bounds no chunk (only ``tiers.cpu_bytes`` does); a chunk wastes less than a unit.
    Set it to the chunk size of the one model a sidecar serves to have each chunk take
    exactly one unit. The name is kept from when it was a fixed slot, the largest chunk
    the arena held. Engine mode uses one chunk of its model."""
    max_tokens_default: int = 256
    """``/v1/chat/completions``: output tokens when a request names no ``max_tokens``."""
    served_model_names: list[str] = []
    """Engine mode: the names ``/v1/models`` lists and chat requests may ask for (the first
    is the one replies carry when a request names none); empty: the model directory's name.
    A request naming any other model gets OpenAI's 404 ``model_not_found``."""
    request_head_timeout_s: float = 10.0
    """A connection must send a complete request head within this many seconds of opening,
    and of its previous reply on a kept-alive connection; else it is closed (with a 408
    where part of a head arrived): sockets that send nothing hold no descriptor for long."""
    max_connections: int = 4096
    """Connections held open at once (never more than the descriptor limit less
    ``reserved_descriptors``). At the cap a new connection closes the longest-idle one
    (no request in flight); where every one has a request in flight it is closed unread."""
    tenant_connection_share: float = 0.5
    """With several tenants: the part of ``max_connections`` one tenant's connections may
    hold; past it the tenant's request on a further connection gets 503 with
    ``Retry-After`` and that connection is closed."""
    open_files_limit: int | None = None
    """The descriptor soft limit (``RLIMIT_NOFILE``) ``kvtier serve`` sets at start; unset:
    the hard limit. Logged."""
    reserved_descriptors: int = 256
    """Descriptors kept from connections for files, Redis, regions and the engine: the
    connection cap is at most the descriptor limit less these."""
    drain_timeout_s: float = 10.0
    """On SIGTERM or SIGINT, requests in flight are drained for at most this long."""
    stop_timeout_s: float = 30.0
    """From SIGTERM or SIGINT the process is gone within this many seconds, whatever its
    threads are doing (past it, it exits at once with status 1)."""
    max_chat_chars: int = 4_000_000
    """``/v1/chat/completions``: the most characters a request's messages may hold; with
    the model's context it bounds a history before it is tokenized (400 past either)."""

    @field_validator("quotas")
    @classmethod
    def _quota_tenants(cls, v: dict[str, TenantQuota]) -> dict[str, TenantQuota]:
        for tenant in v:
            _check_tenant(tenant)
        return v

    @field_validator("port")
    @classmethod
    def _port(cls, v: int) -> int:
        if not 0 <= v <= 65535:
            raise ValueError(f"port must be in 0..65535, got {v}")
        return v

    @field_validator("max_body_bytes", "chunk_slot_bytes", "max_tokens_default",
                     "shm_regions_per_tenant", "max_connections", "max_chat_chars")
    @classmethod
    def _positive_size(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"must be a positive integer, got {v}")
        return v

    @field_validator("body_timeout_s", "body_idle_timeout_s", "shm_lease_s",
                     "reply_write_timeout_s", "request_head_timeout_s", "drain_timeout_s",
                     "stop_timeout_s")
    @classmethod
    def _positive_time(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be a positive number of seconds, got {v}")
        return v

    @field_validator("open_files_limit")
    @classmethod
    def _open_files(cls, v: int | None) -> int | None:
        if v is not None and v < 64:
            raise ValueError(f"must be at least 64 descriptors, got {v}")
        return v

    @field_validator("reserved_descriptors")
    @classmethod
    def _reserve(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be 0 or more, got {v}")
        return v

    @model_validator(mode="after")
    def _stop_after_drain(self) -> ServerConfig:
        if self.stop_timeout_s < self.drain_timeout_s:
            raise ValueError(f"stop_timeout_s ({self.stop_timeout_s}) must be at least "
                             f"drain_timeout_s ({self.drain_timeout_s})")
        return self

    @field_validator("tenant_inflight_share", "tenant_connection_share")
    @classmethod
    def _share(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v


class KVTierConfig(_Section):
    """Root configuration object; :func:`load_config` builds it from defaults, a YAML file,
    ``KVTIER_*`` variables and overrides. (A plain model, not a ``BaseSettings``: those
    read the process environment on every validation, which would override a YAML file's
    values or an explicit ``environ`` after the fact.)"""

    pool: PoolConfig = PoolConfig()
    tiers: TiersConfig = TiersConfig()
    engine: EngineConfig = EngineConfig()
    policy: PolicyConfig = PolicyConfig()
    server: ServerConfig = ServerConfig()
    chunk_tokens: int = 256
    """Tokens per chunk in the lower tiers; a multiple of pool.block_size."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """kvtier's and uvicorn's log level."""

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


class _EnvSettings(BaseSettings, KVTierConfig):
    """The root config's fields as pydantic-settings sees them, for reading variables."""

    model_config = SettingsConfigDict(extra="forbid")


class _EnvSource(EnvSettingsSource):
    """pydantic-settings' reading of ``KVTIER_*`` variables, over a given mapping rather
    than always ``os.environ`` (tests and embedders pass their own)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(
            _EnvSettings,
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter=ENV_NESTED,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {
            name.lower(): None if value.strip().lower() in NONE_WORDS else value
            for name, value in self._environ.items()
        }


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The config fields ``KVTIER_*`` variables set, as a nested mapping (unknown top-level
    names ignored; within a section every name is kept, so a misspelt one is an error)."""
    for name in environ:
        rest = name.upper()[len(ENV_PREFIX) :] if name.upper().startswith(ENV_PREFIX) else ""
        if ENV_NESTED in rest and not all(rest.split(ENV_NESTED)):
            raise ConfigError(f"environment variable {name}: empty name segment")
    try:
        return dict(_EnvSource(environ)())
    except SettingsError as exc:
        raise ConfigError(
            f"environment variables: {exc} (a section such as KVTIER_POOL cannot be set "
            "as a whole; set its fields, e.g. KVTIER_POOL__BLOCK_SIZE)"
        ) from None


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


def describe_fields(model: type[BaseModel] = KVTierConfig, prefix: str = "") -> list[str]:
    """One line per config field: its dotted name, default, ``KVTIER_*`` variable and
    description (what ``kvtier config --help`` shows)."""
    lines: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            lines.extend(describe_fields(kind, f"{dotted}."))
            continue
        env = ENV_PREFIX + dotted.upper().replace(".", ENV_NESTED)
        doc = " ".join((field.description or "").split())
        lines.append(f"{dotted} = {field.default!r}  [{env}]" + (f"\n    {doc}" if doc else ""))
    return lines
