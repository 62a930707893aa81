"""``kvtier make-model``: a random-weight Hugging Face checkpoint at a real model's shapes.

Nothing can be downloaded, yet the engine must be measured on real shapes and tested against
``transformers``. So this writes ``config.json``, safetensors weights (sharded with an index
past a size limit, like HF), a locally trained byte-level BPE ``tokenizer.json``,
``tokenizer_config.json`` with a Jinja chat template, and ``generation_config.json``.

Weights are drawn per tensor from a generator seeded by (seed, tensor name), so the bytes do
not depend on shard boundaries, and big models are generated and written one shard at a time
(memory: one shard, not the model). Everything is written into a temporary sibling directory
and renamed into place at the end: a crash never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.make_model.presets import (
    DTYPE_BYTES,
    PRESETS,
    Preset,
    build_config,
    get_preset,
    parameter_count,
    parameter_shapes,
)
from kvtier.models.chat_template import get_format

DEFAULT_MAX_SHARD_BYTES = 2_000_000_000
INIT_STD = 0.02
# Above this many bytes of weights, show a progress bar.
_PROGRESS_BYTES = 50_000_000


@dataclass(frozen=True)
class MakeModelResult:
    """What was written, for callers and the CLI's summary line."""

    path: Path
    config: dict[str, Any]
    num_parameters: int
    weight_bytes: int
    weight_files: list[str]
    tokenizer_vocab_size: int


# --- shards ------------------------------------------------------------------------------


