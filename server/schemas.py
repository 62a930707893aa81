"""Request and response bodies of the HTTP API (they make the OpenAPI schema)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.chunk_keys import KEY_PATTERN
from kvtier.client import MAX_TURNS_PER_REPORT

MAX_BATCH_KEYS = 65536


class _Doc(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class _Body(_Doc):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


# ------------------------------------------------------------------------ control plane
class Health(_Doc):
    status: Literal["ok"] = "ok"
    mode: Literal["engine", "sidecar"]
    model: str | None = None


class TurnInfo(_Doc):
    turn: int
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    restored_tokens: int
    restored_from: dict[str, int] = {}
    """Restored tokens per tier that held them (tier name -> tokens)."""
    restored_bytes: int = 0
    output_tokens: int
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    total_s: float | None
    finish_reason: str | None
    preemptions: int


class SessionInfo(_Doc):
    id: str
    turns: int
    tokens: int
    """Tokens the session's KV covers (prompt and reply of its last turn)."""
    stored_tokens: int
    """Leading tokens stored in the lower tiers."""
    offloaded: bool
    """Its KV left the pool: the next turn restores it (or recomputes, if cheaper)."""
    busy: bool
    """A turn is in flight."""
    idle_s: float | None = None
    predicted_next_s: float | None = None
    """The policy's expected seconds until the next turn (think-time model)."""


class SessionDetail(SessionInfo):
    messages: int
    history: list[TurnInfo]


class OffloadRequest(_Body):
    tier: str | None = Field(default=None, description="target tier name; default the fastest")
    wait: bool = Field(default=True, description="false: store in the background")


class OffloadResponse(_Doc):
    session_id: str
    stored_tokens: int
    freed_blocks: int
    tier: str
    bytes: int
    failed: dict[str, str]
    pending: bool = False
    """True when ``wait`` was false: the store runs in the background."""


class RestoreResponse(_Doc):
    session_id: str
    tokens: int
    from_pool: int
    from_tiers: int
    tier_hits: dict[str, int]
    bytes: int


class HintResponse(_Doc):
    session_id: str
    action: Literal["resident", "restoring", "prefetching"]


# --------------------------------------------------------------------------- data plane
class LookupRequest(_Body):
    keys: list[str] = Field(max_length=MAX_BATCH_KEYS)
    each: bool = Field(default=False, description="also say whether each key is stored")


class DeriveRequest(_Body):
    source: str = Field(pattern=KEY_PATTERN, description="a stored chunk of the caller's")
    first_token: int = Field(ge=0, description="the first of the source's tokens to take")
    tokens: int = Field(ge=1, description="how many of its tokens, from first_token on")


class TurnItem(_Body):
    session: str = Field(pattern=r"^[\x20-\x7e]{1,256}$",
                         description="the session, as its chunks' stores name it")
    event: Literal["started", "ended"]
    ago_s: float = Field(0.0, ge=0.0, le=86400.0,
                         description="how long before this report the turn started or ended")


class TurnReport(_Body):
    turns: list[TurnItem] = Field(max_length=MAX_TURNS_PER_REPORT, description="oldest first")


class LookupResponse(_Doc):
    length: int
    """How many leading keys are stored somewhere."""
    tiers: list[str]
    """The fastest tier holding each of those keys."""
    present: list[bool] | None = None
    """With ``each``: whether each key is stored, in the prefix or not."""
    located: list[str | None] | None = None
    """With ``each``: the fastest tier holding each key, or null (what ``present`` says,
    with the tier)."""


class PrefetchResponse(_Doc):
    promoted: int
    """Chunks read from a slower tier and written into the fastest."""


class BatchGetRequest(_Body):
    keys: list[str] = Field(max_length=MAX_BATCH_KEYS)
    layers: tuple[int, int] | None = Field(
        default=None, description="read only layers [start, end) of each chunk"
    )


class PutResponse(_Doc):
    key: str
    status: Literal["stored", "present"]
    tiers: list[str]


class RegionRequest(_Doc):
    bytes: int = Field(ge=1, description="size of the region: room for the largest chunk it moves")


class RegionResponse(_Doc):
    id: str
    path: str = Field(description="the file to map (same host, same user)")
    bytes: int
    expires_in_s: float = Field(description=(
        "seconds until the region is reclaimed unless a request uses it (a chunk PUT or GET "
        "through it, or a renewal) before then: server.shm_lease_s from each use"))


class GetIntoRegionResponse(_Doc):
    key: str
    length: int = Field(description="bytes of the chunk, written at the region's offset")
    tier: str


class BatchGetIntoRegionRequest(_Body):
    keys: list[str] = Field(min_length=1, max_length=MAX_BATCH_KEYS)
    region: str = Field(pattern=r"^[0-9a-f]{32}$", description="a region of the caller's")
    offset: int = Field(default=0, ge=0, description="where in the region the first chunk goes")
    room: int | None = Field(default=None, ge=1, description=(
        "bytes the chunks may take from offset (default: to the region's end)"))


class RegionChunkResponse(_Doc):
    key: str
    offset: int = Field(description="where in the region the chunk lies")
    length: int
    tier: str


class BatchGetIntoRegionResponse(_Doc):
    chunks: list[RegionChunkResponse] = Field(description=(
        "the leading keys read, in order, each at a page boundary after the one before"))
    stopped: Literal["missing", "room"] | None = Field(description=(
        "why the keys after them were not read: the next one is not stored (missing) or "
        "does not fit in what is left of the room (room); null: every key was read"))


class BatchPutResponse(_Doc):
    stored: list[str]
    present: list[str]
    failed: dict[str, str]


# --------------------------------------------------------------------------------- chat
class ChatMessage(_Doc):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(_Body):
    include_usage: bool = False


class ModelCard(_Doc):
    """One entry of ``GET /v1/models`` (OpenAI's model object)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    root: str
    """The model directory's name (every alias of one model has the same root)."""


class ModelList(_Doc):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ChatCompletionRequest(_Doc):
    """OpenAI's chat-completions request (the fields kvtier's engine honours)."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)  # unused fields

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="kvtier extension; 0 disables")
    seed: int | None = Field(default=None, ge=-(1 << 63), le=(1 << 64) - 1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    user: str | None = Field(
        default=None, description="session id (the X-Session-Id header takes precedence)"
    )


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class ChoiceMessage(_Doc):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(_Doc):
    index: int = 0
    message: ChoiceMessage
    finish_reason: str | None


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    kvtier: dict[str, Any]
    """Per-response timings and where the prompt's KV came from."""


class Stats(_Doc):
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    mode: Literal["engine", "sidecar"]
    uptime_s: float
    tiers: list[dict[str, Any]]
    manager: dict[str, Any] | None
    tenants: list[dict[str, Any]]
    """Per tenant and tier: ``bytes`` held, ``quota_bytes``, ``quota_evicted_bytes``."""
    pool: dict[str, Any] | None
    sessions: dict[str, int] | None
    turns: dict[str, int] | None = None
    """Sidecar mode: sessions' turns its clients reported (``reported``), the sessions it
    remembers and the turns running (``POST /v1/chunks/turns``)."""
    regions: dict[str, Any] | None = None
    """Same-host clients' shared-memory regions: offered (``enabled``), ``held`` and
    ``held_bytes``, chunks that crossed them by way (``transfers``, ``transfer_bytes``:
    ``put``, ``get``), ``reclaimed`` at their lease's end."""
    policy: dict[str, Any] | None
