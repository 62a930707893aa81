"""ModelConfig: config.json of each architecture, old and new rope keys, and errors that name
the file and the field."""

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.models.config import CheckpointError, ModelConfig, RopeScaling

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
}


def write(tmp_path, raw) -> str:
    (tmp_path / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(tmp_path)


def test_defaults_from_minimal_llama_config(tmp_path):
    cfg = ModelConfig.from_pretrained(write(tmp_path, BASE))
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling == RopeScaling()
    assert not cfg.qkv_bias and not cfg.o_bias and not cfg.tie_word_embeddings
    assert cfg.name == tmp_path.name and cfg.torch_dtype == "float32"


def test_transformers_written_configs(tiny_checkpoint):
    _, d = tiny_checkpoint("llama3")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    _, d = tiny_checkpoint("qwen2")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None
    _, d = tiny_checkpoint("mistral")
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.sliding_window == 4096 and cfg.max_model_len == 512


def test_legacy_rope_keys_and_eos_list(tmp_path):
    raw = dict(BASE, rope_theta=500000.0, torch_dtype="bfloat16", eos_token_id=[1, 7],
               rope_scaling={"type": "linear", "factor": 2.0}, num_key_value_heads=2,
               tie_word_embeddings=True, attention_bias=True)
    cfg = ModelConfig.from_pretrained(write(tmp_path, raw))
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == RopeScaling("linear", 2.0)
    assert cfg.eos_token_ids == (1, 7) and cfg.torch_dtype == "bfloat16"
    assert cfg.tie_word_embeddings and cfg.qkv_bias and cfg.o_bias


def test_fingerprint_separates_models_weights_dtypes_and_salts():
    a = ModelConfig.from_dict(BASE, name="m")
    b = ModelConfig.from_dict(dict(BASE, num_hidden_layers=3), name="m")
    eps = ModelConfig.from_dict(dict(BASE, rms_norm_eps=1e-5), name="m")
    assert a.fingerprint("float16", "w1") == a.fingerprint("float16", "w1")
    prints = {a.fingerprint("float16", "w1"), a.fingerprint("bfloat16", "w1"),
              b.fingerprint("float16", "w1"), eps.fingerprint("float16", "w1"),
              a.fingerprint("float16", "w2"), a.fingerprint("float16", "w1", salt="tenant-a")}
    assert len(prints) == 6
    # The directory's name is not the model: the same weights elsewhere share KV.
    assert ModelConfig.from_dict(BASE, name="n").fingerprint("float16", "w1") == a.fingerprint(
        "float16", "w1")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("{not json", ["not valid JSON"]),
        ("[1, 2]", ["JSON object"]),
        (dict(BASE, architectures=["GPT2LMHeadModel"]),
         ["'architectures'", "GPT2LMHeadModel", "Qwen2ForCausalLM"]),
        ({k: v for k, v in BASE.items() if k != "hidden_size"}, ["'hidden_size'", "missing"]),
        (dict(BASE, vocab_size="100"), ["'vocab_size'", "integer"]),
        (dict(BASE, num_key_value_heads=3), ["'num_key_value_heads'", "divide"]),
        (dict(BASE, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         ["rope_scaling.rope_type", "yarn", "llama3"]),
        (dict(BASE, rope_parameters={"rope_type": "llama3", "factor": 8.0}),
         ["rope_parameters.low_freq_factor", "missing"]),
        (dict(BASE, rms_norm_eps=-1), ["'rms_norm_eps'", "positive"]),
        (dict(BASE, torch_dtype="int8"), ["'torch_dtype'", "int8"]),
        (dict(BASE, hidden_act="gelu"), ["'hidden_act'", "silu"]),
    ],
)
def test_config_errors_name_file_and_field(tmp_path, raw, words):
    with pytest.raises(CheckpointError) as err:
        ModelConfig.from_pretrained(write(tmp_path, raw))
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg
    for w in words:
        assert w in msg


def test_missing_config_and_directory(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    assert issubclass(CheckpointError, ConfigError)


def test_qwen2_window_counts_only_when_enabled():
    raw = dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=64,
               max_position_embeddings=4096)
    assert ModelConfig.from_dict(raw).max_model_len == 4096
    assert ModelConfig.from_dict(dict(raw, use_sliding_window=True)).max_model_len == 64
