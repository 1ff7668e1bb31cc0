"""Block CRC32C checks fed piece by piece (``BlockStream``), as the in-place reader does.

Property: however a file's bytes are cut into pieces, the stream checks each block once,
exactly when its last byte arrives, and a flipped byte anywhere fails its own block.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.errors import ChecksumError
from reshard_svc.format.checksums import BlockTable, crc32c

BS = 4096  # the smallest block size the index accepts


def table(data: bytes) -> BlockTable:
    crcs = tuple(crc32c(data[i : i + BS]) for i in range(0, len(data), BS))
    return BlockTable(file="f.safetensors", size=len(data), block_size=BS, crcs=crcs)


def cut(data: bytes, cuts: list[int]) -> list[memoryview]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [memoryview(data)[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 6 * BS + 123),
    cuts=st.lists(st.integers(0, 10**6), max_size=12),
    flip=st.one_of(st.none(), st.integers(0, 10**6)),
)
def test_stream_checks_every_block_once_however_cut(size, cuts, flip):
    data = os.urandom(size)
    t = table(data)
    if flip is not None:
        at = flip % size
        bad = bytearray(data)
        bad[at] ^= 0x10
        data = bytes(bad)
    done: set[int] = set()
    stream = t.stream(0, done)
    if flip is None:
        for piece in cut(data, cuts):
            stream.update(piece)
        assert stream.close() == size
        assert done == set(range(len(t.crcs)))
        return
    with pytest.raises(ChecksumError) as err:
        for piece in cut(data, cuts):
            stream.update(piece)
    block = at // BS
    lo, hi = block * BS, min(size, (block + 1) * BS)
    assert f"[{lo}, {hi})" in str(err.value) and "f.safetensors" in str(err.value)
    assert block not in done and all(b < block for b in done)


def test_stream_skips_blocks_checked_before_and_may_start_or_end_inside_them():
    data = os.urandom(5 * BS)
    t = table(data)
    done = {0, 4}  # edge blocks an earlier read checked
    bad = bytearray(data)
    bad[10] ^= 1  # inside block 0: not checked again
    bad[4 * BS + 7] ^= 1  # inside block 4: not checked again
    stream = t.stream(100, done)
    stream.update(memoryview(bytes(bad))[100 : 4 * BS + 50])
    assert stream.close() == 3 * BS
    assert done == {0, 1, 2, 3, 4}


def test_stream_refuses_to_start_or_end_inside_an_unchecked_block():
    t = table(os.urandom(3 * BS))
    with pytest.raises(ValueError, match="unaligned"):
        t.stream(5)
    stream = t.stream(0, set())
    stream.update(b"\0" * 0)
    stream.update(os.urandom(10))
    with pytest.raises(ValueError, match="inside a block"):
        stream.close()


def test_stream_over_pieces_matches_check():
    data = os.urandom(3 * BS + 5)
    t = table(data)
    whole = t.check(0, data, set())
    stream = t.stream(0, set())
    for piece in cut(data, [1, BS + 3, 2 * BS]):
        stream.update(piece)
    assert whole == stream.close() == len(data)
