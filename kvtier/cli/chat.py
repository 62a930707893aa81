"""``kvtier chat``: a terminal chat with the reference engine, streamed, with per-turn timings.

On a terminal it is interactive (``/reset`` starts a new session, ``/quit`` or EOF ends);
with stdin from a pipe or file it reads one user message per line, so it can be scripted.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kvtier.cli.options import add_engine_flags, apply_log_level, config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal (reference engine)",
        description="Multi-turn chat with streamed tokens and a timing line per turn. Reads "
        "one message per line when stdin is not a terminal.",
    )
    p.add_argument("--model", default=None, metavar="DIR",
                   help="model directory (HF format); default: SmolLM2-135M-Instruct, got "
                   "once into out/models by `kvtier get-model`")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="system prompt opening each session")
    add_engine_flags(p)
    p.set_defaults(func=run)


def timing_line(stats) -> str:
    ttft = f"{stats.ttft_s * 1e3:.1f} ms" if stats.ttft_s is not None else "-"
    rate = f"{1 / stats.tpot_s:.1f} tok/s" if stats.tpot_s else "-"
    return (
        f"[turn {stats.turn}: TTFT {ttft}, {rate}, {stats.output_tokens} tokens out, "
        f"{stats.reused_tokens} prompt tokens reused / {stats.recomputed_tokens} computed, "
        f"{stats.finish_reason}]"
    )


def run(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    from kvtier.engine.engine import Engine, RequestError
    from kvtier.engine.sampling import SamplingParams

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    config = config_from_args(args)
    apply_log_level(config, args)
    if args.model is None:
        from kvtier.make_model.get_model import default_chat_model

        args.model = str(default_chat_model())
    engine = Engine(args.model, config)
    interactive = stdin.isatty()
    session, n = "chat-1", 1

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    try:
        if interactive:
            write(f"kvtier chat with {args.model} (/reset for a new session, /quit to leave)\n")
        while True:
            if interactive:
                write("you> ")
            line = stdin.readline()
            if not line:
                break
            message = line.rstrip("\n")
            if interactive and message.strip() in ("/quit", "/exit"):
                break
            if interactive and message.strip() == "/reset":
                n += 1
                session = f"chat-{n}"
                write("(new session)\n")
                continue
            if not message.strip():
                continue
            write("assistant> ")
            try:
                result = engine.chat(session, message, params, system=args.system, on_text=write)
            except RequestError as exc:
                write(f"\n[error: {exc}]\n")
                continue
            write("\n" + timing_line(result.stats) + "\n")
    finally:
        engine.close()
    return 0
