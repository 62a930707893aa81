"""A checkpoint's own Jinja chat template, rendered as prefix-stable segments.

Real checkpoints ship their chat template in ``tokenizer_config.json`` (SmolLM2's adds a
default system prompt, others add dates or tool blocks), and a reply must follow the
model's own template to read well. The engine also needs what :mod:`chat_template` gives:
message text tokenized apart from the template's text, so that a user who types
``<|im_end|>`` gets characters, not a control token, and no BPE merge crosses a message
boundary. So the template is rendered with every message's content replaced by a sentinel;
the rendered text is then cut at the sentinels (the template's own text, split again at the
tokenizer's special tokens) and at the messages (plain text, never parsed for specials).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.errors import InvalidArgumentError
from kvtier.models.chat_template import Message, Segment, check_message

_SENTINEL = re.compile("\ue000(\\d+)\ue001")


class ChatTemplateError(InvalidArgumentError):
    """A chat template cannot be rendered, or it rewrites message text it must pass through."""


class TemplateChatFormat:
    """Renders conversations with a Jinja chat template, as (text, is_special) segments."""

    name = "template"
    add_bos = False
    """The template writes BOS itself when the model wants one (as HF's apply_chat_template)."""

    def __init__(
        self,
        template: str,
        special_tokens: Iterable[str],
        *,
        bos_token: str | None,
        eos_token: str | None,
        stop_tokens: Sequence[str] = (),
    ) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not parse: {exc}") from exc
        self.jinja = template
        self.bos_token = bos_token
        self.eos_token = eos_token or ""
        self.stop_tokens = tuple(stop_tokens) or ((eos_token,) if eos_token else ())
        specials = sorted(set(special_tokens), key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    def segments(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> list[Segment]:
        """The conversation as (text, is_special) pieces, in the template's order."""
        from jinja2 import TemplateError

        masked = []
        for i, msg in enumerate(messages):
            check_message(msg, i)
            masked.append({**msg, "content": f"\ue000{i}\ue001"})
        try:
            text = self._template.render(
                messages=masked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc
        segs: list[Segment] = []
        seen: list[int] = []
        pos = 0
        for m in _SENTINEL.finditer(text):
            segs.extend(self._template_text(text[pos : m.start()]))
            i = int(m.group(1))
            seen.append(i)
            segs.append((messages[i]["content"], False))
            pos = m.end()
        segs.extend(self._template_text(text[pos:]))
        if seen != list(range(len(messages))) or "\ue000" in text[pos:]:
            raise ChatTemplateError(
                "the chat template drops, repeats or rewrites message content, so turns "
                "cannot be rendered as prefixes of one another"
            )
        return [s for s in segs if s[0]]

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The prompt as text (what HF's ``apply_chat_template(tokenize=False)`` returns)."""
        return "".join(t for t, _ in self.segments(messages, add_generation_prompt))

    def _template_text(self, text: str) -> list[Segment]:
        if self._specials is None:
            return [(text, False)]
        out: list[Segment] = []
        pos = 0
        for m in self._specials.finditer(text):
            out.append((text[pos : m.start()], False))
            out.append((m.group(0), True))
            pos = m.end()
        out.append((text[pos:], False))
        return out


def template_from_config(raw: Any) -> str | None:
    """The default template of a ``chat_template`` entry: a string, or a list of named ones."""
    if isinstance(raw, str) and raw.strip():
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) and chosen.strip() else None
    return None


def _raise(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")
