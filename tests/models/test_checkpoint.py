"""Checkpoint loading: single and sharded files, dtype conversion, tied embeddings, and errors
naming the file and the tensor for every way a checkpoint can be broken."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvtier.models.checkpoint import expected_shapes, load_checkpoint
from kvtier.models.config import CheckpointError


@pytest.fixture
def llama_dir(tiny_checkpoint, tmp_path):
    """A private copy of the tiny Llama checkpoint that a test may break."""
    _, src = tiny_checkpoint("llama")
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    return dst


def test_single_file_matches_hf_state_dict(tiny_checkpoint):
    model, d = tiny_checkpoint("llama")
    cfg, state = load_checkpoint(d)
    hf = model.state_dict()
    assert set(state) == set(expected_shapes(cfg)) == set(hf)
    for name, t in state.items():
        assert t.dtype == torch.float32 and torch.equal(t, hf[name]), name


def test_sharded_checkpoint_and_dtype(tiny_checkpoint):
    model, d = tiny_checkpoint("qwen2", max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    _, state = load_checkpoint(d, dtype="bfloat16")
    hf = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.bias" in state
    for name, t in state.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, hf[name].to(torch.bfloat16)), name


def test_tied_embeddings_need_no_lm_head(tiny_checkpoint):
    _, d = tiny_checkpoint("llama", tie_word_embeddings=True)
    cfg, state = load_checkpoint(d, dtype="float16")
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    assert state["model.embed_tokens.weight"].dtype == torch.float16


def test_missing_weights_file(tmp_path, llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(llama_dir)


def test_truncated_file_names_it(llama_dir):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(llama_dir)
    assert str(path) in str(err.value) and "not a valid safetensors file" in str(err.value)


def _rewrite(path, edit):
    state = load_file(path)
    edit(state)
    save_file(state, path)


def test_wrong_shape_names_tensor_and_shapes(llama_dir):
    path = llama_dir / "model.safetensors"
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(path, lambda s: s.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(llama_dir)
    msg = str(err.value)
    assert str(path) in msg and name in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_missing_tensor_is_named(llama_dir):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite(llama_dir / "model.safetensors", lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(llama_dir)


def test_unexpected_tensor_is_an_error_but_inv_freq_is_not(llama_dir):
    path = llama_dir / "model.safetensors"
    _rewrite(path, lambda s: s.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq",
                                           torch.ones(8)))
    load_checkpoint(llama_dir)
    _rewrite(path, lambda s: s.__setitem__("model.layers.2.mlp.up_proj.weight",
                                           torch.ones(128, 64)))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(llama_dir)
    assert "unexpected tensor 'model.layers.2.mlp.up_proj.weight'" in str(err.value)


def test_unknown_architecture_names_config(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="FalconForCausalLM"):
        load_checkpoint(llama_dir)


def test_missing_shard_is_named(tiny_checkpoint, tmp_path):
    _, src = tiny_checkpoint("qwen2", max_shard_size="100KB")
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(d)
    assert str(shard) in str(err.value) and "missing" in str(err.value)


def test_index_listing_a_tensor_its_shard_lacks(tiny_checkpoint, tmp_path):
    _, src = tiny_checkpoint("qwen2", max_shard_size="100KB")
    d = tmp_path / "sharded"
    shutil.copytree(src, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    shard = d / index["weight_map"][name]
    _rewrite(shard, lambda s: s.pop(name))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(d)
    assert name in str(err.value) and str(shard) in str(err.value)
