"""``kvtier bench vllm``: real vLLM's OpenAI server with and without kvtier (and the peers,
where they run), multi-turn conversations with think times replayed against each, rounds
interleaved (each round starting one setup later) so that a machine's drift touches
every setup alike.

Per setup: TTFT of first turns and of returning turns (mean, p99), inter-token latency,
output tokens per second, replies identical to vLLM alone's of the same round (token ids),
and, for kvtier, its counters from vLLM's ``/metrics``: blocks loaded, saved, tokens
recomputed by decision, and the connector's time on vLLM's forward path against vLLM's
step time. A setup that cannot run says why (the tail of its log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from kvtier.benchmarks import process_cpu
from kvtier.benchmarks.chat_replay import ChatWorkload, TurnResult, replay, warm_up
from kvtier.benchmarks.paired_rounds import paired_ratio
from kvtier.benchmarks.vllm_servers import (
    VllmSetup,
    root_cause,
    route_requests,
    settled_metrics,
    start_kvtier_serve,
    start_vllm,
)

REPO = Path(__file__).resolve().parent.parent
KVTIER = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "kvtier.connectors.vllm_connector"}


ONE_PROCESS = (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),)


def setups(workdir: Path) -> dict[str, VllmSetup]:
    return {
        "alone": VllmSetup("alone"),
        "kvtier-inprocess": VllmSetup("kvtier-inprocess", {**KVTIER, "kv_connector_extra_config": {
            "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "inprocess-chunks"),
                      "disk_fsync": False}}}),
        "kvtier-serve": VllmSetup("kvtier-serve", {**KVTIER, "kv_connector_extra_config": {"shm": True}},
                                  sidecar=True),
        # a diagnostic: the same tiers, saving only (``kv_producer``, background saves): the
        # connector's cost under the load vLLM alone sees (returning turns recompute)
        "kvtier-saves-only": VllmSetup("kvtier-saves-only", {
            **KVTIER, "kv_role": "kv_producer", "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "saves-only-chunks"),
                          "disk_fsync": False}, "background_saves": True}}),
        # saves on vLLM's forward path (``background_saves`` false): between steps, when
        # vLLM's threads wait, not beside them; a finished request's blocks go at once
        "kvtier-inprocess-inline": VllmSetup("kvtier-inprocess-inline", {
            **KVTIER, "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "inline-chunks"),
                          "disk_fsync": False}, "background_saves": False}}),
        "kvtier-saves-only-inline": VllmSetup("kvtier-saves-only-inline", {
            **KVTIER, "kv_role": "kv_producer", "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "saves-only-inline-chunks"),
                          "disk_fsync": False}, "background_saves": False}}),
        # a diagnostic: the connector present and doing nothing (a consumer of an empty
        # store: it looks up, misses, never loads or saves): vLLM's cost of running with one
        "kvtier-presence": VllmSetup("kvtier-presence", {
            **KVTIER, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "presence-chunks"),
                          "disk_fsync": False}}}),
        # a diagnostic: a connector that does nothing (vLLM's own cost of running with one)
        "null-connector": VllmSetup("null-connector", {
            "kv_connector": "NullConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "kvtier.benchmarks.null_vllm_connector"}),
        # one process (vLLM's engine core runs its one worker inside it): the connector's
        # tiers in vLLM's own process, no private sidecar; with vLLM alone in the same mode
        "alone-1proc": VllmSetup("alone-1proc", env=ONE_PROCESS),
        "kvtier-presence-1proc": VllmSetup("kvtier-presence-1proc", {
            **KVTIER, "kv_role": "kv_consumer", "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "presence-1proc-chunks"),
                          "disk_fsync": False}}}, env=ONE_PROCESS),
        "kvtier-inprocess-1proc": VllmSetup("kvtier-inprocess-1proc", {
            **KVTIER, "kv_connector_extra_config": {
                "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / "inprocess-1proc-chunks"),
                          "disk_fsync": False}}}, env=ONE_PROCESS),
        **_option_setups(workdir),
        "lmcache": VllmSetup("lmcache", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                             extra_path=_site_packages(REPO / ".venv-lmcache"), peer=True),
        "vllm-native": VllmSetup("vllm-native", {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}, peer=True),
    }


def _option_setups(workdir: Path) -> dict[str, VllmSetup]:
    """kvtier with one connector option changed from its default, to measure that option."""
    return {**_load_timing_setups(workdir), **_chunking_setups(workdir),
            **_save_pacing_setups(workdir), **_thread_cores_setups(workdir)}


def _option_pair(workdir: Path, name: str, option: dict[str, Any]) -> dict[str, VllmSetup]:
    """``kvtier-inprocess-<name>`` and ``kvtier-serve-<name>``: the two modes with
    ``option`` changed from the connector's default."""
    inprocess, serve = f"kvtier-inprocess-{name}", f"kvtier-serve-{name}"
    return {
        inprocess: VllmSetup(inprocess, {**KVTIER, "kv_connector_extra_config": {
            "tiers": {"cpu_bytes": 1 << 30, "disk_dir": str(workdir / f"{name}-chunks"),
                      "disk_fsync": False}, **option}}),
        serve: VllmSetup(serve, {**KVTIER, "kv_connector_extra_config": {"shm": True, **option}},
                         sidecar=True),
    }


