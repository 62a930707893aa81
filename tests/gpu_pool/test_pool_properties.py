"""Stateful property test of the paged KV pool against a pure-Python model.

Random programs of add / append / write+mark_computed / fork / free / match_prefix run on a
real :class:`PagedKVPool` with small CPU pools (so out-of-blocks happens) and token
sequences that often share prefixes with live or freed ones (so prefix hits happen).

The KV written for a token is a pair of integers derived from the whole token prefix up to
and including it (exact in float32). KV is a function of the prefix in a real model too, so:

* a sequence reading back its computed positions through its block table must see exactly
  the values of its own prefix: a missing copy-on-write (another sequence writing a
  different prefix into a shared block) or a wrong prefix hit shows up as a mismatch;
* a block registered in the prefix cache under a hash must hold the values of the tokens
  that hash names, for as long as it stays registered, referenced or free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.errors import OutOfBlocksError, SequenceExistsError
from kvtier.gpu_pool import KVStorage, PagedKVPool
from kvtier.hashing import chain_hashes

P1, P2 = 4_194_301, 4_194_287  # primes below 2**22: codes stay exact in float32
VOCAB = 6  # a small vocabulary so random sequences share prefixes too

# How often each interesting situation happened across all examples (checked at the end).
SEEN: Counter[str] = Counter()


def prefix_codes(tokens: list[int]) -> list[tuple[int, int]]:
    """The (K, V) value written for each position: a rolling hash of tokens[: pos + 1]."""
    h1 = h2 = 0
    out = []
    for pos, t in enumerate(tokens):
        h1 = (h1 * 1_000_003 + t + 1) % P1
        h2 = (h2 * 999_983 + 7 * t + pos + 3) % P2
        out.append((h1 + 1, h2 + 1))  # never 0, the value of untouched storage
    return out


@dataclass
class SeqModel:
    tokens: list[int]
    computed: int = 0
    codes: list[tuple[int, int]] = field(default_factory=list)

    def extend(self, new: list[int]) -> None:
        self.tokens += new
        self.codes = prefix_codes(self.tokens)

    def copy(self) -> SeqModel:
        return SeqModel(list(self.tokens), self.computed, list(self.codes))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolMachine(RuleBasedStateMachine):
    """One pool, many sequences; the model says what every sequence must read back."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: PagedKVPool
        self.seqs: dict[int, SeqModel] = {}
        self.history: list[list[int]] = []
        self.hash_codes: dict[bytes, list[tuple[int, int]]] = {}
        self.next_id = 0

    # ------------------------------------------------------------------ setup
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(8, 64),
        layers=st.integers(1, 2),
        caching=st.sampled_from([True, True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, layers: int, caching: bool) -> None:
        storage = KVStorage(layers, num_blocks, block_size, 1, 2, "float32", "cpu")
        self.pool = PagedKVPool(storage, enable_prefix_caching=caching)
        self.bs = block_size
        self.nb = num_blocks
        self.caching = caching
        # Long enough that two or three sequences fill the pool.
        self.max_len = max(2, num_blocks * block_size // 3)

    # -------------------------------------------------------------- helpers
    def draw_tokens(self, data: st.DataObject, max_len: int) -> list[int]:
        """Random tokens, or (often) a prefix of an earlier sequence plus a random tail."""
        tail = st.lists(st.integers(0, VOCAB - 1), max_size=max_len)
        if self.history and data.draw(st.integers(0, 3), label="from_history") > 0:
            base = data.draw(st.sampled_from(self.history), label="base")
            cut = data.draw(st.integers(0, len(base)), label="cut")
            return base[:cut] + data.draw(tail, label="tail")[: max(0, max_len - cut)]
        return data.draw(tail, label="tokens")

    def remember(self, tokens: list[int]) -> None:
        self.history.append(list(tokens))
        del self.history[:-16]

    def live(self) -> list[int]:
        return sorted(self.seqs)

    def snapshot(self) -> tuple[Any, torch.Tensor]:
        """Everything a failed call must leave untouched (LRU order included)."""
        bp, mgr = self.pool.block_pool, self.pool.manager
        seqs = {
            sid: (
                list(s.token_ids),
                list(s.block_ids),
                list(s.block_hashes),
                s.num_computed_tokens,
                s.num_cached_tokens,
            )
            for sid, s in mgr._seqs.items()
        }
        meta = (
            list(bp._ref),
            list(bp._hash),
            list(bp._empty),
            list(bp._evictable),
            dict(bp._cached),
            bp.evictions,
            bp.alloc_calls,
            bp.alloc_blocks,
            seqs,
            mgr.prefix_query_tokens,
            mgr.prefix_hit_tokens,
        )
        return meta, self.pool.storage.kv.clone()

    def assert_unchanged(self, before: tuple[Any, torch.Tensor]) -> None:
        meta, kv = self.snapshot()
        assert meta == before[0]
        assert torch.equal(kv, before[1])

    def read_kv(self, slots: list[int]) -> torch.Tensor:
        """[N, 2] (K, V) of layer 0 / head 0 / dim 0 and a check that every layer, head and
        dim holds the same value (what write_kv stores)."""
        kv = self.pool.storage.kv
        idx = torch.tensor(slots, dtype=torch.long)
        got = kv[:, idx // self.bs, :, idx % self.bs]  # [N, layers, 2, heads, dim]
        first = got[:, :1, :, :1, :1]
        assert torch.equal(got, first.expand_as(got)), "layers / heads / dims disagree"
        return got[:, 0, :, 0, 0]

    def expected(self, codes: list[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(codes, dtype=torch.float32).reshape(-1, 2)

    def write_kv(self, slots: torch.Tensor, codes: list[tuple[int, int]]) -> None:
        kv = self.pool.storage.kv
        n = len(codes)
        vals = self.expected(codes)[:, None, :, None, None].expand(
            n, kv.shape[0], 2, kv.shape[4], kv.shape[5]
        )
        kv[:, slots // self.bs, :, slots % self.bs] = vals

    def register_hashes(self, m: SeqModel, old_full: int) -> None:
        """Remember which token values each newly full, computed block's hash names."""
        bs = self.bs
        new_full = m.computed // bs
        hashes = chain_hashes(m.tokens[: new_full * bs], bs)
        for i in range(old_full, new_full):
            self.hash_codes[hashes[i]] = m.codes[i * bs : (i + 1) * bs]

    # ---------------------------------------------------------------- rules
    def try_add(self, tokens: list[int]) -> tuple[int, SeqModel] | None:
        """add_sequence with the outcome predicted: out-of-blocks exactly when the blocks
        not covered by the prefix hit exceed what stays free, and then nothing changes."""
        sid = self.next_id
        self.next_id += 1
        bp, mgr = self.pool.block_pool, self.pool.manager
        hits = mgr.match_prefix(tokens)
        if not self.caching:
            assert hits == []
        need = _cdiv(len(tokens), self.bs) - len(hits)
        available = bp.num_free - sum(1 for b in hits if bp.ref_count(b) == 0)
        before = self.snapshot()
        if need > available:
            with pytest.raises(OutOfBlocksError, match="adding sequence") as exc:
                self.pool.add_sequence(sid, tokens)
            assert (exc.value.requested, exc.value.available) == (need, available)
            self.assert_unchanged(before)
            assert sid not in self.pool
            SEEN["oob_add"] += 1
            return None
        res = self.pool.add_sequence(sid, tokens)
        assert res.num_cached_tokens == len(hits) * self.bs
        assert res.block_ids[: len(hits)] == hits
        assert len(res.block_ids) == _cdiv(len(tokens), self.bs)
        m = SeqModel(list(tokens), res.num_cached_tokens, prefix_codes(tokens))
        self.seqs[sid] = m
        self.register_hashes(m, 0)
        self.remember(tokens)
        SEEN["hit_blocks"] += len(hits)
        return sid, m

    @rule(data=st.data())
    def add(self, data: st.DataObject) -> None:
        big = data.draw(st.integers(0, 9), label="big") == 0
        self.try_add(self.draw_tokens(data, self.nb * self.bs + self.bs if big else self.max_len))

    @precondition(lambda self: self.history)
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """A returning conversation: an earlier prefix plus new tokens, added and computed
        in one go (the common serving path, and the one that produces prefix hits)."""
        base = data.draw(st.sampled_from(self.history), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2 * self.bs))
        added = self.try_add(base[:cut] + tail)
        if added is None:
            return
        sid, m = added
        if m.computed < len(m.tokens):
            slots = self.pool.slot_mapping(sid, m.computed, len(m.tokens))
            self.write_kv(slots, m.codes[m.computed :])
        self.pool.mark_computed(sid)
        m.computed = len(m.tokens)
        self.register_hashes(m, 0)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def add_existing_id(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()), label="sid")
        before = self.snapshot()
        with pytest.raises(SequenceExistsError, match="already in the pool"):
            self.pool.add_sequence(sid, [1, 2, 3])
        self.assert_unchanged(before)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()), label="sid")
        if data.draw(st.integers(0, 9), label="big") == 0:  # likely out of blocks
            n_new = data.draw(st.integers(self.max_len, 2 * self.max_len), label="n_new")
            new = [t % VOCAB for t in range(n_new)]
        else:
            new = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2 * self.bs + 1))
        self.do_append(sid, new)

    def do_append(self, sid: int, new: list[int]) -> bool:
        """append_tokens with the outcome predicted: the blocks it needs (one more for a
        copy-on-write of a shared partial last block), the copy it asks for, and
        out-of-blocks with nothing changed. Returns whether it appended."""
        m, seq, bp = self.seqs[sid], self.pool.sequence(sid), self.pool.block_pool
        old_blocks = list(seq.block_ids)
        n_old = len(m.tokens)
        cow = n_old % self.bs != 0 and bp.ref_count(old_blocks[-1]) > 1
        need = _cdiv(n_old + len(new), self.bs) - len(old_blocks) + cow
        before = self.snapshot()
        if new and need > bp.num_free:
            with pytest.raises(OutOfBlocksError, match="appending to sequence"):
                self.pool.append_tokens(sid, new)
            self.assert_unchanged(before)
            SEEN["oob_append"] += 1
            return False
        res = self.pool.append_tokens(sid, new)
        if not new:
            assert (res.new_block_ids, res.copies) == ([], [])
            self.assert_unchanged(before)
            return True
        blocks = self.pool.sequence(sid).block_ids
        if cow:
            assert res.copies == [(old_blocks[-1], blocks[len(old_blocks) - 1])]
            assert blocks[: len(old_blocks) - 1] == old_blocks[:-1]
            assert blocks[len(old_blocks) - 1] != old_blocks[-1]
            SEEN["cow"] += 1
        else:
            assert res.copies == []
            assert blocks[: len(old_blocks)] == old_blocks
        assert blocks[len(old_blocks) :] == res.new_block_ids
        m.extend(new)
        self.remember(m.tokens)
        return True

    @precondition(lambda self: any(m.computed < len(m.tokens) for m in self.seqs.values()))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        """Write KV for the next uncomputed tokens through the slot mapping, then publish."""
        todo = [s for s in self.live() if self.seqs[s].computed < len(self.seqs[s].tokens)]
        sid = data.draw(st.sampled_from(todo), label="sid")
        m = self.seqs[sid]
        end = data.draw(st.integers(m.computed + 1, len(m.tokens)), label="end")
        slots = self.pool.slot_mapping(sid, m.computed, end)
        assert slots.dtype == torch.int64 and slots.shape == (end - m.computed,)
        self.write_kv(slots, m.codes[m.computed : end])
        self.pool.mark_computed(sid, end)
        old_full = m.computed // self.bs
        m.computed = end
        self.register_hashes(m, old_full)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def mark_computed_again(self, data: st.DataObject) -> None:
        """Marking fewer tokens than already computed changes nothing."""
        sid = data.draw(st.sampled_from(self.live()), label="sid")
        n = data.draw(st.integers(0, self.seqs[sid].computed), label="n")
        before = self.snapshot()
        self.pool.mark_computed(sid, n)
        self.assert_unchanged(before)

    def do_fork(self, parent: int) -> int:
        child = self.next_id
        self.next_id += 1
        free_before = self.pool.block_pool.num_free
        self.pool.fork(parent, child)
        assert self.pool.block_pool.num_free == free_before, "fork must share, not allocate"
        assert self.pool.sequence(child).block_ids == self.pool.sequence(parent).block_ids
        self.seqs[child] = self.seqs[parent].copy()
        SEEN["fork"] += 1
        return child

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self.do_fork(data.draw(st.sampled_from(self.live()), label="parent"))

    @precondition(lambda self: any(len(m.tokens) % self.bs for m in self.seqs.values()))
    @rule(data=st.data())
    def fork_and_diverge(self, data: st.DataObject) -> None:
        """Fork a sequence whose last block is partial, then append a different token on
        each side: both appends land in the shared block, so copy-on-write must split it."""
        partial = [s for s in self.live() if len(self.seqs[s].tokens) % self.bs]
        parent = data.draw(st.sampled_from(partial), label="parent")
        child = self.do_fork(parent)
        child_appended = self.do_append(child, [0])
        self.do_append(parent, [1])
        if child_appended:  # the child took the copy, the parent kept the shared block
            child_last = self.pool.sequence(child).block_ids[-1]
            assert child_last != self.pool.sequence(parent).block_ids[-1]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(self.live()), label="sid")
        self.pool.free_sequence(sid)
        self.remember(self.seqs.pop(sid).tokens)
        assert sid not in self.pool

    @precondition(lambda self: len(self.seqs) > 1)
    @rule()
    def free_all(self) -> None:
        """A batch of conversations ends: the pool fills with evictable cached blocks."""
        for sid in self.live():
            self.pool.free_sequence(sid)
            self.remember(self.seqs.pop(sid).tokens)

    @rule(data=st.data())
    def match(self, data: st.DataObject) -> None:
        """match_prefix is read-only and returns blocks holding exactly those tokens' KV."""
        tokens = self.draw_tokens(data, self.max_len)
        before = self.snapshot()
        blocks = self.pool.manager.match_prefix(tokens)
        self.assert_unchanged(before)
        if not self.caching:
            assert blocks == []
            return
        bs = self.bs
        assert len(blocks) <= len(tokens) // bs
        assert len(set(blocks)) == len(blocks)
        hashes = chain_hashes(tokens, bs)
        for i, b in enumerate(blocks):
            assert self.pool.block_pool.block_hash(b) == hashes[i]
        if blocks:
            codes = prefix_codes(tokens)[: len(blocks) * bs]
            slots = [b * bs + o for b in blocks for o in range(bs)]
            assert torch.equal(self.read_kv(slots), self.expected(codes))
            SEEN["match_hit_blocks"] += len(blocks)

    @rule()
    def reset_prefix_cache(self) -> None:
        bp = self.pool.block_pool
        evictable = bp.num_evictable
        free = bp.num_free
        assert bp.reset_prefix_cache() == evictable
        assert bp.num_evictable == 0 and bp.num_free == free

    # ----------------------------------------------------------- invariants
    @invariant()
    def pool_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        bp, bs = self.pool.block_pool, self.bs
        bp.check_invariants()
        refs: Counter[int] = Counter()
        for sid, m in self.seqs.items():
            seq = self.pool.sequence(sid)
            assert seq.token_ids == m.tokens
            assert seq.num_computed_tokens == m.computed
            assert len(seq.block_ids) == _cdiv(len(m.tokens), bs)
            assert len(set(seq.block_ids)) == len(seq.block_ids), "a block twice in one table"
            full = m.computed // bs
            assert seq.block_hashes == chain_hashes(m.tokens[: full * bs], bs)
            refs.update(seq.block_ids)
        assert len(self.pool.manager) == len(self.seqs)
        for b in range(self.nb):
            assert bp.ref_count(b) == refs[b], f"block {b}: refcount vs block tables"
        assert bp.num_free == self.nb - len(refs)
        if not self.caching:
            assert bp.num_cached == 0

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        if not hasattr(self, "pool"):
            return
        slots: list[int] = []
        codes: list[tuple[int, int]] = []
        for sid, m in self.seqs.items():
            if m.computed:
                slots += self.pool.manager.slot_mapping(sid, 0, m.computed)
                codes += m.codes[: m.computed]
        if slots:
            assert torch.equal(self.read_kv(slots), self.expected(codes))

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self) -> None:
        if not hasattr(self, "pool"):
            return
        bp, bs = self.pool.block_pool, self.bs
        slots: list[int] = []
        codes: list[tuple[int, int]] = []
        for b in range(self.nb):
            h = bp.block_hash(b)
            if h is not None:
                assert bp.lookup(h) == b
                slots += range(b * bs, (b + 1) * bs)
                codes += self.hash_codes[h]
        if slots:
            assert torch.equal(self.read_kv(slots), self.expected(codes))

    def teardown(self) -> None:
        """Every block returns to the pool when all sequences end."""
        if not hasattr(self, "pool"):
            return
        bp = self.pool.block_pool
        for sid in self.live():
            self.pool.free_sequence(sid)
        assert len(self.pool.manager) == 0
        assert bp.num_free == self.nb and bp.num_used == 0
        assert all(bp.ref_count(b) == 0 for b in range(self.nb))
        bp.check_invariants()
        bp.reset_prefix_cache()
        assert bp.num_cached == 0 and bp.num_evictable == 0
        assert sorted(bp._empty) == list(range(self.nb))


def test_pool_state_machine() -> None:
    SEEN.clear()
    run_state_machine_as_test(
        PoolMachine,
        settings=settings(
            max_examples=200,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The runs must actually exercise the interesting paths, or the test proves little.
    for what in ("oob_add", "oob_append", "hit_blocks", "match_hit_blocks", "cow", "fork"):
        assert SEEN[what] > 0, f"no {what} in any run: {dict(SEEN)}"
