"""A 2-D band split by columns is written from its pieces where they sit (strided views of
a source map or a receive buffer), gathered a cache-sized run of rows at a time: the bytes
and the block CRC32Cs must be exactly those of the assembled band, however it is cut."""

from __future__ import annotations

import io

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.format.checksums import HashingWriter
from reshard_svc.runtime import buffers
from reshard_svc.runtime.buffers import BackgroundWriter, tensor_bytes


def _cuts(draw, n: int) -> list[int]:
    inner = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4))))
    return [0, *[c for c in inner if 0 < c < n], n]


@st.composite
def bands(draw):
    rows, cols = draw(st.integers(1, 300)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.int8]))
    return rows, cols, dtype, _cuts(draw, rows), _cuts(draw, cols), draw(st.integers(64, 4096))


@settings(max_examples=60, deadline=None)
@given(bands())
def test_a_band_from_strided_pieces_writes_the_assembled_bytes(band):
    rows, cols, dtype, row_cuts, col_cuts, piece = band
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    whole = (torch.randn(rows, cols + 7, generator=g) * 50).to(dtype)[:, 3 : 3 + cols]  # strided
    pieces = []
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            pieces.append((((r0, c0), (r1 - r0, c1 - c0)), whole[r0:r1, c0:c1]))
    pieces.reverse()  # arrival order does not matter
    old = buffers.FUSED_PIECE
    buffers.FUSED_PIECE = piece  # small gather runs: many of them per band
    try:
        got, want = io.BytesIO(), io.BytesIO()
        a = HashingWriter(got, "crc32c", 4096)
        b = HashingWriter(want, "crc32c", 4096)
        with BackgroundWriter(1 << 20) as bg:
            a.write(b"header")
            bg.submit_band(a, (rows, cols), pieces)
        b.write(b"header")
        b.write(tensor_bytes(whole.contiguous()))
    finally:
        buffers.FUSED_PIECE = old
    assert got.getvalue() == want.getvalue()
    assert a.result() == b.result() and a.size == b.size
