"""Convert a Llama-architecture GGUF file into a Hugging Face checkpoint the engine loads.

The ``gguf`` package reads the file and dequantizes its tensors; this module only maps
llama.cpp's names and layouts back to Hugging Face's:

- tensor names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
- the rotary permutation llama.cpp applies to the Q and K projections when it converts a
  Hugging Face checkpoint (undone here, or attention would rotate the wrong pairs);
- the metadata (``llama.*`` keys) -> ``config.json``;
- the vocabulary, merges and control tokens -> a ``tokenizers`` byte-level BPE with the
  pre-tokenizer its ``tokenizer.ggml.pre`` names, and the chat template ->
  ``tokenizer_config.json``.

Everything is written into a temporary sibling directory and renamed into place at the end,
as ``make-model`` does: an interrupted conversion never leaves a checkpoint that looks whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.chunk_format import DTYPE_BYTES
from kvtier.make_model.writer import (
    check_destination,
    current_umask,
    install_dir,
    shard_file_names,
    write_json,
)
from kvtier.models.checkpoint import expected_shapes
from kvtier.models.config import CheckpointError, ModelConfig

DEFAULT_MAX_SHARD_BYTES = 2_000_000_000

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre -> how text is split before the merges: llama.cpp's pre-tokenizer names,
# as HF tokenizers pipelines. "smollm" (and StarCoder's family) isolate every digit, then
# apply GPT-2's regex.
_PRE_TOKENIZERS = {
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "qwen2": "qwen2",
}
_CONTROL = 3  # llama.cpp token type of special (control) tokens


@dataclass(frozen=True)
class ConvertResult:
    """What was written, for callers and the CLI's summary line."""

    path: Path
    config: dict[str, Any]
    num_parameters: int
    weight_bytes: int
    weight_files: list[str]
    source: dict[str, Any]


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    provenance: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Write the HF checkpoint of ``gguf_path`` to ``out`` (atomically).

    ``progress(done, total)`` is called after each tensor with parameter counts.
    """
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    src = Path(gguf_path)
    reader = _open(src)
    meta = _Metadata(reader, src)
    out_path = Path(out)
    check_destination(out_path, force)
    config = _config(meta, reader, dtype)
    cfg = ModelConfig.from_dict(config, source=f"{src} (converted config)", name=out_path.name)
    tokenizer_json, tokenizer_config, generation_config = _tokenizer_files(meta, cfg)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.parent / f".{out_path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        files, n_params = _write_weights(reader, src, cfg, tmp, dtype, max_shard_bytes, progress)
        write_json(tmp / "config.json", config)
        (tmp / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
        write_json(tmp / "tokenizer_config.json", tokenizer_config)
        write_json(tmp / "generation_config.json", generation_config)
        source = {
            "converted_from": str(src),
            "gguf_name": meta.get("general.name"),
            "gguf_file_type": meta.get("general.file_type"),
            "dtype": dtype,
            "note": "weights dequantized from the GGUF file with the gguf package",
            **(provenance or {}),
        }
        write_json(tmp / "kvtier_source.json", source)
        _fsync_tree(tmp)
        install_dir(tmp, out_path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConvertResult(
        path=out_path,
        config=config,
        num_parameters=n_params,
        weight_bytes=n_params * DTYPE_BYTES[dtype],
        weight_files=files,
        source=source,
    )


# --- reading -----------------------------------------------------------------------------


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise CheckpointError(
            f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})"
        ) from exc


class _Metadata:
    """The GGUF key/value metadata, with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{self.path}: metadata {key!r} is unreadable: {exc}") from exc

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata {key!r} is missing")
        return value


def _config(meta: _Metadata, reader: Any, dtype: str) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise CheckpointError(
            f"{meta.path}: architecture {arch!r} is not supported; only 'llama' GGUF files "
            "(Llama, SmolLM, Mistral-style) can be converted"
        )
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise CheckpointError(
            f"{meta.path}: rope frequency factors (Llama 3.1-style rope scaling) are not "
            "supported in GGUF conversion yet"
        )
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{meta.path}: rope scaling {scaling!r} is not supported")
    heads = int(meta.require("llama.attention.head_count"))
    hidden = int(meta.require("llama.embedding_length"))
    tokens = meta.require("tokenizer.ggml.tokens")
    vocab = int(meta.get("llama.vocab_size", len(tokens)))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "torch_dtype": dtype,
    }


