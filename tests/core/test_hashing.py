"""Chained block hashes: stable across processes, sensitive to every input, full blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidArgumentError
from kvtier.hashing import HASH_BYTES, chain_hash, chain_hashes

TOKENS = list(range(100, 140))

# Golden values: changing the encoding would orphan every chunk already stored in a tier.
GOLDEN_123 = "259c46ca9ad142898d973b3aa57d770429cf2ecdd725edfd2367d21b842db726"
GOLDEN_123_EXTRA = "d77a0952b6c1885abc3b82de4604d24e95abed5b3fc9c26717f7763734abf2d3"

_CHILD = """
import json
from kvtier.hashing import chain_hash, chain_hashes
print(json.dumps({
    "chain": [h.hex() for h in chain_hashes(list(range(100, 140)), 16, b"fp")],
    "one": chain_hash(None, [1, 2, 3]).hex(),
    "hash_randomised": hash("kvtier"),
}))
"""


def _in_subprocess(seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_stable_across_processes_with_different_hash_seeds() -> None:
    a, b = _in_subprocess("1"), _in_subprocess("4242")
    assert a["hash_randomised"] != b["hash_randomised"]  # the seeds did differ
    here = [h.hex() for h in chain_hashes(TOKENS, 16, b"fp")]
    assert a["chain"] == b["chain"] == here
    assert a["one"] == b["one"] == chain_hash(None, [1, 2, 3]).hex() == GOLDEN_123


def test_golden_digests() -> None:
    assert chain_hash(None, [1, 2, 3]).hex() == GOLDEN_123
    assert chain_hash(None, [1, 2, 3], b"model").hex() == GOLDEN_123_EXTRA
    assert len(chain_hash(None, [1])) == HASH_BYTES == 32


def test_every_input_changes_the_hash() -> None:
    base = chain_hash(None, [1, 2, 3])
    parent = chain_hash(None, [9])
    variants = [
        chain_hash(None, [1, 2, 4]),  # a token
        chain_hash(None, [3, 2, 1]),  # the order
        chain_hash(None, [1, 2]),  # the length
        chain_hash(None, [1, 2, 3, 0]),
        chain_hash(parent, [1, 2, 3]),  # the parent
        chain_hash(chain_hash(None, [8]), [1, 2, 3]),
        chain_hash(None, [1, 2, 3], b"other model"),  # the extra bytes
        # Lengths are encoded: tokens cannot be smuggled in through extra or vice versa.
        chain_hash(None, [1, 2], array("Q", [3]).tobytes()),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_equal_inputs_equal_hashes_whatever_the_sequence_type() -> None:
    h = chain_hash(None, [5, 6, 7])
    assert chain_hash(None, (5, 6, 7)) == h
    assert chain_hash(None, range(5, 8)) == h
    assert chain_hash(None, array("q", [5, 6, 7])) == h


def test_chain_hashes_full_blocks_only() -> None:
    tokens = list(range(10))
    full = chain_hashes(tokens, 4)
    assert len(full) == 2
    assert full[0] == chain_hash(None, tokens[0:4])
    assert full[1] == chain_hash(full[0], tokens[4:8])
    with_tail = chain_hashes(tokens, 4, full_blocks_only=False)
    assert with_tail[:2] == full and len(with_tail) == 3
    assert with_tail[2] == chain_hash(full[1], tokens[8:10])
    assert chain_hashes(tokens[:3], 4) == []
    assert chain_hashes([], 4) == []


def test_chain_hashes_parent_and_extra() -> None:
    full = chain_hashes(TOKENS, 8, b"fp")
    assert chain_hashes(TOKENS[8:], 8, b"fp", parent=full[0]) == full[1:]
    assert chain_hashes(TOKENS, 8, b"other")[0] != full[0]
    assert chain_hashes(TOKENS, 8)[0] != full[0]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=40),
    st.lists(st.integers(0, 2**64 - 1), max_size=40),
    st.sampled_from([1, 2, 4, 8]),
)
def test_prefix_property(a: list[int], b: list[int], bs: int) -> None:
    """Block i's hash depends on exactly the tokens up to the end of block i."""
    ha, hab = chain_hashes(a, bs), chain_hashes(a + b, bs)
    assert hab[: len(a) // bs] == ha
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    hb = chain_hashes(b, bs)
    for i in range(min(len(ha), len(hb))):
        assert (ha[i] == hb[i]) == ((i + 1) * bs <= common)


@pytest.mark.parametrize("tokens", [[-1], [1, -5], [2**64], [1.5], ["a"], [None], [1, 2, "3"]])
def test_invalid_tokens(tokens: list) -> None:
    with pytest.raises(InvalidArgumentError, match=r"token ids must be integers in \[0, 2\*\*64\)"):
        chain_hash(None, tokens)
    with pytest.raises(InvalidArgumentError, match="token ids must be integers"):
        chain_hashes(tokens * 4, 2)


@pytest.mark.parametrize("bs", [0, -4, 2.0])
def test_invalid_block_size(bs: object) -> None:
    with pytest.raises(InvalidArgumentError, match="block_size must be a positive integer"):
        chain_hashes([1, 2, 3, 4], bs)  # type: ignore[arg-type]
