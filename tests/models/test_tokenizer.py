"""The engine's tokenizer: training determinism, round trips, streaming, special tokens, errors."""

from __future__ import annotations

import functools
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError, KVTierError
from kvtier.make_model.tokenizer_training import generate_corpus, train_tokenizer
from kvtier.models.tokenizer import Tokenizer, TokenizerError

STYLES = {"llama3": ("llama3", "llama3"), "chatml": ("chatml", "qwen2"), "llama2": ("llama2", "gpt2")}
SAMPLES = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "def f(x):\n    return x * 12345\n",
    "café naïve Straße Ångström",
    "日本語のテキスト and 中文",
    "emoji 🙂🚀👍🏽 ❤️ family 👨‍👩‍👧",
    "",
]


@functools.cache
def tok(name: str) -> Tokenizer:
    family, style = STYLES[name]
    return Tokenizer.from_str(train_tokenizer(family, 1024, style))


def test_training_is_deterministic_and_fills_the_vocab():
    a = train_tokenizer("llama3", 1024, "llama3")
    assert a == train_tokenizer("llama3", 1024, "llama3")
    assert Tokenizer.from_str(a).vocab_size == 1024
    assert generate_corpus(0) == generate_corpus(0) != generate_corpus(1)
    # A vocab the corpus cannot fill stops early (the model pads the rest).
    big = Tokenizer.from_str(train_tokenizer("chatml", 50_000))
    assert 2000 < big.vocab_size < 50_000


def test_too_small_vocab_is_refused():
    with pytest.raises(InvalidArgumentError, match="at least"):
        train_tokenizer("llama3", 200)


@pytest.mark.parametrize("name", sorted(STYLES))
@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_samples(name, text):
    t = tok(name)
    ids = t.encode(text, add_bos=False)
    assert t.decode(ids) == text
    assert all(0 <= i < t.vocab_size for i in ids)


@pytest.mark.parametrize("name", sorted(STYLES))
@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_any_text(name, text):
    t = tok(name)
    expected = unicodedata.normalize("NFC", text) if name == "chatml" else text  # qwen2: NFC
    assert t.decode(t.encode(text, add_bos=False)) == expected


def test_bos_and_stop_ids():
    llama3 = tok("llama3")
    assert llama3.bos_token_id == llama3.special_token_id("<|begin_of_text|>")
    assert llama3.encode("hi")[0] == llama3.bos_token_id
    assert llama3.encode("hi", add_bos=False)[0] != llama3.bos_token_id
    assert set(llama3.eos_token_ids) == {
        llama3.special_token_id("<|end_of_text|>"),
        llama3.special_token_id("<|eot_id|>"),
    }
    chatml = tok("chatml")
    assert chatml.bos_token_id is None and chatml.encode("hi") == chatml.encode("hi", add_bos=False)
    assert set(chatml.eos_token_ids) == {
        chatml.special_token_id("<|endoftext|>"),
        chatml.special_token_id("<|im_end|>"),
    }
    with pytest.raises(TokenizerError, match="no BOS"):
        chatml.encode("hi", add_bos=True)
    llama2 = tok("llama2")
    assert (llama2.bos_token_id, llama2.eos_token_ids) == (1, [2])  # as Llama 2: <unk> <s> </s>


def test_special_tokens_parse_or_not():
    t = tok("llama3")
    eot = t.special_token_id("<|eot_id|>")
    assert t.encode("a<|eot_id|>b", add_bos=False).count(eot) == 1
    assert eot not in t.encode("a<|eot_id|>b", add_bos=False, parse_special=False)
    assert t.decode(t.encode("a<|eot_id|>b", add_bos=False), skip_special_tokens=True) == "ab"
    assert t.is_special(eot) and not t.is_special(300)
    assert t.special_tokens["<|eot_id|>"] == eot
    with pytest.raises(TokenizerError, match="no special token '<\\|im_end\\|>'"):
        t.special_token_id("<|im_end|>")


@pytest.mark.parametrize("name", sorted(STYLES))
@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40))
def test_stream_of_encoded_text_matches_and_never_breaks_characters(name, text):
    t = tok(name)
    ids = t.encode(text, add_bos=False)
    stream = t.stream()
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.finish())
    assert "".join(deltas) == stream.text == t.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("name", sorted(STYLES))
@pytest.mark.parametrize("skip", [False, True])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stream_of_any_ids_equals_decode(name, skip, data):
    t = tok(name)
    ids = data.draw(st.lists(st.integers(0, t.vocab_size + 10), max_size=30))
    stream = t.stream(skip_special_tokens=skip)
    text = stream.extend(ids) + stream.finish()
    assert text == t.decode(ids, skip_special_tokens=skip)


def test_from_dir_reads_configs_and_names_bad_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text(train_tokenizer("chatml", 600))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2, 7]}')
    t = Tokenizer.from_dir(tmp_path)
    assert 7 in t.eos_token_ids and t.chat_format.name == "chatml"
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(TokenizerError, match="generation_config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(TokenizerError, match="tokenizer.json: not a valid"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="tokenizer.json: tokenizer file not found") as e:
        Tokenizer.from_dir(tmp_path / "missing")
    assert isinstance(e.value, KVTierError) and str(tmp_path / "missing") in str(e.value)
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "nope.json")


def test_token_bytes_range_and_chat_errors():
    t = tok("llama2")
    with pytest.raises(TokenizerError, match="negative"):
        t.token_bytes(-1)
    # Padding ids (model vocab > tokenizer vocab) decode to nothing, streamed or not.
    pad = [300, t.vocab_size + 5, 301]
    stream = t.stream()
    assert stream.extend(pad) + stream.finish() == t.decode(pad) == t.decode([300, 301])
    plain = Tokenizer.from_str(train_tokenizer("llama2", 600))
    assert plain.apply_chat_template([{"role": "user", "content": "x"}])[0] == 1
