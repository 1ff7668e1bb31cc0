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
# next mallocs of that size follow the overwritten link.
USE_AFTER_FREE = textwrap.dedent(
    """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    a, b = libc.malloc(200), libc.malloc(200)
    libc.free(ctypes.c_void_p(b)); libc.free(ctypes.c_void_p(a))
    ctypes.memset(a, 0x41, 8)
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
    "libc_malloc_debug" not in os.environ.get("LD_PRELOAD", "")
    or not os.environ.get("MALLOC_PERTURB_"),
    reason="run without `make test`'s heap checks (LD_PRELOAD, MALLOC_PERTURB_)",
)
def test_under_make_test_fresh_and_freed_memory_is_perturbed():
    """``MALLOC_PERTURB_`` is in effect (on glibc >= 2.34 only with the debug library):
    fresh allocations hold its complement, so a read of memory nobody wrote is garbage."""
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
