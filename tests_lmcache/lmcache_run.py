"""One LMCache engine for the integration test, in its own process.

Usage: python lmcache_run.py write|read PORT TOKEN. ``write`` stores a seeded KV tensor of
three and a bit chunks; ``read`` looks it up and retrieves it into zeros and compares with
the same seeded tensor. Prints one ``RESULT {json}`` line, then leaves with os._exit
(LMCache 0.5.6's engine teardown crashes on CPU-only machines).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import load_engine_config_with_overrides
from lmcache.v1.metadata import LMCacheMetadata

from kvtier.benchmarks.peers_lmcache import cpu_copy_connector

LAYERS, HEADS, HEAD_DIM, CHUNK = 2, 4, 16, 256
NUM_TOKENS = 3 * CHUNK + 40


# The benchmark's connector: copies between LMCache's memory objects and one CPU tensor
# [2, L, T, H*D] (LMCache ships none that copies from plain CPU tensors).
CPUCopyConnector = cpu_copy_connector((LAYERS, HEADS * HEAD_DIM))


def make_engine(port: int, token: str, salt: str = ""):
    config = load_engine_config_with_overrides(
        overrides={
            "chunk_size": CHUNK,
            "local_cpu": False,  # every chunk goes to, and comes back from, kvtier
            "max_local_cpu_size": 0.05,
            "remote_url": f"kvtier://127.0.0.1:{port}",
            "remote_serde": "naive",
            "remote_storage_plugins": ["kvtier"],
            "extra_config": {
                "remote_storage_plugin.kvtier.module_path": "kvtier.connectors.lmcache_remote",
                "remote_storage_plugin.kvtier.class_name": "KVTierAdapter",
                "kvtier_token": token,
                "force_store_wait": True,  # a small CPU pool must not drop chunks
                **({"kvtier_fingerprint_salt": salt} if salt else {}),
                **({"kvtier_accept_codecs": os.environ["KVTIER_TEST_ACCEPT_CODECS"]}
                   if os.environ.get("KVTIER_TEST_ACCEPT_CODECS") else {}),
            },
        }
    )
    metadata = LMCacheMetadata(
        model_name="kvtier-test", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float16,
        kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM),
    )  # fmt: skip
    engine = LMCacheEngineBuilder.get_or_create(
        "kvtier-test", config, metadata, CPUCopyConnector(), lambda t, r: None, lambda o, r: o
    )
    engine.post_init()
    return engine


def main() -> None:
    role, port, token = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    salt = sys.argv[4] if len(sys.argv) > 4 else ""
    tokens = torch.arange(NUM_TOKENS)
    kv = torch.randn(2, LAYERS, NUM_TOKENS, HEADS * HEAD_DIM,
                     generator=torch.Generator().manual_seed(0)).half()  # fmt: skip
    engine = make_engine(port, token, salt)
    if role == "write":
        engine.store(tokens, kvcaches=kv)
        deadline = time.monotonic() + 60  # puts to the remote backend finish in background
        while engine.lookup(tokens) < 3 * CHUNK and time.monotonic() < deadline:
            time.sleep(0.05)
        result = {"stored_tokens": NUM_TOKENS, "visible": engine.lookup(tokens)}
    else:
        out = torch.zeros_like(kv)
        hit = engine.lookup(tokens)
        got = int(engine.retrieve(tokens, kvcaches=out).sum())
        result = {
            "lookup": hit,
            "retrieved": got,
            "equal": bool(torch.equal(out[:, :, :got], kv[:, :, :got])),
            "max_error": float((out[:, :, :got].float() - kv[:, :, :got].float()).abs().max())
            if got else None,
            "max_value": float(kv.float().abs().max()),
            "nothing_past_hit": not bool(out[:, :, got:].any()),
            "untouched": not bool(out.any()) if got == 0 else None,
            "other_lookup": engine.lookup(torch.arange(5000, 5000 + 2 * CHUNK)),
        }
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
