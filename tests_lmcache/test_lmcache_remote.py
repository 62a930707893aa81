"""kvtier as LMCache's remote backend: a real LMCache 0.5 engine (on CPU, its local CPU
cache off so every chunk goes remote) stores KV through a running ``kvtier serve`` and a
second engine retrieves it bit-exact; a stopped server is a miss, never an error or wrong
KV. LMCache ships no connector that copies from plain CPU tensors, so the test has one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import RemoteMetadata, init_remote_metadata_info

from kvtier.chunk_format import parse_header
from kvtier.connectors.lmcache_remote import backend_identity, decode, encode, kvtier_key
from kvtier.connectors.tiers.blobs import get_blobs, put_blobs
from kvtier.connectors.tiers.disk_tier import DiskTier
from kvtier.connectors.tiers.manager import TierManager
from kvtier.errors import ChunkError
from kvtier.kv_codecs import Codec
from kvtier.kv_codecs import decode as decode_kv
from kvtier.kv_codecs import encode as encode_kv
from tests.serve_process import start_serve

pytestmark = pytest.mark.lmcache
HERE = Path(__file__).resolve().parent
LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 4, 16, 256
TOKEN = "lmc-t0k"


@pytest.fixture
def server(tmp_path):
    proc, _, port = start_serve(tmp_path / "chunks", TOKEN)
    yield port, proc
    proc.terminate()
    proc.wait(timeout=30)


def run_engine(role: str, port: int, salt: str = "", accept: str = "") -> dict:
    """One LMCache engine in a fresh process (``lmcache_run.py``): its teardown is not safe
    to run twice in one process, and a second process proves the chunks crossed over.
    ``accept``: the backend's ``kvtier_accept_codecs``."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "lmcache_run.py"), role, str(port), TOKEN, salt],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONHASHSEED="0",  # LMCache's chunk hashes, stable
                 KVTIER_TEST_ACCEPT_CODECS=accept),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[7:])


def _stats(port: int) -> dict:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    return httpx.get(f"http://127.0.0.1:{port}/v1/stats", headers=headers).json()


def test_lmcache_stores_and_retrieves_through_kvtier_serve(server):
    port, proc = server
    wrote = run_engine("write", port)
    assert wrote["stored_tokens"] == 3 * CHUNK + 40 and wrote["visible"] == 3 * CHUNK
    stats = _stats(port)
    assert sum(t["chunks"] for t in stats["tiers"]) == 3  # the full chunks (partial: off)

    salted = run_engine("read", port, salt="another-tenant")  # another identity: a miss
    assert salted["lookup"] == 0 and salted["retrieved"] == 0 and salted["untouched"]
    read = run_engine("read", port)
    assert read["lookup"] == 3 * CHUNK and read["retrieved"] == 3 * CHUNK
    assert read["equal"] and read["nothing_past_hit"]  # bit-exact, nothing invented
    assert read["other_lookup"] == 0
    assert sum(t["hits"] for t in _stats(port)["tiers"]) >= 3  # served by kvtier

    proc.terminate()  # the server goes away: a miss, not an error or wrong KV
    proc.wait(timeout=30)
    gone = run_engine("read", port)
    assert gone["lookup"] == 0 and gone["retrieved"] == 0 and gone["untouched"]


def test_chunk_encoding_round_trip_and_refusals():
    init_remote_metadata_info(1)  # what LMCache's RemoteConnector does at start-up
    shape = torch.Size([2, LAYERS, 40, HEADS * HEAD_DIM])  # a partial chunk
    data = torch.randn(shape).half().numpy().tobytes()
    meta = RemoteMetadata(len(data), [shape], [torch.float16], MemoryFormat.KV_2LTD)
    key = kvtier_key("kvtier-test@1@0@abc@half")
    blob = encode(key, data, meta)
    got_meta, got = decode(key, blob)
    assert bytes(got) == data and list(got_meta.shapes[0]) == list(shape)
    assert got_meta.dtypes == [torch.float16]
    with pytest.raises(ChunkError, match="checksum"):
        decode(key, blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(ChunkError, match="holds"):
        decode(kvtier_key("another"), blob)


def test_the_key_names_the_weights_the_kv_shape_and_the_salt(tmp_path):
    """LMCache's key holds the model's name but not its weights: two checkpoints at one
    path (a fine-tune written over the base) must not share KV."""
    from types import SimpleNamespace

    ckpt = tmp_path / "model"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights of the base model")
    meta = SimpleNamespace(model_name=str(ckpt), kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))
    base = backend_identity(meta, {})
    assert base == backend_identity(meta, {})  # stable: the digest is kept beside the weights
    (ckpt / "model.safetensors").write_bytes(b"weights of the fine-tune!")
    tuned = backend_identity(meta, {})
    assert tuned != base
    other_shape = SimpleNamespace(model_name=str(ckpt), kv_shape=(LAYERS, 2, CHUNK, 8, HEAD_DIM))
    assert backend_identity(other_shape, {}) != tuned
    assert backend_identity(meta, {"kvtier_fingerprint_salt": "t1"}) != tuned
    hub = SimpleNamespace(model_name="org/model", kv_shape=meta.kv_shape)
    assert backend_identity(hub, {}) != tuned  # a hub id is named by itself
    k = "kvtier-test@1@0@abc@half"
    assert kvtier_key(k, base) != kvtier_key(k, tuned)


