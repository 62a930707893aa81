"""The batch routes' msgpack framing: what msgpack packs is parsed the same, chunks as
views; what is not a map of str -> bin is a 400; replies unpack with msgpack."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.chunk_map import chunk_list_parts, parse_chunk_map
from kvtier.server.errors import RouteError

keys = st.text(min_size=0, max_size=300)
blobs = st.binary(min_size=0, max_size=70_000)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(keys, blobs, max_size=20))
def test_what_msgpack_packs_parses_the_same(chunks):
    raw = msgpack.packb(chunks, use_bin_type=True)
    got = parse_chunk_map(memoryview(raw))
    assert {k: bytes(v) for k, v in got.items()} == chunks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), blobs), max_size=20))
def test_replies_unpack_with_msgpack(items):
    raw = b"".join(bytes(p) for p in chunk_list_parts(items))
    assert msgpack.unpackb(raw) == items


@pytest.mark.parametrize("raw", [
    b"", msgpack.packb([1, 2]), msgpack.packb({1: b"x"}), msgpack.packb({"k": "text"}),
    msgpack.packb({"k": b"abc"}, use_bin_type=True)[:-1],
    msgpack.packb({"k": b"abc"}, use_bin_type=True) + b"\x00",
])
def test_anything_else_is_a_400(raw):
    with pytest.raises(RouteError) as err:
        parse_chunk_map(memoryview(raw))
    assert err.value.status == 400
