"""Run the ``reshard`` command line (and the benches' scripts) in processes of their own,
for the tests.

``reshard(*args)`` runs ``python -m reshard_client.cli ARGS`` and returns what
``subprocess.run(..., capture_output=True, text=True)`` would: the exit status (negative
for a signal), stdout and stderr, each from the command's own file descriptors;
``start(*args)`` starts one and returns a :class:`Command`, with the few methods of
``subprocess.Popen`` the tests use; :func:`python` runs a script as ``python SCRIPT ARGS``.

Each command runs in a new process, with the test's environment and working directory, as
the interpreter runs it (``runpy``, ``sys.argv``, ``sys.path[0]``); only the interpreter's
start and the imports are shared, as the harness shares them for workers: the process is
forked from the session's forkserver (:data:`tests.support.harness.JOBS`), which imported
torch, this package and the CLI once (a fresh interpreter spent ~3 s of CPU a command
importing them). Interpreter exit is multiprocessing's: ``SystemExit``'s code, non-daemon
threads joined, the streams flushed. ``fresh=True`` starts a new interpreter instead, for
a test of what start-up itself does.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping

from tests.support.harness import JOBS

CLI = "reshard_client.cli"


class Command:
    """A process started by :func:`start` or :func:`python`."""

    def __init__(self, main: list[str], env: Mapping[str, str] | None, cwd) -> None:
        self.args = [sys.executable, *main]
        self._tmp = tempfile.mkdtemp(prefix="reshard-cmd-")
        self._out, self._err = os.path.join(self._tmp, "stdout"), os.path.join(self._tmp, "stderr")
        where = os.fspath(cwd) if cwd is not None else os.getcwd()
        environ = dict(os.environ if env is None else env)
        self._proc = JOBS.Process(
            target=_main, args=(main, environ, where, self._out, self._err), daemon=False
        )
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait; then (stdout, stderr). Past ``timeout`` the process is killed and
        ``TimeoutExpired`` carries what it wrote."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            out, err = self._take()
            raise subprocess.TimeoutExpired(self.args, timeout or 0, out, err) from None
        return self._take()

    def _take(self) -> tuple[str, str]:
        try:
            return _read(self._out), _read(self._err)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)


def start(*args: str, env: Mapping[str, str] | None = None, cwd=None) -> Command:
    """``python -m reshard_client.cli ARGS``, started (``env``: its whole environment)."""
    return Command(["-m", CLI, *args], env, cwd)


def python(
    script: str, *args: str, env: Mapping[str, str] | None = None, cwd=None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (``SCRIPT`` relative to ``cwd``), run to its end."""
    return _finish(Command([script, *args], env, cwd), timeout)


def reshard(
    *args: str,
    timeout: float = 300,
    cwd=None,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """``env``: the command's whole environment (default: this process's)."""
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", CLI, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
    return _finish(start(*args, env=env, cwd=cwd), timeout)


def _finish(cmd: Command, timeout: float) -> subprocess.CompletedProcess:
    out, err = cmd.communicate(timeout)
    return subprocess.CompletedProcess(cmd.args, cmd.returncode, out, err)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _main(main: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The forked process: the test's environment, directory and streams, then the module
    (``-m NAME``) or script as the interpreter runs it; its ``SystemExit`` becomes this
    process's exit status."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", closefd=False, buffering=1)  # noqa: SIM115
    try:
        if main[0] == "-m":
            sys.path.insert(0, cwd)
            sys.argv = main[1:]
            runpy.run_module(main[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(main[0])
            sys.path.insert(0, os.path.dirname(script))
            sys.argv = [main[0], *main[1:]]
            runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:  # as the interpreter reports an uncaught error: exit status 1
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1) from None
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