def test_through_a_compressing_server_lmcache_gets_its_kv_decoded_or_a_miss(tmp_path):
    """The server's disk keeps chunks as int8 (its RAM tier off): LMCache's KV comes back
    within int8's bound, and a backend that takes exact KV only sees no chunk at all."""
    proc, _, port = start_serve(tmp_path / "chunks", TOKEN, env={
        "KVTIER_TIERS__CPU_BYTES": "0", "KVTIER_TIERS__DISK_CODEC": "int8"})
    try:
        run_engine("write", port)
        exact = run_engine("read", port, accept="none")
        assert exact["lookup"] == 0 and exact["retrieved"] == 0 and exact["untouched"]
        read = run_engine("read", port, accept="none,int8")
        assert read["lookup"] == 3 * CHUNK and read["retrieved"] == 3 * CHUNK
        assert not read["equal"] and read["nothing_past_hit"]
        assert 0 < read["max_error"] <= read["max_value"] / 127 + 1e-3  # half an int8 step
        codecs = _stats(port)["manager"]["codecs"]
        assert codecs["int8"]["chunks_stored"] == 3 and codecs["int8"]["reads"] >= 3
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _kv_meta(fmt, shape):
    init_remote_metadata_info(1)
    data = torch.randn(shape, generator=torch.Generator().manual_seed(7)).half().numpy().tobytes()
    return data, RemoteMetadata(len(data), [torch.Size(shape)], [torch.float16], fmt)


def test_kv_chunks_are_compressible_and_decode_to_the_codecs_values(tmp_path):
    data, meta = _kv_meta(MemoryFormat.KV_2LTD, [2, LAYERS, 40, HEADS * HEAD_DIM])
    key = kvtier_key("kvtier-test@1@0@kv@half")
    blob = encode(key, data, meta)
    header = parse_header(blob)[0]
    assert not header.opaque and header.dtype == "float16"
    assert tuple(header.shape) == (1, 2, LAYERS * 40, 1, HEADS * HEAD_DIM)
    disk = DiskTier(tmp_path / "d", fsync=False)
    disk.codec = Codec.INT8
    mgr = TierManager([disk])
    try:
        put_blobs(mgr, {key: blob})
        (stored,) = get_blobs(mgr, [key])
    finally:
        mgr.close()
    assert stored is not None and parse_header(stored)[0].codec == "int8"
    _, got = decode(key, stored)
    kv = torch.frombuffer(bytearray(data), dtype=torch.float16).view(1, 2, -1, 1, HEADS * HEAD_DIM)
    want = decode_kv(encode_kv(kv, Codec.INT8), Codec.INT8, tuple(kv.shape), torch.float16)
    assert bytes(got) == want.numpy().tobytes() != data  # the codec's values, not others
    with pytest.raises(ChunkError, match="takes none only"):
        decode(key, stored, {"none"})


def test_other_formats_are_stored_opaque_and_never_re_encoded(tmp_path):
    data, meta = _kv_meta(MemoryFormat.KV_T2D, [40, 2, HEADS * HEAD_DIM])  # K and V interleaved
    key = kvtier_key("kvtier-test@1@0@t2d@half")
    blob = encode(key, data, meta)
    assert parse_header(blob)[0].opaque
    disk = DiskTier(tmp_path / "d", fsync=False)
    disk.codec = Codec.INT4
    mgr = TierManager([disk])
    try:
        put_blobs(mgr, {key: blob})
        assert get_blobs(mgr, [key]) == [blob]
    finally:
        mgr.close()
    assert bytes(decode(key, blob)[1]) == data
