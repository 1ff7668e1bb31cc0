"""Pausing Python's cyclic garbage collector around allocation-heavy work.

A process that imported torch holds about 180,000 objects, and each full collection walks
all of them (about 0.1 s on a 2-core VM). Parsing a checkpoint index, planning and
converting build many small objects, enough to set one off in the middle of the work.
Reference counting still frees everything they drop; only the cycle search waits.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused(freeze: bool = False, settle: bool = False) -> Iterator[None]:
    """Run the body with the collector off and restore it after, even on error (nested
    uses are fine: only the outermost one turns it back on). ``freeze=True`` then moves
    every object alive at the end into the permanent generation (for long-lived imports),
    so later collections no longer walk them.

    ``settle=True`` (for a body that builds something long-lived and acyclic, a plan)
    moves what the body left alive to the oldest generation, unwalked: turned back on,
    the collector would otherwise walk every object of it in a young collection at once,
    and again in the next (0.4 s of a 1T plan's 2 s). Full collections still walk them,
    and reference counting frees them as ever. Done by freezing and unfreezing, so only
    where nothing is frozen (an unfreeze would thaw it), from an outermost pause."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        with _FREEZING:  # another thread's freeze never lands between a check and a thaw
            if freeze:
                gc.freeze()
            elif settle and was_enabled and not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
        if was_enabled:
            gc.enable()


#: held while this module freezes (or freezes and thaws) the collector's generations
_FREEZING = threading.Lock()
