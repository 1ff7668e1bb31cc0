"""Element-wise deltas (``reshard_svc.runtime.delta``): bitwise, in the smallest encoding.

Random pieces of every dtype a checkpoint holds, random changes at densities from none to
all, with NaN payloads, -0.0 and denormals among the changed values: patching the old
piece with the delta gives the new one bit for bit, and the encoding is never larger than
the raw piece."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard_svc.errors import UsageError
from reshard_svc.runtime.delta import Encoding, apply, changed, decode, encode, patch

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def as_int(t: torch.Tensor) -> torch.Tensor:
    size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(size) if t.dtype != torch.bool else t.view(torch.uint8)


def piece(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), generator=g, dtype=torch.uint8
    )
    if dtype == torch.bool:
        return raw.remainder(2).to(torch.bool)
    return raw.view(dtype)  # any bit pattern: NaN payloads, -0.0, denormals included


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 3000),
    seed=st.integers(0, 2**31),
    density=st.sampled_from([0.0, 0.0001, 0.01, 0.1, 0.3, 0.7, 1.0]),
    runs=st.booleans(),
)
def test_patching_the_old_piece_gives_the_new_one_bitwise(dtype, n, seed, density, runs):
    old = piece(dtype, n, seed)
    new = old.clone()
    g = torch.Generator().manual_seed(seed + 1)
    if runs:  # changes in a few contiguous runs (rows of a layer)
        k = int(n * density)
        start = int(torch.randint(0, max(1, n - k + 1), (1,), generator=g))
        where = torch.zeros(n, dtype=torch.bool)
        where[start : start + k] = True
    else:
        where = torch.rand(n, generator=g) < density
    fresh = piece(dtype, n, seed + 2)
    as_int(new)[where] = as_int(fresh)[where]
    d = encode(old, new)
    assert d.payload.numel() <= n * old.element_size()  # never worse than the raw piece
    patched = old.clone()
    apply(patched, d.encoding, d.payload)
    assert torch.equal(as_int(patched), as_int(new))
    # what the sender keeps (where, values) updates its own copy the same way
    mine = old.clone()
    patch(mine, d.where, d.values)
    assert torch.equal(as_int(mine), as_int(new))
    assert int(changed(old, new).sum()) == int((as_int(old) != as_int(new)).sum())


def test_the_bits_decide_nan_payloads_signed_zeros_and_denormals():
    old = torch.tensor([0.0, float("nan"), 1e-40, 1.0])
    new = old.clone()
    new[0] = -0.0
    as_int(new)[1] = as_int(old)[1] ^ 1  # another NaN payload
    assert changed(old, new).tolist() == [True, True, False, False]
    d = encode(old, new)
    patched = old.clone()
    apply(patched, d.encoding, d.payload)
    assert torch.equal(as_int(patched), as_int(new))


def test_sparse_changes_are_small_and_dense_ones_are_raw():
    old = piece(torch.bfloat16, 1 << 16, 0)
    new = old.clone()
    as_int(new)[::1000] ^= 1  # 0.1 %: scattered, two bytes of gap per change
    d = encode(old, new)
    assert d.encoding is Encoding.GAPS and d.payload.numel() == 4 + 66 * 4
    new = old.clone()
    as_int(new)[1000:1300] ^= 1  # one run
    d = encode(old, new)
    assert d.encoding is Encoding.RUNS and d.payload.numel() == 4 + 8 + 300 * 2
    new = old.clone()
    as_int(new)[::10] ^= 1  # 10 %: a bitmask beats runs and gaps
    d = encode(old, new)
    assert d.encoding is Encoding.MASK
    dense = old.clone()
    as_int(dense).bitwise_xor_(1)  # every element's lowest bit
    d = encode(old, dense)
    assert d.encoding is Encoding.RAW and d.payload.numel() == old.numel() * 2
    d = encode(old, old.clone())
    assert d.encoding is Encoding.RUNS and d.payload.numel() == 4  # nothing changed: a count


def test_bad_deltas_are_refused_naming_the_problem():
    old = torch.zeros(8)
    with pytest.raises(UsageError, match="same shape and dtype"):
        encode(old, torch.zeros(9))
    with pytest.raises(UsageError, match="raw delta of 4 bytes"):
        apply(old, Encoding.RAW, torch.zeros(4, dtype=torch.uint8))
    bad_runs = torch.tensor([1, 7, 5], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(UsageError, match="outside its piece"):
        apply(old, Encoding.RUNS, torch.cat([bad_runs, torch.zeros(20, dtype=torch.uint8)]))
    with pytest.raises(UsageError, match="value bytes"):
        apply(old, Encoding.MASK, torch.tensor([0b11, 0], dtype=torch.uint8))
    with pytest.raises(UsageError, match="outside its piece"):
        apply(old, Encoding.GAPS, torch.tensor([1, 0, 0, 0, 8, 0], dtype=torch.uint8))
    with pytest.raises(UsageError, match="unknown delta encoding"):
        apply(old, 9, torch.zeros(4, dtype=torch.uint8))


def test_long_gaps_escape_and_strided_views_are_patched_in_place():
    old = torch.zeros(300_000, dtype=torch.bfloat16)
    new = old.clone()
    new[[0, 70_000, 200_001, 299_999]] = torch.tensor([1.0, -0.0, 3.0, 4.0]).to(torch.bfloat16)
    d = encode(old, new)
    assert d.encoding is Encoding.GAPS  # gaps of 70k and 130k need escape tokens
    patched = old.clone()
    apply(patched, d.encoding, d.payload)
    assert torch.equal(as_int(patched), as_int(new))
    # a column block of a wider tensor (a TP shard's region): patched through its strides
    wide = torch.zeros(6, 10)
    region = wide[:, 3:7]
    target = torch.arange(24.0).view(6, 4)
    target[2, 1] = float("nan")
    for kind_of in (target, torch.where(torch.arange(24).view(6, 4) % 7 == 0, target, 0.0)):
        d = encode(torch.zeros(6, 4), kind_of)
        wide.zero_()
        where, values = decode(d.encoding, d.payload, 24, torch.float32)
        patch(region, where, values)
        assert torch.equal(as_int(wide[:, 3:7].contiguous()), as_int(kind_of))
        assert not wide[:, :3].any() and not wide[:, 7:].any()


@pytest.mark.parametrize("density", [0.0, 0.05, 0.5, 1.0])
def test_a_strided_new_piece_is_compared_in_place(density):
    """A sender's piece is often a column block of its shard: compared through its strides."""
    g = torch.Generator().manual_seed(3)
    shard = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    old = shard[:, 16:40].clone()
    where = torch.rand(64, 24, generator=g) < density
    as_int(shard)[:, 16:40][where] ^= 7
    new = shard[:, 16:40]  # strided
    assert not new.is_contiguous()
    d = encode(old, new)
    patched = old.clone()
    apply(patched, d.encoding, d.payload)
    assert torch.equal(as_int(patched), as_int(new))
    lean = encode(old, new, raw_payload=False)
    assert lean.encoding is d.encoding
    if lean.encoding is Encoding.RAW:
        assert lean.payload.numel() == 0  # the caller sends the piece itself


@pytest.mark.parametrize("shape", [(1 << 17,), (512, 256), (8, 1 << 14)])
@pytest.mark.parametrize("density", [0.5, 0.97])
def test_large_pieces_are_sampled_before_a_full_compare(shape, density):
    """Pieces of 64 Ki elements and more: a sample that changed almost everywhere sends the
    piece raw without comparing it all; either way the patch is exact."""
    g = torch.Generator().manual_seed(7)
    old = torch.randn(shape, generator=g).to(torch.bfloat16)
    new = old.clone()
    as_int(new)[torch.rand(shape, generator=g) < density] ^= 1
    d = encode(old, new)
    assert d.encoding is (Encoding.RAW if density > 0.9 else Encoding.MASK)
    patched = old.clone()
    apply(patched, d.encoding, d.payload)
    assert torch.equal(as_int(patched), as_int(new))
