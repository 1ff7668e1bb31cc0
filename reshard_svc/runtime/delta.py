"""Element-wise deltas between two versions of a tensor piece, bitwise.

The building block of a weight sync that sends only what changed
(:class:`~reshard_svc.sessions.sync.WeightSync`): between two RL steps about 99 % of bf16
weights are bit-identical, and a block checksum cannot find the 1 % (a 64 KiB block with
1 % of its elements changed at random is almost never unchanged), so changes are found and
encoded element by element.

* :func:`changed` compares two tensors **as integers** of their element size: a NaN with
  another payload, ``-0.0`` against ``0.0`` and every denormal are changes; nothing that
  is bit-identical is.
* :func:`encode` picks the smallest of four encodings of the new piece against the old
  one, by exact size (every multi-byte field little-endian):

  - ``RAW``: every element;
  - ``MASK``: a bitmask of the changed elements (``ceil(n / 8)`` bytes), then their values;
  - ``RUNS``: an int32 run count, int32 ``(start, length)`` pairs, then the values (changes
    that come in rows);
  - ``GAPS``: an int32 token count, uint16 gaps between changed elements, then the values
    (scattered changes: two bytes per change). A gap of ``0xFFFF`` or more is written as
    ``0xFFFF`` tokens, each moving on 65,535 elements without a change, then the rest.

  Past a density where nothing beats the raw piece it is raw, so the dense case costs
  nothing over sending the piece. Dense pieces are told from sparse ones by a count of
  changed elements before any index is built.
* :func:`decode` checks a payload against its piece and returns what to write;
  :func:`patch` writes it into any view of the old piece (:func:`apply`: both, in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

import numpy as np
import torch

from reshard_svc.errors import UsageError

__all__ = [
    "Delta",
    "Encoding",
    "RAW_UNSENT",
    "apply",
    "as_ints",
    "changed",
    "decode",
    "encode",
    "encoded_size",
    "patch",
    "sampled_density",
    "values_at",
]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ESCAPE = 0xFFFF
#: At or above this share of changed elements, only RAW and MASK are weighed: GAPS and
#: RUNS cannot win there (two or more bytes per change against an eighth of a byte per
#: element), and no index of the changes is built.
DENSE = 1 / 16


#: Pieces of at least this many elements are sampled before a full compare, and go raw
#: when at least this share of the sample changed (a bitmask would save under 6 % there).
SAMPLE_FROM = 1 << 16
SAMPLE_DENSE = 0.9


class Encoding(IntEnum):
    RAW = 0
    MASK = 1
    RUNS = 2
    GAPS = 3


@dataclass(frozen=True, eq=False, kw_only=True)
class Delta:
    """One piece's delta: the encoding, its payload bytes, and where the changes are
    (``None`` for every element, a bool mask, or int64 flat positions) with their new
    values (as integers of the element size), for a sender to update its own copy."""

    encoding: Encoding
    payload: torch.Tensor
    where: torch.Tensor | None
    values: torch.Tensor


_EMPTY = torch.empty(0, dtype=torch.uint8)
#: A piece best sent raw, said without copying it (payload and values empty): what
#: :func:`encode` returns with ``raw_payload=False``, and what a weight sync's cost model
#: picks without comparing.
RAW_UNSENT = Delta(encoding=Encoding.RAW, payload=_EMPTY, where=None, values=_EMPTY)


def _int_kind(t: torch.Tensor) -> torch.dtype:
    kind = _INT_OF_SIZE.get(t.element_size())
    if kind is None:
        raise UsageError(f"cannot compare elements of {t.element_size()} bytes ({t.dtype})")
    return kind


def _as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size, in its own shape and strides."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t.view(_int_kind(t))


def as_ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its element size (no copy), as :func:`patch` writes."""
    return _as_ints(t.detach())


def _ints(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, as integers of its element size (no copy when contiguous)."""
    _int_kind(t)
    return _as_ints(t.detach().contiguous()).reshape(-1)


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """A flat bool mask of the elements whose bits differ."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise UsageError(
            f"a delta needs the same shape and dtype: {tuple(old.shape)} {old.dtype} against "
            f"{tuple(new.shape)} {new.dtype}"
        )
    return _ints(old) != _ints(new)