def plan_shards(
    shapes: dict[str, tuple[int, ...]], dtype: str, max_shard_bytes: int
) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_bytes`` each
    (a tensor bigger than the limit gets a shard of its own), as HF's ``save_pretrained``."""
    if max_shard_bytes <= 0:
        raise InvalidArgumentError(f"max shard size must be positive, got {max_shard_bytes}")
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(n: int) -> list[str]:
    """``model.safetensors`` alone, else HF's ``model-00001-of-0000N.safetensors``."""
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def parse_size(text: str) -> int:
    """``"2GB"``, ``"500MB"``, ``"64KiB"`` or a plain byte count, as bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise InvalidArgumentError(f"bad size {text!r}; write e.g. 2GB, 500MB or 1048576")
    unit = (m.group(2) or "B").upper().rstrip("B") or "B"
    base = 1024 if unit.endswith("I") else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(float(m.group(1)) * base**power)


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    """Norm weights are 1, everything else (biases included) N(0, 0.02) from a per-name generator."""
    import torch

    tdtype = getattr(torch, dtype)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=tdtype)
    # Biases are random too (not zeros), so a loader that drops them is caught.
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * INIT_STD).to(tdtype)


def write_weights(
    out: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    seed: int,
    max_shard_bytes: int,
    on_tensor: Callable[[int], None] | None = None,
) -> list[str]:
    """Generate and write the weights shard by shard; returns the file names."""
    from safetensors.torch import save_file

    shards = plan_shards(shapes, dtype, max_shard_bytes)
    files = shard_file_names(len(shards))
    weight_map: dict[str, str] = {}
    for names, fname in zip(shards, files, strict=True):
        tensors = {}
        for name in names:
            tensors[name] = init_tensor(name, shapes[name], dtype, seed)
            weight_map[name] = fname
            if on_tensor is not None:
                on_tensor(tensors[name].numel() * DTYPE_BYTES[dtype])
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, 0o666 & ~current_umask())  # safetensors creates files 0600
        del tensors
    if len(files) > 1:
        total = sum(math.prod(s) for s in shapes.values()) * DTYPE_BYTES[dtype]
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_json(out / "model.safetensors.index.json", index)
    return files


# --- tokenizer files ---------------------------------------------------------------------


def tokenizer_files(
    preset: Preset, vocab_size: int, max_len: int
) -> tuple[str, dict[str, Any], dict[str, int | list[int] | None]]:
    """(tokenizer.json text, tokenizer_config.json dict, token ids for the configs)."""
    from kvtier.make_model.tokenizer_training import train_tokenizer
    from kvtier.models.tokenizer import Tokenizer

    fmt = get_format(preset.family)
    text = train_tokenizer(
        preset.family, min(preset.tokenizer_vocab, vocab_size), preset.pretokenizer
    )
    tok = Tokenizer.from_str(text)
    if tok.vocab_size > vocab_size:  # pragma: no cover - the trainer respects the cap
        raise InvalidArgumentError(f"tokenizer has {tok.vocab_size} ids > vocab {vocab_size}")
    eos_id = tok.special_token_id(fmt.eos_token)
    bos_id = tok.special_token_id(fmt.bos_token) if fmt.bos_token else eos_id
    stop_ids = [tok.special_token_id(t) for t in fmt.stop_tokens]
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    }
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fmt.bos_token,
        "eos_token": fmt.eos_token,
        "pad_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": fmt.jinja,
    }
    if fmt.name == "llama2":
        tcfg["unk_token"] = "<unk>"
    ids: dict[str, int | list[int] | None] = {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "stop_token_ids": stop_ids,
        "tokenizer_vocab_size": tok.vocab_size,
    }
    return text, tcfg, ids


# --- the command -------------------------------------------------------------------------


def make_model(
    preset: str | Preset,
    out: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    seed: int = 0,
    vocab_size: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    force: bool = False,
    progress: bool | None = None,
) -> MakeModelResult:
    """Write a random-weight HF checkpoint of ``preset`` to ``out`` (atomically)."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    dtype = dtype or p.default_dtype
    if dtype not in DTYPE_BYTES:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    vocab = vocab_size or p.vocab_size
    out_path = Path(out)
    check_destination(out_path, force)

    text, tcfg, ids = tokenizer_files(p, vocab, p.max_position_embeddings)
    config = build_config(
        p, dtype=dtype, vocab_size=vocab, bos_token_id=ids["bos_token_id"],  # type: ignore[arg-type]
        eos_token_id=ids["eos_token_id"],
    )
    shapes = parameter_shapes(config)
    n_params = parameter_count(config)
    weight_bytes = n_params * DTYPE_BYTES[dtype]

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_metadata(tmp, config, text, tcfg, ids, {
            "preset": p.name,
            "seed": seed,
            "dtype": dtype,
            "num_parameters": n_params,
            "vocab_size": vocab,
            "tokenizer_vocab_size": ids["tokenizer_vocab_size"],
            "chat_format": p.family,
            "note": "random weights; token ids >= tokenizer_vocab_size are padding",
        })
        show = progress if progress is not None else weight_bytes >= _PROGRESS_BYTES
        files = _write_weights_with_progress(
            tmp, shapes, dtype, seed, max_shard_bytes, weight_bytes, show, p.name
        )
        install_dir(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return MakeModelResult(
        path=out_path,
        config=config,
        num_parameters=n_params,
        weight_bytes=weight_bytes,
        weight_files=files,
        tokenizer_vocab_size=int(ids["tokenizer_vocab_size"]),  # type: ignore[arg-type]
    )


def _write_metadata(tmp: Path, config: dict, tokenizer: str, tokenizer_config: dict,
                    ids: dict, about: dict) -> None:
    """Everything of a checkpoint but its weights: config, tokenizer, generation config,
    and what make-model made it from (``make_model.json``)."""
    write_json(tmp / "config.json", config)
    (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
    write_json(tmp / "tokenizer_config.json", tokenizer_config)
    write_json(
        tmp / "generation_config.json",
        {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["stop_token_ids"]},
    )
    write_json(tmp / "make_model.json", about)


def _write_weights_with_progress(
    tmp: Path,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    seed: int,
    max_shard_bytes: int,
    total: int,
    show: bool,
    label: str,
) -> list[str]:
    if not show:
        return write_weights(tmp, shapes, dtype, seed, max_shard_bytes)
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(f"writing {label}", total=total)
        return write_weights(
            tmp, shapes, dtype, seed, max_shard_bytes, lambda n: bar.advance(task, n)
        )


def check_destination(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InvalidArgumentError(
            f"{out} is not empty; pass --force to replace it or choose another --out"
        )


def install_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` is removed only after."""
    old: Path | None = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- CLI ---------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight HF checkpoint at a real model's shapes",
        description=(
            "Write config.json, safetensors weights, a locally trained tokenizer and chat "
            "template for a preset architecture. Nothing is downloaded. Presets: "
            + ", ".join(PRESETS)
        ),
    )
    p.add_argument("--preset", required=True, metavar="NAME", help="one of: " + ", ".join(PRESETS))
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                   help="weight dtype (default: float32 for tiny presets, bfloat16 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="embedding rows (default: the real model's vocab)")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE",
                   help="split weights into shards of at most SIZE (default 2GB)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    result = make_model(
        args.preset,
        args.out,
        dtype=args.dtype,
        seed=args.seed,
        vocab_size=args.vocab_size,
        max_shard_bytes=parse_size(args.max_shard_size),
        force=args.force,
    )
    cfg = result.config
    print(
        f"wrote {result.path}: {cfg['architectures'][0]}, {result.num_parameters:,} parameters, "
        f"{result.weight_bytes / 1e6:,.1f} MB {cfg['torch_dtype']} in "
        f"{len(result.weight_files)} file(s); tokenizer {result.tokenizer_vocab_size} of "
        f"{cfg['vocab_size']} ids",
        file=sys.stdout,
    )
    return 0
