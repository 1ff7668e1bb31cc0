"""A rank's pool of checking writers: ``io_threads`` threads that sum and write its files'
byte ranges at the offsets the plan fixed before any byte moved.

A safetensors file's header, and so every tensor's offset in it, is known before a byte is
written (:mod:`reshard_svc.plan.save`, which also spreads a rank's boxes over one file per
I/O thread). :meth:`PooledFile.put` cuts a range into tasks of about :data:`TASK` bytes at
the file's checksum-block bounds; a task sums each block piece (CRC32C), then writes its
bytes with one ``pwrite`` (a lane hands the interpreter lock over a few times per task,
not per block: sixteen lanes and the producer share it). Each thread is a *lane*, and a file's tasks go to
its own lanes (a file per lane when there are as many files as threads: writers of one
file would share its lock). :meth:`PooledFile.close` builds the file's block CRC32Cs from
the parts in file order (a block two ranges share is combined, never summed twice); the
storage makes each file durable as it is closed, the files at once on their lanes (``fsync``).

Who owns what: a range's bytes are the pool's from ``put`` until its tasks are done
(``keep`` holds what they point into); at most ``max_bytes`` are queued, then ``put`` waits
for the oldest task. A task's error is raised by a later ``put`` or by ``close``; on any
error every task in flight is waited for before a file is closed (a task never writes to a
closed descriptor), and the files stay in their staging folder. Used where the storage
takes writes at any offset (:attr:`~reshard_svc.storage.Storage.positional_writes`, local
files); elsewhere a file goes front to back through
:class:`~reshard_svc.runtime.buffers.BackgroundWriter`.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from reshard_svc.errors import CheckpointError
from reshard_svc.format.checksums import FileChecksummer, crc32c
from reshard_svc.storage import Storage

__all__ = ["TASK", "PooledFile", "WritePool"]

#: Bytes one task sums and writes (a multiple of the checksum block).
TASK = 8 * 1024 * 1024

#: A task's result: (file offset, length, CRC32C or 0) of each block piece it wrote.
Parts = list[tuple[int, int, int]]


class WritePool:
    """``threads`` checking writers, one lane each (every call from one thread: the
    rank's saver)."""

    def __init__(self, threads: int, max_bytes: int) -> None:
        self.lanes = [
            ThreadPoolExecutor(1, thread_name_prefix="reshard-io") for _ in range(max(1, threads))
        ]
        self.max_bytes = max(1, max_bytes)
        self._queue: deque[tuple[Future[Parts], int]] = deque()
        self._queued = 0

    @contextlib.contextmanager
    def files(
        self, storage: Storage, specs: Sequence[tuple[str, int]], checksum: str, block_size: int
    ) -> Iterator[list[PooledFile]]:
        """New files ((name, size) each) to fill with :meth:`PooledFile.put`, all open at
        once, each on its share of the lanes; call :meth:`PooledFile.close` on each inside
        the block. Leaving the block closes them on their lanes at once (where the storage
        syncs files, that is each file's ``fsync``)."""
        n, t = len(specs), len(self.lanes)
        writers: list[contextlib.AbstractContextManager[Any]] = []
        out: list[PooledFile] = []
        try:
            for i, (name, size) in enumerate(specs):
                writer = storage.positional_writer(name, size)
                pwrite = writer.__enter__()
                writers.append(writer)
                k = max(1, t // n) if n else 1
                lanes = self.lanes[i * k : (i + 1) * k] if n < t else [self.lanes[i % t]]
                out.append(PooledFile(self, lanes, pwrite, name, size, checksum, block_size))
            yield out
        except BaseException as e:
            self.drain(quiet=True)  # before any file closes
            for writer in reversed(writers):  # closed unsynced: abandoned with their folder
                with contextlib.suppress(BaseException):
                    writer.__exit__(type(e), e, e.__traceback__)
            raise
        _settle([f.lanes[0].submit(w.__exit__, None, None, None) for f, w in zip(out, writers)])

    def submit(
        self, lane: ThreadPoolExecutor, nbytes: int, fn: Callable[..., Parts], *args: Any
    ) -> Future[Parts]:
        """Run ``fn(*args)`` on ``lane``, counting ``nbytes`` queued until it is done; waits
        for the oldest tasks first while the queue is over its budget."""
        while self._queue and self._queued + nbytes > self.max_bytes:
            self._pop()
        task = lane.submit(fn, *args)
        self._queue.append((task, nbytes))
        self._queued += nbytes
        return task

    def _pop(self) -> None:
        task, n = self._queue.popleft()
        self._queued -= n
        task.result()

    def drain(self, quiet: bool = False) -> None:
        """Wait for every task; the first error re-raised (unless ``quiet``)."""
        while self._queue:
            try:
                self._pop()
            except BaseException:
                if not quiet:
                    self.drain(quiet=True)
                    raise

    def close(self) -> None:
        for lane in self.lanes:
            lane.shutdown(wait=True)

    def __enter__(self) -> WritePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _settle(tasks: list[Future[Any]]) -> None:
    """Wait for every task; then the first error, if any, is raised."""
    errors = [task.exception() for task in tasks]
    for error in errors:
        if error is not None:
            raise error


def _when_all_done(tasks: list[Future[Parts]], done: Callable[[], None]) -> None:
    """Run ``done()`` once every task in ``tasks`` has finished (failed ones too)."""
    if not tasks:
        done()
        return
    left = [len(tasks)]
    lock = threading.Lock()

    def one(_: Future[Parts]) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    for task in tasks:
        task.add_done_callback(one)


class PooledFile:
    """One file being written by its lanes."""

    def __init__(
        self,
        pool: WritePool,
        lanes: list[ThreadPoolExecutor],
        pwrite: Callable[[int, memoryview], None],
        name: str,
        size: int,
        checksum: str,
        block_size: int,
    ) -> None:
        if checksum == "sha256":
            raise ValueError("a sha256 reads the file front to back: not for the pool")
        self.pool, self.lanes, self.pwrite = pool, lanes, pwrite
        self.name, self.size = name, size
        self.summing = checksum == "crc32c"
        self.checksum, self.block_size = checksum, block_size
        self._tasks: list[Future[Parts]] = []

    def put(
        self,
        offset: int,
        data: memoryview,
        keep: Any = None,
        done: Callable[[], None] | None = None,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """Queue ``data`` (bytes of the file from ``offset``); ``keep`` is held until
        its tasks are done, then ``done()`` runs (on the lane that finished last, even
        after an error). ``ready()``, where given, is called by each task before it reads
        the bytes (a copy into them still in flight)."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.size:
            raise CheckpointError(
                f"{self.name}: bytes [{offset}, {offset + view.nbytes}) outside its {self.size}"
            )
        at = 0
        tasks: list[Future[Parts]] = []
        while at < view.nbytes:
            end = offset + at + TASK
            end -= end % self.block_size  # tasks end on block bounds: no block split twice
            take = max(1, min(view.nbytes - at, end - offset - at))
            lane = self.lanes[
                min(len(self.lanes) - 1, (offset + at) * len(self.lanes) // self.size)
            ]
            tasks.append(
                self.pool.submit(
                    lane, take, self._task, offset + at, view[at : at + take], keep, ready
                )
            )
            at += take
        self._tasks += tasks
        if done is not None:
            _when_all_done(tasks, done)

    def _task(
        self, offset: int, data: memoryview, keep: Any, ready: Callable[[], None] | None
    ) -> Parts:
        """Sum each block piece of ``data``, then write it in one call (few handovers of
        the interpreter lock: sixteen lanes share it)."""
        if ready is not None:
            ready()
        parts: Parts = []
        bs, pos, n = self.block_size, 0, data.nbytes
        while pos < n:
            at = offset + pos
            take = min(bs - at % bs, n - pos)
            parts.append((at, take, crc32c(data[pos : pos + take]) if self.summing else 0))
            pos += take
        self.pwrite(offset, data)
        return parts

    def close(self) -> list[Any]:
        """Wait for the file's tasks; ``[name, size, checksum fields]`` as the index wants."""
        parts = sorted(p for task in self._tasks for p in task.result())
        self._tasks.clear()
        at = 0
        for offset, n, _ in parts:
            if offset != at:
                break
            at += n
        if at != self.size:
            raise CheckpointError(
                f"{self.name}: the ranges written cover {at} of its {self.size} bytes in order"
            )
        sums = FileChecksummer(self.checksum, self.block_size)
        if not self.summing:
            sums.size = self.size
        elif not sums.take_known([(n, crc) for _, n, crc in parts]):
            raise CheckpointError(f"{self.name}: its parts do not fit its blocks")  # a bug
        return [self.name, self.size, sums.result()]