def _thread_cores_setups(workdir: Path) -> dict[str, VllmSetup]:
    """The connector's threads on the one core of vLLM's worker thread that starts them
    (``KVTIER_THREAD_CORES=inherit``, Linux's rule; by default they run on every core of
    the worker's process: :mod:`kvtier.thread_cores`)."""
    inherit = (("KVTIER_THREAD_CORES", "inherit"),)
    return {name: replace(setup, env=setup.env + inherit)
            for name, setup in _option_pair(workdir, "inherit-cores", {}).items()}


def _load_timing_setups(workdir: Path) -> dict[str, VllmSetup]:
    """When loads run (``async_loads``): before the forward pass (``sync``), or each load
    parked or before the forward pass, chosen per request (``auto``)."""
    return {**_option_pair(workdir, "sync", {"async_loads": False}),
            **_option_pair(workdir, "auto", {"async_loads": "auto"})}


def _chunking_setups(workdir: Path) -> dict[str, VllmSetup]:
    """Chunks of one vLLM block (``chunk_tokens`` 1 rounds up to one block): every block
    saved once (a longer chunk's blocks are saved again while it fills, turn by turn), more
    and smaller objects."""
    return _option_pair(workdir, "block-chunks", {"chunk_tokens": 1})


def _save_pacing_setups(workdir: Path) -> dict[str, VllmSetup]:
    """Saves that do not yield to prefill steps (``saves_yield_to_prefill: false``; the
    default yields where vLLM's cache is on the host): a chunk is written as soon as it is
    computed, beside whatever prefill comes next."""
    return {
        **_option_pair(workdir, "no-yield", {"saves_yield_to_prefill": False}),
        # saves that yield but start a chunk as soon as a prefill step ends (``save_step_gap_s``
        # 0), often beside the next prefill step
        "kvtier-serve-gap-starts": VllmSetup("kvtier-serve-gap-starts", {
            **KVTIER, "kv_connector_extra_config": {"shm": True, "save_step_gap_s": 0}},
            sidecar=True),
    }


def round_setups(root: Path, round_index: int) -> dict[str, VllmSetup]:
    """The setups of one round, storing into directories of that round's own: rounds replay
    the same conversations, and a round must never restore what an earlier one stored."""
    return setups(root / f"r{round_index}")


def round_order(names: list[str], round_index: int) -> list[str]:
    """The setups of round ``round_index`` in the order they run: each round starts one
    setup later than the one before, so that a machine whose speed drifts over a round
    (a page cache filling, a neighbour's load) does not always favour the same setup."""
    k = round_index % len(names) if names else 0
    return names[k:] + names[:k]


def round_runs(names: list[str], round_index: int, known: dict[str, VllmSetup],
               peer_rounds: int | None) -> list[str]:
    """The setups round ``round_index`` runs, in order: the peers only in the first
    ``peer_rounds`` rounds (None: in every round)."""
    return [n for n in round_order(names, round_index)
            if not (known[n].peer and peer_rounds is not None and round_index >= peer_rounds)]


