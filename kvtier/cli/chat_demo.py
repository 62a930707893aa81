"""``kvtier chat-demo``: scripted conversations against a running ``kvtier serve``.

It plays two users of one assistant with a long system prompt. The first asks three
questions and goes idle between them: the session is offloaded to a lower tier (as the
policy does with idle sessions), and each resumed turn restores its history from the tier
instead of recomputing it. The second user then opens a new conversation: its system
prompt is found by content in the tier the first one left it in. Run it again against a
restarted server and the first turn restores from disk too. The table reports what the
server says happened to every prompt token (from the pool, restored from which tier,
recomputed), never the flags the demo was started with.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

SYSTEM = (
    "You are the assistant of a team that runs large language models in production. "
    "Answer in plain English, in two or three short sentences, without lists or code. "
    "Background you can rely on: a model keeps a key-value (KV) cache for every token of a "
    "conversation, so that the next token does not recompute the whole history. The cache "
    "lives in GPU memory, which is scarce, and most conversations sit idle while their "
    "users read and type. kvtier moves the KV cache of an idle conversation down a "
    "hierarchy of cheaper memories: CPU RAM, then local NVMe disk, then a shared Redis "
    "store. When the user comes back, kvtier brings the cache back if copying it is "
    "faster than recomputing it, and recomputes otherwise. Copying a conversation's KV "
    "from CPU memory is usually many times faster than recomputing it; from disk or over "
    "the network it depends on the hardware, so kvtier measures both costs on the machine "
    "it runs on and decides per request. The cache is stored in chunks of 256 tokens whose "
    "keys are hashes of their content and of the model, so two conversations that start "
    "with the same system prompt share the stored chunks of that prompt, and KV computed "
    "by one model is never served to another. Every stored chunk carries checksums, and a "
    "damaged chunk is recomputed, never used. Keep your answers friendly and precise, and "
    "say so when you do not know something."
)
CONVERSATIONS = [
    (
        "first user",
        [
            "What happens to my conversation's cache while I am thinking about my next message?",
            "And when I come back, is the history recomputed?",
            "Why is that faster?",
        ],
    ),
    ("second user", ["Can two conversations share anything in the cache?"]),
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat-demo",
        help="multi-turn chats against kvtier serve, offloading sessions between turns",
        description="Two conversations with one long system prompt against a running "
        "kvtier serve (engine mode). Between turns the session is offloaded to --tier and "
        "the next turn restores it; the second conversation finds the shared system prompt "
        "in the tier. Prints where each turn's KV came from, as the server reports it.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--token", default=None, help="bearer token, if the server asks for one")
    p.add_argument("--tier", default="disk", help="tier idle sessions go to (default disk)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the server")
    p.set_defaults(func=run)


def _wait_ready(client, seconds: float) -> dict:
    from kvtier.errors import KVTierError

    deadline = time.monotonic() + seconds
    while True:
        try:
            return client.health()
        except Exception as exc:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise KVTierError(
                    f"kvtier serve did not answer within {seconds:.0f} s: {exc}"
                ) from None
            time.sleep(0.5)


def kv_source(final: dict[str, Any]) -> str:
    """Where a turn's prompt KV came from, in the server's own words."""
    parts = [f"{tier} {n}" for tier, n in sorted(final.get("restored_from", {}).items())]
    pool = final["reused_tokens"] - final["restored_tokens"]
    if pool:
        parts.insert(0, f"pool {pool}")
    if final["recomputed_tokens"]:
        parts.append(f"computed {final['recomputed_tokens']}")
    return ", ".join(parts)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.client import Client
    from kvtier.errors import KVTierError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    console = Console() if Console().is_terminal else Console(width=120)
    stamp = int(time.time())
    with Client(args.url, token=args.token, timeout=600) as kv:
        health = _wait_ready(kv, args.wait)
        if health["mode"] != "engine":
            raise KVTierError("the server runs without a model: start it with --model DIR")
        console.print(f"[bold]kvtier serve[/] at {args.url}, model {health['model']}")
        table = Table(title="where each prompt token's KV came from (as the server reports)")
        for col in ("conversation", "turn", "prompt", "restored", "MiB read", "computed",
                    "TTFT ms", "KV from (tokens)"):
            table.add_column(col, justify="right")
        rows: list[tuple[str, int, dict[str, Any]]] = []
        for who, questions in CONVERSATIONS:
            session = f"demo-{who.split()[0]}-{stamp}"
            messages = [{"role": "system", "content": SYSTEM}]
            console.rule(f"{who} (session {session})")
            for turn, question in enumerate(questions, 1):
                final = _turn(kv, console, args, session, messages, question, table, who, turn)
                rows.append((who, turn, final))
        console.print()
        console.print(table)
    return _summary(console, rows)


def _turn(kv: Any, console: Any, args: argparse.Namespace, session: str,
          messages: list[dict[str, str]], question: str, table: Any, who: str, turn: int
          ) -> dict[str, Any]:
    """One turn streamed to the console, its row added; then the user goes idle (the
    session is offloaded). The server's own report of the turn."""
    from kvtier.client import chat_text

    messages.append({"role": "user", "content": question})
    console.print(f"[bold cyan]user>[/] {question}")
    console.print("[bold green]assistant>[/] ", end="")
    events = []
    for event in kv.chat_stream(
        messages, session, max_tokens=args.max_tokens, temperature=0,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        events.append(event)
        if event.get("choices"):
            console.print(event["choices"][0]["delta"].get("content") or "", end="")
    console.print()
    messages.append({"role": "assistant", "content": chat_text(events)})
    final = next(e for e in events if e.get("kvtier"))["kvtier"]
    usage = next(e for e in events if e.get("usage"))["usage"]
    table.add_row(
        who, str(turn), str(usage["prompt_tokens"]), str(final["restored_tokens"]),
        f"{final.get('restored_bytes', 0) / 2**20:.1f}",
        str(final["recomputed_tokens"]), f"{final['ttft_s'] * 1e3:.1f}",
        kv_source(final),
    )
    off = kv.offload(session, tier=args.tier)  # the user goes idle
    console.print(
        f"[dim](user idle: session offloaded to {off['tier']}: "
        f"{off['stored_tokens']} tokens stored there, "
        f"{off['bytes'] / 2**20:.1f} MiB newly written (the rest was stored "
        f"already), {off['freed_blocks']} pool blocks freed)[/]"
    )
    return final


def _summary(console: Any, rows: list[tuple[str, int, dict[str, Any]]]) -> int:
    """What the demo showed; 0 when every resumed turn and the shared prompt restored."""
    resumed = [f for who, turn, f in rows if turn > 1]
    shared = next(f for who, turn, f in rows if who == CONVERSATIONS[1][0])
    first = rows[0][2]
    ok_resumed = sum(1 for f in resumed if f["restored_tokens"] > 0)
    console.print(
        f"{ok_resumed} of {len(resumed)} resumed turns restored their history from the tiers; "
        f"the second conversation restored {shared['restored_tokens']} tokens of the shared "
        "system prompt"
        + (f"; the first turn restored {first['restored_tokens']} tokens stored by an earlier "
           "run." if first["restored_tokens"] else ".")
    )
    return 0 if ok_resumed == len(resumed) and shared["restored_tokens"] > 0 else 1
