"""Run the ``reshard`` command line in a process of its own, for the tests.

``reshard(*args)`` runs ``python -m reshard_client.cli ARGS`` and returns what
``subprocess.run(..., capture_output=True, text=True)`` would: the exit status (negative
for a signal), stdout and stderr, each from the command's own file descriptors. The
command runs in a new process, with the test's environment and working directory, as
``-m`` runs it (``runpy``, ``sys.argv``, ``sys.path[0]``); only the interpreter's start and
the imports are shared, as the harness shares them for workers: the process is forked from
the session's forkserver (:data:`tests.support.harness.JOBS`), which imported torch, this
package and the CLI once (a fresh interpreter spent ~3 s of CPU a command importing them).
Interpreter exit is multiprocessing's: ``SystemExit``'s code, non-daemon threads joined,
the streams flushed. ``fresh=True`` starts a new interpreter instead, for a test of what
start-up itself does.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from tests.support.harness import JOBS

CLI = "reshard_client.cli"


def reshard(
    *args: str,
    timeout: float = 300,
    cwd=None,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``env``: the command's whole environment (default: this process's)."""
    argv = [sys.executable, "-m", CLI, *args]
    environ = dict(os.environ if env is None else env)
    if fresh:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environ
        )
    where = os.fspath(cwd) if cwd is not None else os.getcwd()
    with tempfile.TemporaryDirectory(prefix="reshard-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = JOBS.Process(
            target=_command, args=(list(args), environ, where, out, err), daemon=False
        )
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(argv, timeout, _read(out), _read(err))
        return subprocess.CompletedProcess(argv, proc.exitcode, _read(out), _read(err))


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _command(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked process: the test's environment, directory and streams, then the CLI as
    ``-m`` runs it; its ``SystemExit`` becomes this process's exit status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
    sys.path.insert(0, cwd)
    sys.argv = ["-m", *args]
    try:
        runpy.run_module(CLI, run_name="__main__", alter_sys=True)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # as the interpreter reports an uncaught error: exit status 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
