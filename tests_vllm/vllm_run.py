"""One vLLM run for the integration tests (a fresh process each: vLLM holds global state).

Usage: python vllm_run.py MODEL_DIR MODE [EXTRA_JSON [SCENARIO [TP]]]; MODE is ``none`` (no
connector) or ``kvtier`` (KVTierConnector with EXTRA_JSON as kv_connector_extra_config); TP
the tensor-parallel size (1; 2 runs a worker process per core).
SCENARIO ``shared`` (default): two greedy requests sharing a long prefix; ``turns``: a
conversation of two turns, the second sending the first's prompt and reply back with a new
message (token ids); ``session``: the same, both requests with vLLM's session id "alice";
``regenerate``: the first turn, then the same prompt again (a regenerated reply); ``prefill`` / ``decode``: the first request only, run for one token
(a prefill instance) or in full (its decode peer); ``corrupt``: as ``shared``, with one byte
of every chunk file in the connector's ``tiers.disk_dir`` flipped between the two requests;
``corrupt-one``: the same, with one byte flipped in the shared prefix's second chunk only;
``pause``: the two requests of ``shared``, then the second again while the sidecar (process
id in ``KVTIER_TEST_SIDECAR_PID``) is stopped with SIGSTOP, then, once SIGCONT resumed it,
the second again until kvtier hits (each attempt reported).
Then one JSON line per request and one with the metrics.
"""

from __future__ import annotations

import json
import os
import signal
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

PREFIX = " ".join(f"w{i}" for i in range(200))
SUFFIXES = ("alpha beta", "gamma delta")


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    kw = {}
    if mode == "kvtier":
        role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(
            sys.argv[4] if len(sys.argv) > 4 else "", "kv_both")
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.connectors.vllm_connector",
            kv_role=role,
            kv_connector_extra_config=json.loads(sys.argv[3]),
        )
    tp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        kw["tensor_parallel_size"] = tp
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(
        model=model,
        dtype="float32",
        block_size=32,  # a multiple of 32, as vLLM's CPU backend asks
        enable_prefix_caching=False,  # every hit below comes from kvtier
        max_model_len=1024,
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    scenario = sys.argv[4] if len(sys.argv) > 4 else "shared"
    if scenario in ("turns", "session"):
        params = SamplingParams(max_tokens=40, temperature=0, logprobs=3)
        if scenario == "session":  # both turns carry vLLM's session id
            def run(prompt, rid):
                return in_session(llm, prompt, params, "alice", rid)
        else:
            def run(prompt, rid):
                return llm.generate([prompt], params)[0]
        first = run(f"{PREFIX} {SUFFIXES[0]}", "t1")
        report(first)
        history = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
        more = llm.get_tokenizer().encode(f" {SUFFIXES[1]}", add_special_tokens=False)
        report(run({"prompt_token_ids": history + more}, "t2"))
    elif scenario == "regenerate":  # the turns' first request, then the same again
        params = SamplingParams(max_tokens=40, temperature=0, logprobs=3)
        for _ in range(2):
            report(llm.generate([f"{PREFIX} {SUFFIXES[0]}"], params)[0])
    elif scenario in ("prefill", "decode"):
        tokens = 1 if scenario == "prefill" else 12
        params = SamplingParams(max_tokens=tokens, temperature=0, logprobs=3)
        report(llm.generate([f"{PREFIX} {SUFFIXES[0]}"], params)[0])
    elif scenario == "pause":
        paused(llm, int(os.environ["KVTIER_TEST_SIDECAR_PID"]))
    else:
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
        for i, suffix in enumerate(SUFFIXES):
            if scenario == "corrupt" and i:
                corrupt(json.loads(sys.argv[3])["tiers"]["disk_dir"])
            if scenario == "corrupt-one" and i:
                corrupt_chunk(llm, json.loads(sys.argv[3])["tiers"]["disk_dir"], first, 1)
            out = llm.generate([f"{PREFIX} {suffix}"], params)[0]
            first = out if not i else first
            report(out)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    print("METRICS " + json.dumps({k: v for k, v in metrics.items() if "cache" in k or "kvtier" in k}), flush=True)


def paused(llm, pid: int, attempts: int = 60) -> None:
    """The ``pause`` scenario: kvtier stored, hit, stalled, then hit again."""
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    first, second = (f"{PREFIX} {suffix}" for suffix in SUFFIXES)
    report(llm.generate([first], params)[0])
    report(llm.generate([second], params)[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        report(llm.generate([second], params)[0])
    finally:
        os.kill(pid, signal.SIGCONT)
    for _ in range(attempts):  # the connector's probe finds the sidecar answering again
        out = llm.generate([second], params)[0]
        report(out)
        if out.num_cached_tokens:
            break


def corrupt(disk_dir: str) -> None:
    """Flip a byte in the middle of every file under ``disk_dir`` (the stored chunks'
    payloads: bytes a checksum covers)."""
    for root, _, files in os.walk(disk_dir):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if size < 4096:
                continue
            with open(path, "r+b") as f:
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0xFF]))


def corrupt_chunk(llm, disk_dir: str, request, index: int) -> None:
    """Flip a byte in the middle of the file of chunk ``index`` of ``request``'s prompt, as
    the connector keys it (the scheduler's connector, vLLM's engine in this process)."""
    from pathlib import Path

    from kvtier.connectors.tiers.disk_layout import ChunkPaths

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    keys = connector.grid.keys(list(request.prompt_token_ids))
    path = ChunkPaths(Path(disk_dir)).path(keys[index].key)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    print(f"CORRUPT {index} of {len(keys)} chunks of {connector.grid.chunk_blocks} blocks",
          flush=True)


def in_session(llm, prompt, params, session, rid):
    """One request of ``session`` through vLLM's engine (``LLM.generate`` takes no session
    id), stepped until it finishes."""
    engine = llm.llm_engine
    engine.add_request(rid, prompt, params, session_id=session)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def report(out) -> None:
    comp = out.outputs[0]
    print("RESULT " + json.dumps({
        "prompt_ids": list(out.prompt_token_ids),
        "token_ids": list(comp.token_ids),
        "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in comp.logprobs],
        "num_cached_tokens": out.num_cached_tokens,
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
