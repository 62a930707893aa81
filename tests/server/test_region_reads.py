"""A batch read into a shared-memory region over real HTTP on loopback: a stored prefix of
many keys in one request, each chunk verified as it is copied, packed at page boundaries;
it stops at the first key not stored or the first chunk that does not fit, never writes a
corrupt copy, reads only the caller's tenant's chunks into the caller's own region."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from kvtier.chunk_format import namespaced_key
from kvtier.client import Client
from kvtier.config import TokenConfig
from kvtier.connectors.tiers.blobs import put_blobs
from kvtier.errors import InvalidArgumentError
from kvtier.server.region_reads import ALIGN
from tests.http_server import running
from tests.server.test_server_chunks import chunk, key, served
from tests.server.test_shm_regions import _state

ROUTE = "/v1/chunks/batch/get-into-region"


def _blobs(n: int, tokens: int = 64) -> dict[str, bytes]:
    return {key(i): chunk(key(i), seed=i, layers=4, tokens=tokens + 32 * i) for i in range(n)}


def test_a_stored_prefix_comes_in_one_request_packed_and_bit_exact(tmp_path):
    state = _state(tmp_path)
    blobs = _blobs(5)
    with running(state) as url, Client(url, shm=True) as kv:
        for k in (key(0), key(1), key(2), key(4)):  # key(3) is not stored: the prefix ends there
            kv.put_chunk(k, blobs[k])
        before = kv.stats()["regions"]["transfers"]["get"]
        read = kv.get_chunks_in_region(list(blobs), 1 << 20)
        assert read is not None and read.ended and len(read.views) == 3
        for i, view in enumerate(read.views):
            assert bytes(view) == served(blobs[key(i)])
        link = kv._local.link  # noqa: SLF001 - the views lie in it, each at a page
        offsets = [_offset(link, v) for v in read.views]
        assert offsets[0] == 0 and all(o % ALIGN == 0 for o in offsets)
        assert all(offsets[i] + len(read.views[i]) <= offsets[i + 1] < offsets[i] + len(read.views[i]) + ALIGN
                   for i in range(2))
        assert kv.stats()["regions"]["transfers"]["get"] == before + 3
        whole = kv.get_chunks_in_region([key(0), key(1)], 1 << 20)
        assert whole is not None and not whole.ended and len(whole.views) == 2  # every key read
        assert not kv.get_chunks_in_region([key(3), key(0)], 1 << 20).views  # a missing first key


def _offset(link, view: memoryview) -> int:
    base = np.frombuffer(link._mem, np.uint8).ctypes.data  # noqa: SLF001
    return np.frombuffer(view, np.uint8).ctypes.data - base


def test_a_read_stops_where_the_room_ends_and_a_first_chunk_too_large_is_a_413(tmp_path):
    state = _state(tmp_path)
    blobs = _blobs(3)
    sizes = [len(served(b)) for b in blobs.values()]
    with running(state) as url, Client(url, shm=True) as kv:
        for k, b in blobs.items():
            kv.put_chunk(k, b)
        room = -(-sizes[0] // ALIGN) * ALIGN + sizes[1]  # the first two exactly
        read = kv.get_chunks_in_region(list(blobs), room)
        assert read is not None and not read.ended and len(read.views) == 2
        assert [bytes(v) for v in read.views] == [served(blobs[key(0)]), served(blobs[key(1)])]
        with pytest.raises(InvalidArgumentError):
            kv.get_chunks_in_region(list(blobs), sizes[0] - 1)
        with httpx.Client(base_url=url) as http:
            rid = kv._local.link.id  # noqa: SLF001
            r = http.post(ROUTE, json={"keys": [key(0)], "region": rid, "offset": 100,
                                       "room": sizes[0] - 1})
            assert r.status_code == 413
            r = http.post(ROUTE, json={"keys": [key(1), key(2)], "region": rid, "offset": 8192})
            assert r.status_code == 200 and r.json()["stopped"] is None
            assert [c["offset"] for c in r.json()["chunks"]][0] == 8192
            assert http.post(ROUTE, json={"keys": [], "region": rid}).status_code == 422
            assert http.post(ROUTE, json={"keys": ["../x"], "region": rid}).status_code in (400, 422)
            assert http.post(ROUTE, json={"keys": [key(0)], "region": "0" * 32}).status_code == 404


def test_a_corrupt_copy_is_never_read_into_the_region_and_a_slower_intact_one_is(tmp_path):
    state = _state(tmp_path)
    blobs = _blobs(3, tokens=256)
    wheres = {k: namespaced_key("default", k) for k in blobs}
    with running(state) as url, Client(url, shm=True) as kv:
        for k, b in blobs.items():
            kv.put_chunk(k, b, tier="disk")
        cpu = state.manager.tiers[0]
        for k, b in blobs.items():  # a copy in RAM too (what a read would promote)
            assert put_blobs(cpu, {wheres[k]: served(b)}).stored == [wheres[k]]
        slot, _ = cpu._index.get(wheres[key(1)], touch=False)  # noqa: SLF001
        cpu._arena[slot * cpu.slot_bytes + len(served(blobs[key(1)])) - 100] ^= 0xFF  # noqa: SLF001
        read = kv.get_chunks_in_region(list(blobs), 1 << 20)
        assert [bytes(v) for v in read.views] == [served(b) for b in blobs.values()]
        assert state.manager.stats.rejected.get("corrupt") == 1
        state.manager.tiers[1].delete([wheres[key(1)]])  # now the only copy is in RAM...
        slot, _ = cpu._index.get(wheres[key(1)], touch=False)  # noqa: SLF001 - promoted again
        cpu._arena[slot * cpu.slot_bytes + 300] ^= 0xFF  # noqa: SLF001 - ...and corrupt
        read = kv.get_chunks_in_region(list(blobs), 1 << 20)
        assert read.ended and [bytes(v) for v in read.views] == [served(blobs[key(0)])]


def test_a_hit_on_disk_is_promoted_into_ram(tmp_path):
    state = _state(tmp_path)
    blobs = _blobs(2)
    wheres = [namespaced_key("default", k) for k in blobs]
    with running(state) as url, Client(url, shm=True) as kv:
        for k, b in blobs.items():
            kv.put_chunk(k, b, tier="disk")
        assert state.manager.tiers[0].contains_each(wheres) == [False, False]
        assert len(kv.get_chunks_in_region(list(blobs), 1 << 20).views) == 2
        assert state.manager.tiers[0].contains_each(wheres) == [True, True]
        with httpx.Client(base_url=url) as http:
            r = http.post(ROUTE, json={"keys": list(blobs), "region": kv._local.link.id})  # noqa: SLF001
            assert [c["tier"] for c in r.json()["chunks"]] == ["cpu", "cpu"]


def test_a_batch_read_reads_the_callers_tenants_chunks_into_the_callers_region(tmp_path):
    tokens = [TokenConfig(token="token-alice", tenant="alice", scopes=["read", "write"]),
              TokenConfig(token="token-bob1", tenant="bob", scopes=["read", "write"])]
    state = _state(tmp_path, tokens=tokens)
    blob = chunk(key(1))
    with running(state) as url, Client(url, token="token-alice", shm=True) as alice, \
            Client(url, token="token-bob1", shm=True) as bob:
        alice.put_chunk(key(1), blob)
        bob.put_chunk(key(9), chunk(key(9)))  # bob makes a region of his own
        read = bob.get_chunks_in_region([key(1)], 1 << 16)
        assert read is not None and read.ended and not read.views  # alice's key is not bob's
        rid = alice._local.link.id  # noqa: SLF001
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer token-bob1"}) as http:
            r = http.post(ROUTE, json={"keys": [key(9)], "region": rid})
            assert r.status_code == 404 and r.json()["error"]["type"] == "no_such_region"
        got = alice.get_chunks_in_region([key(1)], 1 << 16)
        assert [bytes(v) for v in got.views] == [served(blob, "alice")]
