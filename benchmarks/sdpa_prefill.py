"""A torch-SDPA prefill of kvtier's Llama-family model: the recompute reference of
``kvtier bench ttft``.

The engine's recompute runs kvtier's own paged prefill; a serving engine would run a fused
attention kernel. This forward is what torch alone does with the same weights: plain ops,
one pass over the whole prompt with ``scaled_dot_product_attention(is_causal=True)`` (the
fused kernels on a GPU; never an ``[n, n]`` score matrix of our own), no paged pool, and
logits of the last token only. Weights come from kvtier's checkpoint loader or from a
runner's model, so both run exactly the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from kvtier.gpu_pool.kv_storage import resolve_device, resolve_dtype
from kvtier.models.checkpoint import load_checkpoint
from kvtier.models.config import ModelConfig
from kvtier.models.llama import CausalLM, rope_inv_freq

__all__ = ["SDPAPrefill"]


def _sdpa_supports_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (added in torch 2.5)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


class SDPAPrefill:
    """Prefill of one prompt with torch SDPA; :meth:`last_logits` is the timed call."""

    def __init__(self, cfg: ModelConfig, state: dict[str, torch.Tensor]):
        self.config = cfg
        self.w = dict(state)
        if cfg.tie_word_embeddings or "lm_head.weight" not in self.w:
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        emb = self.w["model.embed_tokens.weight"]
        self.device, self.dtype = emb.device, emb.dtype
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(
            self.device)
        self.gqa = "enable_gqa" if _sdpa_supports_gqa() else "repeat_kv"
        """How grouped K/V heads meet the query heads: SDPA's own ``enable_gqa``, or K/V
        repeated per query head (older torch, or no fused CUDA kernel takes GQA)."""

    @classmethod
    def load(cls, model_dir: str | Path, dtype: str = "auto", device: str = "auto"
             ) -> SDPAPrefill:
        """Read a checkpoint with kvtier's loader (same checks, same dtype conversion)."""
        dev = resolve_device(device)
        cfg, state = load_checkpoint(model_dir, resolve_dtype(dtype, dev), dev)
        return cls(cfg, state)

    @classmethod
    def from_model(cls, model: CausalLM) -> SDPAPrefill:
        """Share a loaded :class:`~kvtier.models.llama.CausalLM`'s tensors (no copy): the
        engine's very weights, without a second copy of them in memory."""
        return cls(model.config, dict(model.state_dict()))

    @torch.inference_mode()
    def last_logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[vocab]`` of the prompt's last token after one causal pass."""
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long).to(self.device)
        n = ids.shape[0]
        cos, sin = self._rope(n)
        x = F.embedding(ids, self.w["model.embed_tokens.weight"])
        with _fused_only(self.device):
            for i in range(cfg.num_hidden_layers):
                p = f"model.layers.{i}."
                x = x + self._attention(self._norm(x, p + "input_layernorm.weight"), p, cos,
                                        sin)
                x = x + self._mlp(self._norm(x, p + "post_attention_layernorm.weight"), p)
        last = self._norm(x[-1:], "model.norm.weight")
        return F.linear(last, self.w["lm_head.weight"])[0].float()

    # ----------------------------------------------------------------- layers
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm in fp32, scaled in the model dtype, as Hugging Face computes it."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return self.w[name] * xf.to(x.dtype)

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, 1, head_dim]`` of positions ``0..n-1`` in the model dtype."""
        pos = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attention(self, x: torch.Tensor, p: str, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
        cfg = self.config
        n, d = x.shape[0], cfg.head_dim
        q = self._linear(x, p + "self_attn.q_proj").view(n, cfg.num_attention_heads, d)
        k = self._linear(x, p + "self_attn.k_proj").view(n, cfg.num_key_value_heads, d)
        v = self._linear(x, p + "self_attn.v_proj").view(n, cfg.num_key_value_heads, d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # [1, heads, n, d]: SDPA's batch, head, sequence layout.
        o = self._sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
        o = o[0].transpose(0, 1).reshape(n, cfg.q_size)
        return self._linear(o, p + "self_attn.o_proj")

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal SDPA (on CUDA, fused kernels only: see :func:`_fused_only`). If none of
        them takes ``enable_gqa`` here, K/V are repeated per query head from then on."""
        if self.gqa == "enable_gqa":
            try:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      enable_gqa=True)
            except torch.cuda.OutOfMemoryError:
                raise  # not a kernel choice: repeated K/V would need more memory still
            except RuntimeError:
                if q.device.type != "cuda":
                    raise
                self.gqa = "repeat_kv"
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        """SwiGLU over every token at once."""
        gate = F.silu(self._linear(x, p + "mlp.gate_proj"))
        return self._linear(gate * self._linear(x, p + "mlp.up_proj"), p + "mlp.down_proj")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _fused_only(device: torch.device):
    """On CUDA, SDPA restricted to its fused backends (flash, cuDNN, memory-efficient): an
    unsupported case fails instead of falling back to the math kernel, whose ``[heads, n,
    n]`` scores take 64 GiB at 32k tokens. Elsewhere, torch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
    return sdpa_kernel([getattr(SDPBackend, b) for b in names if hasattr(SDPBackend, b)])
