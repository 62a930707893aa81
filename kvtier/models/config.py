"""The model's shape, read from a Hugging Face ``config.json``.

One typed object for the Llama family (Llama 2/3/3.x, Qwen2, Mistral), checked once at load
time so a wrong or unsupported checkpoint fails with the file and the field named, before any
weight is read. Its fingerprint goes into the KV hash ``extra``, so KV computed by one model
can never be served to another.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

CONFIG_FILE = "config.json"

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPE_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}


class CheckpointError(ConfigError):
    """A checkpoint directory is missing files, or its files disagree with the model shape."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (``rope_type`` "default" means none)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Llama's flag: bias on q/k/v *and* o projections."""
    mlp_bias: bool = False
    sliding_window: int | None = None
    """Mistral's attention window; the engine does full attention, so it caps max_model_len."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    """The dtype the checkpoint was saved in (``dtype`` / ``torch_dtype``)."""
    name: str = ""
    """Model id: the checkpoint directory's name unless given."""

    @property
    def qkv_bias(self) -> bool:
        return self.architecture == "Qwen2ForCausalLM" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.architecture == "LlamaForCausalLM" and self.attention_bias

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        """Longest sequence served exactly: positions, capped by a sliding window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def fingerprint(self, kv_dtype: str, weights: str, salt: str | None = None) -> bytes:
        """Bytes naming the model and KV layout, for the chained KV hash's ``extra``: the
        architecture, every hyper-parameter the KV depends on, the KV dtype, the digest of
        the weights (:mod:`kvtier.models.weights_digest`) and an optional salt. Not the
        directory's name: the same weights anywhere share KV, other weights never do."""
        r = self.rope_scaling
        parts = [
            "kvtier-model-v2", self.architecture, f"V{self.vocab_size}",
            f"H{self.hidden_size}", f"I{self.intermediate_size}", f"L{self.num_hidden_layers}",
            f"QH{self.num_attention_heads}", f"KVH{self.num_key_value_heads}",
            f"D{self.head_dim}", f"eps{self.rms_norm_eps!r}", f"theta{self.rope_theta!r}",
            f"rope{r.rope_type}:{r.factor!r}:{r.low_freq_factor!r}:{r.high_freq_factor!r}:"
            f"{r.original_max_position_embeddings}",
            f"bias{int(self.qkv_bias)}{int(self.o_bias)}{int(self.mlp_bias)}",
            f"kv{kv_dtype}", f"w{weights}",
        ]
        if salt:
            parts.append(f"salt{len(salt)}:{salt}")
        return "|".join(parts).encode()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = CONFIG_FILE, name: str = ""
                  ) -> ModelConfig:
        """Parse a config.json mapping; ``source`` names the file in errors."""
        return _parse(raw, source, name)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``model_dir/config.json``."""
        path = Path(model_dir) / CONFIG_FILE
        if not Path(model_dir).is_dir():
            raise CheckpointError(f"model directory {model_dir} does not exist")
        if not path.is_file():
            raise CheckpointError(
                f"{path} not found: a Hugging Face checkpoint directory needs config.json"
            )
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path} must hold a JSON object at the top level")
        return _parse(raw, str(path), Path(model_dir).resolve().name)


# ---------------------------------------------------------------------------- parsing
def _bad(source: str, key: str, why: str) -> CheckpointError:
    return CheckpointError(f"{source}: field {key!r} {why}")


def _int(raw: dict[str, Any], key: str, source: str, default: int | None = None,
         minimum: int = 1, label: str = "") -> int:
    v = raw.get(key, default)
    if v is None:
        raise _bad(source, label or key, "is missing (required)")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _bad(source, label or key, f"must be an integer >= {minimum}, got {v!r}")
    return v


def _float(raw: dict[str, Any], key: str, source: str, default: float, label: str = "") -> float:
    v = raw.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise _bad(source, label or key, f"must be a positive number, got {v!r}")
    return float(v)


def _bool(raw: dict[str, Any], key: str, source: str, default: bool) -> bool:
    v = raw.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(source, key, f"must be true or false, got {v!r}")
    return v


def _architecture(raw: dict[str, Any], source: str) -> str:
    archs = raw.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise _bad(source, "architectures",
                   f"must be a non-empty list of names, got {archs!r}; supported: "
                   f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return a
    raise _bad(source, "architectures",
               f"names no supported architecture ({', '.join(archs)}); supported: "
               f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    """theta and scaling from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling`` pair."""
    params = raw.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = raw.get("rope_scaling")
        key = "rope_scaling"
    if params is not None and not isinstance(params, dict):
        raise _bad(source, key, f"must be an object, got {params!r}")
    params = params or {}
    if "rope_theta" in params:
        theta = _float(params, "rope_theta", source, 10000.0, label=f"{key}.rope_theta")
    else:
        theta = _float(raw, "rope_theta", source, 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _bad(source, f"{key}.rope_type",
                   f"is {rope_type!r}, which is not supported; supported: "
                   f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, RopeScaling()
    required = ["factor"]
    if rope_type == "llama3":
        required += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    for req in required:
        if params.get(req) is None:
            raise _bad(source, f"{key}.{req}", f"is missing (required for rope_type {rope_type!r})")
    factor = _float(params, "factor", source, 1.0, label=f"{key}.factor")
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor)
    low = _float(params, "low_freq_factor", source, 1.0, label=f"{key}.low_freq_factor")
    high = _float(params, "high_freq_factor", source, 4.0, label=f"{key}.high_freq_factor")
    orig = _int(params, "original_max_position_embeddings", source,
                label=f"{key}.original_max_position_embeddings")
    if high <= low:
        raise _bad(source, f"{key}.high_freq_factor",
                   f"({high}) must be greater than low_freq_factor ({low})")
    return theta, RopeScaling("llama3", factor, low, high, orig)


def _eos(raw: dict[str, Any], source: str) -> tuple[int, ...]:
    v = raw.get("eos_token_id")
    if v is None:
        return ()
    ids = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise _bad(source, "eos_token_id", f"must be a token id or a list of them, got {v!r}")
    return tuple(ids)


def _dtype(raw: dict[str, Any], source: str) -> str:
    key = "dtype" if raw.get("dtype") is not None else "torch_dtype"
    v = raw.get(key) or "float32"
    if not isinstance(v, str) or v.removeprefix("torch.") not in _DTYPE_NAMES:
        raise _bad(source, key, f"is {v!r}; supported: float32, float16, bfloat16")
    return _DTYPE_NAMES[v.removeprefix("torch.")]


def _parse(raw: dict[str, Any], source: str, name: str) -> ModelConfig:
    arch = _architecture(raw, source)
    hidden = _int(raw, "hidden_size", source)
    heads = _int(raw, "num_attention_heads", source)
    kv_heads = _int(raw, "num_key_value_heads", source, default=heads)
    if heads % kv_heads:
        raise _bad(source, "num_key_value_heads",
                   f"({kv_heads}) must divide num_attention_heads ({heads})")
    if raw.get("head_dim") is None and hidden % heads:
        raise _bad(source, "hidden_size",
                   f"({hidden}) is not divisible by num_attention_heads ({heads}) and no "
                   "head_dim is given")
    head_dim = _int(raw, "head_dim", source, default=hidden // heads)
    if head_dim % 2:
        raise _bad(source, "head_dim", f"must be even for RoPE, got {head_dim}")
    theta, scaling = _rope(raw, source)
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _bad(source, "hidden_act", f"is {act!r}; only silu (SwiGLU) is supported")
    sliding = None
    windowed = arch == "MistralForCausalLM" or raw.get("use_sliding_window") is True
    if windowed and raw.get("sliding_window") is not None:
        sliding = _int(raw, "sliding_window", source)
    bos = raw.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise _bad(source, "bos_token_id", f"must be a token id, got {bos!r}")
    return ModelConfig(
        architecture=arch,
        vocab_size=_int(raw, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", source),
        num_hidden_layers=_int(raw, "num_hidden_layers", source),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_float(raw, "rms_norm_eps", source, 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(raw, "max_position_embeddings", source, default=2048),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", source, False),
        attention_bias=_bool(raw, "attention_bias", source, False),
        mlp_bias=_bool(raw, "mlp_bias", source, False),
        sliding_window=sliding,
        bos_token_id=bos,
        eos_token_ids=_eos(raw, source),
        torch_dtype=_dtype(raw, source),
        name=name,
    )
