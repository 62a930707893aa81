"""The KV tensors of the paged pool.

One tensor ``[layers, num_blocks, 2 (K, V), block_size, kv_heads, head_dim]``: each layer is
a view ``[num_blocks, 2, block_size, kv_heads, head_dim]``, and because all layers share one
allocation with a uniform stride, a kernel can gather a block across every layer in a single
launch. Works on any device torch supports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.chunk_format import DTYPES
from kvtier.errors import ConfigError, InvalidArgumentError
from kvtier.gpu_pool.block_pool import is_power_of_two


class PoolSpec(Protocol):
    """The pool's size and layout as ``kvtier.config.PoolConfig`` gives it (a protocol, so
    the pool stays free of the config layer and its pydantic/YAML imports)."""

    block_size: int
    num_blocks: int | None
    memory_bytes: int | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    enable_prefix_caching: bool



def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"unknown device {name!r}: use cpu, cuda, cuda:N or auto") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available; use cpu or auto")
    return device


def resolve_dtype(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A KV/model dtype by name; ``auto`` is bfloat16 on CUDA and float32 elsewhere (CPU
    kernels for half types are slow and less exact)."""
    if name == "auto":
        on_cuda = (device or resolve_device("auto")).type == "cuda"
        return torch.bfloat16 if on_cuda else torch.float32
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ConfigError(f"unsupported KV dtype {name}; use one of {sorted(DTYPES)}")
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported KV dtype {name!r}; use one of {sorted(DTYPES)}") from None


class KVStorage:
    """Holds the pool's KV tensor and moves whole blocks inside it."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str | torch.dtype = "float16",
        device: str | torch.device = "cpu",
    ):
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(block_size, int) or not is_power_of_two(block_size):
            raise InvalidArgumentError(
                f"block_size must be a power of two (1, 2, 4 ... 128), got {block_size!r}"
            )
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv = torch.zeros(
            (num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str | torch.dtype
    ) -> int:
        """Bytes one block takes across all layers (K and V)."""
        elem = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem

    @classmethod
    def from_config(cls, cfg: PoolSpec) -> KVStorage:
        """Size the pool from ``num_blocks`` or from the ``memory_bytes`` budget."""
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        per_block = cls.bytes_per_block(
            cfg.num_layers, cfg.block_size, cfg.num_kv_heads, cfg.head_dim, dtype
        )
        if cfg.num_blocks is not None:
            num_blocks = cfg.num_blocks
        elif cfg.memory_bytes is not None:
            num_blocks = cfg.memory_bytes // per_block
            if num_blocks < 1:
                raise ConfigError(
                    f"pool.memory_bytes={cfg.memory_bytes} is smaller than one block "
                    f"({per_block} bytes for {cfg.num_layers} layers x {cfg.block_size} tokens "
                    f"x {cfg.num_kv_heads} KV heads x {cfg.head_dim} head_dim in {dtype}); "
                    f"raise it to at least {per_block}"
                )
        else:
            raise ConfigError("size the pool: set pool.num_blocks or pool.memory_bytes")
        return cls(
            cfg.num_layers,
            num_blocks,
            cfg.block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token across all layers: 2 x layers x kv_heads x head_dim x elem."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv.element_size()

    def layer(self, layer: int) -> torch.Tensor:
        """View ``[num_blocks, 2, block_size, kv_heads, head_dim]`` of one layer."""
        return self.kv[layer]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write), one indexed copy."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        self.kv[:, dst] = self.kv[:, src]
