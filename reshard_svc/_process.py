"""Process helpers every part uses: the one place for ``/proc`` and ``prctl``.

A base-layer module (nothing of the package below it): the storage leases, the worker,
the ``reshard`` CLI's runner and the server's launchers all ask here whether a process
still runs, tie a child's life to its parent, and find a free loopback port.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
from collections.abc import Callable, Iterable
from typing import Any

from reshard_svc.errors import CheckpointError

__all__ = ["alive", "fork_call", "free_port", "process_start", "set_pdeathsig", "tagged_pids"]

_PR_SET_PDEATHSIG = 1


def _stat_fields(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return None


def process_start(pid: int) -> int:
    """The start time of process ``pid`` (clock ticks since boot, from ``/proc``), or 0
    where there is no ``/proc``: with the pid it names one process, even after reuse."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else 0  # field 22 of stat; 2 are before ")"
    except (IndexError, ValueError):
        return 0


def alive(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` of this host still runs (and, given ``start``, is the same
    process). A zombie does not run: a worker killed with its launcher is reparented to
    PID 1, which in a container may never reap it, and ``kill(pid, 0)`` still finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    if fields is None:
        return not os.path.isdir("/proc/self")  # gone since kill(); or no /proc here
    if fields and fields[0] in (b"Z", b"X"):
        return False
    return not start or process_start(pid) in (0, start)


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only);
    whether it could. It covers a parent that dies *after* the call: a caller that ran a
    while first also checks that its parent is still the one it expects."""
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    return False


def tagged_pids(name: str, value: str) -> list[int]:
    """PIDs of live (not zombie) processes whose environment carries ``name=value``."""
    tag = f"{name}={value}".encode() + b"\0"
    me = os.getpid()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read() + b"\0"
        except OSError:
            continue
        if b"\0" + tag in b"\0" + env and alive(int(entry)):
            out.append(int(entry))
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a rendezvous or a local server)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def fork_call(fn: Callable[[], Any], what: str, ignore: Iterable[int] = ()) -> Callable[[], Any]:
    """Run ``fn`` in a forked child, whose copy-on-write view of this process's memory is
    a snapshot taken now; return a function that waits for the child and returns what
    ``fn`` returned (JSON-able: it comes back through a pipe) or raises
    :class:`~reshard_svc.errors.CheckpointError` naming ``what``.

    The child runs no process group and should run no torch kernels; signals in ``ignore``
    (a job's stop signals) are the parent's to handle, and the child finishes its work.
    """
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: no return
        code = 0
        try:
            # it never outlives its parent: a killed trainer takes its writer along (what
            # the child writes commits only through the parent)
            if set_pdeathsig(signal.SIGKILL) and os.getppid() != parent:
                os._exit(1)
            for sig in ignore:
                signal.signal(sig, signal.SIG_IGN)
            os.close(read_fd)
            payload: dict[str, Any] = {"ok": fn()}
        except BaseException as e:  # reported to the parent, which raises it
            payload = {"error": f"{type(e).__name__}: {e}"}
            code = 1
        data = json.dumps(payload).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view) :]
        os._exit(code)
    os.close(write_fd)

    def collect() -> Any:
        chunks = []
        with os.fdopen(read_fd, "rb") as f:
            while block := f.read(1 << 16):
                chunks.append(block)
        _, status = os.waitpid(pid, 0)
        if not chunks:
            raise CheckpointError(f"{what} (pid {pid}) died: status {status}")
        result = json.loads(b"".join(chunks))
        if "error" in result:
            raise CheckpointError(f"{what} failed: {result['error']}")
        return result["ok"]

    return collect
