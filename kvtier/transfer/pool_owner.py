"""What the data path needs of the engine's model runner (a protocol, so that
``transfer/`` sits below ``engine/`` and imports nothing of it)."""

from __future__ import annotations

from typing import Protocol

from kvtier.gpu_pool import PagedKVPool
from kvtier.transfer.layer_load import LayerLoad


class PoolOwner(Protocol):
    """The pool, the model fingerprint its chains are keyed with, and the layer-wise loads
    the forward waits on."""

    pool: PagedKVPool
    fingerprint: bytes
    layer_loads: list[LayerLoad]

    def add_layer_load(self, load: LayerLoad) -> None: ...

    def reap_layer_loads(self, wait: bool = False) -> None: ...
