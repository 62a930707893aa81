"""Stateful property test of the paged KV pool against a pure-Python model.

Random programs of add / append / write+mark_computed / fork / free / match_prefix run on a
real :class:`PagedKVPool` with small CPU pools (so out-of-blocks happens) and token
sequences that often share prefixes with live or freed ones (so prefix hits happen). The
model, the KV values it predicts and the invariants checked after every step are in
pool_model.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from kvtier.errors import OutOfBlocksError, SequenceExistsError
from kvtier.hashing import chain_hashes
from tests.gpu_pool.pool_model import SEEN, VOCAB, PoolHarness, SeqModel, cdiv, prefix_codes


class PoolMachine(PoolHarness):
    """The rules: random pool calls, each with its outcome predicted by the model."""

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
        need = cdiv(len(tokens), self.bs) - len(hits)
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
        assert len(res.block_ids) == cdiv(len(tokens), self.bs)
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
        need = cdiv(n_old + len(new), self.bs) - len(old_blocks) + cow
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
