"""The Llama-family decoder (Llama 2/3/3.x, Qwen2, Mistral) on the paged KV pool.

Inference only, plain torch ops, module names equal to Hugging Face's so a checkpoint's state
dict loads as is. Inputs are flattened: the new tokens of every sequence in the batch are
packed into one ``[T]`` vector; each layer writes their K/V into the pool through the slot
mapping and attends over the pool with the paged kernels (Triton on CUDA, the torch
reference on CPU). Logits are computed only for the rows asked for, since the LM head is the
largest matmul of a decode step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.gpu_pool.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from kvtier.models.config import ModelConfig, RopeScaling


@dataclass
class AttentionMetadata:
    """Where the packed tokens of one step live in the pool.

    ``slot_mapping[t]`` is token ``t``'s pool slot (-1: its KV is already there, skip the
    write); sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and has
    ``context_lens[b]`` tokens in the pool once this step's tokens are written.
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_context_len: int
    is_decode: bool
    """Every sequence feeds exactly one token: the decode kernel runs instead of prefill."""


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), with linear or llama3 scaling."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    if scaling.rope_type != "llama3":
        return inv
    # Llama 3.1: keep high frequencies, divide low ones by factor, blend in between.
    s = scaling
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_positions``, precomputed in fp32."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | None = None):
        super().__init__()
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` (rotate-half convention, as HF)."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the model dtype (as HF does)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope(positions, q, k)
        write_kv(k, v, kv_layer, meta.slot_mapping)
        if meta.is_decode:
            o = paged_decode_attention(q, kv_layer, meta.block_tables, meta.context_lens,
                                       max_context_len=meta.max_context_len)
        else:
            o = paged_prefill_attention(q, kv_layer, meta.block_tables, meta.context_lens,
                                        meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b)
        self.up_proj = nn.Linear(h, i, bias=b)
        self.down_proj = nn.Linear(i, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_layer, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's ``model.`` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The whole decoder plus LM head; ``forward`` runs one packed step on the pool."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions or cfg.max_model_len
        self.rope: RotaryEmbedding | None = None

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor],
                        max_positions: int | None = None) -> CausalLM:
        """Build without random init (meta tensors), then adopt the loaded weights."""
        with torch.device("meta"):
            model = cls(cfg, max_positions)
        state = dict(state)
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        device = model.model.embed_tokens.weight.device
        model.rope = RotaryEmbedding(cfg, model.max_positions, device)
        return model.eval()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None,
                before_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (fp32) for the packed tokens.

        ``kv_cache`` is the pool's ``[layers, num_blocks, 2, block_size, kv_heads,
        head_dim]`` tensor; ``logits_indices`` picks rows of the packed batch (default: all).
        ``before_layer(i)`` runs before layer ``i`` (a streamed restore waits there for the
        layer's KV to have arrived).
        """
        assert self.rope is not None, "build the model with CausalLM.from_state_dict"
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, positions, self.rope, kv_cache[i], meta)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x)).float()
