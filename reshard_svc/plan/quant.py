"""FP8 weights and their scales: which tensors a ``--dtype`` cast must keep, and the
block-scaled dequantization ``--dequantize fp8-block`` runs.

Block-scaled FP8 (the DeepSeek-V3 / Qwen3-FP8 convention): a ``float8_e4m3fn`` weight
``W`` of shape ``[..., R, C]`` comes with ``W_scale_inv`` (``model.layers.0.mlp.up_proj.
weight_scale_inv``) of shape ``[..., ceil(R/128), ceil(C/128)]``, one float32 per 128 × 128
block; the real weight is ``float32(W) * scale`` of its block, then cast (what DeepSeek's
``fp8_cast_bf16.py`` computes). A scale is recognised only by its weight: a tensor named
``<X>_scale_inv`` or ``<X>_scale`` whose ``<X>`` is an FP8 tensor of the checkpoint (and
``<module>.input_scale`` beside an FP8 ``<module>.weight``). FP8 values are never cast as
plain floats: without ``--dequantize`` they and their scales keep their dtype.

Pure: names, shapes and boxes in, pairs and boxes out (the arithmetic is
:func:`dequantize_box`, used by the writer on each band).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from reshard_svc.errors import UsageError
from reshard_svc.format.index import TensorMeta
from reshard_svc.layout import Box

__all__ = [
    "BLOCK",
    "DEQUANTIZE",
    "ScalePair",
    "dequantize_box",
    "fp8_pairs",
    "is_fp8",
    "scale_box",
    "scale_tensors",
]

#: What ``--dequantize`` accepts.
DEQUANTIZE = ("fp8-block",)
#: The block edge of block-scaled FP8 (DeepSeek-V3's ``weight_block_size`` [128, 128]).
BLOCK = 128
_SCALE_SUFFIXES = ("_scale_inv", "_scale")
#: rows of a band dequantized at once: bounds the float32 intermediate to a few MiB
_ROWS_AT_ONCE_BYTES = 8 * 1024 * 1024


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def scale_tensors(tensors: Mapping[str, TensorMeta]) -> dict[str, str]:
    """scale name -> the FP8 tensor it scales, for every scale of the checkpoint."""
    out: dict[str, str] = {}
    for name in tensors:
        for suffix in _SCALE_SUFFIXES:
            base = name.removesuffix(suffix)
            if base != name and base in tensors and is_fp8(tensors[base].dtype):
                out[name] = base
                break
        else:
            module, _, leaf = name.rpartition(".")
            weight = f"{module}.weight"
            if leaf == "input_scale" and weight in tensors and is_fp8(tensors[weight].dtype):
                out[name] = weight
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class ScalePair:
    """An FP8 weight and its block scale (``scale`` is a tensor name)."""

    weight: str
    scale: str


def fp8_pairs(tensors: Mapping[str, TensorMeta]) -> dict[str, ScalePair]:
    """weight -> its block scale, for every FP8 tensor; a missing scale, or one whose shape
    does not tile the weight in 128 × 128 blocks, is a :class:`UsageError` naming both."""
    pairs: dict[str, ScalePair] = {}
    for name, meta in tensors.items():
        if not is_fp8(meta.dtype):
            continue
        scale = next((name + s for s in ("_scale_inv",) if name + s in tensors), None)
        if scale is None:
            raise UsageError(
                f"--dequantize fp8-block: {name!r} is {str(meta.dtype).removeprefix('torch.')} "
                f"but the checkpoint has no {name + '_scale_inv'!r} to dequantize it with "
                "(was it left out by --only?)"
            )
        s = tensors[scale]
        want = (*meta.shape[:-2], *(math.ceil(n / BLOCK) for n in meta.shape[-2:]))
        if len(meta.shape) < 2 or tuple(s.shape) != want or not s.dtype.is_floating_point:
            raise UsageError(
                f"--dequantize fp8-block: {scale!r} has shape {list(s.shape)} ({s.dtype}), which "
                f"does not tile {name!r} {list(meta.shape)} in {BLOCK}x{BLOCK} blocks "
                f"(expected a float tensor of shape {list(want)})"
            )
        pairs[name] = ScalePair(weight=name, scale=scale)
    return pairs


def scale_box(box: Box) -> Box:
    """The box of the scale tensor that covers weight box ``box``."""
    lead = box.ndim - 2
    offs = [*box.offsets[:lead]]
    sizes = [*box.sizes[:lead]]
    for o, n in zip(box.offsets[lead:], box.sizes[lead:]):
        lo, hi = o // BLOCK, -(-(o + n) // BLOCK) if n else o // BLOCK
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def dequantize_box(
    data: torch.Tensor, box: Box, scale: torch.Tensor, scale_at: Box, out: torch.dtype
) -> torch.Tensor:
    """``data`` (the FP8 values of weight box ``box``) times its blocks' scales, in float32,
    cast to ``out``. ``scale`` holds the scale tensor's box ``scale_at`` (which covers
    :func:`scale_box` of ``box``). Works a few MiB of rows at a time."""
    result = torch.empty(box.sizes, dtype=out)
    if not data.numel():
        return result
    lead = box.ndim - 2
    idx = []
    for d in range(box.ndim):
        pos = torch.arange(box.offsets[d], box.offsets[d] + box.sizes[d])
        if d >= lead:
            pos = pos // BLOCK
        idx.append(pos - scale_at.offsets[d])
    row = math.prod(box.sizes[1:]) * 4
    step = max(1, _ROWS_AT_ONCE_BYTES // max(1, row))
    for r0 in range(0, box.sizes[0], step):
        r1 = min(box.sizes[0], r0 + step)
        s = scale.to(torch.float32)
        for d, ix in enumerate([idx[0][r0:r1], *idx[1:]]):
            s = s.index_select(d, ix)  # each element's own block scale
        result[r0:r1] = (data[r0:r1].to(torch.float32) * s).to(out)
    return result
