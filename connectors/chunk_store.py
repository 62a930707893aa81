"""Where an engine connector keeps its chunks: kvtier's tiers in-process, or a running
``kvtier serve`` over HTTP. Both answer the same three calls, on the data path's own terms:
a prefix lookup; ``put_from`` (chunks written by their writers' fills straight into memory
the store provides: a CPU arena slot, or a staging buffer a disk write or an upload goes
out of, or the client's shared-memory region); and ``get_into`` (chunks lent as
:class:`~kvtier.connectors.tiers.lent_chunk.LentChunk` whose layers the reader checks right
before it copies them). No chunk-sized bytes object is made on either side.

An in-process store is shared by every connector instance of one process that names the
same configuration (vLLM builds a scheduler-side and a worker-side connector; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` both live in one process and must see one cache).
Across processes, use ``kvtier serve`` (``url``).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from kvtier.chunk_format import chunk_view
from kvtier.chunk_wire import ServiceError
from kvtier.connectors.store_breaker import (
    Breaker,
    Call,
    StoreDeadlines,
    StoreFaults,
    StoreUnavailableError,
    fault_of,
)
from kvtier.connectors.tiers.base import ChunkWrite
from kvtier.connectors.tiers.codec_setup import CodecContext, resolved_auto_fields
from kvtier.connectors.tiers.derived import Derived, TokenRange, derive_chunk
from kvtier.connectors.tiers.host_buffers import StagingPool
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.connectors.tiers.manager import TierManager
from kvtier.connectors.tiers.session_turns import SessionTurns
from kvtier.errors import ChunkError, ConfigError, InvalidArgumentError
from kvtier.kv_codecs import Codec
from kvtier.policies.eviction import ChunkInfo

if TYPE_CHECKING:
    from kvtier.client import ChunkOwner, SessionTurn
    from kvtier.config import KVTierConfig

T = TypeVar("T")


class ChunkStore(Protocol):
    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored."""

    def where(self, keys: Sequence[str]) -> list[str]:
        """The tier holding each of the leading stored ``keys`` (its name; the fastest
        that has it): as long as the stored prefix."""

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is stored (one round trip)."""

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """The tier holding each of ``keys`` (the fastest that has it), prefix or not, or
        None (one round trip): a lookup and its candidate tails in one question."""

    def prefetch(self, keys: Sequence[str]) -> int:
        """Raise the stored prefix of ``keys`` into the fastest tier (a request that will
        read them is coming); how many chunks were read from slower tiers."""

    def report_turns(self, turns: Sequence[SessionTurn]) -> None:
        """When sessions' turns started and ended, oldest first: the store's session-aware
        tiers keep the sessions likely back soon."""

    def put_from(self, writes: Sequence[ChunkWrite]) -> dict[str, str]:
        """Store chunks, each filled by its write; returns the keys that failed, with why."""

    def derive(self, key: str, source: str, tokens: TokenRange, info: ChunkInfo | None = None
               ) -> bool:
        """Store under ``key`` tokens ``tokens`` of the stored chunk ``source`` (every
        layer), cut inside the store: nothing crosses from the caller. False where the
        store holds no exact copy of ``source`` to cut: the caller writes the chunk."""

    def landing_codec(self) -> Codec:
        """The codec the tier a save lands in keeps chunks in: a writer on a GPU encodes
        its chunks there, so only the encoded bytes cross (NONE: the store encodes)."""

    def get_into(self, keys: Sequence[str]) -> contextlib.AbstractContextManager[list[LentChunk | None]]:
        """The stored prefix of ``keys`` lent (None past it, or for a chunk refused),
        valid until the block ends; the reader checks each group of layers before use."""

    def close(self) -> None: ...


class LocalChunkStore:
    """kvtier's tier stack (CPU arena, disk, Redis as configured) in this process."""

    def __init__(self, manager: TierManager) -> None:
        self.manager = manager
        self.turns = SessionTurns(t.eviction for t in manager.tiers)

    def lookup(self, keys: Sequence[str]) -> int:
        return self.manager.lookup(keys).length

    def where(self, keys: Sequence[str]) -> list[str]:
        tiers = self.manager.tiers
        return [tiers[i].name for i in self.manager.lookup(keys).tiers]

    def present(self, keys: Sequence[str]) -> list[bool]:
        return self.manager.present(keys)

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        tiers = self.manager.tiers
        return [None if t is None else tiers[t].name for t in self.manager.locate(keys)]

    def prefetch(self, keys: Sequence[str]) -> int:
        return self.manager.prefetch(keys)

    def report_turns(self, turns: Sequence[SessionTurn]) -> None:
        self.turns.report(turns)

    def put_from(self, writes: Sequence[ChunkWrite]) -> dict[str, str]:
        return dict(self.manager.store(writes).failed)

    def derive(self, key: str, source: str, tokens: TokenRange, info: ChunkInfo | None = None
               ) -> bool:
        return derive_chunk(self.manager, key, source, tokens, info) in (Derived.STORED,
                                                                          Derived.PRESENT)

    def landing_codec(self) -> Codec:
        return self.manager.tiers[0].codec if self.manager.tiers else Codec.NONE

    def get_into(self, keys: Sequence[str]) -> contextlib.AbstractContextManager[list[LentChunk | None]]:
        return self.manager.lease_chunks(keys)

    def close(self) -> None:  # shared: closed when the process exits
        pass


