"""``kvtier bench block-path`` on the CPU: both routes of the block path (host, and the
device route in Triton's interpreter) restore and save tiny chunks bit for bit and write
every field of the JSON; the checks that guard its figures catch a wrong byte."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from kvtier.benchmarks.block_path import BLOCK, check_pool, check_saved, windows
from kvtier.cli.main import main
from kvtier.transfer.block_path import BlockSpan, device_copies

LAYERS, HEADS, DIM, TOKENS, CHUNKS = 2, 2, 32, 32, 3
CHUNK_BYTES = 2 * LAYERS * TOKENS * HEADS * DIM * 2  # bfloat16


def bench(tmp_path, *extra: str) -> dict:
    out = tmp_path / "block-path.json"
    rc = main(["bench", "block-path", "--device", "cpu", "--shape", f"{LAYERS},{HEADS},{DIM}",
               "--chunk-tokens", str(TOKENS), "--chunks", str(CHUNKS), "--rounds", "2",
               "--out", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def assert_common_fields(doc: dict) -> None:
    assert doc["suite"] == "block-path" and doc["device"] == "cpu" and doc["exact"] is True
    assert doc["machine"]["cpu_count"] >= 1 and "torch" in doc["machine"]
    assert doc["shape"] == {"layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
                            "block_size": BLOCK, "chunk_tokens": TOKENS, "dtype": "bfloat16"}
    assert doc["chunk_bytes"] == CHUNK_BYTES and doc["chunks"] == CHUNKS
    assert doc["total_bytes"] == CHUNKS * CHUNK_BYTES
    rows = doc["rows"]
    assert [r["round"] for r in rows] == [0, 1]
    for r in rows:
        for name in ("h2d", "h2d_chunks", "restore", "d2h", "save"):
            assert r[f"{name}_s"] > 0
            assert r[f"{name}_GBps"] == pytest.approx(doc["total_bytes"] / r[f"{name}_s"] / 1e9)
        assert r["restore_vs_h2d"] == pytest.approx(r["h2d_s"] / r["restore_s"])
        assert r["save_vs_d2h"] == pytest.approx(r["d2h_s"] / r["save_s"])
    for name in ("restore_vs_h2d", "save_vs_d2h"):
        values = [r[name] for r in rows]
        assert doc[name] == pytest.approx(statistics.median(values))
        assert doc["ratios"][name] == pytest.approx(
            {"median": statistics.median(values), "min": min(values), "max": max(values)})


def test_the_host_route_restores_and_saves_and_has_no_device_phases(tmp_path):
    doc = bench(tmp_path)
    assert_common_fields(doc)
    assert doc["route"] == "host"
    for name in ("staging", "hash", "scatter"):
        assert doc[f"{name}_GBps"] is None and doc["GBps"][name] is None
        assert all(r[f"{name}_s"] is None for r in doc["rows"])


def test_the_device_route_in_the_interpreter_times_each_phase(tmp_path, monkeypatch):
    """Windows of two chunks: the restore and the hash launches cut three chunks in two."""
    monkeypatch.setattr(device_copies, "WINDOW_BYTES", 2 * CHUNK_BYTES)
    doc = bench(tmp_path, "--device-copies")
    assert_common_fields(doc)
    assert doc["route"] == "device" and doc["window_bytes"] == 2 * CHUNK_BYTES
    assert doc["windows"] == 2 and doc["scatter_bytes"] == 2 * CHUNK_BYTES
    assert all(r["scatter_GBps"] == pytest.approx(2 * CHUNK_BYTES / r["scatter_s"] / 1e9)
               for r in doc["rows"])
    for name in ("staging", "hash", "scatter"):
        assert doc[f"{name}_GBps"] > 0
        assert all(r[f"{name}_s"] > 0 for r in doc["rows"])
    assert doc["hash_GBps"] == pytest.approx(statistics.median(r["hash_GBps"] for r in doc["rows"]))


def test_device_copies_on_a_cpu_need_the_interpreter(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["bench", "block-path", "--device", "cpu", "--device-copies",
                 "--out", str(tmp_path / "x.json")]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("args", [["--chunk-tokens", "24"], ["--shape", "2,2"], ["--chunks", "0"],
                                  ["--gib", "-1"], ["--rounds", "0"]])
def test_bad_arguments_are_refused(args, capsys):
    assert main(["bench", "block-path", "--device", "cpu", *args]) == 2
    assert "kvtier: error" in capsys.readouterr().err


def test_windows_are_cut_as_the_restore_cuts_them():
    assert windows(5, 100, 250) == [(0, 2), (2, 4), (4, 5)]
    assert windows(2, 300, 250) == [(0, 1), (1, 2)]  # a chunk over the window: one alone
    assert windows(4, 64, 1 << 20) == [(0, 4)]


def pool_from(stored: torch.Tensor, spans: list[BlockSpan], blocks: int) -> torch.Tensor:
    """A pool holding each chunk of ``stored`` in its span's blocks, placed half-block by
    half-block (K then V of each block, layer by layer)."""
    pool = torch.zeros(LAYERS, blocks, 2, BLOCK, HEADS, DIM, dtype=torch.bfloat16)
    for i, span in enumerate(spans):
        kv = stored[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES].view(torch.bfloat16).view(
            LAYERS, 2, TOKENS, HEADS, DIM)
        for j, b in enumerate(span.blocks):
            for layer in range(LAYERS):
                for half in (0, 1):
                    pool[layer, b, half] = kv[layer, half, j * BLOCK : (j + 1) * BLOCK]
    return pool


def test_a_wrong_byte_in_the_pool_or_the_save_is_caught():
    per = TOKENS // BLOCK
    spans = [BlockSpan.of([3, 0]), BlockSpan.of([1, 5]), BlockSpan.of([2, 4])]
    stored = torch.randint(0, 256, (CHUNKS * CHUNK_BYTES,), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    shape = (LAYERS, 2, TOKENS, HEADS, DIM)
    pool = pool_from(stored, spans, CHUNKS * per)
    check_pool(pool, stored, spans, shape)
    flipped = pool.clone()
    flipped.view(torch.uint8)[1, 4, 1, 7, 1, 9] ^= 1  # one bit of chunk 2's V, layer 1
    with pytest.raises(RuntimeError, match="chunk 2"):
        check_pool(flipped, stored, spans, shape)
    swapped = [spans[0], BlockSpan.of([5, 1]), spans[2]]  # two blocks of chunk 1 crossed
    with pytest.raises(RuntimeError, match="chunk 1"):
        check_pool(pool, stored, swapped, shape)
    sums = [(1, 2), (3, 4), (5, 6)]
    check_saved(stored.clone(), stored, sums, sums)
    with pytest.raises(RuntimeError, match="chunk 1"):
        check_saved(stored.clone(), stored, [(1, 2), (3, 5), (5, 6)], sums)
    saved = stored.clone()
    saved[-1] ^= 1
    with pytest.raises(RuntimeError, match="saved bytes"):
        check_saved(saved, stored, sums, sums)
