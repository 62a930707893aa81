"""Model presets for ``kvtier make-model``: real architectures' shapes, as HF ``config.json``.

The big presets copy the published configs of their namesakes (dims, rope, tying), so a
random-weight checkpoint made from them costs exactly what the real model costs in KV bytes,
FLOPs and memory. The tiny presets are for tests: same code paths, seconds to build.
Parameter counts are computed from shapes alone, so nothing is allocated to know a size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from kvtier.chunk_format import DTYPE_BYTES
from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True)
class Preset:
    """One architecture at one size; ``family`` picks the tokenizer and chat template."""

    name: str
    arch: str  # "llama" | "qwen2" | "mistral"
    family: str  # "llama3" | "chatml" | "llama2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_scaling: dict[str, Any] | None = None
    default_dtype: str = "bfloat16"
    # Target size of the locally trained BPE vocab (<= vocab_size; the rest is padding).
    tokenizer_vocab: int = 8192
    # Pre-tokenizer split of the real model: "gpt2", "llama3" (digits in 3s) or "qwen2"
    # (single digits, NFC); transformers rebuilds Qwen2's, so ours must be the same.
    pretokenizer: str = "gpt2"
    extra: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            name="tiny",
            arch="llama",
            family="llama3",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            max_position_embeddings=2048,
            # llama3 scaling that bites at tiny scale, so tests exercise it.
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
            default_dtype="float32",
            tokenizer_vocab=1024,
            pretokenizer="llama3",
            description="test model: Llama 3 arch, GQA, llama3 rope scaling, untied",
        ),
        Preset(
            name="tiny-qwen2",
            arch="qwen2",
            family="chatml",
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            vocab_size=1024,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            default_dtype="float32",
            tokenizer_vocab=1024,
            extra={"use_sliding_window": False, "sliding_window": None, "max_window_layers": 2},
            pretokenizer="qwen2",
            description="test model: Qwen2 arch, qkv bias, tied, ChatML",
        ),
        Preset(
            name="tiny-mistral",
            arch="mistral",
            family="llama2",
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            max_position_embeddings=4096,
            default_dtype="float32",
            tokenizer_vocab=1024,
            extra={"sliding_window": None},
            description="test model: Mistral arch, [INST] template, untied",
        ),
        Preset(
            name="smollm-135m",
            arch="llama",
            family="chatml",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            max_position_embeddings=2048,
            description="HuggingFaceTB/SmolLM-135M shapes",
        ),
        Preset(
            name="llama-3.2-1b",
            arch="llama",
            family="llama3",
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling=dict(_LLAMA3_SCALING),
            pretokenizer="llama3",
            description="meta-llama/Llama-3.2-1B shapes",
        ),
        Preset(
            name="llama-3-8b",
            arch="llama",
            family="llama3",
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            max_position_embeddings=8192,
            pretokenizer="llama3",
            description="meta-llama/Meta-Llama-3-8B shapes",
        ),
        Preset(
            name="qwen2-0.5b",
            arch="qwen2",
            family="chatml",
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            extra={"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 24},
            pretokenizer="qwen2",
            description="Qwen/Qwen2-0.5B shapes",
        ),
    ]
}
PRESETS["llama-3.1-8b"] = replace(
    PRESETS["llama-3-8b"], name="llama-3.1-8b", max_position_embeddings=131072,
    rope_scaling={**_LLAMA3_SCALING, "factor": 8.0},
    description="meta-llama/Llama-3.1-8B shapes (128k context: long-history benchmarks)")
"""Llama-3-8B's shapes with Llama 3.1's context and rope scaling."""

_ARCH_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; an error listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None


def build_config(
    preset: Preset,
    *,
    dtype: str,
    vocab_size: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``preset`` (token ids are the local tokenizer's)."""
    cfg: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[preset.arch]],
        "model_type": preset.arch,
        "hidden_act": "silu",
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "head_dim": preset.head_dim,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_theta": preset.rope_theta,
        "rope_scaling": dict(preset.rope_scaling) if preset.rope_scaling else None,
        "max_position_embeddings": preset.max_position_embeddings,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "vocab_size": vocab_size or preset.vocab_size,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if preset.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    cfg.update(preset.extra)
    return cfg


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF weight names and shapes of a Llama/Qwen2/Mistral ``config.json``, in file order."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    nh = config["num_attention_heads"]
    nkv = config["num_key_value_heads"]
    hd = config.get("head_dim") or h // nh
    vocab = config["vocab_size"]
    bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, h)
            if bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


def parameter_count(config: dict[str, Any]) -> int:
    """Number of parameters (tied embeddings counted once), from shapes only."""
    return sum(math.prod(s) for s in parameter_shapes(config).values())


def checkpoint_bytes(config: dict[str, Any], dtype: str) -> int:
    """Bytes of the weights on disk in ``dtype`` (safetensors headers excluded)."""
    return parameter_count(config) * DTYPE_BYTES[dtype]


def kv_bytes_per_token(config: dict[str, Any], dtype: str) -> int:
    """2 x layers x kv_heads x head_dim x element bytes (DESIGN.md's formula)."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * hd
        * DTYPE_BYTES[dtype]
    )