REGION_READ_BYTES = 64 << 20
"""How much of one read a store takes through its thread's shared-memory region (the
region stays that large; the server's ``server.shm_bytes`` is shared by every client)."""
REGION_ALIGN = 4096
"""The most a read into a region leaves between two chunks (each starts at a page)."""


class RemoteChunkStore:
    """A running ``kvtier serve`` (sidecar or engine mode) through its chunk data plane.
    For a server on this host (``shm``) chunks are filled straight into the thread's
    shared-memory region and lent straight out of it, a read's chunks in one request (up
    to ``REGION_READ_BYTES`` of them: the rest, and every chunk without ``shm``, through
    reused staging buffers).

    Every request has a deadline (``deadlines``: lookups a short one, vLLM's scheduler
    waits on them; loads and saves a longer one), and a server that fails to answer is
    set aside for a back-off while a probe asks again (:mod:`.store_breaker`): lookups
    then raise :class:`~kvtier.connectors.store_breaker.StoreUnavailableError` at once
    (a miss), loads too (recomputed), saves come back refused as ``unavailable``."""

    def __init__(self, url: str, chunk_bytes: int, token: str | None = None,
                 deadlines: StoreDeadlines = StoreDeadlines(), shm: bool = False,
                 accept_codecs: frozenset[str] | None = None) -> None:
        from kvtier.client import Client

        self.url = url
        self.deadlines = deadlines
        self.client = Client(url, token=token, timeout=deadlines.transfer_s, shm=shm,
                             accept_codecs=accept_codecs)
        """Loads, saves, prefetches and turn reports."""
        self.asker = Client(url, token=token, timeout=deadlines.lookup_s,
                            accept_codecs=accept_codecs)
        """Lookups (vLLM's scheduler waits on them) and the breaker's probe."""
        self.breaker = Breaker(deadlines.retry_s, self.asker.health, f"kvtier serve at {url}")
        self.chunk_bytes = chunk_bytes
        """The largest chunk the connector writes: the room each read is given."""
        self.region_bytes = REGION_READ_BYTES
        """The most of one read that comes through the region."""
        self.staging = StagingPool(max_idle_bytes=256 << 20)

    @property
    def faults(self) -> StoreFaults:
        return self.breaker.faults

    def _guarded(self, call: Call, request: Callable[[], T]) -> T:
        """``request`` sent unless the store is set aside; a failure without an answer
        sets it aside (its connection was closed by the client)."""
        if not self.breaker.allow(call):
            raise StoreUnavailableError(f"{self.breaker.name} is set aside after a failure "
                                        f"(probed every {self.deadlines.retry_s:g} s)")
        try:
            out = request()
        except ServiceError:
            self.breaker.answered()  # an error status is an answer
            raise
        except Exception as exc:
            fault = fault_of(exc)
            if fault is not None:
                self.breaker.failed(fault)
            raise
        self.breaker.answered()
        return out

    def lookup(self, keys: Sequence[str]) -> int:
        return self._guarded(Call.LOOKUP, lambda: self.asker.lookup(keys).length) if keys else 0

    def where(self, keys: Sequence[str]) -> list[str]:
        return list(self._guarded(Call.LOOKUP, lambda: self.asker.lookup(keys).tiers)) if keys else []

    def present(self, keys: Sequence[str]) -> list[bool]:
        return self._guarded(Call.LOOKUP, lambda: self.asker.present(keys)) if keys else []

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        return self._guarded(Call.LOOKUP, lambda: self.asker.locate(keys)) if keys else []

    def prefetch(self, keys: Sequence[str]) -> int:
        return self._guarded(Call.HINT, lambda: self.client.prefetch(keys)) if keys else 0

    def report_turns(self, turns: Sequence[SessionTurn]) -> None:
        self._guarded(Call.HINT, lambda: self.client.report_turns(turns))

    def tier_capacities(self) -> list[dict[str, Any]]:
        """The server's tiers as ``/v1/stats`` names them (name, capacity_bytes, ...)."""
        return list(self._guarded(Call.HINT, self.client.stats)["tiers"])

    def landing_codec(self) -> Codec:
        return Codec.NONE  # the service encodes what it stores compressed

    def put_from(self, writes: Sequence[ChunkWrite]) -> dict[str, str]:
        """Keys not stored, with why: the server's reasons (``too_large`` for a body over
        its limit), or ``unavailable`` where it did not answer or is set aside. A
        ``conflict`` is not among them: another writer stored that key first (one version
        per key), so its KV is there to load."""
        failed: dict[str, str] = {}
        for write in writes:
            try:
                self._guarded(Call.SAVE, lambda w=write: self._put(w))
            except ServiceError as exc:
                if exc.status == 413:
                    failed[write.key] = f"too_large: {exc.message}"
                elif exc.status != 409:
                    failed[write.key] = f"{exc.status}: {exc.message}"
            except Exception as exc:
                if fault_of(exc) is None and not isinstance(exc, StoreUnavailableError):
                    raise
                failed[write.key] = f"unavailable: {exc}"
        return failed

    def derive(self, key: str, source: str, tokens: TokenRange, info: ChunkInfo | None = None
               ) -> bool:
        return self._guarded(Call.SAVE, lambda: self.client.derive_chunk(
            key, source, tokens.first, tokens.count, _owner(info))) is not None

    def _put(self, write: ChunkWrite) -> None:
        def fill(room: memoryview) -> int:
            return write.write_into(torch.frombuffer(room, dtype=torch.uint8))

        owner = _owner(write.info)  # the session and place reach the service's tiers
        if self.client.shm and self.client.put_chunk_filled(write.key, fill, write.nbytes,
                                                            owner=owner) is not None:
            return
        with self.staging.borrowed(write.nbytes) as buf:
            n = write.write_into(buf)
            self.client.put_chunk(write.key, memoryview(buf[:n].numpy()), owner=owner)

    @contextlib.contextmanager
    def get_into(self, keys: Sequence[str]) -> Iterator[list[LentChunk | None]]:
        """Each chunk lent from the thread's shared-memory region or read into a staging
        buffer, up to the first one missing; its header checked here (the service named it
        for this caller's namespace already), its layers by the reader."""
        held: list[torch.Tensor] = []
        out: list[LentChunk | None] = [None] * len(keys)
        try:
            self._guarded(Call.LOAD, lambda: self._read_all(keys, out, held))
            yield out
        finally:
            for buf in held:
                self.staging.release(buf)

    def _read_all(self, keys: Sequence[str], out: list[LentChunk | None],
                  held: list[torch.Tensor]) -> None:
        for i in range(self._lend_from_region(keys, out), len(keys)):
            chunk = self._read(keys[i], held)
            if chunk is None:
                break
            out[i] = chunk

    def _lend_from_region(self, keys: Sequence[str], out: list[LentChunk | None]) -> int:
        """Lend the leading chunks out of the region, read in one request (filling
        ``out``); the index reads go on from: 0 without a region, ``len(keys)`` once one is
        missing (a prefix ends there)."""
        if not self.client.shm or not keys:
            return 0
        room = max(self.chunk_bytes, min(len(keys) * (self.chunk_bytes + REGION_ALIGN),
                                         self.region_bytes))
        try:
            read = self.client.get_chunks_in_region(keys, room)
        except InvalidArgumentError:  # larger than any chunk of ours: not one of ours
            return len(keys)
        if read is None:
            return 0
        for i, view in enumerate(read.views):
            chunk = self._lent(keys[i], torch.frombuffer(view, dtype=torch.uint8))
            if chunk is None:
                return len(keys)  # a gap: nothing after it is used
            out[i] = chunk
        return len(keys) if read.ended else len(read.views)

    def _read(self, key: str, held: list[torch.Tensor]) -> LentChunk | None:
        """A chunk read into a staging buffer through the reply's body: the region may
        hold chunks lent by this read already (a region read would write over them)."""
        buf = self.staging.acquire(self.chunk_bytes)
        held.append(buf)
        try:
            got = self.client.get_chunk_into(key, memoryview(buf.numpy())[: self.chunk_bytes],
                                             through_region=False)
        except InvalidArgumentError:  # larger than any chunk of ours: not one of ours
            return None
        if got is None:
            return None
        return self._lent(key, buf[: len(got)])

    @staticmethod
    def _lent(key: str, view: torch.Tensor) -> LentChunk | None:
        try:
            header, _ = chunk_view(view, key, verify=False, as_kv=False, any_namespace=True)
        except ChunkError:
            return None
        return LentChunk(view, header)

    def close(self) -> None:
        self.client.close()
        self.asker.close()
        self.staging.close()


