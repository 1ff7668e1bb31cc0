"""Zero-copy helpers: tensor memory as I/O buffers, and a background hash+write pipeline.

``tensor_runs`` exposes a CPU tensor view (contiguous or strided) as the list of its
contiguous memory runs, in row-major element order, so ``preadv`` can read stored bytes
straight into place. ``BackgroundWriter`` hashes and writes buffers on two helper
threads (hashlib and file writes release the GIL), in submission order, with a cap on
queued bytes so memory stays bounded.
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from reshard_svc.storage import HashingWriter

__all__ = ["BackgroundWriter", "tensor_bytes", "tensor_runs"]

MAX_RUNS = 16384


def tensor_runs(view: torch.Tensor) -> list[memoryview] | None:
    """Writable byte views of ``view``'s contiguous runs in element order, or None when
    the view is not on the CPU or splits into more than ``MAX_RUNS`` runs."""
    if view.device.type != "cpu":
        return None
    if view.numel() == 0:
        return []
    shape, strides = list(view.shape), list(view.stride())
    k, expected = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expected):
        expected *= shape[k - 1]
        k -= 1
    outer = shape[:k]
    if math.prod(outer) > MAX_RUNS:
        return None
    esz = view.element_size()
    run_bytes = math.prod(shape[k:]) * esz
    base = view.data_ptr()
    offsets = [0]
    for size, stride in zip(outer, strides[:k]):
        offsets = [o + i * stride * esz for o in offsets for i in range(size)]
    return [
        memoryview((ctypes.c_char * run_bytes).from_address(base + off)).cast("B")
        for off in offsets
    ]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


class BackgroundWriter:
    """Hash and write buffers in order on helper threads; at most ``max_bytes`` queued."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(1, max_bytes)
        self._hash = ThreadPoolExecutor(1, thread_name_prefix="reshard-hash")
        self._write = ThreadPoolExecutor(1, thread_name_prefix="reshard-write")
        self._queue: deque[tuple[Future[Any], Future[Any], int]] = deque()
        self._queued = 0

    def submit(self, out: HashingWriter, data: memoryview, keep: Any = None) -> None:
        """Queue ``data`` for ``out``; ``keep`` is held until the write is done."""
        n = data.nbytes
        while self._queue and self._queued + n > self.max_bytes:
            self._pop()
        h = self._hash.submit(out.sha.update, data)
        w = self._write.submit(_write_raw, out, data, keep)
        self._queue.append((h, w, n))
        self._queued += n

    def _pop(self) -> None:
        h, w, n = self._queue.popleft()
        self._queued -= n
        h.result()
        w.result()

    def drain(self) -> None:
        """Wait for everything queued; re-raises the first failure."""
        while self._queue:
            self._pop()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._hash.shutdown(wait=True)
            self._write.shutdown(wait=True)

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self._queue.clear()
            self._hash.shutdown(wait=True)
            self._write.shutdown(wait=True)
        else:
            self.close()


def _write_raw(out: HashingWriter, data: memoryview, keep: Any) -> None:
    out.raw.write(data)
    out.size += data.nbytes
