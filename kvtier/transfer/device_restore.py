"""The restore route to a GPU: copy each chunk while the host checks it.

A restore into a pool on the host checks each group of a chunk's layers right before it
scatters it (the bytes read from memory once). To a GPU the copy is a DMA the host does not
touch, so checking first and copying after would run the two one after the other: 0.12-0.17x
of a pinned copy's speed on an H200 (benchmarks/results/ttft-nvidia-h200.json). Here each
chunk goes to the device in one copy as soon as its bytes lie in host memory and is
scattered into its blocks (in order, on the side stream), while the restore workers check
the same bytes; a chunk that fails its check or its read is reported, and the caller
poisons it with every later chunk, whose blocks are uncached before anyone reads them.

A compressed chunk (issue 33) crosses as it is stored, 2-3.8x fewer bytes than its KV, and
is decoded on the device in the scatter (:func:`~kvtier.gpu_pool.kernels.api.scatter_decoded`);
bytes only a foreign writer puts there are reported by the kernel once the copies are done,
and the chunk fails as one whose checksum did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from kvtier.connectors.tiers.chunk_workers import start_restore
from kvtier.connectors.tiers.lent_chunk import LentChunk
from kvtier.errors import ChunkFormatError
from kvtier.gpu_pool.kernels import scatter_blocks
from kvtier.gpu_pool.kernels.api import DECODE_ERRORS, scatter_decoded


def copy_then_check(
    kv: torch.Tensor,
    side_stream: Callable[[], torch.cuda.Stream],
    parts: Sequence[LentChunk],
    spans: Sequence[tuple[int, list[int]]],
    first: int,
) -> list[tuple[int, str]]:
    """Layers ``first``.. of each chunk of ``parts`` into ``kv`` at its span (the offset of
    its first new token, the blocks from there); the chunks that failed, as (index,
    reason). Every copy has finished when this returns (the lent memory may go). Runs on
    any device; on CUDA on ``side_stream()``, after what the current stream queued."""
    n = kv.shape[0]

    def check(item: tuple[int, LentChunk]) -> tuple[int, str] | None:
        i, part = item
        try:
            part.check(first, n)
        except ChunkFormatError as exc:
            return i, str(exc)
        return None

    failed: list[tuple[int, str]] = []
    statuses: torch.Tensor | None = None  # per chunk, what a device decode found
    checks = start_restore(check, list(enumerate(parts)))
    side = side_stream() if kv.is_cuda else None
    if side is not None:  # blocks just freed may still be read by queued kernels
        side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i, (part, (off, ids)) in enumerate(zip(parts, spans, strict=False)):
                if not ids:
                    continue
                try:
                    part.wait_read(n)
                except ChunkFormatError as exc:
                    failed.append((i, str(exc)))
                    break
                if part.header.lossy:  # the stored bytes cross; the device decodes them
                    step = part.header.layer_nbytes
                    src = part.payload[first * step : n * step].to(kv.device, non_blocking=True)
                    if statuses is None:
                        statuses = torch.zeros(len(parts), dtype=torch.int32, device=kv.device)
                    scatter_decoded(src, part.header.codec, kv[first:n], ids,
                                    tokens=part.header.num_tokens, offset=off,
                                    status=statuses[i : i + 1])
                else:
                    src = part.kv[first:n].to(kv.device, non_blocking=True)
                    scatter_blocks(src[:, :, off:].contiguous(), kv[first:n], ids)
    finally:
        failed += [f for f in checks.result() if f is not None]
        if side is not None:
            done = torch.cuda.Event()
            done.record(side)
            done.synchronize()  # the copies are done before the lent memory is let go
    if statuses is not None:
        failed += _decode_failures(parts, statuses)
    return failed


def _decode_failures(parts: Sequence[LentChunk], statuses: torch.Tensor) -> list[tuple[int, str]]:
    """The chunks whose device decode found bytes no encoder writes (recorded on each, so
    its tier drops it as it does a chunk failing its checksum)."""
    failed = []
    for i, code in enumerate(statuses.tolist()):
        if code:
            try:
                parts[i].refuse(f"{parts[i].header.codec} "
                                f"{DECODE_ERRORS.get(code, 'payload does not decode')}")
            except ChunkFormatError as exc:
                failed.append((i, str(exc)))
    return failed
