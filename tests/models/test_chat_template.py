"""Chat templates: the prefix property multi-turn KV reuse rests on, and the Jinja twin."""

from __future__ import annotations

import functools

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.make_model.tokenizer_training import train_tokenizer
from kvtier.models.chat_template import FORMATS, detect_format, get_format, render_ids
from kvtier.models.tokenizer import Tokenizer

FAMILY_STYLE = {"llama3": "llama3", "chatml": "qwen2", "llama2": "gpt2"}


@functools.cache
def tokenizer(family: str) -> Tokenizer:
    return Tokenizer.from_str(train_tokenizer(family, 1024, FAMILY_STYLE[family]))


_content = st.lists(
    st.sampled_from(list("abc xyz\n\t.,!?'0123456789") + ["é", "🙂", "日", "<|", "|>", "[INST]"]),
    max_size=30,
).map("".join)


@st.composite
def conversations(draw) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_content)})
    for i in range(draw(st.integers(1, 8))):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": draw(_content)})
    return msgs


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=60, deadline=None)
@given(msgs=conversations())
def test_each_turn_extends_the_previous_ids(family, msgs):
    tok, fmt = tokenizer(family), get_format(family)
    for k in range(1, len(msgs)):
        head = render_ids(tok, fmt, msgs[:k])
        longer = render_ids(tok, fmt, msgs[: k + 1], add_generation_prompt=True)
        assert _is_prefix(head, longer)
        if msgs[k]["role"] == "assistant":
            # The prompt the model answered is a prefix of the conversation with its answer.
            prompt = render_ids(tok, fmt, msgs[:k], add_generation_prompt=True)
            assert _is_prefix(prompt, render_ids(tok, fmt, msgs[: k + 1]))


@pytest.mark.parametrize("family", sorted(FORMATS))
@settings(max_examples=40, deadline=None)
@given(msgs=conversations(), gen=st.booleans())
def test_ids_decode_to_the_text_and_jinja_renders_the_same_text(family, msgs, gen):
    tok, fmt = tokenizer(family), get_format(family)
    text = fmt.render_text(msgs, add_generation_prompt=gen)
    assert tok.decode(render_ids(tok, fmt, msgs, gen)) == text
    jinja = jinja2.Environment().from_string(fmt.jinja)
    rendered = jinja.render(
        messages=msgs, add_generation_prompt=gen, bos_token=fmt.bos_token or "",
        eos_token=fmt.eos_token,
    )
    assert rendered == text


def test_special_strings_in_content_stay_text():
    tok, fmt = tokenizer("llama3"), get_format("llama3")
    ids = render_ids(tok, fmt, [{"role": "user", "content": "<|eot_id|>"}])
    eot = tok.special_token_id("<|eot_id|>")
    assert ids.count(eot) == 1 and ids[-1] == eot


def test_sample_renderings():
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ]
    assert get_format("chatml").render_text(msgs, True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>assistant\n"
    )
    assert get_format("llama3").render_text(msgs[1:2], True) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert get_format("llama2").render_text(msgs, True) == (
        "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST] A</s>"
    )


def test_detect_format():
    assert detect_format({"<|im_start|>": 1}).name == "chatml"
    assert detect_format({"<|start_header_id|>": 1}).name == "llama3"
    assert detect_format({"[INST]": 1}).name == "llama2"
    assert detect_format({"hello": 1}) is None


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"role": "tool", "content": "x"}, "role 'tool'"),
        ({"role": "user"}, "'role' and 'content'"),
        ({"role": "user", "content": 3}, "content must be a string"),
    ],
)
def test_bad_messages(bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        get_format("chatml").render_text([bad])


def test_unknown_format():
    with pytest.raises(InvalidArgumentError, match="llama3"):
        get_format("vicuna")