_LOCAL: dict[str, LocalChunkStore] = {}
_LOCAL_LOCK = threading.Lock()


def _owner(info: ChunkInfo | None) -> ChunkOwner | None:
    """The session and place of a chunk, as the service takes them."""
    from kvtier.client import ChunkOwner

    return None if info is None or info.session is None else ChunkOwner(str(info.session), info.index)


def accept_codecs(options: Mapping[str, Any]) -> frozenset[str] | None:
    """The ``accept_codecs`` option: the codecs of stored KV a connector loads (``[none]``:
    exact KV only); None where unset (what the store's readers take by default: exact KV
    and what its own tiers write)."""
    names = options.get("accept_codecs")
    if names is None:
        return None
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    if not isinstance(names, (list, tuple)) or not names:
        raise ConfigError(f"accept_codecs: a list of codecs (none, fp8, int8, int4), not {names!r}")
    try:
        return frozenset(Codec.parse(str(n).strip()).value for n in names)
    except InvalidArgumentError as exc:
        raise ConfigError(f"accept_codecs: {exc}") from None


def _tiers_config(options: Mapping[str, Any], codecs: frozenset[str] | None) -> KVTierConfig:
    """The configuration a connector's in-process tiers are built from: ``config`` (a YAML
    path), then ``tiers`` (and the connector's defaults where neither sets a field)."""
    from kvtier.config import load_config
    from kvtier.connectors.tiers.connector_defaults import unset_defaults

    overrides = {"tiers": dict(options.get("tiers") or {})}
    if codecs is not None:
        overrides["tiers"]["accept_codecs"] = sorted(codecs)
    cfg = load_config(options.get("config"), overrides=overrides)
    for name, value in unset_defaults(cfg.tiers.model_fields_set).items():
        setattr(cfg.tiers, name, value)
    return cfg