# --- weights -----------------------------------------------------------------------------


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for one the model does not use."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind != "weight":
        return None
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.weight"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rotary(weight: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's halves)."""
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensors(reader: Any, path: Path, cfg: ModelConfig) -> Iterator[tuple[str, Any]]:
    """(HF name, float32 numpy array) of every tensor the model needs, dequantized."""
    from gguf.quants import dequantize

    expected = expected_shapes(cfg)
    seen: set[str] = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise CheckpointError(f"{path}: tensor {t.name!r} has no place in a Llama model")
        try:
            array = dequantize(t.data, t.tensor_type)
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(
                f"{path}: cannot dequantize {t.name!r} ({t.tensor_type.name}): {exc}"
            ) from exc
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_rotary(array, cfg.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_rotary(array, cfg.num_key_value_heads)
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {t.name!r} for this config")
        if tuple(array.shape) != expected[name]:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has shape {list(array.shape)} after dequantizing, "
                f"expected {list(expected[name])} from the file's metadata"
            )
        seen.add(name)
        yield name, array
    missing = [n for n in expected if n not in seen]
    if missing:
        raise CheckpointError(f"{path}: lacks tensor(s) {', '.join(missing[:5])}")


def _write_weights(
    reader: Any,
    path: Path,
    cfg: ModelConfig,
    out: Path,
    dtype: str,
    max_shard_bytes: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[list[str], int]:
    """Write the weights in shards of at most ``max_shard_bytes``; returns (files, params)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    target = getattr(torch, dtype)
    width = DTYPE_BYTES[dtype]
    total = sum(int(np.prod(s)) for s in expected_shapes(cfg).values())
    shards: list[dict[str, Any]] = [{}]
    size = 0
    done = 0
    pending: list[Path] = []

    def flush() -> None:
        part = out / f".shard-{len(pending)}.safetensors"
        save_file(shards[-1], str(part), metadata={"format": "pt"})
        pending.append(part)

    for name, array in _tensors(reader, path, cfg):
        nbytes = array.size * width
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][name] = torch.tensor(array).to(target)  # copies: GGUF F32 tensors are read-only maps
        size += nbytes
        done += array.size
        if progress is not None:
            progress(done, total)
    flush()
    names = shard_file_names(len(pending))
    weight_map: dict[str, str] = {}
    for part, fname, tensors in zip(pending, names, shards, strict=True):
        os.rename(part, out / fname)
        os.chmod(out / fname, 0o666 & ~current_umask())  # safetensors creates files 0600
        weight_map.update({n: fname for n in tensors})
    if len(names) > 1:
        index = {"metadata": {"total_size": total * width}, "weight_map": weight_map}
        write_json(out / "model.safetensors.index.json", index)
    return names, total


# --- tokenizer ---------------------------------------------------------------------------


def _tokenizer_files(
    meta: _Metadata, cfg: ModelConfig
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json, generation_config.json)."""
    style = _pre_tokenizer_style(meta)
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(tokens) > cfg.vocab_size:
        raise CheckpointError(
            f"{meta.path}: {len(tokens)} tokens but only {cfg.vocab_size} embedding rows"
        )
    control = [(i, t) for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
               if ty == _CONTROL]
    tok = _bpe_tokenizer(meta, tokens, style, control)

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    added = {
        str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        for i, t in control
    }
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    generation_config = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return tok.to_str(), tokenizer_config, generation_config


def _pre_tokenizer_style(meta: _Metadata) -> str:
    """How text is split before the merges (a byte-level BPE vocabulary only)."""
    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{meta.path}: tokenizer model {kind!r} is not supported; only byte-level BPE "
            "('gpt2') vocabularies can be converted"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        raise CheckpointError(
            f"{meta.path}: no tokenizer.ggml.pre, so how text is split before the merges is "
            "unknown (an old conversion); convert the model again with a current llama.cpp"
        )
    style = _PRE_TOKENIZERS.get(pre)
    if style is None:
        raise CheckpointError(
            f"{meta.path}: pre-tokenizer {pre!r} is not supported; known: "
            f"{', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    return style


def _bpe_tokenizer(meta: _Metadata, tokens: list[str], style: str,
                   control: list[tuple[int, str]]) -> Any:
    """The byte-level BPE tokenizer of the vocabulary, its pre-tokenizer and special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{meta.path}: the vocabulary repeats tokens")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style.endswith("gpt2"))
    if style == "gpt2":
        tok.pre_tokenizer = byte_level
    elif style == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        split = _LLAMA3_SPLIT if style == "llama3" else _QWEN2_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in control])
    return tok


# --- files -------------------------------------------------------------------------------


def _fsync_tree(directory: Path) -> None:
    """Flush every file and the directory itself before the rename publishes them."""
    for p in directory.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
