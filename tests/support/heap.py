"""glibc's heap checks over the whole suite (``make test`` turns them on).

``make test`` runs pytest, and so every process a test starts (gloo workers, forked
writers, servers, engines), with ``MALLOC_PERTURB_``: glibc fills memory on ``malloc`` and
``free``, so a use after free reads garbage instead of plausible old bytes, and its
built-in checks abort a process whose heap is corrupt (a write after ``free``, a double
free).

Not ``MALLOC_CHECK_=3``: on glibc 2.34 and later it takes effect only with
``libc_malloc_debug.so.0`` preloaded, whose checking ``malloc`` keeps its own arena and
lock, which ``fork()`` does not take: a child forked while another thread of its parent
holds that lock waits for it forever (a forked writer of a training process that runs
gloo and background threads). Under it, 7 of 100 forks of a process whose threads
allocate hung, and the fast tier's kill test hung 2 times in 8;
``test_a_threaded_process_forks_without_a_hung_child`` keeps it out.

A process that aborts this way prints one of glibc's messages on its standard error, which
is the test's captured output (workers inherit the test's descriptors): :func:`heap_error`
finds it, and the suite's hook fails that test with the message, whatever the test itself
concluded (a test that expects a worker to die still fails on a heap error).
"""

from __future__ import annotations

import re

__all__ = ["HEAP_ERROR", "heap_error"]

#: glibc's malloc_printerr messages (malloc.c), and the debug library's.
HEAP_ERROR = re.compile(
    r"(?:\b(?:malloc|free|realloc|calloc|memalign|munmap_chunk|malloc_consolidate|_int_malloc"
    r"|_int_free|_int_realloc|tcache_thread_shutdown|malloc_check_get_size)\(\): "
    r"[a-z][^\n]{0,80}"
    r"|double free or corruption[^\n]{0,20}"
    r"|corrupted size vs\. prev_size[^\n]{0,20}"
    r"|corrupted double-linked list[^\n]{0,20})"
)


def heap_error(text: str) -> str | None:
    """The first glibc heap-corruption message in ``text``, or None."""
    found = HEAP_ERROR.search(text)
    return found.group(0) if found else None
