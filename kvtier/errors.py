"""The one exception hierarchy of kvtier.

Every error a user can cause derives from :class:`KVTierError` and says what was wrong and
what to change. Errors that are also ordinary Python categories (a bad value, a missing key)
inherit from the builtin too, so callers that catch ``ValueError`` keep working.
"""

from __future__ import annotations


class KVTierError(Exception):
    """Root of every error kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value (file, environment variable or argument) is invalid."""


class InvalidArgumentError(KVTierError, ValueError):
    """An argument to a kvtier API is out of range or of the wrong kind."""


class PoolError(KVTierError):
    """Base for errors of the paged KV pool."""


class OutOfBlocksError(PoolError):
    """The pool has too few free blocks for the request; nothing was allocated."""

    def __init__(self, requested: int, available: int, what: str = "allocation") -> None:
        self.requested = requested
        self.available = available
        super().__init__(
            f"{what} needs {requested} free KV blocks but only {available} are available; "
            "free or offload sequences, or size the pool larger (pool.num_blocks / "
            "pool.memory_bytes)"
        )


class UnknownSequenceError(PoolError, LookupError):
    """A sequence id that the pool does not hold."""

    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(
            f"unknown sequence id {seq_id!r}: it was never added to the pool or was already freed"
        )

    def __str__(self) -> str:  # LookupError would otherwise repr() the message
        return str(self.args[0])


class SequenceExistsError(PoolError, ValueError):
    """A sequence id that is already in use was added again."""

    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(
            f"sequence id {seq_id!r} is already in the pool; free it first or pick a new id"
        )


class KernelInputError(InvalidArgumentError):
    """Tensors handed to a pool kernel disagree in shape, dtype or device, or point out of bounds."""


class TraceFormatError(InvalidArgumentError):
    """A workload trace line could not be parsed."""

    def __init__(self, path: str, line_no: int, reason: str) -> None:
        self.path = path
        self.line_no = line_no
        super().__init__(f"{path}:{line_no}: {reason}")


class ChunkError(KVTierError):
    """A stored KV chunk cannot be used; a restore treats it as a miss and recomputes."""


class ChunkFormatError(ChunkError, ValueError):
    """A chunk's bytes are malformed: bad magic or header, wrong length, checksum mismatch."""


class ChunkMismatchError(ChunkError):
    """A well-formed chunk that belongs to another key or model (fingerprint)."""


class TierError(KVTierError):
    """A storage tier failed (disk full, Redis down or slow ...)."""


class TierUnavailableError(TierError):
    """The tier cannot be reached now (server down, timeout); callers fall back to recompute."""


class DescriptorsExhaustedError(TierUnavailableError):
    """The process is out of file descriptors (EMFILE, ENFILE): nothing stored could be
    opened, which says nothing about whether it is stored. A reader that can recompute
    takes it as a miss; the service answers 503 ``descriptors_exhausted`` (retry), never
    "not found" or "full"."""