def encoded_size(kind: Encoding, n: int, k: int, runs: int, itemsize: int, gaps: int = 0) -> int:
    """Bytes of a piece of ``n`` elements with ``k`` changed in ``runs`` runs (``gaps``:
    the escape tokens GAPS needs on top of one per change)."""
    if kind is Encoding.RAW:
        return n * itemsize
    if kind is Encoding.MASK:
        return math.ceil(n / 8) + k * itemsize
    if kind is Encoding.RUNS:
        return 4 + 8 * runs + k * itemsize
    return 4 + 2 * (k + gaps) + k * itemsize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _gap_tokens(idx: np.ndarray) -> np.ndarray:
    gaps = np.diff(idx, prepend=-1) - 1
    escapes = gaps // ESCAPE
    if not escapes.any():
        return gaps.astype(np.uint16)
    # each change: its escapes, then the rest of its gap
    tokens = np.full(len(idx) + int(escapes.sum()), ESCAPE, dtype=np.uint16)
    ends = np.cumsum(escapes + 1) - 1
    tokens[ends] = (gaps - escapes * ESCAPE).astype(np.uint16)
    return tokens


class _Pair:
    """An old and a new piece as integers, compared once: on the CPU through numpy, in
    the new piece's own strides (no copy of a strided region; numpy's compare is several
    times faster than torch's for 1- and 2-byte integers), on a device through torch."""

    def __init__(self, old: torch.Tensor, new: torch.Tensor) -> None:
        self.new = new
        self.host = new.device.type == "cpu" and old.device.type == "cpu"
        if self.host:
            self.b = _as_ints(new.detach()).numpy()
            mask = np.not_equal(_as_ints(old.detach()).numpy(), self.b)
            self.mask = mask.reshape(-1)
            self.k = int(np.count_nonzero(self.mask))
        else:
            self.flat = _ints(new)
            mask_t = _ints(old).to(self.flat.device) != self.flat
            self.k = int(torch.count_nonzero(mask_t))
            self.mask = mask_t.cpu().numpy()
        self.n = self.mask.size

    def pick(self, where: np.ndarray) -> torch.Tensor:
        """The new values at ``where`` (a flat bool mask or positions), in order."""
        if not self.host:
            return self.flat[torch.from_numpy(where).to(self.flat.device)].cpu()
        b = self.b
        if where.dtype == np.bool_:  # compress beats boolean indexing several times over
            picked = np.compress(where, b.reshape(-1) if b.flags.c_contiguous else b.ravel())
        elif b.flags.c_contiguous:
            picked = b.reshape(-1)[where]
        else:
            picked = b[np.unravel_index(where, b.shape)]
        if not picked.size:
            return torch.empty(0, dtype=_int_kind(self.new))
        return torch.from_numpy(np.ascontiguousarray(picked))

    def raw(self) -> Delta:
        return _raw(self.new)


def _raw(new: torch.Tensor) -> Delta:
    flat = _ints(new)
    return Delta(encoding=Encoding.RAW, payload=_bytes(flat), where=None, values=flat)


def sampled_density(old: torch.Tensor, new: torch.Tensor) -> float | None:
    """The share of changed elements in a sample of a large CPU piece (16 rows, or 16
    runs of 1,024 elements, spread over it); None for a small or device piece."""
    n = new.numel()
    if n < SAMPLE_FROM or new.device.type != "cpu" or old.device.type != "cpu":
        return None
    a, b = _as_ints(old.detach()).numpy(), _as_ints(new.detach()).numpy()
    if b.ndim >= 2 and b.shape[0] >= 16:
        rows = np.linspace(0, b.shape[0] - 1, 16).astype(np.int64)
        diff = np.not_equal(a[rows], b[rows])
    else:
        a, b = a.reshape(-1), b.reshape(-1)  # a 1-D or short piece: contiguous
        starts = np.linspace(0, n - 1024, 16).astype(np.int64)
        diff = np.concatenate([np.not_equal(a[i : i + 1024], b[i : i + 1024]) for i in starts])
    return float(np.count_nonzero(diff)) / diff.size


