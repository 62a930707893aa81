"""The scheduler side of kvtier's vLLM connector: which of a request's blocks the store
holds, what to load into the blocks vLLM allocates, and which newly computed prompt blocks
to save, as a :class:`~kvtier.connectors.vllm_blocks.StepPlan` per step.

It reads vLLM's objects only for the fields named here (``request.request_id``,
``prompt_token_ids``; the allocated blocks' ``get_block_ids()``; the scheduler output's new
and cached requests), so the main suite drives it with plain stand-ins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.connectors.chunk_store import ChunkStore
from kvtier.connectors.vllm_blocks import BlockTransfer, StepPlan, block_keys

log = logging.getLogger(__name__)


@dataclass
class _ReqState:
    """One running request."""

    prompt: list[int]
    keys: list[str]
    """Keys of the prompt's full blocks."""
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0
    """Leading prompt blocks known to be stored (loaded ones included)."""


@dataclass
class _Planned:
    """What the last lookup of a request found: load blocks ``first`` to ``stored``."""

    first: int
    stored: int


class SchedulerSide:
    """``store()`` opens the store when first needed (the scheduler process may never)."""

    def __init__(self, store: Callable[[], ChunkStore], block_size: int,
                 fingerprint: bytes) -> None:
        self._store = store
        self.block_size = block_size
        self.fingerprint = fingerprint
        self._requests: dict[str, _ReqState] = {}
        self._planned: dict[str, _Planned] = {}
        self._loads: dict[str, BlockTransfer] = {}
        self.hit_blocks = 0

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens past ``num_computed_tokens`` the store can provide: the longest stored
        prefix of the prompt's full blocks, leaving at least one token to compute."""
        prompt = list(request.prompt_token_ids or [])
        state = self._requests.get(request.request_id)
        if state is None:
            keys = block_keys(prompt, self.block_size, self.fingerprint)
            state = self._requests[request.request_id] = _ReqState(prompt, keys)
        usable = (len(prompt) - 1) // self.block_size
        try:
            stored = self._store().lookup(state.keys[:usable]) if usable > 0 else 0
        except Exception as exc:  # noqa: BLE001 - an unreachable store is a miss
            log.warning("kvtier lookup failed, recomputing: %s", exc)
            stored = 0
        first = num_computed_tokens // self.block_size
        if stored <= first:
            return 0
        self._planned[request.request_id] = _Planned(first, stored)
        return stored * self.block_size - num_computed_tokens

    def allocated(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: the planned load targets them."""
        state = self._requests[request.request_id]
        state.block_ids = list(block_ids)
        plan = self._planned.pop(request.request_id, None)
        if num_external_tokens <= 0 or plan is None:
            return
        self._loads[request.request_id] = BlockTransfer(
            request.request_id, state.block_ids[plan.first : plan.stored],
            state.keys[plan.first : plan.stored])
        state.saved = max(state.saved, plan.stored)
        self.hit_blocks += plan.stored - plan.first

    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """This step's loads, and saves of the prompt blocks the step completes."""
        plan = StepPlan(loads=list(self._loads.values()))
        self._loads.clear()
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_ids is not None:
                state.block_ids = list(new_ids[0])  # a resumed request gets all its blocks
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            progress[req_id] = cached.num_computed_tokens[i]
        for req_id, computed in progress.items():
            save = self._completed(req_id, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if save is not None:
                plan.saves.append(save)
        return plan

    def _completed(self, req_id: str, done: int) -> BlockTransfer | None:
        """The prompt blocks of ``req_id`` full once ``done`` tokens are computed and not
        saved yet (then counted as saved)."""
        state = self._requests[req_id]
        full = min(min(done, len(state.prompt)) // self.block_size, len(state.keys),
                   len(state.block_ids))
        if full <= state.saved:
            return None
        save = BlockTransfer(req_id, state.block_ids[state.saved : full],
                             state.keys[state.saved : full])
        state.saved = full
        return save

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._planned.pop(req_id, None)
        self._loads.pop(req_id, None)
