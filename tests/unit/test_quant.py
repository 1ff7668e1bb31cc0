"""The pure side of FP8: which tensors are scales, which scale box covers a weight box,
and block dequantization of any box equal to the whole tensor's, sliced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.errors import UsageError
from reshard_svc.format.index import TensorMeta
from reshard_svc.layout import Box
from reshard_svc.plan.quant import dequantize_box, fp8_pairs, scale_box, scale_tensors

E4M3 = torch.float8_e4m3fn


def meta(name: str, dtype: torch.dtype, *shape: int) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape, layout=None, chunks=())


def test_scales_are_known_by_their_fp8_weight():
    ts = {
        m.name: m
        for m in [
            meta("a.weight", E4M3, 256, 256),
            meta("a.weight_scale_inv", torch.float32, 2, 2),
            meta("a.input_scale", torch.float32, 1),
            meta("b.weight", torch.bfloat16, 4, 4),
            meta("b.weight_scale_inv", torch.float32, 1, 1),
            meta("c.weight_scale", torch.float32, 1),
        ]
    }
    assert scale_tensors(ts) == {"a.weight_scale_inv": "a.weight", "a.input_scale": "a.weight"}
    assert list(fp8_pairs(ts)) == ["a.weight"]


def test_a_scale_that_does_not_tile_is_named():
    ts = {m.name: m for m in [meta("w", E4M3, 300, 130), meta("w_scale_inv", torch.float32, 2, 2)]}
    with pytest.raises(UsageError, match=r"'w_scale_inv' has shape \[2, 2\].*expected .*\[3, 2\]"):
        fp8_pairs(ts)
    with pytest.raises(UsageError, match="no 'v_scale_inv'"):
        fp8_pairs({"v": meta("v", E4M3, 4, 4)})


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    lead=st.integers(0, 2),
    data=st.data(),
)
def test_dequantizing_a_box_equals_the_whole_tensor_sliced(rows, cols, lead, data):
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    shape = (*(2,) * lead, rows, cols)
    w = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(E4M3)
    s = torch.rand((*(2,) * lead, -(-rows // 128), -(-cols // 128)), generator=g)
    full = s.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]
    whole = (w.to(torch.float32) * full).to(torch.bfloat16)
    offs, sizes = [], []
    for n in shape:
        o = data.draw(st.integers(0, n - 1))
        offs.append(o)
        sizes.append(data.draw(st.integers(1, n - o)))
    box = Box(tuple(offs), tuple(sizes))
    sbox = scale_box(box)
    at = sbox  # the caller holds exactly the covering scale box here
    got = dequantize_box(
        w[box.slices_in(Box((0,) * len(shape), shape))],
        box,
        s[sbox.slices_in(Box((0,) * len(shape), s.shape))],
        at,
        torch.bfloat16,
    )
    want = whole[box.slices_in(Box((0,) * len(shape), shape))]
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