def encode(
    old: torch.Tensor,
    new: torch.Tensor,
    *,
    raw_payload: bool = True,
    density: float | None | Literal["sample"] = "sample",
) -> Delta:
    """``new`` against ``old`` in the smallest encoding. ``raw_payload=False``: when the
    piece is best sent raw, say so without copying it (:data:`RAW_UNSENT`). A large CPU
    piece whose sample (:func:`sampled_density`; ``density``: the caller's, when it has
    sampled already) has changed almost everywhere goes raw without a full compare: only
    a cost decision, a raw piece is always right."""
    if old.shape != new.shape or old.dtype != new.dtype:
        changed(old, new)  # raises, naming both
    share = sampled_density(old, new) if density == "sample" else density
    if share is not None and share >= SAMPLE_DENSE:
        return _raw(new) if raw_payload else RAW_UNSENT
    pair = _Pair(old, new)
    n, k, isz = pair.n, pair.k, new.element_size()
    if n >= 2**31 or k == n:
        return pair.raw() if raw_payload else RAW_UNSENT
    sizes: dict[Encoding, int] = {
        Encoding.RAW: n * isz,
        Encoding.MASK: encoded_size(Encoding.MASK, n, k, 0, isz),
    }
    idx = np.zeros(0, dtype=np.int64)
    runs = np.zeros((0, 2), dtype=np.int64)
    tokens = np.zeros(0, dtype=np.uint16)
    if k < DENSE * n:
        idx = np.flatnonzero(pair.mask)
        if k:
            breaks = np.flatnonzero(np.diff(idx) != 1)
            starts = idx[np.concatenate(([0], breaks + 1))]
            ends = idx[np.concatenate((breaks, [k - 1]))] + 1
            runs = np.stack([starts, ends - starts], axis=1)
        tokens = _gap_tokens(idx)
        sizes[Encoding.RUNS] = encoded_size(Encoding.RUNS, n, k, len(runs), isz)
        sizes[Encoding.GAPS] = encoded_size(Encoding.GAPS, n, k, 0, isz, len(tokens) - k)
    best = min(sizes, key=lambda e: (sizes[e], e))
    if best is Encoding.RAW:
        return pair.raw() if raw_payload else RAW_UNSENT
    if best is Encoding.MASK:
        values = pair.pick(pair.mask)
        bits = torch.from_numpy(np.packbits(pair.mask, bitorder="little"))
        return Delta(
            encoding=best,
            payload=torch.cat([bits, _bytes(values)]),
            where=torch.from_numpy(pair.mask),
            values=values,
        )
    values = pair.pick(idx)
    if best is Encoding.RUNS:
        head = torch.tensor([len(runs)], dtype=torch.int32).view(torch.uint8)
        body = torch.from_numpy(runs.astype(np.int32).reshape(-1)).view(torch.uint8)
    else:
        head = torch.tensor([len(tokens)], dtype=torch.int32).view(torch.uint8)
        body = torch.from_numpy(tokens).view(torch.uint8)
    return Delta(
        encoding=best,
        payload=torch.cat([head, body, _bytes(values)]),
        where=torch.from_numpy(idx),
        values=values,
    )


def _count(data: torch.Tensor, what: str, n: int) -> int:
    if data.numel() < 4:
        raise UsageError(f"a {what} delta of {data.numel()} bytes has no count")
    (c,) = data[:4].clone().view(torch.int32).tolist()
    return int(c)


