"""glibc's heap checks over the whole suite (``make test`` turns them on).

``make test`` runs pytest, and so every process a test starts (gloo workers, forked
writers, servers, engines), with ``LD_PRELOAD=libc_malloc_debug.so.0``,
``MALLOC_CHECK_=3`` and ``MALLOC_PERTURB_``: glibc then aborts a process whose heap is
corrupt (a write after ``free``, a double free), and fills memory on ``malloc`` and
``free``, so a use after free reads garbage instead of plausible old bytes. On glibc 2.34
and later the preload is what makes ``MALLOC_PERTURB_`` and ``MALLOC_CHECK_`` take effect.

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
