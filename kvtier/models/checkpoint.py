"""Load a Hugging Face safetensors checkpoint into a state dict with HF tensor names.

Every expected tensor must be present with the shape the :class:`ModelConfig` implies, and
nothing unexpected may be left over: a checkpoint that does not match its config fails here,
naming the file and the tensor, instead of producing plausible garbage later.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvtier.gpu_pool.kv_storage import resolve_dtype
from kvtier.models.config import CheckpointError, ModelConfig

__all__ = ["CheckpointError", "expected_shapes", "load_checkpoint", "load_state_dict"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HARMLESS_SUFFIXES = ("rotary_emb.inv_freq",)
"""Buffers some exporters save that the model recomputes; ignored when present."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model needs."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out, h)
            if cfg.qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
            shapes[f"{p}mlp.{proj}_proj.weight"] = shape
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{proj}_proj.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it, from the shard index or the single file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{index} is not a valid shard index (JSON with a 'weight_map'): {exc}"
            ) from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to files")
        files = {name: model_dir / str(f) for name, f in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise CheckpointError(f"shard {f} named in {index} is missing")
        return files
    single = model_dir / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} (only "
            "safetensors checkpoints are supported)"
        )
    return {"": single}


def load_state_dict(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Read and validate every weight, converted to ``dtype`` on ``device``."""
    model_dir = Path(model_dir)
    target = resolve_dtype(dtype)
    expected = expected_shapes(cfg)
    by_file: dict[Path, list[str] | None] = {}
    for name, path in checkpoint_files(model_dir).items():
        if name == "":
            by_file[path] = None  # single file: every tensor in it
        else:
            names = by_file.setdefault(path, [])
            assert names is not None
            names.append(name)
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = list(f.keys())
                for name in keys if names is None else names:
                    if name not in keys:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} is listed in {INDEX_FILE} but not in "
                            "the file"
                        )
                    _check_name(name, expected, cfg, path)
                    if name not in expected:
                        continue  # harmless extra (tied lm_head, rotary buffers)
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != expected[name]:
                        raise CheckpointError(
                            f"{path}: tensor {name!r} has shape {list(shape)}, expected "
                            f"{list(expected[name])} from config.json"
                        )
                    state[name] = f.get_tensor(name).to(device=device, dtype=target)
                    where[name] = path
        except SafetensorError as exc:
            raise CheckpointError(f"{path} is not a valid safetensors file: {exc}") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    missing = [n for n in expected if n not in state]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensor(s) {', '.join(missing[:5])}{more} that "
            "config.json implies; the weights and config.json do not belong together"
        )
    return state


def _check_name(name: str, expected: dict[str, tuple[int, ...]], cfg: ModelConfig,
                path: Path) -> None:
    """Reject tensors the model would silently drop."""
    if name in expected or name.endswith(HARMLESS_SUFFIXES):
        return
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return  # a tied checkpoint may still carry the copy
    raise CheckpointError(
        f"{path}: unexpected tensor {name!r} (config.json describes a "
        f"{cfg.architecture} with {cfg.num_hidden_layers} layers, "
        f"attention_bias={cfg.attention_bias}); the weights and config.json do not match"
    )


def load_checkpoint(
    model_dir: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and validated state dict of a checkpoint directory."""
    cfg = ModelConfig.from_pretrained(model_dir)
    return cfg, load_state_dict(model_dir, cfg, dtype, device)
