"""A sidecar started as docs/vllm.md starts it keeps real models' chunks in its RAM tier:
256-token chunks of Llama-3-8B (bf16, 32 MiB) and of SmolLM2-135M (fp32, 11 MiB), and
their tails, through real HTTP against a real ``kvtier serve`` process. Before, its CPU
arena was cut into 4 MiB slots: such chunks went to disk, or, with no disk tier, were
refused (``too_large``) while the RAM tier stayed empty."""

from __future__ import annotations

import httpx
import pytest
import torch

from kvtier.chunk_format import decode_chunk, encode_chunk
from tests.serve_process import start_serve

TOKEN = "sidecar-model-chunks-token"
FP = b"a model's fingerprint"
SIDECAR_ENV = {"KVTIER_TIERS__CPU_FREE_RESERVE": "0.05", "KVTIER_TIERS__DISK_O_DIRECT": "true"}
"""What docs/vllm.md starts the sidecar with (the tiers the connector's own have)."""

LLAMA_3_8B = (32, 8, 128, torch.bfloat16)
"""layers, kv heads, head dim, KV dtype."""
SMOLLM2_135M = (30, 3, 64, torch.float32)


def _chunk(i: int, shape: tuple, tokens: int) -> tuple[str, bytes]:
    layers, heads, dim, dtype = shape
    key = f"{i:064x}"
    kv = torch.full((layers, 2, tokens, heads, dim), float(i % 7), dtype=dtype)
    return key, encode_chunk(key, FP, kv)


def _chunks() -> dict[str, bytes]:
    return dict([_chunk(1, LLAMA_3_8B, 256), _chunk(2, LLAMA_3_8B, 256), _chunk(3, LLAMA_3_8B, 100),
                 _chunk(4, SMOLLM2_135M, 256), _chunk(5, SMOLLM2_135M, 256),
                 _chunk(6, SMOLLM2_135M, 37)])


def _run(tmp_path, env: dict[str, str]) -> tuple[dict[str, str], dict]:
    """Each chunk PUT, then the tier each is in, and the server's stats."""
    proc, url, _ = start_serve(tmp_path / "disk", TOKEN, env={**SIDECAR_ENV, **env})
    chunks = _chunks()
    assert len(chunks[f"{1:064x}"]) > 32 << 20 and len(chunks[f"{4:064x}"]) > 11 << 20
    try:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=120) as http:
            for key, blob in chunks.items():
                r = http.put(f"/v1/chunks/{key}", content=blob,
                             headers={"Content-Type": "application/octet-stream"})
                assert r.status_code == 201, (key, r.status_code, r.text)
            tiers = {key: http.head(f"/v1/chunks/{key}").headers.get("X-KVTier-Tier", "")
                     for key in chunks}
            got = http.get(f"/v1/chunks/{1:064x}")
            assert got.status_code == 200 and got.headers["X-KVTier-Tier"] == "cpu"
            _, kv = decode_chunk(got.content, any_namespace=True)  # every checksum checked
            assert torch.equal(kv, decode_chunk(chunks[f"{1:064x}"])[1])
            stats = http.get("/v1/stats").json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return tiers, stats


@pytest.mark.timeout(300)
def test_a_sidecar_started_as_documented_keeps_real_models_chunks_in_ram(tmp_path):
    tiers, stats = _run(tmp_path, {})
    assert set(tiers.values()) == {"cpu"}, tiers
    by_name = {t["name"]: t for t in stats["tiers"]}
    assert by_name["cpu"]["chunks"] == 6 and by_name["disk"]["chunks"] == 0
    assert by_name["cpu"].get("errors", {}) == {}


@pytest.mark.timeout(300)
def test_without_a_disk_tier_the_sidecar_stores_them_in_ram_instead_of_refusing_them(tmp_path):
    tiers, stats = _run(tmp_path, {"KVTIER_TIERS__DISK_BYTES": "0"})
    assert set(tiers.values()) == {"cpu"}, tiers
    (cpu,) = stats["tiers"]
    assert cpu["name"] == "cpu" and cpu["chunks"] == 6 and cpu.get("errors", {}) == {}
