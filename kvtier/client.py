"""Clients for a running ``kvtier serve``: :class:`Client` (sync) and :class:`AsyncClient`.

Both speak every route with the same method names; the async one awaits. Errors come back as
:class:`ServiceError` carrying the HTTP status and the server's error type, so a caller can
tell an unknown session (404) from a bad chunk (400) from a full store (507).

    with Client("http://127.0.0.1:8100") as kv:
        kv.put_chunk(key, blob)
        n = kv.lookup(keys).length
        reply = kv.chat([{"role": "user", "content": "hi"}], session_id="u1")
"""

from __future__ import annotations

import enum
import hashlib
import http.client
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import msgpack
import numpy as np

from kvtier.chunk_wire import (
    ACCEPT_CODECS_HEADER,
    ChunkWire,
    ServiceError,
    accept_header,
    error_from,
)
from kvtier.client_region import RegionLink, RegionUnavailable
from kvtier.errors import InvalidArgumentError
from kvtier.io_priority import IOPriority, current_priority

__all__ = ["AsyncClient", "Client", "Lookup", "ServiceError"]

log = logging.getLogger(__name__)

MSGPACK = "application/x-msgpack"
OCTETS = "application/octet-stream"


@dataclass(frozen=True)
class Lookup:
    length: int
    tiers: list[str]
    present: list[bool] | None = None
    """With ``each``: whether each key is stored, prefix or not."""
    located: list[str | None] | None = None
    """With ``each``: the fastest tier holding each key, or None."""


@dataclass(frozen=True)
class _Call:
    """One HTTP request, built once and sent by either client."""

    method: str
    path: str
    json: Any = None
    content: bytes | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    ok: tuple[int, ...] = (200,)
    """Statuses that are not errors (a 404 of HEAD is an answer, not an error)."""


Blob = bytes | bytearray | memoryview


def _layers(layers: tuple[int, int] | None) -> dict[str, str] | None:
    return {"layers": f"{layers[0]}:{layers[1]}"} if layers else None


def _raise_for(resp: httpx.Response, ok: tuple[int, ...]) -> None:
    if resp.status_code in ok or resp.status_code < 300 and 200 in ok:
        return
    try:
        err = resp.json()["error"]
        raise ServiceError(resp.status_code, err["type"], err["message"])
    except (ValueError, KeyError, TypeError):
        raise ServiceError(resp.status_code, "http_error", resp.text[:500]) from None


def _chat_body(
    messages: Sequence[Mapping[str, str]], stream: bool, options: Mapping[str, Any]
) -> dict[str, Any]:
    return {"messages": [dict(m) for m in messages], "stream": stream, **options}


def _session_headers(session_id: str | None) -> dict[str, str] | None:
    return {"X-Session-Id": session_id} if session_id else None


def _sse_event(line: str) -> dict[str, Any] | None:
    """A parsed ``data:`` line of a chat stream; None for keep-alives and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    event = json.loads(data)
    if "error" in event:
        err = event["error"]
        raise ServiceError(err.get("code", 500), err.get("type", "error"), err.get("message", ""))
    return event


class _Routes:
    """The request of every route (shared by both clients)."""

    @staticmethod
    def health() -> _Call:
        return _Call("GET", "/healthz")

    @staticmethod
    def stats() -> _Call:
        return _Call("GET", "/v1/stats")

    @staticmethod
    def metrics() -> _Call:
        return _Call("GET", "/metrics")

    @staticmethod
    def sessions() -> _Call:
        return _Call("GET", "/v1/sessions")

    @staticmethod
    def session(session_id: str) -> _Call:
        return _Call("GET", f"/v1/sessions/{session_id}")

    @staticmethod
    def offload(session_id: str, tier: str | None, wait: bool) -> _Call:
        return _Call("POST", f"/v1/sessions/{session_id}/offload", {"tier": tier, "wait": wait})

    @staticmethod
    def restore(session_id: str) -> _Call:
        return _Call("POST", f"/v1/sessions/{session_id}/restore")

    @staticmethod
    def hint(session_id: str) -> _Call:
        return _Call("POST", f"/v1/sessions/{session_id}/hint")

    @staticmethod
    def end_session(session_id: str) -> _Call:
        return _Call("DELETE", f"/v1/sessions/{session_id}", ok=(204,))

    @staticmethod
    def put_chunk(key: str, blob: Blob, tier: str | None, owner: ChunkOwner | None = None) -> _Call:
        params = _put_params(tier, owner)
        headers = {"Content-Type": OCTETS}
        content = blob if isinstance(blob, bytes) else bytes(blob)  # httpx sends bytes
        return _Call("PUT", f"/v1/chunks/{key}", None, content, params, headers, (200, 201))

    @staticmethod
    def derive_chunk(key: str, source: str, first_token: int, tokens: int,
                     owner: ChunkOwner | None = None) -> _Call:
        body = {"source": source, "first_token": first_token, "tokens": tokens}
        return _Call("POST", f"/v1/chunks/{key}/derive", body, params=_put_params(None, owner),
                     ok=(200, 201))

    @staticmethod
    def get_chunk(key: str, layers: tuple[int, int] | None) -> _Call:
        return _Call("GET", f"/v1/chunks/{key}", params=_layers(layers), ok=(200, 404))

    @staticmethod
    def has_chunk(key: str) -> _Call:
        return _Call("HEAD", f"/v1/chunks/{key}", ok=(200, 404))

    @staticmethod
    def delete_chunk(key: str) -> _Call:
        return _Call("DELETE", f"/v1/chunks/{key}", ok=(204, 404))

    @staticmethod
    def prefetch(keys: Sequence[str]) -> _Call:
        return _Call("POST", "/v1/chunks/prefetch", {"keys": list(keys)})

    @staticmethod
    def report_turns(turns: Sequence[SessionTurn]) -> _Call:
        body = {"turns": [{"session": session_param(t.session), "event": t.event.value,
                           "ago_s": t.ago_s} for t in turns]}
        return _Call("POST", "/v1/chunks/turns", body, ok=(204,))

    @staticmethod
    def lookup(keys: Sequence[str], each: bool = False) -> _Call:
        body: dict[str, Any] = {"keys": list(keys)}
        if each:
            body["each"] = True
        return _Call("POST", "/v1/chunks/lookup", body)

    @staticmethod
    def get_chunks(keys: Sequence[str], layers: tuple[int, int] | None) -> _Call:
        body: dict[str, Any] = {"keys": list(keys)}
        if layers:
            body["layers"] = list(layers)
        return _Call("POST", "/v1/chunks/batch/get", body)

    @staticmethod
    def put_chunks(chunks: Mapping[str, bytes], tier: str | None) -> _Call:
        payload = msgpack.packb({k: bytes(v) for k, v in chunks.items()}, use_bin_type=True)
        params = _put_params(tier)
        return _Call(
            "POST", "/v1/chunks/batch/put", None, payload, params, {"Content-Type": MSGPACK}
        )

    @staticmethod
    def chat(
        messages: Sequence[Mapping[str, str]], session_id: str | None, stream: bool, **options: Any
    ) -> _Call:
        return _Call(
            "POST",
            "/v1/chat/completions",
            _chat_body(messages, stream, options),
            headers=_session_headers(session_id),
        )


_SESSION_PARAM = re.compile(r"[\x20-\x7e]{1,256}")


@dataclass(frozen=True)
class RegionReads:
    """Chunks one read put in a thread's shared-memory region (views of it, in key order)."""

    views: list[memoryview]
    ended: bool
    """The key after them is not stored (a prefix ends there). False: every key was read,
    or the next did not fit in the room (the caller reads it another way)."""


