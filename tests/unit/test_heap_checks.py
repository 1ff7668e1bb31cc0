"""The suite's heap checks are live, and a heap error fails the test that saw it.

``make test`` runs every test process under glibc's checks (``tests/support/heap.py``). A
check that is configured but not in effect would show nothing, so this proves it: a child
that writes into freed memory (the defect class of issue 52: a buffer written after it
was released) is aborted by glibc with its message, and a test whose worker died that way
fails with the test's name, even when the test itself expected the worker to fail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.heap import heap_error

REPO = Path(__file__).resolve().parents[2]

# Two freed chunks in one tcache bin, then a write into the first (a use after free): the
# next mallocs of that size follow the overwritten link. glibc stores that link XORed with
# its own address >> 12 (safe-linking); the write is chosen so that the link glibc reads
# back is always misaligned (0x...41), whatever the address: glibc aborts with its message
# every time (plain 0x41 bytes read back aligned, 1 run in 16, and the process segfaulted
# silently).
USE_AFTER_FREE = textwrap.dedent(
    """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    a, b = libc.malloc(200), libc.malloc(200)
    libc.free(ctypes.c_void_p(b)); libc.free(ctypes.c_void_p(a))
    ctypes.c_uint64.from_address(a).value = (a >> 12) ^ 0x4141414141414141
    libc.malloc(200); libc.malloc(200)
    print("survived")
    """
)


@pytest.mark.parametrize(
    "text, found",
    [
        (
            "x\nmalloc(): unaligned tcache chunk detected\n",
            "malloc(): unaligned tcache chunk detected",
        ),
        ("free(): double free detected in tcache 2", "free(): double free detected in tcache 2"),
        ("[rank1]: double free or corruption (out)\n", "double free or corruption (out)"),
        ("corrupted size vs. prev_size\n", "corrupted size vs. prev_size"),
        ("munmap_chunk(): invalid pointer", "munmap_chunk(): invalid pointer"),
        ("INFO saved step 4 (free space: 3 GiB)\nmalloc arena stats\n", None),
    ],
)
def test_glibc_heap_messages_are_recognised(text, found):
    assert heap_error(text) == found


def test_a_write_after_free_aborts_the_process_with_glibcs_message():
    got = subprocess.run(
        [sys.executable, "-c", USE_AFTER_FREE], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == -signal.SIGABRT, (got.returncode, got.stdout, got.stderr)
    assert heap_error(got.stderr) is not None, got.stderr
    assert "survived" not in got.stdout


@pytest.mark.skipif(
    not os.environ.get("MALLOC_PERTURB_"),
    reason="run without `make test`'s heap checks (MALLOC_PERTURB_)",
)
def test_under_make_test_fresh_and_freed_memory_is_perturbed():
    """``MALLOC_PERTURB_`` is in effect: fresh allocations hold its complement, so a read
    of memory nobody wrote is garbage."""
    code = textwrap.dedent(
        """
        import ctypes
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        a = libc.malloc(4096)
        print(bytes((ctypes.c_ubyte * 64).from_address(a)).hex())
        """
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    perturb = int(os.environ["MALLOC_PERTURB_"]) & 0xFF
    assert got.stdout.strip() == bytes([perturb ^ 0xFF] * 64).hex(), got


def test_a_worker_that_dies_of_a_heap_error_fails_its_test_by_name(tmp_path):
    """Even a test that expects its worker to fail (as the kill tests do) fails when the
    worker died of a heap error; the report names the test."""
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_runtest_makereport  # noqa: F401\n"
    )
    (tmp_path / "test_worker.py").write_text(
        textwrap.dedent(
            f"""
            import subprocess, sys

            def test_expects_its_worker_to_die():
                rc = subprocess.run([sys.executable, "-c", {USE_AFTER_FREE!r}]).returncode
                assert rc != 0

            def test_a_clean_worker():
                assert subprocess.run([sys.executable, "-c", "print(1)"]).returncode == 0
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    out = got.stdout + got.stderr
    assert got.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert (
        "test_worker.py::test_expects_its_worker_to_die: a process aborted on a heap error" in out
    )


# Threads that allocate outside the GIL (torch ops), and a main thread that forks as our
# forked writers do; a child that has not exited within 10 s is hung.
FORKS = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    torch.set_num_threads(1)
    stop = threading.Event()
    def churn():
        x = torch.ones(256)
        while not stop.is_set():
            y = x * 2
            del y
    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    hung = 0
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 10
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                break
            time.sleep(0.001)
    stop.set()
    for t in threads:
        t.join()
    print(hung)
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_a_threaded_process_forks_without_a_hung_child():
    """Under the suite's heap settings (inherited), a child forked from a process whose
    threads allocate never hangs. With glibc's ``MALLOC_CHECK_=3`` through
    ``libc_malloc_debug.so.0``, 7 of 100 such children hung on the debug library's arena
    lock (taken by another thread at the fork): every test with a forked writer could
    hang at random (see tests/support/heap.py)."""
    got = subprocess.run(
        [sys.executable, "-c", FORKS, "100"], capture_output=True, text=True, timeout=240
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.strip() == "0", (got.stdout, os.environ.get("LD_PRELOAD"))
