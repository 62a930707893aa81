"""``kvtier chat-demo``: a scripted multi-turn chat against a running ``kvtier serve``.

It plays a user who asks, goes idle (the session is offloaded to a lower tier, as the
policy does with idle sessions), and comes back: the second turn's history is restored
from the tier instead of recomputed, and the demo prints where every prompt token's KV came
from and the time to first token of each turn.
"""

from __future__ import annotations

import argparse
import logging
import time

SYSTEM = (
    "You are kvtier's demo assistant. You answer questions about serving large language "
    "models: paged KV caches, prefix caching, offloading idle conversations to CPU memory, "
    "NVMe and Redis, and restoring them when the user comes back. "
) * 4
QUESTIONS = [
    "What happens to my conversation's KV cache while I am thinking about my next message?",
    "And when I come back, is the history recomputed?",
    "How much faster is that than recomputing it?",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat-demo",
        help="multi-turn chat against kvtier serve, offloading the session between turns",
        description="Three turns of one conversation against a running kvtier serve "
        "(engine mode); between turns the session is offloaded to --tier, and the next turn "
        "restores it. Prints a timing table.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8100")
    p.add_argument("--token", default=None, help="bearer token, if the server asks for one")
    p.add_argument("--tier", default="disk", help="tier the idle session goes to (default disk)")
    p.add_argument("--max-tokens", type=int, default=24)
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


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvtier.client import Client, chat_text
    from kvtier.errors import KVTierError

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise here
    console = Console()
    session = f"demo-{int(time.time())}"
    with Client(args.url, token=args.token, timeout=600) as kv:
        health = _wait_ready(kv, args.wait)
        if health["mode"] != "engine":
            raise KVTierError("the server runs without a model: start it with --model DIR")
        console.print(f"[bold]kvtier serve[/] at {args.url}, model {health['model']}")
        messages = [{"role": "system", "content": SYSTEM}]
        table = Table(title=f"session {session}")
        for col in ("turn", "prompt", "reused", "restored", "recomputed", "TTFT ms", "KV from"):
            table.add_column(col, justify="right")
        for turn, question in enumerate(QUESTIONS, 1):
            messages.append({"role": "user", "content": question})
            console.print(f"\n[bold cyan]user>[/] {question}")
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
            reply = chat_text(events)
            messages.append({"role": "assistant", "content": reply})
            final = next(e for e in events if e.get("kvtier"))["kvtier"]
            usage = next(e for e in events if e.get("usage"))["usage"]
            restored = final["restored_tokens"]
            pool = final["reused_tokens"] - restored
            source = (
                f"{args.tier} (restored)" if restored else ("pool" if pool else "computed")
            )
            table.add_row(
                str(turn),
                str(usage["prompt_tokens"]),
                str(pool),
                str(restored),
                str(final["recomputed_tokens"]),
                f"{final['ttft_s'] * 1e3:.1f}",
                source,
            )
            if turn < len(QUESTIONS):
                off = kv.offload(session, tier=args.tier)
                console.print(
                    f"[dim](user idle: session offloaded to {off['tier']}: "
                    f"{off['stored_tokens']} tokens, {off['bytes'] / 2**20:.1f} MiB, "
                    f"{off['freed_blocks']} pool blocks freed)[/]"
                )
        console.print()
        console.print(table)
        info = kv.session(session)
        restored_turns = sum(1 for t in info["history"][1:] if t["restored_tokens"] > 0)
        console.print(
            f"{restored_turns} of {len(QUESTIONS) - 1} resumed turns restored their history "
            f"from {args.tier} instead of recomputing it."
        )
        kv.end_session(session)
    return 0 if restored_turns == len(QUESTIONS) - 1 else 1