@dataclass(frozen=True)
class ChunkOwner:
    """The conversation a stored chunk belongs to and its place in it (e.g. its first
    block): a session-aware tier keeps a session's chunks together and gives up the last
    ones first."""

    session: str
    place: int = 0


class TurnEvent(enum.Enum):
    STARTED = "started"
    ENDED = "ended"


@dataclass(frozen=True)
class SessionTurn:
    """A session's turn started or ended ``ago_s`` seconds before it was reported (reports
    go in batches, later than the events, without moving them): what lets a store's
    session-aware tiers rank sessions by when they are likely back, not only by idle time
    (:mod:`kvtier.connectors.tiers.session_turns`)."""

    session: str
    event: TurnEvent
    ago_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.ago_s >= 0.0:  # NaN too
            raise InvalidArgumentError(f"a turn's ago_s must be >= 0, not {self.ago_s}")


MAX_TURNS_PER_REPORT = 4096
"""Turns one ``POST /v1/chunks/turns`` carries at most."""


def session_param(session: str) -> str:
    """A session as the service takes it: itself where it is 1 to 256 printable ASCII
    characters, else its digest (the same for every call that names it)."""
    if _SESSION_PARAM.fullmatch(session):
        return session
    return hashlib.sha256(session.encode()).hexdigest()


def _put_params(tier: str | None, owner: ChunkOwner | None = None) -> dict[str, Any] | None:
    """A store's query: its tier, its owner (session and place) where known, and
    ``priority=background`` when the calling thread stores in the background
    (:func:`~kvtier.io_priority.background_io`: the service's tiers then serve what someone
    waits for first, as for their own background stores)."""
    params: dict[str, Any] = {"tier": tier} if tier else {}
    if owner is not None:
        params.update(session=session_param(owner.session), place=owner.place)
    if current_priority() is IOPriority.BACKGROUND:
        params["priority"] = IOPriority.BACKGROUND.value
    return params or None


def _headers(token: str | None, accept_codecs: Collection[str] | None = None) -> dict[str, str]:
    """Every request's headers: the bearer token, and the codecs of stored KV this
    client's reads take (unset: whatever the server's stack takes)."""
    out = {"Authorization": f"Bearer {token}"} if token else {}
    if accept_codecs is not None:
        out[ACCEPT_CODECS_HEADER] = accept_header(accept_codecs)
    return out


def _region_gone(status: int, body: bytes) -> bool:
    """The server does not know the region (it restarted, or the region was deleted)."""
    if status != 404:
        return False
    try:
        return json.loads(body)["error"]["type"] == "no_such_region"
    except (ValueError, KeyError, TypeError):
        return False


