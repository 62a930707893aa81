"""The fragmentation analyzer: allocation strategies, replay invariants, the known shape of
the results, and the command line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvtier.benchmarks.fragmentation.analysis import analyse
from kvtier.benchmarks.fragmentation.cli import register
from kvtier.benchmarks.fragmentation.simulator import replay
from kvtier.benchmarks.fragmentation.strategies import (
    STRATEGY_NAMES,
    ContiguousExact,
    Extents,
    make_strategy,
)
from kvtier.benchmarks.fragmentation.workloads import (
    Request,
    Workload,
    builtin_workload,
    load_mooncake_trace,
)
from kvtier.errors import InvalidArgumentError, TraceFormatError

SCALE = 0.25
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_excerpt.jsonl"


@pytest.fixture(scope="module")
def mixed():
    w = builtin_workload("mixed-dynamic", SCALE)
    return {a.workload.name: a for a in analyse([w], STRATEGY_NAMES)}["mixed-dynamic"]


def test_paged16_beats_96_percent_and_maxlen_stays_under_40_on_mixed(mixed):
    assert mixed.result("paged-16").utilisation >= 0.96
    assert mixed.result("contiguous-maxlen").utilisation <= 0.40
    assert mixed.contiguous_fine is False
    assert "paging is essential" in mixed.verdict


def test_smaller_blocks_never_waste_more_on_mixed(mixed):
    utils = [mixed.result(f"paged-{b}").utilisation for b in (1, 8, 16, 32, 64, 128)]
    assert utils == sorted(utils, reverse=True)
    assert mixed.result("paged-1").utilisation == pytest.approx(1.0)


def test_exact_size_contiguous_pays_in_copies_and_external_fragmentation(mixed):
    exact = mixed.result("contiguous-exact-firstfit")
    assert exact.utilisation == pytest.approx(1.0)  # reserves exactly what it holds ...
    assert exact.copies > 0 and exact.tokens_copied > 0  # ... by moving sequences
    assert exact.external_fragmentation > 0.05
    assert mixed.result("paged-16").external_fragmentation == 0.0


def test_every_request_is_accounted_for(mixed):
    n = len(mixed.workload.requests)
    wanted = sum(q.output_len for q in mixed.workload.requests)
    for r in mixed.results:
        assert r.completed + r.rejected == n, r.strategy
        if r.rejected == 0:  # preempted sequences keep their tokens: nothing generated twice
            assert r.tokens_generated == wanted, r.strategy


@pytest.mark.parametrize(
    "name,fine",
    [("uniform-long", True), ("short-turnover", False), ("rare-long", False)],
)
def test_verdict_matches_the_pattern(name, fine):
    w = builtin_workload(name, SCALE)
    (a,) = analyse([w], ["contiguous-maxlen", "contiguous-exact-firstfit", "paged-16"])
    assert a.contiguous_fine is fine, a.verdict
    assert w.contiguous_expected_fine is fine


def test_rare_long_max_len_reservation_collapses_concurrency():
    w = builtin_workload("rare-long", SCALE)
    (a,) = analyse([w], ["contiguous-maxlen", "paged-16"])
    assert a.result("contiguous-maxlen").peak_concurrency <= 2  # 16K each in 32K
    assert a.result("paged-16").peak_concurrency > 20


def test_extents_coalesce_and_fit():
    ext = Extents(100, "first")
    a, b, c = ext.alloc(10), ext.alloc(20), ext.alloc(30)
    assert (a, b, c) == (0, 10, 30)
    ext.free(b, 20)
    assert ext.largest() == 40  # the tail [60, 100)
    ext.free(a, 10)
    assert ext.alloc(30) == 0  # [0, 30) coalesced from the two freed extents
    ext.free(0, 30)
    ext.free(c, 30)
    assert ext.largest() == 100 and ext.alloc(100) == 0


def test_best_fit_picks_the_tightest_hole():
    ext = Extents(100, "best")
    blocks = [ext.alloc(10) for _ in range(10)]
    ext.free(blocks[1], 10)  # hole of 10 at 10
    ext.free(blocks[4], 10)
    ext.free(blocks[5], 10)  # hole of 20 at 40
    assert ext.alloc(10) == 10
    first = Extents(100, "first")
    for s in range(0, 100, 10):
        assert first.alloc(10) == s


def test_exact_growth_moves_when_blocked_and_counts_copies():
    s = ContiguousExact(20, "first")
    assert s.admit(0, 5, 10) and s.admit(1, 5, 10)  # [0,5) [5,10)
    assert s.grow(0, 6)  # blocked by seq 1: moves to [10, 16)
    assert (s.copies, s.tokens_copied) == (1, 5)
    assert s.grow(0, 7)  # now extends in place
    assert s.copies == 1 and s.reserved == 12


def test_random_replays_keep_memory_consistent():
    rng = random.Random(7)
    reqs = [
        Request(rng.randint(0, 50), rng.randint(1, 60), rng.randint(1, 30), 128) for _ in range(60)
    ]
    reqs.sort(key=lambda r: r.arrival_step)
    w = Workload("random", "random", reqs, memory_tokens=256)
    for name in STRATEGY_NAMES:
        strategy = make_strategy(name, w.memory_tokens)
        r = replay(w, strategy)
        assert r.completed + r.rejected == len(reqs)
        assert strategy.reserved == 0, f"{name} leaked memory"
        assert 0.0 <= r.external_fragmentation <= 1.0
        assert r.memory_held_fraction <= r.memory_reserved_fraction + 1e-9


def test_requests_that_can_never_fit_are_rejected():
    w = Workload("big", "big", [Request(0, 500, 10, 600), Request(0, 10, 10, 600)], 256)
    r = replay(w, make_strategy("paged-16", 256))
    assert (r.rejected, r.rejected_never_fit, r.completed) == (1, 1, 1)


def test_unknown_strategy_and_workload_are_rejected_clearly():
    with pytest.raises(InvalidArgumentError, match="power of two"):
        make_strategy("paged-3", 1024)
    with pytest.raises(InvalidArgumentError, match="unknown strategy 'buddy'"):
        make_strategy("buddy", 1024)
    with pytest.raises(InvalidArgumentError, match="unknown workload 'nope'"):
        builtin_workload("nope")


def test_mooncake_trace_loads_and_replays(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 40, "input_length": 300, "output_length": 2, "hash_ids": [2]},
    ]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = load_mooncake_trace(p, ms_per_step=20)
    assert [(r.arrival_step, r.prompt_len, r.output_len) for r in w.requests] == [
        (0, 1000, 5),
        (2, 300, 2),
    ]
    assert w.requests[0].max_len == 1024 and w.memory_tokens == 1024
    (a,) = analyse([w], ["contiguous-maxlen", "paged-16"])
    assert a.result("paged-16").completed == 2


@pytest.mark.parametrize(
    "line,match",
    [
        ("{not json", r"t.jsonl:2: not valid JSON"),
        ('{"timestamp": 0, "output_length": 3}', r"t.jsonl:2: missing field 'input_length'"),
        ('{"timestamp": 0, "input_length": -4, "output_length": 3}', r"input_length must be"),
        ('{"timestamp": "x", "input_length": 4, "output_length": 3}', r"timestamp must be"),
        ("[1, 2]", r"must be a JSON object"),
    ],
)
def test_malformed_trace_lines_name_the_line(tmp_path, line, match):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=match):
        load_mooncake_trace(p)


def test_cli_writes_json_and_plot(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out, png = tmp_path / "frag.json", tmp_path / "frag.png"
    args = parser.parse_args(
        [
            "fragmentation",
            "--workloads",
            "mixed-dynamic,uniform-long",
            "--scale",
            "0.05",
            "--trace",
            str(TRACE),
            "--trace-limit",
            "200",
            "--strategies",
            "contiguous-maxlen,contiguous-exact-bestfit,paged-16,paged-128",
            "--out",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert args.func(args) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "fragmentation" and doc["machine"]["cpu_count"] >= 1
    names = [w["workload"] for w in doc["workloads"]]
    assert names == ["mixed-dynamic", "uniform-long", "trace:mooncake_excerpt.jsonl"]
    for w in doc["workloads"]:
        assert [r["strategy"] for r in w["results"]] == [
            "contiguous-maxlen",
            "contiguous-exact-bestfit",
            "paged-16",
            "paged-128",
        ]
        assert w["verdict"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
