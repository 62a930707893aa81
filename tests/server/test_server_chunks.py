"""The chunk data plane over real HTTP on loopback: every route, batch calls, and the error
cases (malformed chunk -> 400 and nothing stored, oversize body -> 413, missing or wrong
token -> 401), in sidecar mode with a CPU arena over a disk directory."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest
import torch

from kvtier.chunk_format import encode_chunk, validate_chunk, with_namespace
from kvtier.client import AsyncClient, Client, ServiceError
from kvtier.config import load_config
from kvtier.server.state import ServiceState
from tests.http_server import running

FP = b"test-model"


def chunk(key: str, seed: int = 0, layers: int = 4, tokens: int = 16) -> bytes:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, 2, 8, generator=g).to(torch.float16)
    return encode_chunk(key, FP, kv)


def key(i: int) -> str:
    return f"{i:032x}"


def served(blob: bytes, tenant: str = "default") -> bytes:
    """What the service stores and serves for ``blob`` uploaded by ``tenant``: the same
    chunk, its header naming the tenant (open servers: ``default``)."""
    return with_namespace(blob, tenant)


def _config(tmp_path, **server):
    return load_config(
        environ={},
        overrides={
            "tiers": {
                "cpu_bytes": 1 << 20,
                "disk_dir": str(tmp_path / "chunks"),
                "disk_bytes": 64 << 20,
                "disk_fsync": False,
            },
            "server": {"chunk_slot_bytes": 64 << 10, **server},
        },
    )


@pytest.fixture
def sidecar(tmp_path):
    state = ServiceState.sidecar(_config(tmp_path, max_body_bytes=1 << 20))
    with running(state) as url:
        yield url, state


def test_put_get_head_delete_round_trip(sidecar):
    url, state = sidecar
    blob = chunk(key(1))
    with Client(url) as kv:
        assert kv.health()["mode"] == "sidecar"
        put = kv.put_chunk(key(1), blob)
        assert put == {"key": key(1), "status": "stored", "tiers": ["cpu"]}
        assert kv.put_chunk(key(1), blob)["status"] == "present"  # content-addressed
        assert kv.has_chunk(key(1)) and not kv.has_chunk(key(2))
        assert kv.get_chunk(key(1)) == served(blob)
        assert kv.get_chunk(key(2)) is None
        part = kv.get_chunk(key(1), layers=(1, 3))
        header = validate_chunk(part, key(1), FP, any_namespace=True)
        assert header.first_layer == 1 and header.num_layers == 2
        assert kv.delete_chunk(key(1)) and not kv.delete_chunk(key(1))
        assert not kv.has_chunk(key(1))
    assert len(state.manager.tiers[0]) == 0


def test_put_to_a_named_tier_and_lookup_reports_where(sidecar):
    url, _ = sidecar
    with Client(url) as kv:
        kv.put_chunk(key(1), chunk(key(1)))
        kv.put_chunk(key(2), chunk(key(2), 2), tier="disk")
        found = kv.lookup([key(1), key(2), key(3), key(4)])
        assert (found.length, found.tiers) == (2, ["cpu", "disk"])
        assert kv.lookup([key(3), key(1)]).length == 0  # a prefix, not a set
        assert kv.locate([key(2), key(3), key(1)]) == ["disk", None, "cpu"]
        with pytest.raises(ServiceError) as err:
            kv.locate(["not a key"])  # over the chunk wire: the same error as through httpx
        assert err.value.status == 400 and "not chunk keys" in err.value.message
        with pytest.raises(ServiceError) as err:
            kv.put_chunk(key(5), chunk(key(5)), tier="nvme9")
        assert err.value.status == 400 and "unknown tier" in err.value.message


def test_batch_put_and_get(sidecar):
    url, _ = sidecar
    blobs = {key(i): chunk(key(i), i) for i in range(6)}
    with Client(url) as kv:
        res = kv.put_chunks(blobs)
        assert sorted(res["stored"]) == sorted(blobs) and not res["failed"]
        again = kv.put_chunks({key(0): blobs[key(0)]})
        assert again["present"] == [key(0)] and again["stored"] == []
        got = kv.get_chunks([key(0), key(99), key(5)])
        assert got == [served(blobs[key(0)]), None, served(blobs[key(5)])]
        parts = kv.get_chunks([key(1)], layers=(0, 1))
        assert validate_chunk(parts[0], key(1), FP, any_namespace=True).num_layers == 1


def test_async_client_does_the_same(sidecar):
    url, _ = sidecar

    async def go():
        async with AsyncClient(url) as kv:
            await asyncio.gather(*(kv.put_chunk(key(i), chunk(key(i), i)) for i in range(8)))
            found = await kv.lookup([key(i) for i in range(9)])
            blobs = await kv.get_chunks([key(3)])
            return found, blobs, await kv.has_chunk(key(7)), await kv.get_chunk(key(2))

    found, blobs, has, two = asyncio.run(go())
    assert found.length == 8 and blobs == [served(chunk(key(3), 3))] and has
    assert two == served(chunk(key(2), 2))


@pytest.mark.parametrize(
    "mangle, why",
    [
        (lambda b: b"XXXX" + b[4:], "not a kvtier chunk"),
        (lambda b: b[:-3], "truncated"),
        (lambda b: b + b"\0\0", "padded"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "checksum mismatch"),
        (lambda b: b"", "shorter than its fixed prefix"),
    ],
)
def test_malformed_chunk_is_400_and_nothing_is_stored(sidecar, mangle, why):
    url, state = sidecar
    with Client(url) as kv:
        with pytest.raises(ServiceError) as err:
            kv.put_chunk(key(1), mangle(chunk(key(1))))
        assert err.value.status == 400 and err.value.type == "invalid_chunk"
        assert why in err.value.message
        assert not kv.has_chunk(key(1))
    assert all(len(t) == 0 for t in state.manager.tiers)


def test_chunk_under_the_wrong_key_is_refused(sidecar):
    url, _ = sidecar
    with Client(url) as kv:
        with pytest.raises(ServiceError, match="holds"):
            kv.put_chunk(key(2), chunk(key(1)))
        assert not kv.has_chunk(key(2))


def test_one_bad_chunk_fails_the_whole_batch(sidecar):
    url, state = sidecar
    blobs = {key(i): chunk(key(i), i) for i in range(3)}
    blobs[key(1)] = blobs[key(1)][:-1]
    with Client(url) as kv:
        with pytest.raises(ServiceError) as err:
            kv.put_chunks(blobs)
        assert err.value.status == 400 and key(1) in err.value.message
        assert kv.lookup([key(0)]).length == 0
        r = kv.http.post(
            "/v1/chunks/batch/put", content=b"\xc1garbage", headers={"Content-Type": "x"}
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"
        r = kv.http.post("/v1/chunks/batch/put", content=msgpack.packb([1, 2]))
        assert r.status_code == 400
    assert all(len(t) == 0 for t in state.manager.tiers)


def test_bad_keys_and_layers_are_400_or_422(sidecar):
    url, _ = sidecar
    with Client(url) as kv:
        assert kv.http.get("/v1/chunks/bad.key").status_code == 422
        assert kv.http.get(f"/v1/chunks/{key(1)}", params={"layers": "3:1"}).status_code == 400
        assert kv.http.get(f"/v1/chunks/{key(1)}", params={"layers": "x"}).status_code == 422
        with pytest.raises(ServiceError) as err:
            kv.lookup(["ok-key", "../etc/passwd"])
        assert err.value.status == 400
        # A key with a trailing newline is not a key ("$" alone would let it through).
        assert kv.http.get("/v1/chunks/abcd%0A").status_code == 422
        with pytest.raises(ServiceError) as err:
            kv.lookup(["abcd\n"])
        assert err.value.status == 400
        r = kv.http.post("/v1/chunks/lookup", json={"keys": "nope"})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"


def test_oversize_body_is_413_before_anything_is_stored(sidecar):
    url, state = sidecar
    big = chunk(key(1), tokens=4096)  # ~1 MiB of payload plus header: over the 1 MiB limit
    assert len(big) > 1 << 20
    with Client(url) as kv:
        with pytest.raises(ServiceError) as err:
            kv.put_chunk(key(1), big)
        assert err.value.status == 413
        # Without Content-Length (chunked upload) the limit still holds.
        def body():
            for i in range(0, len(big), 65536):
                yield big[i : i + 65536]

        r = kv.http.put(f"/v1/chunks/{key(1)}", content=body())
        assert r.status_code == 413
        assert not kv.has_chunk(key(1))
    assert all(len(t) == 0 for t in state.manager.tiers)


def test_store_full_is_507_with_the_reason(tmp_path):
    cfg = load_config(
        environ={},
        overrides={
            "tiers": {"cpu_bytes": 0, "disk_dir": str(tmp_path / "c"), "disk_bytes": 4096},
        },
    )
    with running(ServiceState.sidecar(cfg)) as url, Client(url) as kv:
        with pytest.raises(ServiceError) as err:
            kv.put_chunk(key(1), chunk(key(1)))
        assert err.value.status == 507 and "disk" in err.value.message


def test_auth_token_guards_every_route_but_healthz(tmp_path):
    state = ServiceState.sidecar(_config(tmp_path, auth_token="s3cret"))
    with running(state) as url:
        assert httpx.get(f"{url}/healthz").status_code == 200
        for path in ("/v1/stats", "/metrics", "/v1/sessions", f"/v1/chunks/{key(1)}"):
            r = httpx.get(url + path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert "missing bearer token" in r.json()["error"]["message"]
            r = httpx.get(url + path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401 and "wrong bearer token" in r.json()["error"]["message"]
        with Client(url, token="wrong") as kv, pytest.raises(ServiceError) as err:
            kv.put_chunk(key(1), chunk(key(1)))
        assert err.value.status == 401
        with Client(url, token="s3cret") as kv:
            assert kv.put_chunk(key(1), chunk(key(1)))["status"] == "stored"
            assert kv.stats()["tiers"][0]["chunks"] == 1
        # The scheme is case-insensitive (RFC 9110); the token is not.
        for scheme in ("bearer", "BEARER", "Bearer"):
            r = httpx.get(f"{url}/v1/stats", headers={"Authorization": f"{scheme} s3cret"})
            assert r.status_code == 200, scheme
        for bad in ("Bearer S3CRET", "Basic s3cret", "s3cret", "Bearer", "Bearer s3cret x"):
            assert httpx.get(f"{url}/v1/stats",
                             headers={"Authorization": bad}).status_code == 401, bad


@pytest.mark.parametrize(("host", "token", "allowed", "refused"), [
    ("127.0.0.1", None, False, False), ("::1", None, False, False),
    ("localhost", None, False, False), ("0.0.0.0", "t", False, False),
    ("0.0.0.0", None, False, True), ("10.1.2.3", None, False, True),
    ("myhost.example", None, False, True), ("0.0.0.0", None, True, False),
])
def test_serving_beyond_loopback_without_a_token_is_refused(host, token, allowed, refused):
    from kvtier.cli.serve import check_exposure
    from kvtier.errors import ConfigError

    if refused:
        with pytest.raises(ConfigError, match="without a bearer token"):
            check_exposure(host, token, allowed)
    else:
        check_exposure(host, token, allowed)


def test_stats_and_metrics_count_what_happened(sidecar):
    url, _ = sidecar
    with Client(url) as kv:
        for i in range(3):
            kv.put_chunk(key(i), chunk(key(i), i))
        kv.get_chunk(key(0))
        kv.get_chunk(key(9))
        with pytest.raises(ServiceError):
            kv.lookup(["not a key"])
        assert kv.http.get("/v1/nowhere").status_code == 404
        stats = kv.stats()
        cpu = stats["tiers"][0]
        assert stats["mode"] == "sidecar" and cpu["name"] == "cpu" and cpu["chunks"] == 3
        assert cpu["hits"] == 1 and stats["manager"]["misses"] == 1
        text = kv.metrics()
    assert 'kvtier_tier_chunks{tier="cpu"} 3.0' in text
    assert 'kvtier_tier_hits_total{tier="cpu"} 1.0' in text
    assert 'kvtier_transfer_seconds_count{direction="put"} 3.0' in text
    assert 'kvtier_http_requests_total{method="PUT",route="/v1/chunks/{key}",status="201"} 3.0' in text
    assert 'kvtier_errors_total{kind="not_found"}' in text
    assert 'kvtier_http_requests_total{method="POST",route="/v1/chunks/lookup",status="400"} 1.0' in text
    assert 'kvtier_http_requests_total{method="GET",route="unmatched",status="404"} 1.0' in text


def test_sessions_in_sidecar_mode_are_unknown(sidecar):
    url, _ = sidecar
    with Client(url) as kv:
        assert kv.sessions() == []
        for call in (kv.session, kv.restore, kv.offload, kv.hint, kv.end_session):
            with pytest.raises(ServiceError) as err:
                call("nobody")
            assert err.value.status == 404
        with pytest.raises(ServiceError) as err:
            kv.chat([{"role": "user", "content": "hi"}])
        assert err.value.status == 404 and "--model" in err.value.message
        r = kv.http.get("/v1/nothing-here")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"


def test_kvtier_serve_refuses_to_start_exposed_without_a_token(capsys, monkeypatch):
    from kvtier.cli.main import main

    monkeypatch.delenv("KVTIER_SERVER__AUTH_TOKEN", raising=False)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "--allow-unauthenticated" in capsys.readouterr().err


def test_stats_and_metrics_never_scan_redis(tmp_path):
    """/v1/stats and /metrics read counters kept as writes happen: with many keys in Redis
    (another writer's among them) neither sends a SCAN, and the chunk count is this
    service's own."""
    from tests.redis_servers import RedisServer

    server = RedisServer()
    server.start()
    try:
        with server.client() as raw:
            pipe = raw.pipeline(transaction=False)
            for i in range(3000):
                pipe.set(f"kvtier:{i:040x}", b"x")
            pipe.execute()
        cfg = load_config(environ={}, overrides={"tiers": {
            "cpu_bytes": 0, "disk_bytes": 0, "redis_url": server.url}})
        with running(ServiceState.sidecar(cfg)) as url, Client(url) as kv:
            assert kv.put_chunk(key(1), chunk(key(1)))["status"] == "stored"
            with server.client() as raw:
                scans = int(raw.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
                for _ in range(3):
                    stats = kv.stats()
                    assert httpx.get(f"{url}/metrics").status_code == 200
                after = int(raw.info("commandstats").get("cmdstat_scan", {}).get("calls", 0))
            assert after == scans
            (redis,) = [t for t in stats["tiers"] if t["name"] == "redis"]
            assert redis["chunks"] == 1 and redis["used_bytes"] == len(served(chunk(key(1))))
    finally:
        server.cleanup()
