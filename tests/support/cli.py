"""Run the ``reshard`` command line as a real subprocess, for the tests."""

from __future__ import annotations

import subprocess
import sys


def reshard(*args: str, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reshard_client.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )
