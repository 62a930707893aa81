"""Chat templates (Llama 3 headers, ChatML, Llama 2/Mistral ``[INST]``) rendered to token ids.

Multi-turn KV reuse needs one property: the ids of a conversation up to turn k are a prefix
of the ids up to turn k+1, and the generation prompt is a prefix of the assistant message it
announces. So a conversation is rendered as a list of *segments* (a special token, or a piece
of text) where each message's segments depend only on that message and the one before it, and
each text segment is tokenized on its own: no BPE merge can cross a segment boundary, so
appending a message only appends ids. The same format is written as a Jinja ``chat_template``
into ``tokenizer_config.json``; its text equals the concatenation of our segments.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError

ROLES = ("system", "user", "assistant")

Segment = tuple[str, bool]  # (text, is_special_token)
Message = Mapping[str, str]


@dataclass(frozen=True)
class ChatFormat:
    """A family's special tokens and its rendering rules."""

    name: str
    special_tokens: tuple[str, ...]  # in id order: they take the tokenizer's first ids
    bos_token: str | None  # prepended to every prompt when ``add_bos``
    eos_token: str  # end of text
    stop_tokens: tuple[str, ...]  # every token that ends a generation (eos, end of turn)
    add_bos: bool
    jinja: str
    _message: Callable[[Message, Message | None], list[Segment]]
    _generation_prompt: tuple[Segment, ...]

    def segments(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> list[Segment]:
        """The conversation as (text, is_special) pieces, BOS first when the family uses one."""
        segs: list[Segment] = []
        if self.bos_token is not None and self.add_bos:
            segs.append((self.bos_token, True))
        prev: Message | None = None
        for i, msg in enumerate(messages):
            check_message(msg, i)
            segs.extend(s for s in self._message(msg, prev) if s[0])
            prev = msg
        if add_generation_prompt:
            segs.extend(self._generation_prompt)
        return segs

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The prompt as text (what HF's ``apply_chat_template(tokenize=False)`` returns)."""
        return "".join(t for t, _ in self.segments(messages, add_generation_prompt))


def check_message(msg: Message, index: int) -> None:
    if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
        raise InvalidArgumentError(
            f"message {index} must be a mapping with 'role' and 'content', got {msg!r}"
        )
    if msg["role"] not in ROLES:
        raise InvalidArgumentError(
            f"message {index} has role {msg['role']!r}; use one of {', '.join(ROLES)}"
        )
    if not isinstance(msg["content"], str):
        raise InvalidArgumentError(f"message {index} content must be a string")


# --- Llama 3: <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|> ---------------


def _llama3_message(msg: Message, prev: Message | None) -> list[Segment]:
    return [
        ("<|start_header_id|>", True),
        (msg["role"], False),
        ("<|end_header_id|>", True),
        ("\n\n", False),
        (msg["content"], False),
        ("<|eot_id|>", True),
    ]


_LLAMA3_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# --- ChatML: <|im_start|>role\ncontent<|im_end|>\n -----------------------------------------


def _chatml_message(msg: Message, prev: Message | None) -> list[Segment]:
    return [
        ("<|im_start|>", True),
        (msg["role"] + "\n", False),
        (msg["content"], False),
        ("<|im_end|>", True),
        ("\n", False),
    ]


_CHATML_JINJA = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# --- Llama 2 / Mistral: <s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer</s> --------
# A system message opens the [INST] block and the next user message closes it, so each
# message's segments still depend only on the message before it. There is no generation
# prompt: "[/INST]" already hands the turn to the assistant.


def _llama2_message(msg: Message, prev: Message | None) -> list[Segment]:
    role, content = msg["role"], msg["content"]
    if role == "system":
        return [("[INST]", True), (" <<SYS>>\n" + content + "\n<</SYS>>\n\n", False)]
    if role == "user":
        if prev is not None and prev["role"] == "system":
            return [(content + " ", False), ("[/INST]", True)]
        return [("[INST]", True), (" " + content + " ", False), ("[/INST]", True)]
    return [(" " + content, False), ("</s>", True)]


_LLAMA2_JINJA = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '[INST] <<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}"
    "{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'system' %}"
    "{{ message['content'] + ' [/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

FORMATS: dict[str, ChatFormat] = {
    "llama3": ChatFormat(
        name="llama3",
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        stop_tokens=("<|end_of_text|>", "<|eot_id|>"),
        add_bos=True,
        jinja=_LLAMA3_JINJA,
        _message=_llama3_message,
        _generation_prompt=(
            ("<|start_header_id|>", True),
            ("assistant", False),
            ("<|end_header_id|>", True),
            ("\n\n", False),
        ),
    ),
    "chatml": ChatFormat(
        name="chatml",
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos_token=None,
        eos_token="<|endoftext|>",
        stop_tokens=("<|endoftext|>", "<|im_end|>"),
        add_bos=False,
        jinja=_CHATML_JINJA,
        _message=_chatml_message,
        _generation_prompt=(("<|im_start|>", True), ("assistant\n", False)),
    ),
    "llama2": ChatFormat(
        name="llama2",
        special_tokens=("<unk>", "<s>", "</s>", "[INST]", "[/INST]"),
        bos_token="<s>",
        eos_token="</s>",
        stop_tokens=("</s>",),
        add_bos=True,
        jinja=_LLAMA2_JINJA,
        _message=_llama2_message,
        _generation_prompt=(),
    ),
}

# A tokenizer's family is recognised by a special token only that family has.
_MARKERS = (("<|start_header_id|>", "llama3"), ("<|im_start|>", "chatml"), ("[INST]", "llama2"))


def get_format(name: str) -> ChatFormat:
    """The chat format called ``name``; an error listing the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown chat format {name!r}; choose one of: {', '.join(FORMATS)}"
        ) from None


def detect_format(vocab: Mapping[str, int] | set[str]) -> ChatFormat | None:
    """The family whose marker special token is in ``vocab``; None when none is."""
    for marker, name in _MARKERS:
        if marker in vocab:
            return FORMATS[name]
    return None


class _Encoder:
    """What :func:`render_ids` needs from a tokenizer (kvtier.models.tokenizer.Tokenizer has it)."""

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]: ...  # noqa: E501

    def special_token_id(self, token: str) -> int: ...


def render_ids(
    tokenizer: _Encoder,
    fmt: ChatFormat,
    messages: Sequence[Message],
    add_generation_prompt: bool = False,
) -> list[int]:
    """Token ids of the conversation: special tokens by id, each text segment encoded alone.

    Text is encoded with special-token parsing off, so a user typing ``<|eot_id|>`` gets the
    characters, not the control token.
    """
    ids: list[int] = []
    for text, special in fmt.segments(messages, add_generation_prompt):
        if special:
            ids.append(tokenizer.special_token_id(text))
        else:
            ids.extend(tokenizer.encode(text, add_bos=False, parse_special=False))
    return ids
