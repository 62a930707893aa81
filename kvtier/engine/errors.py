"""The exceptions the engine raises, and how a failed turn becomes one.

They sit in their own module so that the engine loop (:mod:`kvtier.engine.engine`) and its
offload/restore side (:mod:`kvtier.engine.offload`) both raise them without importing each
other; :mod:`kvtier.engine.engine` re-exports them, the place callers import them from.
"""

from __future__ import annotations

from kvtier.engine.session import TurnResult
from kvtier.errors import InvalidArgumentError, KVTierError


class RequestError(KVTierError):
    """One request failed (for example, its prompt is over max_model_len); others go on."""


class EngineStepError(RequestError):
    """The engine failed while running the request (a bug or a device error, not the
    request's fault); the engine itself goes on serving."""


def turn_error(session_id: str, result: TurnResult) -> RequestError:
    """The exception a failed turn raises: the engine's fault or the request's."""
    cls = EngineStepError if result.internal_error else RequestError
    return cls(f"session {session_id!r}: {result.error}")


class UnknownSessionError(InvalidArgumentError, LookupError):
    """A session id the engine does not hold."""


class SessionBusyError(InvalidArgumentError):
    """The session already has a turn in flight (one turn per session at a time)."""
