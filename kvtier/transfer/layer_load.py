"""A restore in progress, layer by layer: what the model waits on while KV streams in.

A streamed restore publishes its blocks in the prefix cache at once, so the resumed request
is scheduled over them straight away, and fills them one layer at a time on a loader thread;
the forward pass waits for layer ``l`` just before layer ``l``'s attention, so layer ``l``
computes while layer ``l + 1`` is still being read. A chunk that fails to read part-way
(a tier gone, a corrupt layer) *poisons* its blocks and every later chunk's: the engine
thread takes them out of the prefix cache and recomputes whatever referenced them, before
any forward reads a layer that was not loaded. Nothing is ever computed over unloaded KV.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.errors import KVTierError


class LayerLoadError(KVTierError):
    """A streamed restore lost chunks after the model started using them; the step that
    hit it is abandoned and the requests over those chunks are recomputed."""


@dataclass
class LayerLoad:
    """Progress of one streamed restore (shared by the loader thread and the engine thread)."""

    num_layers: int
    chunk_blocks: list[list[int]]
    """New pool blocks each restored chunk fills, in chunk order."""
    release: Callable[[LayerLoad], None] | None = None
    """Engine-thread cleanup once the loader is done (frees the blocks' temporary owner)."""
    error: str | None = None
    bytes: int = 0
    """Bytes read so far (loader thread)."""
    _ready: list[threading.Event] = field(default_factory=list)
    _cuda_events: list[torch.cuda.Event | None] = field(default_factory=list)
    _poison_from: int | None = None
    _handled_from: int | None = None
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._ready = [threading.Event() for _ in range(self.num_layers)]
        self._cuda_events = [None] * self.num_layers

    # ---------------------------------------------------------------- loader side
    def layer_loaded(self, layer: int, event: torch.cuda.Event | None = None) -> None:
        self._cuda_events[layer] = event
        self._ready[layer].set()

    def poison(self, chunk_index: int, reason: str) -> None:
        """Chunks from ``chunk_index`` on will not be loaded (call before marking the layer
        that failed as loaded)."""
        with self._lock:
            if self._poison_from is None or chunk_index < self._poison_from:
                self._poison_from = chunk_index
                self.error = reason

    def active_chunks(self) -> int:
        """How many leading chunks the loader still fills."""
        with self._lock:
            return len(self.chunk_blocks) if self._poison_from is None else self._poison_from

    def finish(self) -> None:
        """The loader is done (successfully or not): every layer is released to waiters."""
        for layer in range(self.num_layers):
            self._ready[layer].set()
        self._done.set()

    # ---------------------------------------------------------------- engine side
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait_layer(self, layer: int) -> None:
        """Block until ``layer`` is loaded; raise if chunks were poisoned and not yet handled."""
        self._ready[layer].wait()
        if self.unhandled_poison():
            raise LayerLoadError(f"restore lost chunks while streaming: {self.error}")
        ev = self._cuda_events[layer]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)

    def wait(self) -> None:
        self._done.wait()

    def unhandled_poison(self) -> bool:
        with self._lock:
            p = self._poison_from
            return p is not None and (self._handled_from is None or p < self._handled_from)

    def take_poisoned_blocks(self) -> list[int]:
        """Blocks of the chunks poisoned since the last call (the engine thread uncaches them
        and recomputes the requests over them)."""
        with self._lock:
            p = self._poison_from
            if p is None or (self._handled_from is not None and p >= self._handled_from):
                return []
            upto = len(self.chunk_blocks) if self._handled_from is None else self._handled_from
            self._handled_from = p
        return [b for blocks in self.chunk_blocks[p:upto] for b in blocks]

    @property
    def loaded_chunks(self) -> int:
        """Chunks fully loaded (valid once ``done``)."""
        return self.active_chunks()
