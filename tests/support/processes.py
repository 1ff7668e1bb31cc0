"""Process ids for lease tests."""

from __future__ import annotations

import subprocess


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (its leases are stale)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
