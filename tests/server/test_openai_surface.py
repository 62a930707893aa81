"""The OpenAI surface with the `openai` client package against a live server on loopback:
the model list, a model's card, chat and streaming under served names, and OpenAI's 404
``model_not_found`` for a model the server does not serve."""

from __future__ import annotations

import openai
import pytest
import torch

from kvtier.config import load_config
from kvtier.make_model.writer import make_model
from kvtier.server.state import ServiceState
from tests.http_server import running

QUESTION = [{"role": "user", "content": "Tell me about caches."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return make_model("tiny", tmp_path_factory.mktemp("m") / "tiny-chat", seed=3).path


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _state(model_dir, names=None) -> ServiceState:
    server = {"served_model_names": names} if names else {}
    cfg = load_config(environ={}, overrides={"pool": {"num_blocks": 64}, "tiers": {
        "cpu_bytes": 0, "disk_bytes": 0}, "server": server})
    return ServiceState.with_engine(cfg, model_dir)


def test_the_model_list_and_chat_under_the_directory_name(model_dir):
    with running(_state(model_dir)) as url:
        client = _client(url)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]
        card = client.models.retrieve("tiny-chat")
        assert card.owned_by == "kvtier" and card.object == "model"
        reply = client.chat.completions.create(model="tiny-chat", messages=QUESTION,
                                               max_tokens=4, temperature=0)
        assert reply.model == "tiny-chat" and reply.choices[0].message.content
        assert reply.usage.prompt_tokens > 0


def test_another_model_is_openais_model_not_found(model_dir):
    with running(_state(model_dir)) as url:
        client = _client(url)
        with pytest.raises(openai.NotFoundError) as err:
            client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=4)
        assert err.value.status_code == 404
        assert err.value.body["type"] == "model_not_found"
        assert "gpt-4o" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")


def test_served_names_alias_the_model_in_replies_and_streams(model_dir):
    with running(_state(model_dir, ["smol", "gpt-4o-mini"])) as url:
        client = _client(url)
        cards = list(client.models.list())
        assert [m.id for m in cards] == ["smol", "gpt-4o-mini"]
        assert {m.root for m in cards} == {"tiny-chat"}  # one model, two names
        reply = client.chat.completions.create(model="gpt-4o-mini", messages=QUESTION,
                                               max_tokens=4, temperature=0)
        assert reply.model == "gpt-4o-mini"
        chunks = list(client.chat.completions.create(
            model="smol", messages=QUESTION, max_tokens=4, temperature=0, stream=True))
        assert chunks and {c.model for c in chunks} == {"smol"}
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content  # greedy: the same reply
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=4)


@pytest.mark.parametrize("user", ["a\r\nX-Evil: 1", "日本語", "nul\x00", "x" * 257,
                                  "alpha:bob"])
def test_a_session_id_that_cannot_travel_in_a_header_is_a_400(model_dir, user):
    with running(_state(model_dir)) as url:
        client = _client(url)
        with pytest.raises(openai.BadRequestError, match="session id"):
            client.chat.completions.create(model="tiny-chat", messages=QUESTION, max_tokens=2,
                                           user=user)
        assert client.chat.completions.create(  # the server is unharmed
            model="tiny-chat", messages=QUESTION, max_tokens=2, user="alice@example.com"
        ).choices
