"""The scheduler's turn reports: sent off vLLM's path in batches, in the order they
happened, each with how long before its batch it happened; a store that cannot be reached
costs nothing but the report; one that takes no reports (engine mode, tested with the
engine) is told nothing more."""

from __future__ import annotations

import threading

from kvtier.chunk_wire import ServiceError
from kvtier.client import SessionTurn, TurnEvent
from kvtier.connectors.chunk_store import RemoteChunkStore
from kvtier.connectors.store_breaker import StoreDeadlines
from kvtier.connectors.vllm_turns import MAX_PENDING, TurnReporter


def test_events_go_in_order_in_batches_with_their_age():
    gate, sending, batches = threading.Event(), threading.Event(), []

    def send(turns):
        sending.set()
        gate.wait(10)
        batches.append(list(turns))

    clock = [100.0]
    reporter = TurnReporter(send, clock=lambda: clock[0])
    reporter.started("a")  # its batch waits at the gate while the next events queue up
    assert sending.wait(10)  # taken by the reporter's thread (once it has started)
    clock[0] += 2.0
    reporter.ended("a")
    reporter.started("b")
    clock[0] += 1.0
    gate.set()
    reporter.drain()
    flat = [t for b in batches for t in b]
    assert [(t.session, t.event) for t in flat] == [
        ("a", TurnEvent.STARTED), ("a", TurnEvent.ENDED), ("b", TurnEvent.STARTED)]
    assert len(batches) == 2 and batches[1][0].ago_s == 1.0 and reporter.sent == 3
    reporter.close()


def test_an_unreachable_store_costs_only_the_report():
    store = RemoteChunkStore("http://127.0.0.1:9", 1 << 16, deadlines=StoreDeadlines(transfer_s=2.0))
    reporter = TurnReporter(store.report_turns)
    reporter.started("s")
    reporter.drain()
    assert reporter.sent == 0 and reporter.enabled  # tried again with the next events
    store.close()
    reporter.close()


def test_a_store_that_takes_no_reports_is_told_nothing_more():
    calls = []

    def send(turns: list[SessionTurn]) -> None:
        calls.append(turns)
        raise ServiceError(409, "conflict", "this server runs an engine")

    reporter = TurnReporter(send)
    reporter.started("s")
    reporter.drain()
    reporter.ended("s")
    reporter.drain()
    assert len(calls) == 1 and not reporter.enabled


def test_events_a_silent_store_leaves_pending_are_bounded():
    entered, gate = threading.Event(), threading.Event()

    def send(turns):
        entered.set()
        gate.wait(10)

    reporter = TurnReporter(send)
    reporter.started("first")
    assert entered.wait(10)  # its report hangs: what follows waits
    for i in range(MAX_PENDING + 10):
        reporter.started(f"s{i}")
    assert reporter.dropped == 10
    gate.set()
    reporter.close()