def _site_packages(venv: Path) -> str | None:
    """The site-packages of ``venv`` (LMCache's environment, built by the test command)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    return str(found[0]) if found else None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "vllm", help="real vLLM with and without kvtier (and peers): multi-turn TTFT, ITL, outputs",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "out" / "models" / "smollm2-135m-instruct"))
    p.add_argument("--vllm-python", default=str(REPO / ".venv-integration" / "bin" / "python"))
    p.add_argument("--setups", default="alone,kvtier-inprocess,kvtier-serve,lmcache,vllm-native")
    p.add_argument("--rounds", type=int, default=2)
    for name, value in asdict(ChatWorkload()).items():
        if isinstance(value, bool):
            p.add_argument(f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=value)
        else:
            p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=320, help="vLLM's KV cache, in blocks")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--cpu-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for every setup "
                   "(default: every core, 0-N; vLLM binds one core by default, both with a connector)")
    p.add_argument("--setup-limit-s", type=float, default=600.0,
                   help="time one setup's replay may take (one that stalls is cut and says so)")
    p.add_argument("--peer-rounds", type=int, default=None,
                   help="run the peers (lmcache, vllm-native) in the first N rounds only "
                   "(default: every round): a peer that cannot serve on this host says so once")
    p.add_argument("--peer-limit-s", type=float, default=None,
                   help="the peers' replay limit (default: --setup-limit-s)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    console = Console()
    work = ChatWorkload(**{k: getattr(args, k) for k in asdict(ChatWorkload())})
    names = [s.strip() for s in args.setups.split(",") if s.strip()]
    rounds: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        unknown = [n for n in names if n not in setups(Path(tmp))]
        if unknown:
            raise SystemExit(f"unknown setups {unknown}; known: {', '.join(setups(Path(tmp)))}")
        for r in range(args.rounds):
            rounds.append({})
            known = round_setups(Path(tmp), r)
            for name in round_runs(names, r, known, args.peer_rounds):
                console.print(f"round {r + 1}: [bold]{name}[/bold] ...")
                rounds[-1][name] = _one(known[name], args, work, Path(tmp) / f"r{r}-{name}")
                rows = _summarise([n for n in names if n in rounds[0]], rounds)
                _write(args, work, rows)  # what ran so far survives a stop
    _print(console, rows)
    if args.out:
        console.print(f"wrote {args.out}")
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _chunk_bytes(args: argparse.Namespace, setup: VllmSetup) -> int:
    """The largest chunk the setup's connector writes for this model (the sidecar's slot
    size): its ``chunk_tokens`` (256) in whole blocks (one at least) of every layer,
    float32 as the bench runs vLLM."""
    from kvtier.chunk_format import max_chunk_bytes
    from kvtier.connectors.vllm_blocks import DEFAULT_CHUNK_TOKENS, ChunkGrid

    extra = (setup.kv_transfer_config or {}).get("kv_connector_extra_config", {})
    grid = ChunkGrid.of(args.block_size, b"", int(extra.get("chunk_tokens", DEFAULT_CHUNK_TOKENS)))
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    block = layers * 2 * args.block_size * cfg.get("num_key_value_heads", heads) * head_dim * 4
    return max_chunk_bytes(layers, block * grid.chunk_blocks)


def _write(args: argparse.Namespace, work: ChatWorkload, rows: list[dict[str, Any]]) -> None:
    if not args.out:
        return
    doc = {"suite": "vllm", "workload": asdict(work), "setups": rows,
           "config": {k: str(v) for k, v in vars(args).items() if k != "func"},
           "machine": _machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")


def _one(setup: VllmSetup, args: argparse.Namespace, work: ChatWorkload, workdir: Path
         ) -> dict[str, Any]:
    """One setup once: its turns, wall time and vLLM's metrics, or why it could not run."""
    workdir.mkdir(parents=True)
    sidecar = server = None
    try:
        if setup.sidecar:
            sidecar = start_kvtier_serve(workdir, slot_bytes=_chunk_bytes(args, setup))
        server = start_vllm(args.vllm_python, args.model, setup, workdir, args,
                            sidecar.url if sidecar else None)
        limit_s = _limit_s(setup, args)
        roots = [s.proc.pid for s in (server, sidecar) if s is not None]
        asyncio.run(warm_up(server.url, "m", work))
        # the warm-ups' own work (a connector's saves of them, the holds of their blocks)
        # done before the clock starts, alike for every setup: left running, it fell on
        # the opening burst's first prefill in some starts (docs/vllm.md, session 45)
        settled_metrics(server.url)
        cpu_before = process_cpu.sample(roots)
        asked_before = route_requests(sidecar.url) if sidecar else {}
        done = asyncio.run(replay(server.url, "m", work, limit_s=limit_s, warmup=False))
        got = {"turns": done.turns, "wall_s": done.wall_s, "metrics": settled_metrics(server.url)}
        cpu_after = process_cpu.sample(roots)
        if cpu_before is not None and cpu_after is not None:
            got["cpu_s"] = (cpu_after - cpu_before).as_dict()
        if sidecar:  # what the connector asked of the sidecar, by route
            asked = route_requests(sidecar.url)
            got["sidecar_requests"] = {k: n - asked_before.get(k, 0) for k, n in asked.items()
                                       if n > asked_before.get(k, 0) and "/metrics" not in k}
        if not done.finished:
            got["unfinished"] = (f"{len(done.turns)} of {work.conversations * work.turns} turns "
                                 f"in {limit_s:.0f} s; it logged: "
                                 f"{root_cause(server.log.read_text(errors='replace'))}")
        return got
    except RuntimeError as exc:
        return {"error": str(exc)[:2500]}
    finally:
        for s in (server, sidecar):
            if s is not None:
                s.stop()


