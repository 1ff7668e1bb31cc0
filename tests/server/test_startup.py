"""``reshard-server`` started bare, the way a new user first tries it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from tests.support.harness import free_port


def test_bare_start_warns_and_keeps_its_state_out_of_the_cwd(tmp_path):
    cwd, state = tmp_path / "checkout", tmp_path / "state"
    cwd.mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESHARD_")}
    env["XDG_STATE_HOME"] = str(state)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard_server.main", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"server did not come up: {proc.stdout and proc.stdout.read()}"
                )
            time.sleep(0.2)
        # with no token, every API call is refused
        assert httpx.get(f"http://127.0.0.1:{port}/v1/jobs").status_code == 401
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "RESHARD_TOKEN is empty" in out, out
    assert "RESHARD_ROOTS is empty" in out and "paths or URI prefixes" in out, out
    assert "Traceback" not in out, out
    assert list(cwd.iterdir()) == [], "the server wrote into the folder it was started from"
    assert (state / "reshard-server" / "jobs.db").exists()
