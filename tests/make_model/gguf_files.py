"""Tiny GGUF files written the way llama.cpp's converter writes them, for fast conversion tests.

The weights come from a transformers model; Q and K rows get llama.cpp's rotary permutation,
and tensors can be stored quantized (Q8_0), so a conversion that forgets to undo either one
fails the round trip.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _bytes_to_unicode() -> list[str]:
    """The byte-level alphabet, in byte order (GPT-2's table, as kvtier's tokenizer has it)."""
    from kvtier.models.tokenizer import _bytes_to_unicode as table

    by_byte = table()
    return [by_byte[b] for b in range(256)]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def write_tiny_gguf(path: Path, hf_model, *, quantize: bool = False, arch: str = "llama",
                    drop: str | None = None) -> Path:
    """Write ``hf_model`` (a tiny LlamaForCausalLM) as a GGUF file at ``path``."""
    import gguf

    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    tokens = CONTROL_TOKENS + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for name, t in hf_model.state_dict().items():
        a = t.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            g = f"blk.{layer}.{_LAYER[rest.removesuffix('.weight')]}.weight"
        if g.endswith("attn_q.weight"):
            a = permute(a, heads)
        elif g.endswith("attn_k.weight"):
            a = permute(a, kv_heads)
        if g == drop:
            continue
        if quantize and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
