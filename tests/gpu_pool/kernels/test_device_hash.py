"""XXH3-64 of byte ranges on the device (Triton on CUDA, the interpreter on CPU): bit for bit
the xxhash package's digests (what the host stores with every chunk) for every length branch,
whole-word, shifted-word and byte reads; pass 1 writes each full block's contribution where
pass 2 looks for it; the fused check flags exactly the ranges whose bytes changed; host copies
of the ranges give the same digests and are what the bounds are checked on; bad inputs raise
before anything is launched."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash

from kvtier.errors import KernelInputError
from kvtier.gpu_pool.kernels import triton_xxh3
from kvtier.gpu_pool.kernels.triton_xxh3 import check_ranges, xxh3_ranges
from tests.gpu_pool.kernel_cases import triton_devices

DEVICES = triton_devices()
SEED = 1729
KIB = 1024


def _bytes(n: int, seed: int) -> torch.Tensor:
    """n random bytes in a fresh torch allocation (its address is 8-aligned)."""
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)).clone()


def _want(buf: torch.Tensor, starts, lengths) -> torch.Tensor:
    """The xxhash package's digests of the same ranges, as int64 bits."""
    data = memoryview(buf.cpu().numpy())
    sums = [xxhash.xxh3_64_intdigest(data[s : s + n]) for s, n in zip(starts, lengths, strict=True)]
    return torch.tensor(sums, dtype=torch.uint64).view(torch.int64)


def _hash(buf: torch.Tensor, starts, lengths, device) -> torch.Tensor:
    got = xxh3_ranges(buf.to(device), torch.tensor(starts, device=device),
                      torch.tensor(lengths, device=device))
    return got.cpu()


def _mismatches(got, want, starts, lengths) -> list[tuple[int, int]]:
    """(start, length) of every range whose digest differs, for the failure message."""
    return [(starts[i], lengths[i]) for i in torch.nonzero(got != want).flatten().tolist()]


def _random_ranges(rng, size: int) -> tuple[list[int], list[int]]:
    """4096 ranges of a ``size``-byte buffer: every length 0-300, lengths around the 1 KiB
    blocks, 64 of up to 64 KiB and the rest of up to 1280 bytes (the interpreter's time goes
    by range more than by byte), each at a random start; then 24 that end on buf's last
    byte, with every start modulo 8."""
    edges = [1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 4095, 4096, 4097,
             16 * KIB - 1, 16 * KIB, 16 * KIB + 1, 64 * KIB - 1, 64 * KIB]
    lengths = list(range(301)) + edges
    lengths += rng.integers(2 * KIB, 64 * KIB, 64, endpoint=True).tolist()
    lengths += rng.integers(0, 1280, 4096 - len(lengths) - 24, endpoint=True).tolist()
    starts = [int(rng.integers(0, size - n, endpoint=True)) for n in lengths]
    for n in (241, 1025, 3000):  # the last stripe, or the tail word, holds buf's last byte
        for skew in range(8):
            lengths.append(n)
            starts.append(size - n - skew)
    return starts, lengths


@pytest.mark.parametrize("device", DEVICES)
def test_random_ranges_match_xxhash(device):
    rng = np.random.default_rng(SEED)
    size = 256 * KIB + 5  # not a whole number of words: the last ones use the tail word
    buf = _bytes(size, SEED)
    starts, lengths = _random_ranges(rng, size)
    assert len(starts) >= 4096 and set(range(301)) <= set(lengths)
    got = _hash(buf, starts, lengths, device)
    want = _want(buf, starts, lengths)
    assert torch.equal(got, want), _mismatches(got, want, starts, lengths)[:20]


