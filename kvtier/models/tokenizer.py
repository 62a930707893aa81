"""The engine's tokenizer: a thin wrapper over a ``tokenizers`` byte-level BPE.

It adds what serving needs on top of encode/decode: BOS by family, the set of stop ids,
special-token lookup, chat rendering to ids, and a streaming detokenizer that emits text as
tokens arrive without ever splitting a UTF-8 character (a byte-level token can end in the
middle of one; the decoder holds those bytes back until the character is complete).
"""

from __future__ import annotations

import codecs
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError
from kvtier.models.chat_template import FORMATS, ChatFormat, detect_format, render_ids
from kvtier.models.jinja_template import ChatTemplateError, TemplateChatFormat, template_from_config

log = logging.getLogger(__name__)


class TokenizerError(KVTierError, ValueError):
    """A tokenizer file is missing or unreadable, or a token it lacks was asked for."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    bs += list(range(0xAE, 0xFF + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_CHAR_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_name(value: Any) -> str | None:
    """``bos_token`` in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Byte-level BPE tokenizer with the chat format of its family."""

    def __init__(
        self,
        backend: Any,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        source: str = "<memory>",
        chat_template: str | None = None,
        add_bos: bool | None = None,
    ) -> None:
        self._tok = backend
        self.source = source
        vocab = backend.get_vocab(with_added_tokens=True)
        self._specials: dict[str, int] = {
            t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special
        }
        self.chat_format: ChatFormat | TemplateChatFormat | None = self._chat_format(
            vocab, chat_template, bos_token, eos_token
        )
        fmt = self.chat_format
        self._special_ids = frozenset(self._specials.values())
        bos_token = bos_token if bos_token is not None else (fmt.bos_token if fmt else None)
        eos_token = eos_token if eos_token is not None else (fmt.eos_token if fmt else None)
        self.bos_token_id: int | None = vocab.get(bos_token) if bos_token else None
        self.eos_token_id: int | None = vocab.get(eos_token) if eos_token else None
        if add_bos is not None:
            self.add_bos_default = add_bos and self.bos_token_id is not None
        else:
            self.add_bos_default = bool(fmt.add_bos) if fmt else self.bos_token_id is not None
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        stops += [vocab[t] for t in (fmt.stop_tokens if fmt else ()) if t in vocab]
        stops += list(extra_eos_ids)
        self.eos_token_ids: list[int] = sorted(set(stops))
        self._raw = backend  # parses special tokens in text
        self._literal: Any = None  # a copy that does not (made on first use)
        self._bytes: list[bytes] | None = None

    def _chat_format(
        self, vocab: Mapping[str, int], template: str | None, bos: str | None, eos: str | None
    ) -> ChatFormat | TemplateChatFormat | None:
        """The checkpoint's own template when it has one kvtier does not know by heart
        (rendered with Jinja), else the built-in family its special tokens name."""
        builtin = detect_format(vocab)
        known = {f.jinja for f in FORMATS.values()}
        if template is None or template in known:
            return builtin
        try:
            fmt = TemplateChatFormat(
                template, self._specials, bos_token=bos, eos_token=eos,
            )
            fmt.segments([{"role": "user", "content": "hi"}], add_generation_prompt=True)
        except ChatTemplateError as exc:
            fallback = builtin.name if builtin else "none"
            log.warning("%s: %s; using the built-in chat format (%s)", self.source, exc, fallback)
            return builtin
        return fmt

    # --- construction ------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and, if present, ``tokenizer_config.json`` and
        ``generation_config.json`` (for BOS/EOS names and extra stop ids) from a model dir."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(
                f"{tj}: tokenizer file not found; point at a model directory made by "
                "`kvtier make-model` or a Hugging Face checkpoint with a tokenizer.json"
            )
        tok = cls._load_backend(tj)
        cfg = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        extra = gen.get("eos_token_id")
        extra_ids = extra if isinstance(extra, list) else ([extra] if isinstance(extra, int) else [])
        add_bos = cfg.get("add_bos_token")
        return cls(
            tok,
            bos_token=_token_name(cfg.get("bos_token")),
            eos_token=_token_name(cfg.get("eos_token")),
            extra_eos_ids=extra_ids,
            source=str(tj),
            chat_template=template_from_config(cfg.get("chat_template")),
            add_bos=add_bos if isinstance(add_bos, bool) else None,
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a bare ``tokenizer.json``; BOS/EOS come from the detected chat family."""
        p = Path(path)
        if not p.is_file():
            raise TokenizerError(f"{p}: tokenizer file not found")
        return cls(cls._load_backend(p), source=str(p))

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        return cls(Backend.from_str(text))

    @staticmethod
    def _load_backend(path: Path) -> Any:
        from tokenizers import Tokenizer as Backend

        try:
            return Backend.from_str(path.read_text(encoding="utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(
                f"{path}: not a valid tokenizer.json ({str(exc).splitlines()[0][:200]}); "
                "regenerate it with `kvtier make-model` or copy it from the original checkpoint"
            ) from exc

    # --- encode / decode ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text``; BOS first when ``add_bos`` (default: the family's habit).

        With ``parse_special=False`` special-token strings in ``text`` are plain characters.
        """
        backend = self._raw if parse_special else self._literal_backend()
        ids = list(backend.encode(text, add_special_tokens=False).ids)
        if add_bos is None:
            add_bos = self.add_bos_default
        if add_bos:
            if self.bos_token_id is None:
                raise TokenizerError(f"{self.source}: this tokenizer has no BOS token")
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; incomplete UTF-8 at the end becomes U+FFFD."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generation."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def _literal_backend(self) -> Any:
        if self._literal is None:
            from tokenizers import Tokenizer as Backend

            self._literal = Backend.from_str(self._tok.to_str())
            self._literal.encode_special_tokens = True
        return self._literal

    # --- special tokens and bytes ------------------------------------------------------

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string -> id."""
        return dict(self._specials)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def special_token_id(self, token: str) -> int:
        """The id of special token ``token``; an error naming the tokenizer if it lacks it."""
        try:
            return self._specials[token]
        except KeyError:
            raise TokenizerError(
                f"{self.source}: no special token {token!r}; it has {sorted(self._specials)}"
            ) from None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a special token: its UTF-8 text).

        Ids past the tokenizer's vocab (the model's padding rows) stand for nothing, as in
        ``decode``, which skips them.
        """
        if self._bytes is None:
            self._bytes = self._build_byte_table()
        if token_id < 0:
            raise TokenizerError(f"{self.source}: negative token id {token_id}")
        return self._bytes[token_id] if token_id < len(self._bytes) else b""

    def _build_byte_table(self) -> list[bytes]:
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        table: list[bytes] = []
        for i in range(self.vocab_size):
            if i in added:
                table.append(added[i].encode("utf-8"))
                continue
            piece = self._tok.id_to_token(i) or ""
            table.append(bytes(_CHAR_TO_BYTE[c] for c in piece if c in _CHAR_TO_BYTE))
        return table

    # --- chat --------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a conversation in this tokenizer's chat format (see chat_template)."""
        if self.chat_format is None:
            raise TokenizerError(
                f"{self.source}: no chat format recognised (no chat_template in "
                "tokenizer_config.json, and no Llama 3, ChatML or [INST] special tokens)"
            )
        return render_ids(self, self.chat_format, messages, add_generation_prompt)


class StreamDecoder:
    """Turns token ids into text deltas as they arrive.

    Each token's bytes go through an incremental UTF-8 decoder, so a character split across
    tokens is emitted once it is complete, and the concatenated deltas plus :meth:`finish`
    equal ``Tokenizer.decode`` of all the ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        """Feed one id; return the new complete text (possibly empty)."""
        if self._skip and self._tokenizer.is_special(token_id):
            return ""
        delta = self._utf8.decode(self._tokenizer.token_bytes(token_id))
        self.text += delta
        return delta

    def extend(self, ids: Iterable[int]) -> str:
        """Feed several ids; return the new text."""
        return "".join(self.push(i) for i in ids)

    def finish(self) -> str:
        """Flush held-back bytes of an unfinished character (as U+FFFD)."""
        delta = self._utf8.decode(b"", final=True)
        self.text += delta
        return delta


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON file as a dict; corrupt → an error naming it; missing → {}."""
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON ({exc}); fix or delete it") from exc
    if not isinstance(doc, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return doc
