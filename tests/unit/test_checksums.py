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


# One pass per byte: a check cut into parts, and a writer that combines them.


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_a_combined_crc32c_is_the_crc32c_of_the_joined_bytes(a, b):
    from reshard_svc.format.checksums import crc32c_combine

    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5 * BS),
    st.lists(st.integers(0, 5 * BS), max_size=8),
    st.lists(st.integers(0, 5 * BS), min_size=2, max_size=6),
)
def test_a_check_cut_into_parts_gives_any_range_between_cuts(size, cuts, asks):
    from reshard_svc.format.checksums import Parts

    data = os.urandom(size)
    t = table(data)
    cuts = sorted({c % (size + 1) for c in cuts})
    parts: Parts = {}
    done: set[int] = set()
    assert t.check(0, data, done, cuts, parts) == size
    # any range whose ends are cuts or block bounds: its CRC32C without reading it again
    ends = sorted({0, size, *cuts, *range(0, size, BS)})
    picks = sorted({ends[i % len(ends)] for i in asks})
    for a, b in zip(picks, picks[1:]):
        assert t.crc_of(a, b, done, parts) == crc32c(data[a:b])
    # a range ending elsewhere is not known
    inner = [x for x in range(1, size) if x not in ends]
    if inner:
        assert t.crc_of(0, inner[0], done, parts) is None


def test_a_corrupt_part_fails_its_block():
    data = bytearray(os.urandom(3 * BS))
    t = table(bytes(data))
    data[BS + 10] ^= 1
    with pytest.raises(ChecksumError, match="block 1"):
        t.check(0, bytes(data), set(), [BS + 5, BS + 100], {})


@settings(max_examples=100, deadline=None)
@given(st.integers(0, BS - 1), st.lists(st.integers(1, 2 * BS), min_size=1, max_size=8))
def test_a_writer_combining_known_parts_writes_the_block_crcs_it_would_have_summed(head, lens):
    from reshard_svc.format.checksums import FileChecksummer

    data = os.urandom(head + sum(lens))
    direct = FileChecksummer("crc32c", BS)
    direct.update(data)
    combined = FileChecksummer("crc32c", BS)
    combined.update(data[:head])  # a header, summed
    pos = head
    for n in lens:  # each piece cut at the blocks' bounds, as the reader cuts it
        bounds = [pos, *range((pos // BS + 1) * BS, pos + n, BS), pos + n]
        parts = [(b - a, crc32c(data[a:b])) for a, b in zip(bounds, bounds[1:])]
        assert combined.take_known(parts)
        pos += n
    assert combined.result() == direct.result() and combined.size == direct.size
    # parts that cross a block bound are refused, and nothing is counted
    assert not FileChecksummer("crc32c", BS).take_known([(BS + 1, 0)])
    assert not FileChecksummer("sha256", BS).take_known([(1, crc32c(b"x"))])


def test_a_convert_writes_straight_slabs_with_block_crcs_from_the_source_check(
    tmp_path, monkeypatch
):
    """TP=1 -> rows on 3 ranks, one worker: every written byte of the data sections is a
    slab of verified source bytes, so its block CRC32Cs are combined from the source
    check's parts; the files verify, and their blocks match a direct CRC32C of the file."""
    import torch

    import reshard_svc
    from reshard_svc.format.checksums import FileChecksummer
    from reshard_svc.format.index import CheckpointIndex

    combined = []
    real = FileChecksummer.take_known

    def spy(self, parts):
        ok = real(self, parts)
        combined.append(sum(n for n, _ in parts) if ok else 0)
        return ok

    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(4096, 100, generator=g).to(torch.bfloat16),
        "b": torch.randn(999, 70, generator=g),
    }
    reshard_svc.save(sd, str(tmp_path / "src"))  # (its pool combines its own parts too)
    monkeypatch.setattr(FileChecksummer, "take_known", spy)  # what the convert combines
    reshard_svc.convert(
        str(tmp_path / "src"), str(tmp_path / "dst"), mesh="tp=3", rules={"*": "S(0)"}
    )
    assert sum(combined) == sum(t.numel() * t.element_size() for t in sd.values())
    assert reshard_svc.verify(str(tmp_path / "dst")).ok
    index = CheckpointIndex.loads((tmp_path / "dst" / "reshard.index.json").read_bytes())
    for name in index.files:
        data = (tmp_path / "dst" / name).read_bytes()
        want = index.block_tables()[name].crcs
        assert (
            tuple(crc32c(data[i : i + 1024 * 1024]) for i in range(0, len(data), 1024 * 1024))
            == want
        )
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    reshard_svc.load(got, str(tmp_path / "dst"))
    assert all(torch.equal(got[k], sd[k]) for k in sd)