def _limit_s(setup: VllmSetup, args: argparse.Namespace) -> float:
    """How long ``setup``'s replay may take: a peer's own limit where one is given."""
    if setup.peer and args.peer_limit_s is not None:
        return args.peer_limit_s
    return args.setup_limit_s


def _stats(values: list[float]) -> dict[str, float | None]:
    """Mean, median and p99. The median beside the mean: 24 first turns a round, the first
    few of them queued together behind the opening burst, move a mean by tens of percent."""
    values = [v for v in values if v == v]  # NaN: a turn that failed
    if not values:
        return {"mean": None, "median": None, "p99": None}
    p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def _phase_means(m: dict[str, float]) -> dict[str, float | None]:
    """vLLM's own split of a request's time to its first token, mean over the replay's
    requests (its two warm-ups included): waiting in its queue (arrival to first
    scheduled: where a scheduler hook or a parked load shows) and prefilling (first
    scheduled to first token: where anything slowing the forward passes shows)."""
    def mean(name: str) -> float | None:
        count = m.get(f"vllm:{name}_count")
        return m.get(f"vllm:{name}_sum", 0.0) / count if count else None

    return {"queue_s_mean": mean("request_queue_time_seconds"),
            "prefill_s_mean": mean("request_prefill_time_seconds")}


