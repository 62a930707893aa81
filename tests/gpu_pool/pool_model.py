"""The pure-Python model behind test_pool_properties.py, and its checks of the pool.

The KV written for a token is a pair of integers derived from the whole token prefix up to
and including it (exact in float32). KV is a function of the prefix in a real model too, so:

* a sequence reading back its computed positions through its block table must see exactly
  the values of its own prefix: a missing copy-on-write (another sequence writing a
  different prefix into a shared block) or a wrong prefix hit shows up as a mismatch;
* a block registered in the prefix cache under a hash must hold the values of the tokens
  that hash names, for as long as it stays registered, referenced or free.

:class:`PoolHarness` holds one pool and the model of every sequence in it, the helpers that
read, write and snapshot the pool, and the invariants checked after every step; the rules
that drive it are in test_pool_properties.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant

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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)



class PoolHarness(RuleBasedStateMachine):
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
            assert len(seq.block_ids) == cdiv(len(m.tokens), bs)
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
