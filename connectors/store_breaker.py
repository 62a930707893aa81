"""How an engine connector treats a ``kvtier serve`` that stopped answering: every request
has a deadline, and after a failure the store is skipped for a short back-off while a
probe in the background asks whether it answers again; the first answer closes the
breaker and the store is used again at once.

vLLM's scheduler waits on a lookup with its whole loop stopped, so a sidecar that hangs
(paused, swapping, a full accept queue) must cost it one deadline, not one per request:
while the breaker is open a lookup is a miss at once (the request recomputes), a load is a
load error (its blocks recomputed) and a save is refused as ``unavailable`` (counted), all
without a round trip. Timeouts, refusals and skips are counted (:class:`StoreFaults`) for
vLLM's ``/metrics``.
"""

from __future__ import annotations

import enum
import http.client
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.errors import ConfigError, KVTierError

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 0.5
"""How long a lookup (vLLM's scheduler waits on it) may wait for the store by default."""
TRANSFER_TIMEOUT_S = 5.0
"""How long a load's or a save's request may wait for the store by default (a load of
64 MiB read from the store's disk in one request must fit in it on a busy host)."""
RETRY_AFTER_S = 1.0
"""How long the store is skipped after a failure before a probe asks again, by default."""


class StoreUnavailableError(KVTierError, ConnectionError):
    """The store is skipped: it failed (timed out, refused or dropped a connection) less
    than the back-off ago, and no probe has found it answering since."""


class Call(enum.Enum):
    """What a request to the store was for (skips are counted by it)."""

    LOOKUP = "lookup"
    LOAD = "load"
    SAVE = "save"
    HINT = "hint"
    """Prefetches and turn reports: a lost one costs speed, never KV."""


class Fault(enum.Enum):
    """How a request to the store failed without an answer."""

    TIMEOUT = "timeout"
    FAILED = "failed"
    """Refused, reset, cut short: no answer."""


def fault_of(exc: BaseException) -> Fault | None:
    """The transport fault ``exc`` is (None: the store answered, e.g. an error status, or
    the failure is the caller's own)."""
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        return Fault.TIMEOUT
    if isinstance(exc, StoreUnavailableError):
        return None
    if isinstance(exc, (OSError, http.client.HTTPException, httpx.TransportError)):
        return Fault.FAILED
    return None


@dataclass(frozen=True)
class StoreDeadlines:
    """The connector's deadlines and back-off (``kv_connector_extra_config``), seconds."""

    lookup_s: float = LOOKUP_TIMEOUT_S
    transfer_s: float = TRANSFER_TIMEOUT_S
    retry_s: float = RETRY_AFTER_S

    OPTIONS = {"lookup_timeout_s": "lookup_s", "transfer_timeout_s": "transfer_s",
               "store_retry_s": "retry_s"}

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> StoreDeadlines:
        """From the options named in :attr:`OPTIONS`, each a number of seconds above 0 and
        at most 600 (unset: the defaults)."""
        given = {}
        for option, name in cls.OPTIONS.items():
            value = options.get(option)
            if value is None:
                continue
            try:
                seconds = float(value)
            except (TypeError, ValueError):
                raise ConfigError(f"kvtier connector: {option} must be a number of seconds, "
                                  f"not {value!r}") from None
            if not 0 < seconds <= 600:  # NaN too
                raise ConfigError(f"kvtier connector: {option} must be above 0 and at most "
                                  f"600 seconds, not {value!r}")
            given[name] = seconds
        return cls(**given)


@dataclass
class StoreFaults:
    """What the store cost the connector, counted for vLLM's ``/metrics``."""

    timeouts: int = 0
    """Requests that found no answer within their deadline (their connection closed)."""
    failures: int = 0
    """Requests that failed otherwise without an answer (refused, reset, cut short)."""
    breaker_opens: int = 0
    """Times the store was set aside after a failure."""
    skipped: dict[Call, int] = field(default_factory=lambda: dict.fromkeys(Call, 0))
    """Requests not sent because the store was set aside, by what they were for."""

    def counters(self) -> dict[str, int]:
        """As the connector's counters (``vllm:kvtier_<name>_total``)."""
        return {"store_timeouts": self.timeouts, "store_failures": self.failures,
                "store_breaker_opens": self.breaker_opens,
                "skipped_lookups": self.skipped[Call.LOOKUP],
                "skipped_loads": self.skipped[Call.LOAD],
                "skipped_saves": self.skipped[Call.SAVE]}


class BreakerState(enum.Enum):
    CLOSED = "closed"
    """Requests go to the store."""
    OPEN = "open"
    """Requests are skipped; once the back-off has passed, a probe starts."""
    PROBING = "probing"
    """Requests are skipped while a probe asks the store in the background."""


class Breaker:
    """Closed until a request fails without an answer; then open for ``retry_s``, after
    which the next request that finds it open starts ``probe`` on a thread of its own
    (never on the caller's: a probe of a store still hung waits its deadline there). A
    probe that returns, or any request that gets an answer, closes it; a probe that fails
    opens it for another ``retry_s``."""

    def __init__(self, retry_s: float, probe: Callable[[], object], name: str = "store",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self._probe = probe
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self.state = BreakerState.CLOSED
        self._opened_at = 0.0
        self.faults = StoreFaults()

    def allow(self, call: Call) -> bool:
        """Whether a request for ``call`` may go to the store now; a skipped one is counted."""
        with self._lock:
            if self.state is BreakerState.CLOSED:
                return True
            self.faults.skipped[call] += 1
            if self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self.retry_s:
                self.state = BreakerState.PROBING
                threading.Thread(target=self._run_probe, name="kvtier-store-probe",
                                 daemon=True).start()
            return False

    def answered(self) -> None:
        """A request got an answer (an error status too): the store is up."""
        with self._lock:
            if self.state is not BreakerState.CLOSED:
                log.warning("kvtier: %s answers again; using it", self.name)
            self.state = BreakerState.CLOSED

    def failed(self, fault: Fault) -> None:
        """A request failed without an answer: the store is set aside for ``retry_s``."""
        with self._lock:
            if fault is Fault.TIMEOUT:
                self.faults.timeouts += 1
            else:
                self.faults.failures += 1
            if self.state is BreakerState.CLOSED:
                self.faults.breaker_opens += 1
                log.warning("kvtier: %s did not answer (%s); skipping it for %.1f s, then "
                            "probing (transfer_timeout_s, lookup_timeout_s, store_retry_s)",
                            self.name, fault.value, self.retry_s)
            if self.state is not BreakerState.PROBING:
                self.state = BreakerState.OPEN
                self._opened_at = self._clock()

    def _run_probe(self) -> None:
        try:
            self._probe()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the store aside
            with self._lock:
                self.state = BreakerState.OPEN
                self._opened_at = self._clock()
            log.debug("kvtier: %s probe failed: %s", self.name, exc)
            return
        self.answered()