@pytest.mark.parametrize("device", DEVICES)
def test_aligned_ranges_read_whole_words(device):
    rng = np.random.default_rng(SEED + 1)
    size = 512 * KIB
    buf = _bytes(size, SEED + 1)
    lengths = (8 * rng.integers(0, 8 * KIB, 32, endpoint=True)).tolist()  # up to 64 KiB
    lengths += (8 * rng.integers(0, 512, 224, endpoint=True)).tolist()
    lengths += [248, 1024, 1032, 2048]
    starts = [8 * int(rng.integers(0, (size - n) // 8, endpoint=True)) for n in lengths]
    got = _hash(buf, starts, lengths, device)
    want = _want(buf, starts, lengths)
    assert torch.equal(got, want), _mismatches(got, want, starts, lengths)[:20]


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_buffer_reads_bytes(device):
    """A buf whose address is not 8-aligned (a slice one byte in) is read byte by byte."""
    rng = np.random.default_rng(SEED + 2)
    base = _bytes(40 * KIB + 1, SEED + 2).to(device)
    buf = base[1:]
    assert buf.data_ptr() % 8 != 0
    lengths = [0, 7, 100, 200, 241, 1024, 1025, 4096, 4103, 20000, 40 * KIB]
    starts = [int(rng.integers(0, buf.numel() - n, endpoint=True)) for n in lengths]
    got = xxh3_ranges(buf, torch.tensor(starts, device=device),
                      torch.tensor(lengths, device=device)).cpu()
    want = _want(buf, starts, lengths)
    assert torch.equal(got, want), _mismatches(got, want, starts, lengths)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_mib_ranges(device):
    buf = _bytes(7 * 2**20 + 11, SEED + 3)
    starts = [0, 2**20 + 3, 3 * 2**20 + 8]
    lengths = [2**20, 2 * 2**20 + 5, 4 * 2**20 - 1]  # whole, shifted and odd
    got = _hash(buf, starts, lengths, device)
    assert torch.equal(got, _want(buf, starts, lengths))


@pytest.mark.parametrize("device", DEVICES)
def test_check_flags_exactly_the_changed_ranges(device):
    lengths = [1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1024, 1025, 5000, 9000, 0]
    starts = np.cumsum([0, *lengths[:-1]]).tolist()  # back to back, no overlap
    buf = _bytes(sum(lengths) + 3, SEED + 4)
    expected = _want(buf, starts, lengths).to(device)
    flips = {0: 0, 2: 3, 6: 16, 8: 127, 11: 239, 12: 200, 13: 1023, 14: 1024, 15: 2500,
             16: 8999}  # range -> byte within it: first, last, mid-stripe, block edges
    for r, at in flips.items():
        buf[starts[r] + at] ^= 0x20
    buf = buf.to(device)
    st, ln = torch.tensor(starts, device=device), torch.tensor(lengths, device=device)
    bad = torch.full((len(lengths),), 7, dtype=torch.int32, device=device)
    assert check_ranges(buf, st, ln, expected, bad=bad) is bad
    assert torch.nonzero(bad.cpu()).flatten().tolist() == sorted(flips)
    assert set(bad.cpu().tolist()) == {0, 1}
    out = torch.empty(len(lengths), dtype=torch.int64, device=device)
    assert xxh3_ranges(buf, st, ln, out=out) is out
    assert torch.equal(out.cpu() != expected.cpu(), bad.cpu().bool())


def _block_sum(block: np.ndarray) -> np.ndarray:
    """XXH3_accumulate_512 over one full 1 KiB block, before the scramble, from the spec:
    per lane l, the sum over its 16 stripes of lo32(d ^ k) * hi32(d ^ k) plus the data of
    lane l ^ 1 (u64, wrapping)."""
    secret = triton_xxh3.SECRET
    keys = np.array([[int.from_bytes(secret[8 * (s + lane) : 8 * (s + lane) + 8], "little")
                      for lane in range(8)] for s in range(16)], dtype=np.uint64)
    data = block.view("<u8").reshape(16, 8)
    dk = data ^ keys
    swapped = data.sum(axis=0, dtype=np.uint64)[[1, 0, 3, 2, 5, 4, 7, 6]]
    return ((dk & np.uint64(0xFFFFFFFF)) * (dk >> np.uint64(32))).sum(axis=0) + swapped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("skew", [0, 1], ids=["words", "bytes"])
def test_pass1_rows_in_range_order(device, skew):
    """One pass-1 launch over ranges of different lengths (no block, one, several, more than
    a program's GROUP; odd tails; starts at six offsets mod 8) writes range i's block b to
    row first[i] + b, rows of ranges without blocks taking no room; pass 2 then gives
    xxhash's digests."""
    lengths = [5 * KIB + 3, 0, 200, 1024, 1025, 3 * KIB, 2 * KIB + 77, 17 * KIB + 5,
               9 * KIB - 1, 4097, 241]
    starts = np.cumsum([0, *(n + 13 for n in lengths[:-1])]).tolist()
    base = _bytes(starts[-1] + lengths[-1] + 6, SEED + 5).to(device)
    buf = base[skew:]  # skew 1: not 8-aligned, read byte by byte
    st, ln = torch.tensor(starts, device=device), torch.tensor(lengths, device=device)
    blocks = [max(n - 1, 0) // KIB for n in lengths]
    assert sum(b > triton_xxh3.GROUP.value for b in blocks) == 1 and blocks.count(0) == 4
    assert len({s % 8 for s, b in zip(starts, blocks, strict=True) if b}) == 6

    first = triton_xxh3._plan(ln)
    rows = int(first[-1])
    sums = triton_xxh3._block_sums(buf, st, ln, first, rows).cpu()

    assert first.cpu().tolist() == np.cumsum([0, *blocks]).tolist()
    data = buf.cpu().numpy()
    want = [_block_sum(data[s + KIB * b : s + KIB * (b + 1)])
            for s, n in zip(starts, blocks, strict=True) for b in range(n)]
    assert rows == len(want) == 39
    assert np.array_equal(sums[:rows].numpy().view(np.uint64), np.stack(want))
    got = xxh3_ranges(buf, st, ln).cpu()
    assert torch.equal(got, _want(buf, starts, lengths)), _mismatches(
        got, _want(buf, starts, lengths), starts, lengths)


@pytest.mark.parametrize("device", DEVICES)
def test_host_ranges_give_the_same_sums(device):
    """host_ranges: the same digests and flags as the read-back route, for every path."""
    lengths = [0, 5, 16, 100, 200, 241, 1024, 1025, 3000, 6 * KIB + 1]
    starts = np.cumsum([3, *(n + 5 for n in lengths[:-1])]).tolist()
    buf = _bytes(starts[-1] + lengths[-1], SEED + 6).to(device)
    host = (np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    st, ln = torch.from_numpy(host[0]).to(device), torch.from_numpy(host[1]).to(device)
    want = _want(buf, starts, lengths)

    assert torch.equal(xxh3_ranges(buf, st, ln, host_ranges=host).cpu(), want)
    assert torch.equal(xxh3_ranges(buf, st, ln).cpu(), want)
    expected = want.clone()
    expected[[2, 7, 9]] ^= 1
    flags = check_ranges(buf, st, ln, expected.to(device), host_ranges=host).cpu()
    assert torch.nonzero(flags).flatten().tolist() == [2, 7, 9]
    assert torch.equal(check_ranges(buf, st, ln, expected.to(device)).cpu(), flags)


@pytest.mark.parametrize("device", DEVICES)
def test_device_ranges_past_buf_are_cut_to_it(device):
    """The bounds are checked on host_ranges only (no read-back): where the device's copies
    disagree and run past buf, the kernel reads nothing outside it and hashes what is in it
    (such a digest will not match a stored one; the chunk is recomputed, never read wrong)."""
    size = 7 * KIB + 3
    buf = _bytes(size, SEED + 7).to(device)
    starts, lengths = [100, 5000, 2 * KIB], [3 * KIB, size - 5000, 300]
    host = (np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64))
    device_lengths = [3 * KIB, size - 5000 + 40 * KIB, 300]  # range 1 runs 40 KiB past buf
    got = xxh3_ranges(buf, torch.tensor(starts, device=device),
                      torch.tensor(device_lengths, device=device), host_ranges=host).cpu()
    assert torch.equal(got, _want(buf, starts, lengths))


# ------------------------------------------------------------------------------- bad input
@pytest.fixture
def launches(monkeypatch):
    """Replace the launch with a recorder: a missed check shows up as a recorded launch."""
    calls: list[int] = []
    monkeypatch.setattr(triton_xxh3, "_launch", lambda buf, starts, *a: calls.append(len(starts)))
    return calls


def _args(**over):
    args = {"buf": torch.zeros(100, dtype=torch.uint8), "starts": torch.tensor([0, 50]),
            "lengths": torch.tensor([50, 50])}
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    ({"lengths": torch.tensor([50, 51])}, r"range 1 \(50 \+ 51 bytes\) ends past buf \(100"),
    ({"starts": torch.tensor([0, 101]), "lengths": torch.tensor([1, 0])}, "ends past buf"),
    ({"starts": torch.tensor([-1, 0])}, "must be >= 0"),
    ({"lengths": torch.tensor([-1, 0])}, "must be >= 0"),
    ({"lengths": torch.tensor([1, 2, 3])}, "lengths has 3 entries but starts has 2"),
    ({"lengths": torch.tensor([1, 2], dtype=torch.int32)}, "lengths must be a 1-D int64"),
    ({"starts": torch.tensor([[0, 50]])}, "starts must be a 1-D int64"),
    ({"starts": [0, 50]}, "starts must be a torch.Tensor"),
    ({"buf": torch.zeros(100, dtype=torch.int8)}, "buf must be a 1-D uint8"),
    ({"buf": torch.zeros(10, 10, dtype=torch.uint8)}, "buf must be a 1-D uint8"),
    ({"buf": torch.zeros(200, dtype=torch.uint8)[::2]}, "buf must be contiguous"),
    ({"starts": torch.tensor([0, 9, 50, 7])[::2]}, "starts must be contiguous"),
    ({"starts": torch.tensor([0, 50], device="meta")}, "starts is on meta"),
])
def test_bad_input_raises_before_launch(launches, over, match):
    with pytest.raises(ValueError, match=match):
        xxh3_ranges(**_args(**over))
    with pytest.raises(ValueError, match=match):
        check_ranges(**_args(**over), expected=torch.zeros(2, dtype=torch.int64))
    assert launches == []


@pytest.mark.parametrize(("kw", "match"), [
    ({"expected": torch.zeros(3, dtype=torch.int64)},
     r"expected must be torch.int64 of shape \(2,\)"),
    ({"expected": torch.zeros(2, dtype=torch.uint64)}, "expected must be torch.int64"),
    ({"expected": torch.zeros(2, dtype=torch.int64), "bad": torch.zeros(2, dtype=torch.int64)},
     "bad must be torch.int32"),
])
def test_bad_check_outputs_raise(launches, kw, match):
    with pytest.raises(ValueError, match=match):
        check_ranges(**_args(), **kw)
    assert launches == []


def test_bad_out_raises(launches):
    with pytest.raises(ValueError, match="out must be torch.int64"):
        xxh3_ranges(**_args(), out=torch.zeros(2, dtype=torch.int32))
    assert launches == []


def _host(starts, lengths, dtype=np.int64):
    return np.array(starts, dtype=dtype), np.array(lengths, dtype=dtype)


@pytest.mark.parametrize(("host", "match"), [
    (_host([0, 50], [50, 51]), r"range 1 \(50 \+ 51 bytes\) ends past buf \(100"),
    (_host([0, 101], [1, 0]), "ends past buf"),
    (_host([-1, 0], [50, 50]), "must be >= 0"),
    (_host([0, 50], [-1, 50]), "must be >= 0"),
    (_host([0, 50], [50, 50], np.int32), "host_ranges' starts must be a 1-D int64 numpy"),
    (_host([0, 50, 60], [50, 50, 1]), r"of 2 entries \(as many as starts\), got int64 of shape"),
    ((np.array([0, 50]), [50, 50]), "host_ranges' lengths must be .* got list"),
    (_host([0, 50], [50, 50])[:1], r"must be a \(starts, lengths\) pair"),
    (np.array([[0, 50], [50, 50]]), r"must be a \(starts, lengths\) pair"),
])
def test_bad_host_ranges_raise_before_launch(launches, host, match):
    """The device's starts and lengths are fine: what is checked is the host copies."""
    with pytest.raises(KernelInputError, match=match):
        xxh3_ranges(**_args(), host_ranges=host)
    with pytest.raises(KernelInputError, match=match):
        check_ranges(**_args(), expected=torch.zeros(2, dtype=torch.int64), host_ranges=host)
    assert launches == []


def test_no_ranges_no_launch(launches):
    none = torch.zeros(0, dtype=torch.int64)
    assert xxh3_ranges(torch.zeros(0, dtype=torch.uint8), none, none).shape == (0,)
    assert check_ranges(torch.zeros(4, dtype=torch.uint8), none, none, none).dtype == torch.int32
    assert launches == []


@pytest.mark.parametrize("device", DEVICES)
def test_empty_ranges_of_an_empty_buffer(device):
    buf = torch.zeros(0, dtype=torch.uint8, device=device)
    zero = torch.zeros(3, dtype=torch.int64, device=device)
    assert torch.equal(xxh3_ranges(buf, zero, zero).cpu(), _want(buf, [0] * 3, [0] * 3))


# ---------------------------------------------------------------------------- CUDA lowering
COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtier.gpu_pool.kernels import triton_xxh3 as m
from kvtier.gpu_pool.kernels.aot import _ptxas_report

def build(fn, types, constexprs, warps, arch):
    sig = {n: "*i64" for n in fn.arg_names}
    sig.update(types, **{c: "constexpr" for c in constexprs})
    src = ASTSource(fn, sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    return _ptxas_report(k.asm["ptx"], arch)

for arch in (80, 90):
    for words in (True, False):
        ints = {"buf": "*u8", "size": "i64", "rows": "i64"}
        print("pass1", arch, words, "ok", build(
            m._block_sums_kernel, {**ints, "n": "i64", "steps": "i32"}, {"WORDS": words},
            m.GROUP_WARPS, arch))
        for check in (False, True):
            print("pass2", arch, words, check, "ok", build(
                m._xxh3_kernel, {**ints, "out": "*i32" if check else "*i64"},
                {"WORDS": words, "CHECK": check}, m.NUM_WARPS, arch))
"""


def test_kernel_compiles_for_cuda_targets():
    """The interpreter checks what the kernels compute, not that Triton lowers them: compile
    every variant of both passes for sm_80 and sm_90 (no GPU needed) and check that nothing
    spills."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [ln for ln in out.stdout.splitlines() if " ok " in ln]
    assert len(rows) == 12 and sum(ln.startswith("pass1") for ln in rows) == 4, out.stdout
    assert all("0 bytes spill stores" in ln for ln in rows), out.stdout
