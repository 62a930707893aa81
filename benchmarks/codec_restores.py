"""Restores of compressed chunks against uncompressed ones, same tier, same run (issue 33).

For each tier (a disk directory with write + fsync, read cold; a real ``redis-server``) and
each codec, the same chunks of KV (``chunk_tokens`` tokens of the model's shape, random
values, the serving dtype) are stored through the tier stack, which encodes them for a
tier of that codec, then restored as the engine's host restore does: leased, each layer
checked and then copied, or decoded where lossy, straight into memory that already exists
(the pool's place) in one native pass, on the restore workers. With ``device`` a GPU, as the
engine's restore to a GPU pool does: a window of chunks copied as stored to the device,
checked and decoded there, then scattered (both through ``transfer.block_path``).
``kv_GBps`` is KV delivered per second (decoded bytes);
``none_kv_GBps`` the same for the uncompressed chunks in the same round. Rounds interleave
the codecs; the median round is reported. ``tokens_held_ratio``: how many more tokens a
tier of fixed bytes holds (stored bytes of ``none`` over the codec's, headers included).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.chunk_format import encode_chunk
from kvtier.connectors.tiers.base import ChunkWrite, Tier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.kv_codecs import Codec
from kvtier.transfer.block_path import BlockSpan, CacheBlocks, scatter

FP = b"bench-codec-restores"


@dataclass(frozen=True)
class RestoreSetup:
    shape: tuple[int, int, int, int, int]
    """One chunk's KV: [layers, 2, tokens, heads, head_dim]."""
    dtype: torch.dtype
    chunks: int
    rounds: int
    device: str = "cpu"
    """Where the restored KV goes: a host pool (``cpu``) or a GPU pool (``cuda``)."""


def restore_rows(setup: RestoreSetup, codecs: list[Codec], redis_url: str | None,
                 workdir: Path) -> list[dict[str, Any]]:
    """One row per tier and lossy codec (see the module)."""
    from kvtier.benchmarks.tiers import _fadvise_dontneed
    from kvtier.connectors.tiers.disk_tier import DiskTier
    from kvtier.connectors.tiers.redis_tier import RedisTier

    kvs = [torch.randn(setup.shape, generator=torch.Generator().manual_seed(i)).to(setup.dtype)
           for i in range(setup.chunks)]
    keys = [f"{i:040x}" for i in range(setup.chunks)]
    blobs = [encode_chunk(k, FP, kv) for k, kv in zip(keys, kvs, strict=True)]
    kv_bytes = sum(kv.numel() * kv.element_size() for kv in kvs)
    media: dict[str, Callable[[Path], Tier]] = {
        "disk": lambda d: DiskTier(d, fsync=True)}
    if redis_url:
        media["redis"] = lambda d: RedisTier(redis_url)
    rows = []
    for medium, make in media.items():
        seconds: dict[Codec, list[float]] = {c: [] for c in [Codec.NONE, *codecs]}
        stored: dict[Codec, int] = {}
        for r in range(setup.rounds):
            for codec in seconds:
                where = workdir / f"{medium}-{codec.value}-{r}"
                tier = make(where)
                tier.codec = codec
                manager = TierManager([tier], fingerprint=FP)
                try:
                    manager.delete(keys)
                    report = manager.store([ChunkWrite.of_blob(k, b) for k, b in
                                            zip(keys, blobs, strict=True)])
                    if not report.ok:
                        raise RuntimeError(f"{medium} {codec.value}: store failed: {report.failed}")
                    stored[codec] = tier.used_bytes
                    if medium == "disk":
                        _fadvise_dontneed(sorted(where.rglob("*.kvc")))
                    restore = _restore_to_device if setup.device != "cpu" else _restore
                    seconds[codec].append(restore(manager, keys, kvs, setup.device))
                finally:
                    manager.delete(keys)
                    manager.close()
                    shutil.rmtree(where, ignore_errors=True)
        none = kv_bytes / statistics.median(seconds[Codec.NONE]) / 1e9
        for codec in codecs:
            rows.append({
                "tier": medium, "codec": codec.value, "dtype": str(setup.dtype).split(".")[-1],
                "pool_device": setup.device,
                "chunk_shape": list(setup.shape), "chunks": setup.chunks,
                "kv_GBps": kv_bytes / statistics.median(seconds[codec]) / 1e9,
                "none_kv_GBps": none,
                "speedup": statistics.median(seconds[Codec.NONE]) / statistics.median(seconds[codec]),
                "stored_bytes": stored[codec], "none_stored_bytes": stored[Codec.NONE],
                "tokens_held_ratio": stored[Codec.NONE] / stored[codec],
                "rounds": setup.rounds,
            })
    return rows


def _restore(manager: TierManager, keys: list[str], kvs: list[torch.Tensor], device: str
             ) -> float:
    """Seconds to lease, check, decode and copy every chunk into existing memory, as the
    engine's restore does (the block path); the KV delivered is checked against what was
    stored (exact for ``none``, close otherwise)."""
    return _restore_to_device(manager, keys, kvs, device)


def _restore_to_device(manager: TierManager, keys: list[str], kvs: list[torch.Tensor],
                       device: str) -> float:
    """Seconds to lease every chunk and restore it into a pool on ``device`` through the
    block path, all copies done; the pool (faulted in before) holds one chunk per block."""
    layers, two, tokens, heads, dim = kvs[0].shape
    pool = torch.zeros((layers, len(kvs), two, tokens, heads, dim), dtype=kvs[0].dtype,
                       device=device)
    cache = CacheBlocks.of_pool(pool)
    spans = [BlockSpan.of([i]) for i in range(len(kvs))]
    if pool.is_cuda:
        torch.cuda.synchronize(pool.device)
    t0 = time.perf_counter()
    with manager.lease_chunks(keys) as lent:
        if any(p is None for p in lent):
            raise RuntimeError("a chunk was not found")
        done = scatter(lent, spans, cache)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - t0
    if done.reason is not None:
        raise RuntimeError(f"chunk {done.served} failed to restore: {done.reason}")
    _check_delivered([pool[:, i].cpu() for i in range(len(kvs))], kvs)
    return elapsed


def _check_delivered(got_kvs: list[torch.Tensor], kvs: list[torch.Tensor]) -> None:
    """The KV delivered is what was stored (exact for ``none``, close otherwise)."""
    for got, want in zip(got_kvs, kvs, strict=True):
        scale = want.float().abs().amax()
        if (got.float() - want.float()).abs().amax() > scale / 6:  # int4's bound, loosely
            raise RuntimeError("a restored chunk is not the KV that was stored")


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvtier-bench-codecs-", dir="."))
