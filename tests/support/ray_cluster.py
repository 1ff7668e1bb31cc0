"""A real Ray cluster on this host for the Ray launcher's tests: a head (with the dashboard
and its job API) and one more worker node, each with its own CPU count, started with
Ray's own ``ray start``. Stopping it stops only its own processes (``ray stop`` would stop
every Ray on the host, another user's or another test run's included)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from reshard_svc._process import free_port

RAY = str(Path(sys.executable).with_name("ray"))


class RayCluster:
    def __init__(self, tmp: Path, cpus_per_node: int = 2) -> None:
        self.tmp, self.cpus = tmp, cpus_per_node
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs = ""

    def _ray(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        # the nodes' entrypoints and workers find this venv's python first, as on a cluster
        # whose nodes have reshard-svc installed
        path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PATH": path}
        return subprocess.run(
            [RAY, *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
        )

    def __enter__(self) -> RayCluster:
        head = self._ray(
            "start",
            "--head",
            f"--port={self.port}",
            f"--dashboard-port={self.dashboard_port}",
            "--dashboard-host=127.0.0.1",
            "--include-dashboard=true",
            f"--num-cpus={self.cpus}",
            f"--temp-dir={self.tmp}",
            "--disable-usage-stats",
        )
        if head.returncode != 0:
            self.stop()  # what a half-started head left (its GCS, dashboard, monitor)
            raise RuntimeError(f"ray start --head failed: {head.stderr[-2000:]}")
        m = re.search(r"--address='([^']+)'", head.stdout + head.stderr)
        self.gcs = m.group(1) if m else f"127.0.0.1:{self.port}"
        node = self._ray(
            "start", f"--address={self.gcs}", f"--num-cpus={self.cpus}", "--disable-usage-stats"
        )
        if node.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start --address failed: {node.stderr[-2000:]}")
        self._wait_for(2)
        return self

    def _wait_for(self, nodes: int) -> None:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + 90
        while True:
            status = self._ray("status", f"--address={self.gcs}", timeout=60).stdout
            active = status.split("Active:", 1)[-1].split("Pending:", 1)[0]
            if active.count("node_") >= nodes:
                try:
                    JobSubmissionClient(self.address).list_jobs()
                    return
                except Exception:  # the dashboard comes up a little later
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not come up: {status[-2000:]}")
            time.sleep(1)

    def jobs(self) -> dict[str, str]:
        """Every Ray job's submission id and status."""
        from ray.job_submission import JobSubmissionClient

        return {
            j.submission_id: str(j.status.value)
            for j in JobSubmissionClient(self.address).list_jobs()
            if j.submission_id
        }

    def placement_groups(self) -> list[dict[str, Any]]:
        """Placement groups not removed."""
        out = self._ray("list", "placement-groups", f"--address={self.gcs}", "--format=json").stdout
        import json

        try:
            groups = json.loads(out)
        except ValueError:
            return []
        return [g for g in groups if g.get("state") != "REMOVED"]

    def processes(self) -> list[Any]:
        """This cluster's processes: those whose command line names its temp folder or its
        GCS address (its GCS, raylets, dashboard and agents), and everything under them
        (workers, a job's torchrun)."""
        import psutil

        marks = [str(self.tmp), f"127.0.0.1:{self.port}"]
        if self.gcs:
            marks.append(self.gcs)
        found: dict[int, Any] = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                line = " ".join(p.info["cmdline"] or ())
                if any(m in line for m in marks):
                    found[p.pid] = p
                    found.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                continue
        found.pop(os.getpid(), None)
        return list(found.values())

    def stop(self) -> None:
        """SIGTERM to this cluster's processes, SIGKILL to what is left after 15 s."""
        import psutil

        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)

    def __exit__(self, *exc: Any) -> None:
        self.stop()
