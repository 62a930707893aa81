"""``kvtier bench engine``: prefill and decode throughput of the reference engine.

Prefill tokens/s against context length and decode tokens/s against batch size, through the
model runner on the paged pool, next to two references measured in the same run: the same
model run by Hugging Face transformers (dense KV, SDPA) when it is installed, and this
machine's matrix-multiply throughput (the compute roofline of the weights' FLOPs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

DEFAULT_CONTEXTS = (128, 512, 1024, 2048)
DEFAULT_BATCHES = (1, 4, 16, 32)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "engine",
        help="prefill tokens/s vs context and decode tokens/s vs batch of the reference engine",
        description="Throughput of the reference engine on a make-model checkpoint, with "
        "transformers and a GEMM roofline measured in the same run as references.",
    )
    p.add_argument("--model", type=Path, default=None, help="model dir (default: --preset)")
    p.add_argument("--preset", default="smollm-135m", help="make-model preset when no --model")
    p.add_argument(
        "--models-dir",
        type=Path,
        default=Path("out/models"),
        help="where generated presets are kept between runs",
    )
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)))
    p.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)))
    p.add_argument("--decode-context", type=int, default=128, help="prompt length for decode")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    from kvtier.errors import InvalidArgumentError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise InvalidArgumentError(
            f"--{what} takes positive integers separated by commas, got {text!r}"
        )
    return vals


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_s(fn, repeats: int, device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_flops(device, dtype) -> float:
    """Sustained matmul FLOP/s at a transformer-like shape: the roofline for weight FLOPs."""
    import torch

    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    s = _median_s(lambda: a @ b, 3, device)
    return 2 * n**3 / s


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from kvtier.gpu_pool.kv_storage import resolve_device

    contexts = _ints(args.contexts, "contexts")
    batches = _ints(args.batches, "batches")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    model_dir = _model_dir(args, dtype)
    console = Console() if Console().is_terminal else Console(width=140)

    bench = _Bench.start(model_dir, dtype, device, contexts, batches, args)
    hf = None if args.no_hf else _load_hf(model_dir, dtype, device)
    prefill_rows = _measure_prefill(bench, hf, contexts, args, console)
    decode_rows = _measure_decode(bench, hf, batches, args, console)

    peak = _gemm_flops(device, getattr(torch, dtype))
    weight_flops_per_token = 2 * (bench.n_params or 0)
    for r in prefill_rows:
        r["weight_flops_utilisation"] = r["tokens_per_s"] * weight_flops_per_token / peak

    _print_tables(console, prefill_rows, decode_rows, hf is not None,
                  f"prefill: {model_dir.name} {dtype} on {device}", args.decode_context)
    console.print(f"GEMM {dtype} peak measured in this run: {peak / 1e9:.1f} GFLOP/s")
    if args.out:
        path = _write(args, model_dir, dtype, device, bench.n_params, peak, hf is not None,
                      prefill_rows, decode_rows)
        console.print(f"wrote {path}")
    return 0


def _model_dir(args: argparse.Namespace, dtype: str) -> Path:
    """--model, or the --preset checkpoint under --models-dir (generated on first use)."""
    from kvtier.make_model.writer import make_model

    model_dir = args.model
    if model_dir is None:
        model_dir = args.models_dir / args.preset
        if not (model_dir / "config.json").is_file():
            make_model(args.preset, model_dir, dtype=dtype)
    return model_dir


class _Bench:
    """The model runner under test, with the random prompts and sequence ids it is fed."""

    def __init__(self, runner, device) -> None:
        import torch

        self.runner = runner
        self.device = device
        self.n_params = (
            sum(p.numel() for p in runner.model.parameters())
            if hasattr(runner.model, "parameters")
            else None
        )
        self.vocab = runner.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        self.seq_counter = iter(range(10**9))

    @classmethod
    def start(cls, model_dir: Path, dtype: str, device, contexts: list[int],
              batches: list[int], args: argparse.Namespace) -> _Bench:
        """A runner with a pool large enough for the longest prefill and the largest batch."""
        from kvtier.engine.model_runner import ModelRunner

        decode_len = args.decode_context + args.decode_steps + 2
        need_tokens = max(max(contexts), max(batches) * decode_len)
        runner = ModelRunner(
            model_dir,
            dtype=dtype,
            device=device,
            num_blocks=need_tokens // 16 + 64,
            enable_prefix_caching=False,
            max_model_len=max(max(contexts), decode_len),
        )
        return cls(runner, device)

    def tokens(self, n: int) -> list[int]:
        import torch

        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def prefill_once(self, n: int) -> None:
        sid = f"p{next(self.seq_counter)}"
        self.runner.add_sequence(sid, self.tokens(n))
        self.runner.run([(sid, n)])
        self.runner.free_sequence(sid)

    def decode_step_seconds(self, b: int, args: argparse.Namespace) -> float:
        """Prefill ``b`` prompts, then the mean time of a decode step over --decode-steps."""
        runner = self.runner
        sids = [f"d{next(self.seq_counter)}" for _ in range(b)]
        for sid in sids:
            runner.add_sequence(sid, self.tokens(args.decode_context))
        runner.run([(sid, args.decode_context) for sid in sids])

        def step() -> None:
            for sid in sids:
                runner.append_tokens(sid, [1])
            runner.run([(sid, 1) for sid in sids])

        step()  # warm-up
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            step()
        _sync(self.device)
        s = (time.perf_counter() - t0) / args.decode_steps
        for sid in sids:
            runner.free_sequence(sid)
        return s


def _load_hf(model_dir: Path, dtype: str, device):
    """The same checkpoint in transformers, or None when transformers is not installed."""
    import torch

    try:
        from transformers import AutoModelForCausalLM

        return (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
            .to(device)
            .eval()
        )
    except ImportError:
        return None


def _measure_prefill(bench: _Bench, hf, contexts: list[int], args: argparse.Namespace,
                     console) -> list[dict[str, Any]]:
    import torch

    device = bench.device
    rows: list[dict[str, Any]] = []
    for n in contexts:
        with console.status(f"prefill {n} tokens"):
            s = _median_s(lambda n=n: bench.prefill_once(n), args.repeats, device)
            row: dict[str, Any] = {"context": n, "seconds": s, "tokens_per_s": n / s}
            if hf is not None:
                ids = torch.tensor([bench.tokens(n)], device=device)
                with torch.inference_mode():
                    hs = _median_s(lambda ids=ids: hf(ids, logits_to_keep=1), args.repeats, device)
                row.update(hf_seconds=hs, hf_tokens_per_s=n / hs, vs_hf=hs / s)
        rows.append(row)
    return rows


def _measure_decode(bench: _Bench, hf, batches: list[int], args: argparse.Namespace,
                    console) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for b in batches:
        with console.status(f"decode batch {b}"):
            s = bench.decode_step_seconds(b, args)
            row: dict[str, Any] = {"batch": b, "step_seconds": s, "tokens_per_s": b / s}
            if hf is not None:
                row.update(_hf_decode(hf, b, args, bench.tokens, bench.device))
                row["vs_hf"] = row["tokens_per_s"] / row["hf_tokens_per_s"]
        rows.append(row)
    return rows


def _print_tables(console, prefill_rows: list[dict[str, Any]], decode_rows: list[dict[str, Any]],
                  hf: bool, prefill_title: str, decode_context: int) -> None:
    from rich.table import Table

    t = Table(title=prefill_title, title_justify="left")
    for col in ("context", "ms", "tok/s", "HF tok/s", "ours / HF speed", "of GEMM peak"):
        t.add_column(col, justify="right")
    for r in prefill_rows:
        t.add_row(
            str(r["context"]),
            f"{r['seconds'] * 1e3:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r.get('hf_tokens_per_s', 0):.0f}" if hf else "-",
            f"{r['vs_hf']:.2f}" if hf else "-",
            f"{r['weight_flops_utilisation']:.0%}",
        )
    console.print(t)
    t = Table(title=f"decode ({decode_context}-token prompts)", title_justify="left")
    for col in ("batch", "ms/step", "tok/s", "HF tok/s", "ours / HF speed"):
        t.add_column(col, justify="right")
    for r in decode_rows:
        t.add_row(
            str(r["batch"]),
            f"{r['step_seconds'] * 1e3:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r.get('hf_tokens_per_s', 0):.0f}" if hf else "-",
            f"{r['vs_hf']:.2f}" if hf else "-",
        )
    console.print(t)


def _write(args: argparse.Namespace, model_dir: Path, dtype: str, device, n_params, peak: float,
           hf: bool, prefill_rows: list[dict[str, Any]], decode_rows: list[dict[str, Any]]):
    import torch

    from kvtier.benchmarks.results import write_result

    return write_result(
        args.out,
        "engine",
        {
            "config": {
                "model": str(model_dir),
                "preset": args.preset if args.model is None else None,
                "dtype": dtype,
                "device": str(device),
                "threads": torch.get_num_threads(),
                "decode_context": args.decode_context,
                "decode_steps": args.decode_steps,
                "repeats": args.repeats,
                "num_parameters": n_params,
            },
            "reference": {"gemm_flops_per_s": peak, "transformers": hf},
            "prefill": prefill_rows,
            "decode": decode_rows,
        },
    )


def _hf_decode(hf, b: int, args, tokens, device) -> dict[str, float]:
    """transformers' own decode loop state: prefill a batch, then time single-token steps."""
    import torch

    ids = torch.tensor([tokens(args.decode_context) for _ in range(b)], device=device)
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        past = out.past_key_values
        nxt = torch.ones((b, 1), dtype=torch.long, device=device)
        out = hf(nxt, past_key_values=past, use_cache=True)  # warm-up step
        past = out.past_key_values
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(args.decode_steps):
            out = hf(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
        _sync(device)
    s = (time.perf_counter() - t0) / args.decode_steps
    return {"hf_step_seconds": s, "hf_tokens_per_s": b / s}