class Client:
    """Synchronous client (one connection pool; thread-safe as httpx.Client is)."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float = 60.0,
        shm: bool = False, accept_codecs: Collection[str] | None = None, **httpx_kwargs: Any,
    ) -> None:
        headers = _headers(token, accept_codecs)
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout, **httpx_kwargs)
        self.wire: ChunkWire | None = None
        """Single-chunk PUT/GET bodies over ``http://`` (see :mod:`kvtier.chunk_wire`)."""
        if base_url.startswith("http://") and not httpx_kwargs:
            self.wire = ChunkWire(base_url, headers, timeout)
        self.shm = shm
        """Whole chunks move through a shared-memory region (a server on this host, see
        :mod:`kvtier.client_region`); turned off, with a warning, where none can be used."""
        self._local = threading.local()
        self._links: list[RegionLink] = []
        self._links_lock = threading.Lock()

    # shared-memory regions: one per thread (a region holds one chunk in flight)
    def _region(self) -> RegionLink | None:
        if not self.shm:
            return None
        link = getattr(self._local, "link", None)
        if link is None:
            link = self._local.link = RegionLink(self._region_call)
            with self._links_lock:
                self._links.append(link)
        return link

    def _region_call(self, method: str, path: str, params: dict[str, Any] | None,
                     body: Any) -> tuple[int, bytes]:
        if self.wire is not None:
            return self._wire_json(method, path, params, body)
        r = self.http.request(method, path, params=params, json=body)
        return r.status_code, r.content

    def _through_region(self, link: RegionLink, method: str, path: str,
                        params: dict[str, Any] | None, body: Any) -> tuple[int, bytes]:
        """A request that moves bytes through ``link``'s region; one that gets no answer
        (a timeout, a dropped connection) abandons the region (the server may still use
        it) before the error goes on to the caller."""
        try:
            return self._region_call(method, path, params, body)
        except (OSError, http.client.HTTPException, httpx.TransportError):
            link.abandon()
            raise

    def _no_region(self, why: RegionUnavailable) -> None:
        log.warning("shared-memory regions are off for this client: %s", why)
        self.shm = False

    def _send(self, call: _Call) -> httpx.Response:
        resp = self.http.request(
            call.method,
            call.path,
            json=call.json,
            content=call.content,
            params=call.params,
            headers=call.headers,
        )
        _raise_for(resp, call.ok)
        return resp

    def _ask(self, call: _Call) -> Any:
        """A small JSON question and its JSON answer: over the chunk wire where there is
        one (a connector's lookups wait in vLLM's scheduler loop, and httpx's own cost per
        request is about a third of a loopback lookup's), else through httpx."""
        if self.wire is None or call.content is not None:
            return self._send(call).json()
        status, body = self._wire_json(call.method, call.path, call.params, call.json, call.headers)
        if not (status in call.ok or status < 300 and 200 in call.ok):
            raise error_from(status, body)
        return json.loads(body)

    def _wire_json(self, method: str, path: str, params: dict[str, Any] | None, body: Any,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A request with a JSON body (or none) over the chunk wire: its status and body."""
        assert self.wire is not None
        data = None if body is None else json.dumps(body).encode()
        sent = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        resp = self.wire.request(method, path, params, data, sent or None)
        return resp.status, resp.read()

    # control
    def health(self) -> dict[str, Any]:
        return self._send(_Routes.health()).json()

    def stats(self) -> dict[str, Any]:
        return self._send(_Routes.stats()).json()

    def metrics(self) -> str:
        return self._send(_Routes.metrics()).text

    def sessions(self) -> list[dict[str, Any]]:
        return self._send(_Routes.sessions()).json()

    def session(self, session_id: str) -> dict[str, Any]:
        return self._send(_Routes.session(session_id)).json()

    def offload(self, session_id: str, tier: str | None = None, wait: bool = True) -> dict[str, Any]:
        return self._send(_Routes.offload(session_id, tier, wait)).json()

    def restore(self, session_id: str) -> dict[str, Any]:
        return self._send(_Routes.restore(session_id)).json()

    def hint(self, session_id: str) -> str:
        return self._send(_Routes.hint(session_id)).json()["action"]

    def end_session(self, session_id: str) -> None:
        self._send(_Routes.end_session(session_id))

    # data plane
    def put_chunk(self, key: str, blob: Blob, tier: str | None = None,
                  owner: ChunkOwner | None = None) -> dict[str, Any]:
        """Store one chunk; ``blob`` is sent from where it is (bytes or any buffer), or
        copied into this thread's shared-memory region (``shm``). ``owner``: the session
        the chunk belongs to and its place in it, for the service's session-aware tiers."""
        if self.shm:
            src = np.frombuffer(memoryview(blob).cast("B"), np.uint8)

            def fill(room: memoryview) -> int:
                np.copyto(np.frombuffer(room, np.uint8)[: len(src)], src)
                return len(src)

            done = self.put_chunk_filled(key, fill, len(src), tier, owner)
            if done is not None:
                return done
        if self.wire is None:
            return self._send(_Routes.put_chunk(key, blob, tier, owner)).json()
        resp = self.wire.request("PUT", f"/v1/chunks/{key}", _put_params(tier, owner), blob,
                                 {"Content-Type": OCTETS})
        body = resp.read()
        if resp.status not in (200, 201):
            raise error_from(resp.status, body)
        return json.loads(body)

    def put_chunk_filled(self, key: str, fill: Callable[[memoryview], int], nbytes: int,
                         tier: str | None = None, owner: ChunkOwner | None = None
                         ) -> dict[str, Any] | None:
        """Store a chunk that ``fill`` writes straight into this thread's shared-memory
        region (given ``nbytes`` of room, it returns the chunk's length): no buffer of the
        caller's in between. None where no region can be used (``shm`` off, or the server
        offers none): the caller sends the chunk from a buffer. A server that restarted
        gets a new region, filled again."""
        link = self._region()
        for attempt in (0, 1) if link is not None else ():
            try:
                room = link.room(nbytes)
            except RegionUnavailable as exc:
                self._no_region(exc)
                return None
            n = fill(room)
            params = {"region": link.id, "offset": 0, "length": n, **(_put_params(tier, owner) or {})}
            status, body = self._through_region(link, "PUT", f"/v1/chunks/{key}", params, None)
            if _region_gone(status, body) and not attempt:
                link.forget()
                continue
            if status not in (200, 201):
                raise error_from(status, body)
            return json.loads(body)
        return None

    def get_chunks_in_region(self, keys: Sequence[str], room: int) -> RegionReads | None:
        """Read the stored prefix of ``keys`` into this thread's shared-memory region in one
        request, within its first ``room`` bytes: views of the region, valid until this
        thread's next region call; no copy on this side. None where no region can be used
        (the caller reads into buffers of its own). InvalidArgumentError where the first
        chunk is larger than ``room``."""
        link = self._region()
        for attempt in (0, 1) if link is not None else ():
            try:
                region = link.room(room)
            except RegionUnavailable as exc:
                self._no_region(exc)
                return None
            status, body = self._through_region(
                link, "POST", "/v1/chunks/batch/get-into-region", None,
                {"keys": list(keys), "region": link.id, "room": room})
            if _region_gone(status, body) and not attempt:
                link.forget()  # the server restarted: a new region, once
                continue
            if status == 413:
                raise InvalidArgumentError(f"chunk {keys[0]} does not fit a {room}-byte buffer")
            if status != 200:
                raise error_from(status, body)
            got = json.loads(body)
            views = [region[c["offset"] : c["offset"] + c["length"]] for c in got["chunks"]]
            return RegionReads(views, ended=got["stopped"] == "missing")
        return None

    def get_chunk(self, key: str, layers: tuple[int, int] | None = None) -> bytes | None:
        """The chunk's bytes, or None when it is not stored."""
        if self.wire is None:
            resp = self._send(_Routes.get_chunk(key, layers))
            return None if resp.status_code == 404 else resp.content
        resp = self.wire.request("GET", f"/v1/chunks/{key}", _layers(layers))
        body = resp.read()
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise error_from(resp.status, body)
        return body

    def get_chunk_into(
        self, key: str, out: Blob, layers: tuple[int, int] | None = None,
        through_region: bool = True,
    ) -> memoryview | None:
        """Read the chunk straight into ``out`` (a writable buffer that holds it): the
        filled part of it, or None when it is not stored. No bytes object is made. With
        ``shm`` it comes through this thread's region, which it overwrites
        (``through_region`` False: through the reply's body, leaving views of the region
        that :meth:`get_chunks_in_region` lent intact)."""
        mem = memoryview(out).cast("B")
        if layers is None and self.shm and through_region:
            read = self.get_chunks_in_region([key], len(mem))
            if read is not None:
                if not read.views:
                    return None
                got = read.views[0]
                np.copyto(np.frombuffer(mem[: len(got)], np.uint8), np.frombuffer(got, np.uint8))
                return mem[: len(got)]
        if self.wire is None:
            blob = self.get_chunk(key, layers)
            if blob is None:
                return None
            if len(blob) > len(mem):
                raise InvalidArgumentError(f"a {len(blob)}-byte chunk does not fit a {len(mem)}-byte buffer")
            mem[: len(blob)] = blob
            return mem[: len(blob)]
        resp = self.wire.request("GET", f"/v1/chunks/{key}", _layers(layers))
        if resp.status != 200:
            body = resp.read()
            if resp.status == 404:
                return None
            raise error_from(resp.status, body)
        return self.wire.read_into(resp, mem)

    def has_chunk(self, key: str) -> bool:
        return self._send(_Routes.has_chunk(key)).status_code == 200

    def derive_chunk(self, key: str, source: str, first_token: int, tokens: int,
                     owner: ChunkOwner | None = None) -> dict[str, Any] | None:
        """Store under ``key`` tokens ``[first_token, first_token + tokens)`` of the stored
        chunk ``source``, cut inside the service (nothing uploaded). None where the service
        holds no exact copy of the source to cut (missing, evicted, kept compressed, or not
        KV): the caller uploads the chunk itself."""
        try:
            return self._ask(_Routes.derive_chunk(key, source, first_token, tokens, owner))
        except ServiceError as exc:
            if exc.status in (404, 409):
                return None
            raise

    def delete_chunk(self, key: str) -> bool:
        return self._send(_Routes.delete_chunk(key)).status_code == 204

    def lookup(self, keys: Sequence[str]) -> Lookup:
        return Lookup(**self._ask(_Routes.lookup(keys)))

    def prefetch(self, keys: Sequence[str]) -> int:
        """Raise the stored prefix of ``keys`` into the server's fastest tier (a request
        that will read them is on its way); how many chunks were read from slower ones."""
        return int(self._ask(_Routes.prefetch(keys))["promoted"])

    def report_turns(self, turns: Sequence[SessionTurn]) -> None:
        """Tell the service when sessions' turns started and ended (oldest first): its
        session-aware tiers keep the sessions likely back soon (a sidecar's; an engine-mode
        service ranks its own sessions and answers 409)."""
        if turns:
            self._send(_Routes.report_turns(turns))

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is stored (one request)."""
        return list(Lookup(**self._ask(_Routes.lookup(keys, each=True))).present or [])

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """The fastest tier holding each of ``keys``, prefix or not, or None (one request)."""
        got = Lookup(**self._ask(_Routes.lookup(keys, each=True)))
        if got.located is None:
            raise ServiceError(502, "old_server", "the lookup names no tier per key (an older kvtier)")
        return list(got.located)

    def get_chunks(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None
    ) -> list[bytes | None]:
        return msgpack.unpackb(self._send(_Routes.get_chunks(keys, layers)).content, raw=False)

    def put_chunks(self, chunks: Mapping[str, bytes], tier: str | None = None) -> dict[str, Any]:
        return self._send(_Routes.put_chunks(chunks, tier)).json()

    # chat
    def chat(
        self, messages: Sequence[Mapping[str, str]], session_id: str | None = None, **options: Any
    ) -> dict[str, Any]:
        """A chat completion (OpenAI's response object plus ``kvtier`` timings)."""
        return self._send(_Routes.chat(messages, session_id, False, **options)).json()

    def chat_stream(
        self, messages: Sequence[Mapping[str, str]], session_id: str | None = None, **options: Any
    ) -> Iterator[dict[str, Any]]:
        """The stream's chunk objects, in order (text is in ``choices[0].delta.content``)."""
        call = _Routes.chat(messages, session_id, True, **options)
        with self.http.stream(
            call.method, call.path, json=call.json, headers=call.headers
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                _raise_for(resp, (200,))
            for line in resp.iter_lines():
                event = _sse_event(line)
                if event is not None:
                    yield event

    def close(self) -> None:
        with self._links_lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        self.http.close()
        if self.wire is not None:
            self.wire.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Asynchronous client: the same methods as :class:`Client`, awaited."""

    def __init__(
        self, base_url: str, token: str | None = None, timeout: float = 60.0,
        accept_codecs: Collection[str] | None = None, **httpx_kwargs: Any
    ) -> None:
        self.http = httpx.AsyncClient(
            base_url=base_url, headers=_headers(token, accept_codecs), timeout=timeout,
            **httpx_kwargs)

    async def _send(self, call: _Call) -> httpx.Response:
        resp = await self.http.request(
            call.method,
            call.path,
            json=call.json,
            content=call.content,
            params=call.params,
            headers=call.headers,
        )
        _raise_for(resp, call.ok)
        return resp

    async def health(self) -> dict[str, Any]:
        return (await self._send(_Routes.health())).json()

    async def stats(self) -> dict[str, Any]:
        return (await self._send(_Routes.stats())).json()

    async def metrics(self) -> str:
        return (await self._send(_Routes.metrics())).text

    async def sessions(self) -> list[dict[str, Any]]:
        return (await self._send(_Routes.sessions())).json()

    async def session(self, session_id: str) -> dict[str, Any]:
        return (await self._send(_Routes.session(session_id))).json()

    async def offload(
        self, session_id: str, tier: str | None = None, wait: bool = True
    ) -> dict[str, Any]:
        return (await self._send(_Routes.offload(session_id, tier, wait))).json()

    async def restore(self, session_id: str) -> dict[str, Any]:
        return (await self._send(_Routes.restore(session_id))).json()

    async def hint(self, session_id: str) -> str:
        return (await self._send(_Routes.hint(session_id))).json()["action"]

    async def end_session(self, session_id: str) -> None:
        await self._send(_Routes.end_session(session_id))

    async def put_chunk(self, key: str, blob: bytes, tier: str | None = None) -> dict[str, Any]:
        return (await self._send(_Routes.put_chunk(key, blob, tier))).json()

    async def get_chunk(self, key: str, layers: tuple[int, int] | None = None) -> bytes | None:
        resp = await self._send(_Routes.get_chunk(key, layers))
        return None if resp.status_code == 404 else resp.content

    async def has_chunk(self, key: str) -> bool:
        return (await self._send(_Routes.has_chunk(key))).status_code == 200

    async def delete_chunk(self, key: str) -> bool:
        return (await self._send(_Routes.delete_chunk(key))).status_code == 204

    async def lookup(self, keys: Sequence[str]) -> Lookup:
        return Lookup(**(await self._send(_Routes.lookup(keys))).json())

    async def get_chunks(
        self, keys: Sequence[str], layers: tuple[int, int] | None = None
    ) -> list[bytes | None]:
        resp = await self._send(_Routes.get_chunks(keys, layers))
        return msgpack.unpackb(resp.content, raw=False)

    async def put_chunks(
        self, chunks: Mapping[str, bytes], tier: str | None = None
    ) -> dict[str, Any]:
        return (await self._send(_Routes.put_chunks(chunks, tier))).json()

    async def chat(
        self, messages: Sequence[Mapping[str, str]], session_id: str | None = None, **options: Any
    ) -> dict[str, Any]:
        return (await self._send(_Routes.chat(messages, session_id, False, **options))).json()

    async def chat_stream(
        self, messages: Sequence[Mapping[str, str]], session_id: str | None = None, **options: Any
    ) -> AsyncIterator[dict[str, Any]]:
        call = _Routes.chat(messages, session_id, True, **options)
        async with self.http.stream(
            call.method, call.path, json=call.json, headers=call.headers
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                _raise_for(resp, (200,))
            async for line in resp.aiter_lines():
                event = _sse_event(line)
                if event is not None:
                    yield event

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def chat_text(events: Sequence[Mapping[str, Any]]) -> str:
    """The reply text of a list of stream events."""
    return "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")
    )
