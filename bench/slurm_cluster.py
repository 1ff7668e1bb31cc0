"""A real single-node Slurm cluster (munged, slurmctld, slurmd on 127.0.0.1) for the tests
and the benches.

Debian's ``slurm-wlm`` and ``munge`` packages (``.ci/run`` installs them when it runs as
root). Everything lives in one temporary folder: its own munge key and socket, its own
``slurm.conf`` (``SLURM_CONF`` points the client commands at it), state, spool and logs.
Run ``python bench/slurm_cluster.py`` to start one by hand and print its ``SLURM_CONF``; the
tests (``tests/server/conftest.py``) and ``bench/launchers.py`` start theirs with it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from reshard_svc._process import free_port

__all__ = ["SlurmCluster", "missing"]

DAEMONS = ("munged", "slurmctld", "slurmd")


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    if sys.platform != "linux":
        return "Slurm tests need Linux"
    if os.geteuid() != 0:
        return "Slurm tests need root (slurmd runs jobs as their submitter)"
    for exe in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol"):
        if shutil.which(exe) is None and not Path("/usr/sbin", exe).exists():
            return f"{exe} not found: apt-get install slurm-wlm munge"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """``with SlurmCluster(tmp) as c:`` — ``c.env`` carries ``SLURM_CONF``."""

    def __init__(self, root: Path, cpus: int | None = None) -> None:
        self.root = Path(root)
        self.cpus = cpus or max(os.cpu_count() or 1, 4)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge" / "munge.sock"
        host = socket.gethostname()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=reshard-test",
                    f"SlurmctldHost={host}(127.0.0.1)",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    f"SlurmctldPort={free_port()}",
                    f"SlurmdPort={free_port()}",
                    "AuthType=auth/munge",
                    f"AuthInfo=socket={sock}",
                    "CredType=cred/munge",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    "KillWait=5",
                    "MinJobAge=600",
                    "InactiveLimit=0",
                    f"NodeName={host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        self._spawn(
            [
                _exe("munged"),
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
            "munged",
        )
        self._wait(lambda: sock.exists(), timeout, "munged socket")
        self._spawn([_exe("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld")
        self._wait(self._ctld_up, timeout, "slurmctld")
        self._spawn([_exe("slurmd"), "-D", "-f", str(self.conf)], "slurmd")
        self._wait(self._node_idle, timeout, "slurmd (node idle)")

    def _spawn(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - closed with proc
        self._procs.append(
            subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        )
        log.close()

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, check=check, timeout=30
        )

    def _ctld_up(self) -> bool:
        return self.run("scontrol", "ping", check=False).stdout.count("UP") > 0

    def _node_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
        return out.startswith("idle")

    def _wait(self, ok: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited ({p.returncode}); logs in {self.root}")
            if ok():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} did not come up in {timeout} s; logs in {self.root / 'log'}")

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False) if self._procs else None
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self._procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()


if __name__ == "__main__":
    import tempfile

    why = missing()
    if why:
        sys.exit(why)
    with SlurmCluster(Path(tempfile.mkdtemp(prefix="slurm-"))) as cluster:
        print(f"export SLURM_CONF={cluster.conf}  # Ctrl-C stops the cluster")  # noqa: T201
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