def _round_row(got: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    turns: list[TurnResult] = got["turns"]
    m = got["metrics"]
    def reply(t: TurnResult) -> tuple:
        return (tuple(t.token_ids), t.text)  # token ids where the server returns them

    ref = {(t.conversation, t.turn): reply(t) for t in reference["turns"]} if reference else {}
    # compared where vLLM alone answered the same turn (a replay cut by its time limit
    # has no reference for its last turns: those are counted apart, not as different)
    same = [reply(t) == ref[(t.conversation, t.turn)] for t in turns
            if (t.conversation, t.turn) in ref]
    forward = m.get("vllm:kvtier_load_seconds_total", 0) + m.get("vllm:kvtier_save_wait_seconds_total", 0)
    step = m.get("vllm:kvtier_step_seconds_total", 0)
    return {
        "first_ttft": _stats([t.ttft_s for t in turns if t.turn == 0]),
        "first_ttfts_s": [round(t.ttft_s, 4) for t in turns if t.turn == 0],
        "returning_ttft": _stats([t.ttft_s for t in turns if t.turn > 0]),
        "returning_ttfts_s": {f"{t.conversation}:{t.turn}": round(t.ttft_s, 4)
                              for t in turns if t.turn > 0},
        "started_s": {f"{t.conversation}:{t.turn}": round(t.started_s, 4) for t in turns},
        "itl_mean_s": statistics.fmean([x for t in turns for x in t.itl_s] or [float("nan")]),
        "wall_s": got["wall_s"],
        "output_tok_per_s": sum(len(t.token_ids) for t in turns) / got["wall_s"],
        "errors": sum(1 for t in turns if t.error),
        "unfinished": got.get("unfinished"),
        "identical_to_alone": (sum(same), len(same)) if ref else None,
        "without_reference": sum(1 for t in turns if (t.conversation, t.turn) not in ref) if ref else None,
        "kvtier_loaded_blocks": m.get("vllm:kvtier_loaded_blocks_total"),
        "kvtier_saved_blocks": m.get("vllm:kvtier_saved_blocks_total"),
        "kvtier_derived_blocks": m.get("vllm:kvtier_derived_blocks_total"),
        "kvtier_load_errors": m.get("vllm:kvtier_load_errors_total"),
        "recomputed_by_decision_tokens": m.get("vllm:kvtier_recomputed_by_decision_tokens_total"),
        "connector_forward_share": forward / step if step else None,
        "connector_schedule_s": m.get("vllm:kvtier_schedule_seconds_total"),
        "kvtier_lookups": m.get("vllm:kvtier_lookups_total"),
        "arrival_raises": m.get("vllm:kvtier_arrival_raises_total"),
        "parked_loads": m.get("vllm:kvtier_parked_loads_total"),
        "loads_before_forward": m.get("vllm:kvtier_loads_before_forward_total"),
        "parked_load_s": m.get("vllm:kvtier_parked_load_seconds_total"),
        "save_hold_s": m.get("vllm:kvtier_save_hold_seconds_total"),
        "held_requests": m.get("vllm:kvtier_held_requests_total"),
        "kvtier_steps": m.get("vllm:kvtier_steps_total"),
        "session_turns_reported": m.get("vllm:kvtier_session_turns_reported_total"),
        "store_faults": {name: m.get(f"vllm:kvtier_{name}_total") for name in (
            "store_timeouts", "store_failures", "store_breaker_opens", "skipped_lookups",
            "skipped_loads", "skipped_saves", "refused_saves_too_large", "refused_saves_full",
            "refused_saves_unavailable", "refused_saves_error")},
        "external_hit_tokens": m.get("vllm:external_prefix_cache_hits_total"),
        "prefix_cache_hit_tokens": m.get("vllm:prefix_cache_hits_total"),
        **_phase_means(m),
        "cpu_s": got.get("cpu_s"),
        "sidecar_requests": got.get("sidecar_requests"),
    }


def _summarise(names: list[str], rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setup: each round's figures, then the mean over rounds and the ratios to vLLM
    alone of the same round."""
    by_round: dict[str, dict[int, dict[str, Any]]] = {}
    rows = []
    for name in names:
        per_round, errors = by_round.setdefault(name, {}), []
        for i, rnd in enumerate(rounds):
            got = rnd.get(name)
            if got is None:
                continue
            if "error" in got:
                errors.append(got["error"])
                continue
            alone = rnd.get("alone")
            per_round[i] = _round_row(got, alone if alone and "error" not in alone and name != "alone" else None)
        row: dict[str, Any] = {"setup": name, "rounds": list(per_round.values()),
                               "could_not_run": errors[0] if errors else None}
        if per_round:
            row.update(_means(name, row["rounds"], rounds))
        rows.append(row)
    for row in rows:  # once vLLM alone's rounds are known, wherever it is listed
        if row["setup"] != "alone" and by_round[row["setup"]] and by_round.get("alone"):
            row.update(_paired_ratios(by_round[row["setup"]], by_round["alone"]))
    return rows


def _paired_ratios(rows: dict[int, dict[str, Any]], alone: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """First- and returning-turn TTFT means against vLLM alone's (``rows`` and ``alone``:
    round rows by round), round by round, with the 95 % interval the rounds give their
    mean (:mod:`~kvtier.benchmarks.paired_rounds`)."""
    out: dict[str, Any] = {}
    for kind in ("first_ttft", "returning_ttft"):
        ratio = paired_ratio([(row[kind]["mean"], alone[i][kind]["mean"])
                              for i, row in rows.items() if i in alone])
        out[f"{kind}_ratio"] = None if ratio is None else ratio.as_dict()
    return out


def _means(name: str, per_round: list[dict[str, Any]], rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(key: str, sub: str | None = None) -> float | None:
        vals = [(r[key][sub] if sub else r[key]) for r in per_round]
        vals = [v for v in vals if v is not None]
        return statistics.fmean(vals) if vals else None

    out = {"first_ttft_mean_s": mean("first_ttft", "mean"), "first_ttft_p99_s": mean("first_ttft", "p99"),
           "first_ttft_median_s": mean("first_ttft", "median"),
           "returning_ttft_mean_s": mean("returning_ttft", "mean"),
           "returning_ttft_median_s": mean("returning_ttft", "median"),
           "returning_ttft_p99_s": mean("returning_ttft", "p99"), "itl_mean_s": mean("itl_mean_s"),
           "wall_s": mean("wall_s"), "output_tok_per_s": mean("output_tok_per_s"),
           "connector_forward_share": mean("connector_forward_share"),
           "recomputed_by_decision_tokens": mean("recomputed_by_decision_tokens")}
    out["cpu_s"] = _mean_cpu([r["cpu_s"] for r in per_round if r.get("cpu_s")])
    same = [r["identical_to_alone"] for r in per_round if r["identical_to_alone"]]
    out["identical_turns"] = [sum(a for a, _ in same), sum(b for _, b in same)] if same else None
    return out


def _mean_cpu(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rounds' CPU split (:mod:`~kvtier.benchmarks.process_cpu`) averaged: each role's
    seconds, and each thread group's (0 in a round without it)."""
    if not rounds:
        return None
    out: dict[str, Any] = {k: statistics.fmean(r[k] for r in rounds) for k in rounds[0] if k != "threads"}
    groups = {g for r in rounds for g in r.get("threads", {})}
    out["threads"] = dict(sorted(((g, statistics.fmean(r.get("threads", {}).get(g, 0.0) for r in rounds))
                                  for g in groups), key=lambda kv: -kv[1]))
    return out


def _print(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    alone = next((r for r in rows if r["setup"] == "alone" and r.get("returning_ttft_mean_s")), None)

    def ms(v: float | None, key: str) -> str:
        if v is None:
            return "-"
        ratio = f" ({v / alone[key]:.2f}x)" if alone and alone.get(key) and alone is not None else ""
        return f"{v * 1e3:.0f}{ratio}"

    table = Table(title="real vLLM, multi-turn with think times (ms; ratios to vLLM alone)")
    for col in ("setup", "returning TTFT mean", "median", "p99", "first TTFT mean", "median", "ITL", "tok/s",
                "identical", "connector share", "CPU s: vLLM / kvtier (sidecar)",
                "first / returning x alone, 95 % over rounds", "note"):
        table.add_column(col)
    for r in rows:
        if r.get("could_not_run") and not r["rounds"]:
            table.add_row(r["setup"], *["-"] * 11, "could not run: " + r["could_not_run"].split(" (server")[0][:120])
            continue
        same = r["identical_turns"]
        share = r["connector_forward_share"]
        table.add_row(r["setup"], ms(r["returning_ttft_mean_s"], "returning_ttft_mean_s"),
                      ms(r["returning_ttft_median_s"], "returning_ttft_median_s"),
                      ms(r["returning_ttft_p99_s"], "returning_ttft_p99_s"),
                      ms(r["first_ttft_mean_s"], "first_ttft_mean_s"),
                      ms(r["first_ttft_median_s"], "first_ttft_median_s"), ms(r["itl_mean_s"], "itl_mean_s"),
                      f"{r['output_tok_per_s']:.1f}", f"{same[0]}/{same[1]}" if same else "-",
                      f"{share:.1%}" if share is not None else "-", _cpu(r.get("cpu_s")),
                      " / ".join(_interval(r.get(f"{k}_ttft_ratio")) for k in ("first", "returning")), _note(r))
    console.print(table)


def _cpu(cpu: dict[str, float] | None) -> str:
    """CPU seconds a round (:mod:`~kvtier.benchmarks.process_cpu`): vLLM's own threads, then
    kvtier's, of which its sidecar process's."""
    if not cpu:
        return "-"
    return f"{cpu['vllm_s']:.1f} / {cpu['kvtier_s']:.1f} ({cpu['sidecar_s']:.1f})"


def _interval(ratio: dict[str, Any] | None) -> str:
    if not ratio:
        return "-"
    if ratio["low"] is None:
        return f"{ratio['mean']:.2f}"
    return f"{ratio['mean']:.2f} [{ratio['low']:.2f}-{ratio['high']:.2f}]"


def _note(row: dict[str, Any]) -> str:
    cut = [r["unfinished"] for r in row["rounds"] if r.get("unfinished")]
    return ("cut: " + cut[0][:100]) if cut else ""


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.get("first_ttft_mean_s") is not None]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(ran))
    ax.bar([i - 0.2 for i in x], [r["first_ttft_mean_s"] * 1e3 for r in ran], 0.4, label="first turn")
    back = [i for i in x if ran[i].get("returning_ttft_mean_s") is not None]  # none: --turns 1
    if back:
        ax.bar([i + 0.2 for i in back], [ran[i]["returning_ttft_mean_s"] * 1e3 for i in back], 0.4,
               label="returning turn")
    crowded = len(ran) > 4  # long setup names overlap side by side: tilt them
    ax.set_xticks(list(x), [r["setup"] for r in ran], rotation=20 if crowded else 0,
                  ha="right" if crowded else "center", fontsize=8 if crowded else None)
    ax.set_ylabel("mean TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _machine() -> dict[str, Any]:
    from kvtier.benchmarks.machine import machine_info

    return machine_info()
