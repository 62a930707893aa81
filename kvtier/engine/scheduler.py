"""Iteration-level continuous batching over the model runner (the vLLM v1 / nano-vllm model).

Every step spends a token budget: running sequences first (one token each when decoding,
the next chunk when their prefill is long), then waiting requests in arrival order while
the pool has blocks for them. A prompt longer than the budget is prefilled in chunks
across steps, interleaved with other sequences' decodes. When a running sequence needs a
block and none is free, the most recently admitted sequence is preempted: its blocks are
freed (full blocks stay in the prefix cache) and it is re-queued at the front, to be
recomputed when it is admitted again.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvtier.engine.model_runner import ModelRunner
from kvtier.engine.sampling import SamplingParams, StopChecker, sample_one
from kvtier.errors import InvalidArgumentError, OutOfBlocksError
from kvtier.hashing import chain_hashes
from kvtier.models.tokenizer import StreamDecoder, Tokenizer
from kvtier.policies.reuse_ceiling import ReuseCeiling
from kvtier.transfer.kv_transfer import KVTransfer
from kvtier.transfer.layer_load import LayerLoadError

log = logging.getLogger(__name__)


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimings:
    """Wall-clock points of one request (``time.perf_counter`` seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


@dataclass
class Request:
    request_id: Hashable
    prompt_ids: list[int]
    params: SamplingParams
    stop: StopChecker
    generator: torch.Generator | None
    timings: RequestTimings
    on_token: Callable[[Request, int, str], None] | None = None
    decoder: StreamDecoder | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    state: RequestState = RequestState.WAITING
    finish_reason: str | None = None
    """``stop`` (EOS, stop token or string), ``length`` (max_tokens or max_model_len),
    ``error`` (see ``error``)."""
    error: str | None = None
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (first admission)."""
    num_computed_tokens: int = 0
    """Tokens this request ran through the model (prefill, recompute after preemption, decode)."""
    num_preemptions: int = 0
    internal_error: bool = False
    """Failed by the engine itself (a step raised), not by anything in the request."""
    num_swapped_in_tokens: int = 0
    """Tokens restored from the tiers after a preemption (instead of recomputed)."""
    _swapped_tokens: int = 0
    _admitted_once: bool = False
    _text_checked: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


class Scheduler:
    """Owns the waiting and running queues and drives the runner one step at a time."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        swap: KVTransfer | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise InvalidArgumentError(
                "max_num_seqs and max_num_batched_tokens must be >= 1, got "
                f"{max_num_seqs} and {max_num_batched_tokens}"
            )
        self.runner = runner
        self.tokenizer = tokenizer
        self.swap = swap
        """Where preempted sequences' KV goes (swap-out) instead of being recomputed."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        eos = set(runner.config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        # Sample only ids the tokenizer can turn into text: checkpoints pad their embedding
        # past the tokenizer's vocabulary (make-model's random models do so widely).
        self.sample_vocab = runner.config.vocab_size
        if tokenizer is not None:
            self.sample_vocab = min(self.sample_vocab, tokenizer.vocab_size)
        self.steps = 0
        self.preemptions = 0
        self.reuse = ReuseCeiling()
        """The best hit rate the requests allow, beside the one achieved (a window)."""
        self.on_step: Callable[[float], None] | None = None
        """Told how long each model step ran (the live policy's load meter)."""
        self.on_prompt_blocks: Callable[[list[bytes]], None] | None = None
        """Told each admitted prompt's full blocks (chained hashes under the model's
        fingerprint, as the residency keys them): the live policy watches victims."""

    # ------------------------------------------------------------------ intake
    def add(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: Hashable | None = None,
        on_token: Callable[[Request, int, str], None] | None = None,
        arrival: float | None = None,
    ) -> Request:
        """Queue a request. One that can never run (empty, too long, bad token ids) is
        returned already finished with ``finish_reason == "error"``: it never stalls others.

        ``arrival`` (``time.perf_counter``): when the caller took the request in, if work on
        it came before queueing (a chat turn restores its KV first); default now."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            stop=StopChecker(params, self.eos_token_ids),
            generator=params.make_generator(),
            timings=RequestTimings(time.perf_counter() if arrival is None else arrival),
            on_token=on_token,
            decoder=self.tokenizer.stream() if self.tokenizer is not None else None,
        )
        problem = self._validate(req)
        if problem:
            self._finish(req, "error", problem)
        else:
            self.waiting.append(req)
        return req

    def _validate(self, req: Request) -> str | None:
        limit = self.runner.max_model_len
        vocab = self.runner.config.vocab_size
        if any(r.request_id == req.request_id for r in itertools.chain(self.waiting, self.running)):
            return f"request id {req.request_id!r} is already in use"
        if not req.prompt_ids:
            return "the prompt is empty: give at least one token"
        if len(req.prompt_ids) >= limit:
            return (
                f"the prompt has {len(req.prompt_ids)} tokens; max_model_len is {limit}, which "
                "must leave room for at least one generated token: shorten the prompt"
            )
        bad = next((t for t in req.prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return f"token id {bad} is outside the model's vocabulary [0, {vocab})"
        blocks = self.runner.pool.manager.blocks_needed(len(req.prompt_ids) + 1)
        if blocks > self.runner.pool.block_pool.num_blocks:
            return (
                f"the prompt needs {blocks} KV blocks but the pool has only "
                f"{self.runner.pool.block_pool.num_blocks}: give the pool more memory"
            )
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """Schedule, run the model once, sample; returns the requests finished by this step."""
        if self.runner.layer_loads:
            self._drop_lost_restores()
        batch = self._schedule()
        if not batch:
            return []
        self.steps += 1
        t0 = time.perf_counter()
        try:
            logits = self.runner.run([(r.request_id, n) for r, n in batch])
        except LayerLoadError as exc:
            log.warning("step abandoned: %s", exc)
            self._drop_lost_restores()
            return []  # the unaffected rows run again next step; nothing was marked computed
        logits = logits[:, : self.sample_vocab]
        done: list[Request] = []
        now = time.perf_counter()
        for row, (req, n) in enumerate(batch):
            req.num_computed_tokens += n
            if req.state is not RequestState.RUNNING:
                continue  # preempted by an earlier row of this step: recomputed later
            seq = self.runner.pool.sequence(req.request_id)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk: no token to sample yet
            token = sample_one(logits[row], req.params, req.generator)
            if self._emit(req, token, now):
                done.append(req)
        if self.on_step is not None:  # after sampling: on a GPU the step has run by then
            self.on_step(time.perf_counter() - t0)
        return done

    def _schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        batch: list[tuple[Request, int]] = []
        for req in self.running:
            if budget == 0:
                break
            seq = self.runner.pool.sequence(req.request_id)
            n = min(max(seq.num_tokens - seq.num_computed_tokens, 1), budget)
            batch.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req._swapped_tokens and self.swap is not None:
                pool = self.runner.pool
                need = pool.manager.blocks_needed(len(req.all_ids))
                if self.running and need > pool.block_pool.num_free:
                    break  # swap in once it fits, not before (the read would be wasted)
                loaded = self.swap.load(req.all_ids, req._swapped_tokens)
                req.num_swapped_in_tokens += loaded.from_tiers
            try:
                added = self.runner.add_sequence(req.request_id, req.all_ids)
            except OutOfBlocksError:
                if not self.running:  # nothing will ever free blocks for it
                    self.waiting.popleft()
                    self._finish(req, "error", "the KV pool is too small for this request")
                    continue
                break
            self.waiting.popleft()
            self.running.append(req)
            req.state = RequestState.RUNNING
            req._swapped_tokens = 0
            if not req._admitted_once:
                req._admitted_once = True
                req.num_cached_tokens = added.num_cached_tokens
                req.timings.first_scheduled = time.perf_counter()
                self._count_reuse(req)
            n = min(max(len(req.all_ids) - added.num_cached_tokens, 1), budget)
            batch.append((req, n))
            budget -= n
        return batch

    def _emit(self, req: Request, token: int, now: float) -> bool:
        """Record a sampled token; True when the request is finished."""
        req.output_ids.append(token)
        t = req.timings
        if t.first_token is None:
            t.first_token = now
        t.token_times.append(now)
        reason = req.stop.check_token(token, len(req.output_ids))
        # The token that ends the turn (EOS, <|im_end|>, a stop id) stays in the ids, where
        # the KV needs it, but not in the text, as in vLLM and OpenAI's API.
        ends_turn = reason == "stop"
        delta = req.decoder.push(token) if req.decoder is not None and not ends_turn else ""
        if req.decoder is not None and req.params.stop:
            req.text = req.decoder.text
            cut = req.stop.find_stop_string(req.text, req._text_checked)
            req._text_checked = len(req.text)
            if cut is not None:
                keep_delta = max(0, cut - (len(req.text) - len(delta)))
                delta = delta[:keep_delta]
                req.text = req.text[:cut]
                reason = "stop"
        elif req.decoder is not None:
            req.text = req.decoder.text
        if reason is None and len(req.all_ids) >= self.runner.max_model_len:
            reason = "length"
        if req.on_token is not None:
            req.on_token(req, token, delta)
        if reason is not None:
            self._release(req)  # at once: its blocks serve the rows after it
            self._finish(req, reason)
            return True
        self._append(req, token)
        return False

    def _append(self, req: Request, token: int) -> None:
        """Give the sampled token a slot for the next step, preempting if the pool is full."""
        while True:
            try:
                self.runner.append_tokens(req.request_id, [token])
                return
            except OutOfBlocksError:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    return  # re-queued with the token; it is recomputed on re-admission

    def _drop_lost_restores(self) -> None:
        """Recompute the requests over chunks a streamed restore lost, then release the
        finished restores (see :mod:`kvtier.transfer.layer_load`)."""
        lost = self.runner.take_poisoned_blocks()
        if lost:
            for req in list(self.running):
                if lost.intersection(self.runner.pool.sequence(req.request_id).block_ids):
                    self._preempt(req, swap=False)
        self.runner.reap_layer_loads()

    def settle_loads(self) -> None:
        """Wait for every streamed restore to finish and clean up after it."""
        for load in list(self.runner.layer_loads):
            load.wait()
        self._drop_lost_restores()

    def _preempt(self, req: Request, swap: bool = True) -> None:
        log.debug("preempting %s (%d tokens)", req.request_id, len(req.all_ids))
        self.running.remove(req)
        req._swapped_tokens = 0
        if swap and self.swap is not None:  # swap out: its computed KV goes to the fastest tier
            req._swapped_tokens = self.swap.save(req.all_ids).tokens
        self.runner.free_sequence(req.request_id)
        req.state = RequestState.WAITING
        req.num_preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.runner.free_sequence(req.request_id)

    def _count_reuse(self, req: Request) -> None:
        """A request's prompt blocks against the reuse ceiling, with the ones it found."""
        bs = self.runner.pool.block_size
        full = len(req.prompt_ids) // bs * bs
        hashes = chain_hashes(req.prompt_ids[:full], bs, self.runner.fingerprint)
        self.reuse.requested(hashes, served=min(req.num_cached_tokens, full) // bs)
        if self.on_prompt_blocks is not None:
            self.on_prompt_blocks(hashes)

    def _count_reply(self, req: Request) -> None:
        """The full blocks a reply completed: the next turn's prompt may ask for them."""
        bs = self.runner.pool.block_size
        ids = req.all_ids
        start = len(req.prompt_ids) // bs
        full = len(ids) // bs
        if full > start:
            self.reuse.produced(chain_hashes(ids[: full * bs], bs, self.runner.fingerprint)[start:])

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req._admitted_once and error is None:
            self._count_reply(req)
        req.state = RequestState.FINISHED
        req.finish_reason = reason
        req.error = error
        req.timings.finished = time.perf_counter()
        if req.decoder is not None and not req.params.stop:
            req.decoder.finish()
            req.text = req.decoder.text

    def fail_all(self, error: str) -> list[Request]:
        """A step raised: finish every queued and running request with ``error`` and give
        back their blocks, so the engine can go on serving new requests."""
        failed = [*self.running, *self.waiting]
        for req in list(self.running):
            self._release(req)
        self.waiting.clear()
        for req in failed:
            req.internal_error = True
            self._finish(req, "error", error)
        return failed

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is; True if it was found."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                self._finish(req, "abort")
                return True
        for req in list(self.running):
            if req.request_id == request_id:
                self._release(req)
                self._finish(req, "abort")
                return True
        return False
