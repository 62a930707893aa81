"""``kvtier make-model``: HF loads what it writes, shapes are the real ones, writes are atomic."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from kvtier.cli.main import main  # noqa: E402
from kvtier.errors import InvalidArgumentError  # noqa: E402
from kvtier.make_model import writer as mm  # noqa: E402
from kvtier.make_model.presets import (  # noqa: E402
    PRESETS,
    build_config,
    kv_bytes_per_token,
    parameter_count,
    parameter_shapes,
)
from kvtier.models.tokenizer import Tokenizer  # noqa: E402

TINY = ["tiny", "tiny-qwen2", "tiny-mistral"]
TEXTS = ["Hello world, how are you?", "def f(x):\n    return x * 12345", "café 🙂 日本語 <|im_end|>"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {p: mm.make_model(p, root / p).path for p in TINY}


@pytest.mark.parametrize("preset", TINY)
def test_transformers_loads_it_and_agrees(made, preset):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = made[preset]
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (d / f).is_file(), f
    cfg_doc = json.loads((d / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(d)
    assert cfg.model_type == PRESETS[preset].arch
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    assert type(model).__name__ == cfg_doc["architectures"][0]
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert params == parameter_shapes(cfg_doc)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg_doc)

    ours = Tokenizer.from_dir(d)
    hf_tok = AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        assert hf_tok(text)["input_ids"] == ours.encode(text)
        assert hf_tok.decode(ours.encode(text, add_bos=False)) == text
    hf_text = hf_tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert hf_text == ours.chat_format.render_text(CONVERSATION, add_generation_prompt=True)
    assert set(ours.eos_token_ids) >= {cfg_doc["eos_token_id"]}

    ids = ours.apply_chat_template(CONVERSATION)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg_doc["vocab_size"])
    assert torch.isfinite(logits).all()


def test_same_seed_same_bytes_other_seed_other_weights(made, tmp_path):
    again = mm.make_model("tiny", tmp_path / "again").path
    other = mm.make_model("tiny", tmp_path / "other", seed=1).path
    first = made["tiny"]
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / f).read_bytes() == (first / f).read_bytes(), f
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (first / "tokenizer.json").read_bytes()


def test_sharded_checkpoint_has_a_complete_index_and_loads(made, tmp_path):
    from transformers import AutoModelForCausalLM

    d = mm.make_model("tiny", tmp_path / "sharded", max_shard_bytes=150_000).path
    index = json.loads((d / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 2 and not (d / "model.safetensors").exists()
    assert files == mm.shard_file_names(len(files))
    config = json.loads((d / "config.json").read_text())
    shapes = parameter_shapes(config)
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == parameter_count(config) * 4
    for name, fname in index["weight_map"].items():
        with safe_open(str(d / fname), "pt") as f:
            assert name in f.keys() and tuple(f.get_slice(name).get_shape()) == shapes[name]  # noqa: SIM118
    # Same seed, same tensors, whatever the shard layout: the models give the same logits.
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(d).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(made["tiny"]).eval()(ids).logits
    assert torch.equal(a, b)


def test_shard_plan():
    shapes = {"a": (10,), "b": (10,), "c": (100,), "d": (1,)}
    assert mm.plan_shards(shapes, "float32", 80) == [["a", "b"], ["c"], ["d"]]
    assert mm.plan_shards(shapes, "float32", 10**9) == [["a", "b", "c", "d"]]
    assert mm.shard_file_names(1) == ["model.safetensors"]
    assert mm.shard_file_names(2)[1] == "model-00002-of-00002.safetensors"
    with pytest.raises(InvalidArgumentError):
        mm.plan_shards(shapes, "float32", 0)


@pytest.mark.parametrize(
    "text, n", [("2GB", 2 * 10**9), ("500MB", 5 * 10**8), ("64KiB", 65536), ("123", 123)]
)
def test_parse_size(text, n):
    assert mm.parse_size(text) == n


def test_parse_size_rejects_junk():
    with pytest.raises(InvalidArgumentError, match="bad size"):
        mm.parse_size("lots")


# Published parameter counts (tied embeddings counted once).
REAL = {
    "smollm-135m": (134_515_008, dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                      num_key_value_heads=3, intermediate_size=1536,
                                      vocab_size=49152, tie_word_embeddings=True,
                                      rope_theta=10000.0)),
    "llama-3.2-1b": (1_235_814_400, dict(hidden_size=2048, num_hidden_layers=16,
                                        num_attention_heads=32, num_key_value_heads=8,
                                        intermediate_size=8192, vocab_size=128256,
                                        tie_word_embeddings=True, rope_theta=500000.0)),
    "llama-3-8b": (8_030_261_248, dict(hidden_size=4096, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=14336, vocab_size=128256,
                                      tie_word_embeddings=False, rope_theta=500000.0)),
    "llama-3.1-8b": (8_030_261_248, dict(hidden_size=4096, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8,
                                        intermediate_size=14336, vocab_size=128256,
                                        tie_word_embeddings=False, rope_theta=500000.0,
                                        max_position_embeddings=131072)),
    "qwen2-0.5b": (494_032_768, dict(hidden_size=896, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2,
                                    intermediate_size=4864, vocab_size=151936,
                                    tie_word_embeddings=True, rope_theta=1000000.0)),
}


@pytest.mark.parametrize("name", sorted(REAL))
def test_big_presets_have_the_real_shapes(name):
    count, dims = REAL[name]
    cfg = build_config(PRESETS[name], dtype="bfloat16")
    assert {k: cfg[k] for k in dims} == dims
    assert parameter_count(cfg) == count
    assert cfg["head_dim"] == (128 if "8b" in name else 64)
    if name in ("llama-3.2-1b", "llama-3.1-8b"):
        assert cfg["rope_scaling"] == {
            "rope_type": "llama3", "factor": 32.0 if name == "llama-3.2-1b" else 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    else:
        assert cfg["rope_scaling"] is None
    if name.startswith("qwen2"):
        assert "model.layers.0.self_attn.q_proj.bias" in parameter_shapes(cfg)
    if "8b" in name:
        assert kv_bytes_per_token(cfg, "bfloat16") == 128 * 1024  # DESIGN.md: 128 KiB/token


def test_vocab_is_padded_past_the_tokenizer(tmp_path):
    res = mm.make_model("tiny", tmp_path / "m", vocab_size=1500, dtype="bfloat16")
    cfg = json.loads((res.path / "config.json").read_text())
    assert cfg["vocab_size"] == 1500 and cfg["torch_dtype"] == "bfloat16"
    assert res.tokenizer_vocab_size == Tokenizer.from_dir(res.path).vocab_size == 1024
    with safe_open(str(res.path / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight")
    assert emb.shape == (1500, 64) and emb.dtype == torch.bfloat16
    # A vocab smaller than the preset's tokenizer trains a smaller tokenizer.
    small = mm.make_model("tiny", tmp_path / "s", vocab_size=600)
    assert small.tokenizer_vocab_size == 600


def test_refuses_a_non_empty_dir_unless_forced(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--force"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dirs left


def test_unknown_preset_lists_the_presets(tmp_path, capsys):
    assert main(["make-model", "--preset", "gpt-5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'gpt-5'" in err and all(p in err for p in PRESETS)
    assert not (tmp_path / "x").exists()


def test_other_bad_arguments(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        mm.make_model("tiny", tmp_path / "file")
    with pytest.raises(InvalidArgumentError, match="unknown dtype"):
        mm.make_model("tiny", tmp_path / "a", dtype="int8")
    with pytest.raises(InvalidArgumentError, match="at least"):
        mm.make_model("tiny", tmp_path / "b", vocab_size=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_crash_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(mm, "write_weights", boom)
    with pytest.raises(RuntimeError, match="disk on fire"):
        mm.make_model("tiny", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_path(tmp_path):
    res = mm.make_model("tiny-qwen2", tmp_path / "m", progress=True)
    assert (res.path / "model.safetensors").is_file()
