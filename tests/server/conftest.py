"""A real reshard-server (uvicorn) on a free loopback port, in its own process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

import reshard_svc
from reshard_client import ReshardClient
from reshard_server.launchers import job_pids
from tests.support.cli import reshard
from tests.support.harness import free_port

TOKEN = "test-token-123"


class Server:
    """One server process; ``kill9`` + ``start`` simulates a crash and restart."""

    def __init__(
        self, base: Path, roots: list[str], env: dict[str, str] | None = None, **settings: str
    ) -> None:
        self.base = base
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "RESHARD_TOKEN": TOKEN,
            "RESHARD_ROOTS": ",".join(roots),
            "RESHARD_DB": str(base / "jobs.db"),
            "RESHARD_DATA_DIR": str(base / "server-data"),
            "RESHARD_POLL_INTERVAL_S": "0.1",
            "RESHARD_CANCEL_GRACE_S": "3",
            **{f"RESHARD_{k.upper()}": v for k, v in settings.items()},
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        log = open(self.base / f"server-{self.port}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reshard_server.main",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start; see {log.name}")
            time.sleep(0.1)

    def client(self, token: str | None = TOKEN) -> ReshardClient:
        return ReshardClient(self.url, token)

    def kill9(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``reshard`` command line against ``server`` (its URL and token from the env)."""
    env = {**os.environ, "RESHARD_URL": server.url, "RESHARD_TOKEN": TOKEN}
    return reshard(*args, env=env)


@pytest.fixture
def make_server(tmp_path):
    servers: list[Server] = []

    def make(
        roots: list[str] | None = None, env: dict[str, str] | None = None, **settings: str
    ) -> Server:
        s = Server(tmp_path, roots or [str(tmp_path / "data")], env, **settings)
        servers.append(s)
        return s.start()

    (tmp_path / "data").mkdir()
    yield make
    for s in servers:
        s.stop()
    db = tmp_path / "jobs.db"
    if db.exists():  # leave no worker behind, whatever the test did
        import sqlite3

        for (job_id,) in sqlite3.connect(db).execute("SELECT id FROM jobs"):
            for pid in job_pids(job_id):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def server(make_server):
    return make_server()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A real single-node Slurm cluster (slurm-wlm + munge) for the whole session."""
    from bench.slurm_cluster import SlurmCluster, missing

    why = missing()
    if why:
        pytest.skip(why)
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real Ray cluster (a head and a worker node on this host) for the whole session."""
    pytest.importorskip("ray.job_submission")
    from tests.support.ray_cluster import RayCluster

    # a process that looks like another Ray on this host: stopping ours leaves it alone (it
    # outlives any session: killed below; a 15-minute sleep ended by itself in a slow run)
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(86400)", "raylet", "--gcs-address=x:1"]
    )
    try:
        # a short folder: Ray's AF_UNIX sockets live under it (107 bytes at most), and a
        # pytest worker's basetemp (.../pytest-N/popen-gw1/ray0/session_.../sockets/...)
        # is too long for them
        short = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        try:
            with RayCluster(short) as cluster:
                yield cluster
        finally:
            shutil.rmtree(short, ignore_errors=True)
        assert cluster.processes() == [], "the Ray cluster left processes behind"
        assert other.poll() is None, "stopping the test's Ray cluster stopped another process"
    finally:
        other.kill()
        other.wait()


def tensors(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 32, generator=g),
        "o": torch.randn(32, rows, generator=g).to(torch.bfloat16),
        "b": torch.randn(32, generator=g),
    }


def make_tp4(uri: str, scratch: str, sd: dict[str, torch.Tensor]) -> None:
    """A TP=4 checkpoint at ``uri`` holding ``sd``."""
    reshard_svc.save(sd, scratch)
    reshard_svc.convert(scratch, uri, mesh="tp=4", rules={"w": "S(0)", "o": "S(1)", "b": "R"})


def assert_holds(uri: str, sd: dict[str, torch.Tensor]) -> None:
    assert reshard_svc.verify(uri).ok
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, uri)
    for k in sd:
        assert torch.equal(out[k], sd[k]), k


@pytest.fixture
def k8s(tmp_path):
    """A stand-in Kubernetes API server with a local "kubelet" (see tests/k8s_standin.py)."""
    pytest.importorskip("kubernetes")
    pytest.importorskip("kubeflow_trainer_api")
    from tests.support.k8s_standin import StandInCluster

    with StandInCluster(tmp_path / "k8s") as cluster:
        yield cluster


def assert_reattaches(server, job_id: str, dst: str, outlives, engine: str) -> None:
    """``kill -9`` the server mid-job: the engine's job runs on (``outlives()``), and the
    restarted server re-attaches to it instead of launching it again."""
    server.kill9()
    time.sleep(1)
    assert outlives(), f"the {engine} job must outlive the server"
    server.start()  # same database: re-attach, do not launch again
    with server.client() as c:
        final = c.wait(job_id, timeout=240)
        assert final.state.value == "succeeded", (final.error, c.logs(job_id).text)
        assert final.attempts == 1
    assert reshard_svc.verify(dst).ok
