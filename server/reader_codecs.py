"""Which codecs of stored KV a reader takes, as it says in each read (issue 33): one
service may hold lossy chunks (a tier configured with ``tiers.<tier>_codec``) for readers
that accept them and serve exact KV only to readers that do not.

A client names what it takes in the ``X-KVTier-Accept-Codecs`` header (comma-separated
codec names: ``none`` for exact KV); its lookups then skip the tiers of other codecs and
its reads refuse chunks of other codecs (a miss, the chunk left where it is). A request
without the header takes what the server's stack takes (``tiers.accept_codecs``: by
default exact KV and what its own tiers write).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Header

from kvtier.chunk_wire import ACCEPT_CODECS_HEADER as HEADER
from kvtier.kv_codecs import CODEC_NAMES
from kvtier.server.errors import RouteError

AcceptCodecs = Annotated[str | None, Header(
    alias=HEADER,
    description=("codecs of stored KV this reader takes, comma-separated (none = exact KV, "
                 "fp8, int8, int4); default: the server's tiers.accept_codecs"))]


def reader_codecs(header: str | None) -> frozenset[str] | None:
    """The codecs a request's header names (None: no header, the stack's own); a name that
    is no codec, or none at all, is a 400."""
    if header is None:
        return None
    names = frozenset(n.strip() for n in header.split(",") if n.strip())
    known = CODEC_NAMES
    bad = sorted(names - known)
    if bad or not names:
        raise RouteError(400, f"{HEADER}: {', '.join(n[:16] for n in bad) or 'empty'} — "
                         f"name one or more of {', '.join(sorted(known))}")
    return names