def decode(
    kind: int, payload: torch.Tensor, n: int, dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Check a payload for a piece of ``n`` elements of ``dtype``; return where it writes
    (``None``: everything; a bool mask; or int64 flat positions) and the values, as
    integers of the element size. Raises :class:`UsageError` naming what is wrong."""
    isz = torch.empty(0, dtype=dtype).element_size()
    int_kind = _INT_OF_SIZE.get(isz)
    if int_kind is None:
        raise UsageError(f"cannot patch elements of {isz} bytes ({dtype})")
    data = payload.view(torch.uint8).reshape(-1)
    where: torch.Tensor | None
    if kind == Encoding.RAW:
        if data.numel() != n * isz:
            raise UsageError(f"a raw delta of {data.numel()} bytes for {n * isz}")
        return None, data.view(int_kind)
    if kind == Encoding.MASK:
        nbits = math.ceil(n / 8)
        if data.numel() < nbits:
            raise UsageError(f"a mask delta of {data.numel()} bytes for {n} elements")
        bits = np.unpackbits(data[:nbits].numpy(), bitorder="little", count=n).view(np.bool_)
        where = torch.from_numpy(bits)
        k, values = int(np.count_nonzero(bits)), data[nbits:]
    elif kind == Encoding.RUNS:
        r = _count(data, "runs", n)
        if not 0 <= r <= n or data.numel() < 4 + 8 * r:
            raise UsageError(f"a runs delta of {data.numel()} bytes names {r} runs")
        pairs = data[4 : 4 + 8 * r].clone().view(torch.int32).reshape(r, 2).numpy().astype(np.int64)
        starts, lengths = pairs[:, 0], pairs[:, 1]
        if (lengths < 0).any() or (starts < 0).any() or (starts + lengths > n).any():
            raise UsageError("a runs delta reaches outside its piece")
        values = data[4 + 8 * r :]
        before = np.concatenate(([0], np.cumsum(lengths)[:-1])) if r else np.zeros(0, np.int64)
        pos = np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()))
        where, k = torch.from_numpy(pos), len(pos)
    elif kind == Encoding.GAPS:
        t = _count(data, "gaps", n)
        if not 0 <= t or data.numel() < 4 + 2 * t:
            raise UsageError(f"a gaps delta of {data.numel()} bytes names {t} tokens")
        tokens = data[4 : 4 + 2 * t].clone().view(torch.int16).numpy().view(np.uint16)
        tokens = tokens.astype(np.int64)
        escape = tokens == ESCAPE
        pos = (np.cumsum(np.where(escape, ESCAPE, tokens + 1)) - 1)[~escape]
        if len(pos) and pos[-1] >= n:
            raise UsageError("a gaps delta reaches outside its piece")
        values = data[4 + 2 * t :]
        where, k = torch.from_numpy(pos), len(pos)
    else:
        raise UsageError(f"unknown delta encoding {kind!r}")
    if values.numel() != k * isz:
        raise UsageError(f"a delta of {values.numel()} value bytes for {k} changed elements")
    return where, values.clone().view(int_kind)


def patch(region: torch.Tensor, where: torch.Tensor | None, values: torch.Tensor) -> None:
    """Write decoded ``values`` into ``region`` (any view, its elements in row-major
    order) at ``where`` (see :func:`decode`)."""
    ints = _as_ints(region)
    values = values.to(ints.device)
    if where is None:
        ints.copy_(values.view(region.shape))
    elif where.dtype == torch.bool and region.is_contiguous() and ints.device.type == "cpu":
        # positions, then a scatter: several times faster than a boolean assignment
        ints.view(-1).numpy()[np.flatnonzero(where.numpy())] = values.numpy()
    elif where.dtype == torch.bool:
        ints.masked_scatter_(where.to(ints.device).view(region.shape), values)
    elif not where.numel():
        return
    elif region.is_contiguous() and ints.device.type == "cpu":
        ints.view(-1).numpy()[where.numpy()] = values.numpy()  # numpy's is the faster scatter
    elif region.is_contiguous():
        ints.view(-1)[where.to(ints.device)] = values
    else:
        ints[torch.unravel_index(where.to(ints.device), region.shape)] = values


def values_at(region: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """The elements of ``region`` at ``where`` (as :func:`patch` takes it: None for every
    element, a bool mask or int64 flat positions), as integers, copied to the host:
    ``patch(region, where, values_at(region, where))`` puts them back."""
    flat = _as_ints(region.detach()).reshape(-1)
    if where is None:
        taken = flat.clone() if flat.data_ptr() == region.data_ptr() else flat
    elif where.dtype == torch.bool and flat.device.type == "cpu":
        # numpy's compress: several times faster than torch's boolean indexing
        taken = torch.from_numpy(np.compress(where.reshape(-1).numpy(), flat.numpy()))
    elif where.dtype == torch.bool:
        taken = flat[where.to(flat.device).reshape(-1)]
    else:
        taken = flat[where.to(flat.device)]
    return taken.cpu()


def apply(old: torch.Tensor, kind: int, payload: torch.Tensor) -> None:
    """Patch ``old`` in place with a payload from :func:`encode`."""
    where, values = decode(kind, payload, old.numel(), old.dtype)
    patch(old, where, values)