def with_auto_codecs(options: Mapping[str, Any], ctx: CodecContext | None) -> dict[str, Any]:
    """``options`` with each of its tiers' ``auto`` codecs resolved for the chunks ``ctx``
    describes, within the configuration's quality budget (``policy.max_kv_error``): the
    connector knows its model's chunks, its tiers (in-process, or a private sidecar that
    sees no model) do not. Unchanged for a ``url`` (that server's tiers are its own) or
    without a context (``auto`` is then none)."""
    if ctx is None or options.get("url"):
        return dict(options)
    cfg = _tiers_config(options, None)
    chosen = resolved_auto_fields(cfg.tiers, replace(ctx, max_error=cfg.policy.max_kv_error))
    if not chosen:
        return dict(options)
    return {**options, "tiers": {**dict(options.get("tiers") or {}), **chosen}}


def open_store(options: Mapping[str, Any], slot_bytes: int) -> ChunkStore:
    """A store from a connector's options.

    ``url`` (and ``token``, ``shm``, the deadlines of
    :class:`~kvtier.connectors.store_breaker.StoreDeadlines`): a running ``kvtier serve``. Otherwise in-process tiers
    from ``config`` (a YAML path) and/or ``tiers`` (a mapping of :class:`TiersConfig`
    fields); ``slot_bytes`` sizes the CPU arena's slots to the engine's chunks; a tier's
    ``auto`` codec is none here (resolve it first: :func:`with_auto_codecs`).
    ``accept_codecs``: what the reads take (:func:`accept_codecs`).
    """
    codecs = accept_codecs(options)
    if options.get("url"):
        return RemoteChunkStore(str(options["url"]), slot_bytes, options.get("token"),
                                StoreDeadlines.of(options), shm=bool(options.get("shm", False)),
                                accept_codecs=codecs)
    from kvtier.connectors.tiers.factory import build_tiers

    cache_key = json.dumps([options.get("config"), dict(options.get("tiers") or {}),
                            sorted(codecs) if codecs is not None else None, slot_bytes],
                           sort_keys=True)
    with _LOCAL_LOCK:
        store = _LOCAL.get(cache_key)
        if store is None:
            cfg = _tiers_config(options, codecs)
            manager = build_tiers(cfg.tiers, slot_bytes, fingerprint=None)
            if manager is None:
                raise ConfigError("the connector's tiers are all disabled; enable one or set url")
            store = _LOCAL[cache_key] = LocalChunkStore(manager)
        return store
