"""``kvtier bench codecs``: what each KV codec at rest costs in quality and speed, on a real
model (issue 33).

Quality: held English text (the Python language reference shipped with the interpreter,
``pydoc_data``: prose every machine has, none of it seen by the benchmark's authors when the
codecs were written) is cut into samples of ``history + continuation`` tokens. For each, the
model computes the history, its KV is taken out of the pool, round-tripped through the codec
and put back, and the model reads the continuation over it; the reference is the same run
with the exact KV. Figures: perplexity of the continuation (ratio to exact), top-1 agreement
and mean KL divergence of the next-token distributions, and whether a greedy reply from the
history alone is token for token the same.

Speed: encoding and decoding a 256-token chunk of the model's KV (native kernels on the
host, the torch reference on a GPU), in GB/s of KV, against a copy of the same bytes into
memory that already exists, in the same run.

Restores (:mod:`.codec_restores`): the same chunks stored uncompressed and by each codec in
a disk tier (write + fsync, read cold) and a real Redis, restored as the engine restores;
KV delivered per second against the uncompressed restore in the same run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

from kvtier.kv_codecs import Codec

DEFAULT_MODEL = Path("out/models/smollm2-135m-instruct")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "codecs", help="KV codecs at rest: quality on a real model and speed, per codec",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                   help="a model directory (default: SmolLM2-135M-Instruct, `kvtier get-model`)")
    p.add_argument("--codecs", default="fp8,int8,int4")
    p.add_argument("--history", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--dtype", default=None, help="the pool's dtype (default float32)")
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=5, help="speed: median of this many")
    p.add_argument("--restore-chunks", type=int, default=24,
                   help="restores: chunks per tier and codec (0: no restore rows)")
    p.add_argument("--restore-rounds", type=int, default=3)
    p.add_argument("--restore-dtype", default="bfloat16",
                   help="restores: the KV's dtype (what a server keeps in its pool)")
    p.add_argument("--restore-device", default="cpu",
                   help="restores: the pool's device, cpu or cuda (a GPU pool: chunks cross as "
                        "stored and are decoded on the device)")
    p.add_argument("--restore-only", action="store_true",
                   help="only the restore rows (no model run: --restore-shape gives the KV)")
    p.add_argument("--restore-shape", default=None,
                   help="restores: layers,kv_heads,head_dim (default: the model's)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)
    p.set_defaults(func=run)


def held_text() -> str:
    """The Python reference's topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvtier.engine.model_runner import ModelRunner
    from kvtier.errors import ConfigError
    from kvtier.models.tokenizer import Tokenizer

    codecs = [Codec.parse(c.strip()) for c in args.codecs.split(",") if c.strip()]
    console = Console()
    if args.restore_only:
        return _run_restores_only(args, codecs, console)
    if not (args.model / "config.json").is_file():
        raise ConfigError(f"no model at {args.model}: make one with `kvtier get-model "
                          "smollm2-135m-instruct --out out/models/smollm2-135m-instruct`")
    span = args.history + args.continuation
    runner = ModelRunner(args.model, dtype=args.dtype or "float32", device=args.device,
                         num_blocks=2 * (span // 16 + 4), max_model_len=span + args.greedy_tokens,
                         enable_prefix_caching=False)
    ids = Tokenizer.from_dir(args.model).encode(held_text())
    step = max(span, (len(ids) - span) // max(args.samples, 1))
    samples = [ids[i : i + span] for i in range(0, len(ids) - span, step)][: args.samples]
    with torch.inference_mode():
        exact = [_reference(runner, s, args) for s in samples]
        rows = []
        for codec in codecs:
            with console.status(f"{codec.value}: quality on {len(samples)} samples"):
                quality = [_quality(runner, s, e, codec, args) for s, e in zip(samples, exact, strict=True)]
            rows.append({"codec": codec.value, **_speed(runner, codec, args.repeats),
                         **_mean_quality(quality)})
    storage = runner.pool.storage
    shape = (storage.num_layers, storage.kv.shape[4], storage.kv.shape[5])
    restores = _restores(shape, codecs, args, console) if args.restore_chunks else []
    payload = {"model": str(args.model), "dtype": str(runner.pool.storage.kv.dtype),
               "device": str(runner.device), "history": args.history,
               "continuation": args.continuation, "samples": len(samples),
               "text": "pydoc_data.topics (the Python reference)", "codecs": rows,
               "restore": restores}
    _print(console, rows)
    _print_restores(console, restores)
    if args.out:
        from kvtier.benchmarks.results import write_result

        console.print(f"wrote {write_result(args.out, 'codecs', payload)}")
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _history_kv(runner: Any, seq: str, tokens: list[int]) -> list[int]:
    runner.add_sequence(seq, tokens)
    runner.run([(seq, len(tokens))])
    return list(runner.pool.sequence(seq).block_ids)


def _reference(runner: Any, sample: list[int], args: argparse.Namespace) -> dict[str, Any]:
    """Exact KV: the continuation's log-probabilities and the greedy reply."""
    hist = sample[: args.history]
    _history_kv(runner, "ref", hist)
    greedy = _greedy(runner, "ref", args.greedy_tokens)
    runner.free_sequence("ref")
    _history_kv(runner, "ref", hist)
    logp = _continue(runner, "ref", sample[args.history :])
    runner.free_sequence("ref")
    return {"logp": logp, "greedy": greedy}


def _quality(runner: Any, sample: list[int], exact: dict[str, Any], codec: Codec,
             args: argparse.Namespace) -> dict[str, float]:
    import torch

    hist, cont = sample[: args.history], sample[args.history :]
    blocks = _history_kv(runner, "c", hist)
    _round_trip(runner, blocks, len(hist), codec)
    greedy = _greedy(runner, "c", args.greedy_tokens)
    runner.free_sequence("c")
    blocks = _history_kv(runner, "c", hist)
    _round_trip(runner, blocks, len(hist), codec)
    logp = _continue(runner, "c", cont)
    runner.free_sequence("c")
    ref = exact["logp"]
    target = torch.tensor(cont[1:], device=ref.device)
    nll_ref = -ref[:-1].gather(1, target[:, None]).mean()
    nll = -logp[:-1].gather(1, target[:, None]).mean()
    kl = (ref.exp() * (ref - logp)).sum(-1).mean()
    return {"ppl_ratio": math.exp(float(nll - nll_ref)),
            "top1_agreement": float((ref.argmax(-1) == logp.argmax(-1)).float().mean()),
            "kl": float(kl), "greedy_identical": float(greedy == exact["greedy"])}


def _round_trip(runner: Any, blocks: list[int], tokens: int, codec: Codec) -> None:
    """The history's KV through the codec and back into its blocks."""
    from kvtier.gpu_pool.kernels import gather_blocks, scatter_blocks
    from kvtier.kv_codecs import decode, encode

    kv = runner.pool.storage.kv
    chunk = gather_blocks(kv, blocks, num_tokens=tokens)
    back = decode(encode(chunk, codec), codec, tuple(chunk.shape), chunk.dtype)
    scatter_blocks(back, kv, blocks, num_tokens=tokens)


def _continue(runner: Any, seq: str, tokens: list[int]) -> Any:
    """Log-probabilities after each continuation token, over the sequence's KV."""
    runner.append_tokens(seq, tokens)
    return runner.run([(seq, len(tokens))], all_positions=True).float().log_softmax(-1)


def _greedy(runner: Any, seq: str, n: int) -> list[int]:
    out = [int(runner.run([(seq, 1)])[0].argmax())]  # the history's last token again
    while len(out) < n:
        runner.append_tokens(seq, out[-1:])
        out.append(int(runner.run([(seq, 1)])[0].argmax()))
    return out


def _mean_quality(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def _speed(runner: Any, codec: Codec, repeats: int) -> dict[str, float]:
    """Encode and decode GB/s of KV (decoded bytes) for one 256-token chunk, and the copy."""
    import torch

    from kvtier.kv_codecs import decode, encode, layout

    storage = runner.pool.storage
    _, _, _, _, heads, dim = storage.kv.shape
    shape = (storage.num_layers, 2, 256, heads, dim)
    kv = torch.randn(shape, device=storage.kv.device).to(storage.kv.dtype)
    dst = torch.empty_like(kv)
    payload = encode(kv, codec)
    nbytes = kv.numel() * kv.element_size()

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            if kv.is_cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if kv.is_cuda:
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        return nbytes / statistics.median(samples) / 1e9

    return {"bytes_per_value": layout(codec, shape, kv.dtype).nbytes / kv.numel(),
            "ratio_vs_kv_dtype": nbytes / layout(codec, shape, kv.dtype).nbytes,
            "encode_GBps": timed(lambda: encode(kv, codec)),
            "decode_GBps": timed(lambda: decode(payload, codec, shape, kv.dtype)),
            "copy_GBps": timed(lambda: dst.copy_(kv))}


def _run_restores_only(args: argparse.Namespace, codecs: list[Codec], console: Any) -> int:
    """``--restore-only``: the restore rows of a KV shape, no model (a GPU loan's step)."""
    from kvtier.errors import ConfigError

    if args.restore_shape:
        try:
            layers, heads, dim = (int(x) for x in args.restore_shape.split(","))
        except ValueError:
            raise ConfigError(f"--restore-shape {args.restore_shape!r}: give "
                              "layers,kv_heads,head_dim (e.g. 32,8,128)") from None
    elif (args.model / "config.json").is_file():
        from kvtier.models.config import ModelConfig

        cfg = ModelConfig.from_pretrained(args.model)
        layers, heads, dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    else:
        raise ConfigError("--restore-only needs --restore-shape or a --model directory")
    restores = _restores((layers, heads, dim), codecs, args, console)
    _print_restores(console, restores)
    if args.out:
        from kvtier.benchmarks.results import write_result

        console.print(f"wrote {write_result(args.out, 'codecs', {'codecs': [], 'restore': restores})}")
    return 0


def _restores(shape: tuple[int, int, int], codecs: list[Codec], args: argparse.Namespace,
              console: Any) -> list[dict[str, Any]]:
    """Restore rows from a disk directory and a real Redis (see :mod:`.codec_restores`)."""
    import shutil

    from kvtier.benchmarks.codec_restores import RestoreSetup, default_workdir, restore_rows
    from kvtier.benchmarks.tiers import _start_redis
    from kvtier.chunk_format import DTYPES

    layers, heads, dim = shape
    setup = RestoreSetup((layers, 2, 256, heads, dim), DTYPES[args.restore_dtype],
                         args.restore_chunks, args.restore_rounds, args.restore_device)
    redis = _start_redis()
    workdir = default_workdir()
    try:
        with console.status("restores: disk and Redis, every codec"):
            return restore_rows(setup, codecs, redis[1] if redis else None, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if redis:
            redis[0].kill()
            shutil.rmtree(redis[2], ignore_errors=True)


def _print_restores(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title="Restores of compressed chunks against uncompressed ones (same run)")
    for col in ("tier", "codec", "KV GB/s", "none KV GB/s", "speed-up", "tokens held"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["tier"], r["codec"], f"{r['kv_GBps']:.2f}", f"{r['none_kv_GBps']:.2f}",
                  f"{r['speedup']:.2f}x", f"{r['tokens_held_ratio']:.2f}x")
    console.print(t)


def _print(console: Any, rows: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title="KV codecs at rest: quality against exact KV, speed against a copy")
    for col in ("codec", "B/value", "ratio", "ppl ratio", "top-1", "KL", "greedy same",
                "encode GB/s (x copy)", "decode GB/s (x copy)"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["codec"], f"{r['bytes_per_value']:.3f}", f"{r['ratio_vs_kv_dtype']:.2f}x",
                  f"{r['ppl_ratio']:.4f}", f"{r['top1_agreement']:.3f}", f"{r['kl']:.4f}",
                  f"{r['greedy_identical']:.2f}",
                  f"{r['encode_GBps']:.2f} ({r['encode_GBps'] / r['copy_GBps']:.2f})",
                  f"{r['decode_GBps']:.2f} ({r['decode_GBps'] / r['copy_GBps']:.2f})")
    console.print(t)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for r in rows:
        ax.scatter(r["bytes_per_value"], r["ppl_ratio"])
        ax.annotate(r["codec"], (r["bytes_per_value"], r["ppl_ratio"]))
    ax.set_xlabel("bytes per KV value")
    ax.set_ylabel("perplexity / exact")
    ax.set_title("KV codecs: quality against size")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
