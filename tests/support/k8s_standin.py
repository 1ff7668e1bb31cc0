"""A stand-in Kubernetes API server for the Kubernetes launcher's tests.

No real API server can run on these machines, so this serves — over HTTP on a loopback
port, to the real ``kubernetes`` client — exactly the routes the launcher uses:

- ``POST/GET/DELETE /apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs[/{name}]``
  (a create is validated against the Kubeflow Trainer API schema, 422 otherwise);
- ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` and ``.../pods/{name}/log``.

Its "kubelet" plays the Trainer's ``torch-distributed`` runtime: for a TrainJob it starts
one local process per node running the trainer's ``command`` with the env the Trainer
injects (``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT``), labels its pods the way JobSet does, sets ``Complete``/``Failed``
conditions from the exit codes (a SIGKILLed container reports ``OOMKilled``, as the kubelet
does after an OOM kill), and deletes with foreground propagation: SIGTERM, a grace period,
SIGKILL, and the object disappears once its pods are gone. Its one node has no GPUs: a
TrainJob asking for ``nvidia.com/gpu`` gets pods the scheduler leaves ``Pending``
(``PodScheduled=False``, reason ``Unschedulable``), as a real scheduler does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.support.harness import free_port
from tests.support.k8s_schema import TrainJobInvalid, validate_trainjob

__all__ = ["StandInCluster"]

GROUP_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/{ns}/trainjobs"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> JSONResponse:
    body = {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
    return JSONResponse(body, status_code=code)


class Node:
    """One TrainJob node: a pod backed by a local process group."""

    def __init__(
        self,
        job: TrainJob,
        rank: int,
        cmd: list[str],
        env: dict[str, str],
        unschedulable: str | None = None,
    ) -> None:
        self.name = f"{job.name}-node-0-{rank}"
        self.log = job.cluster.root / f"{job.namespace}-{self.name}.log"
        self.killed_by_delete = False
        self.unschedulable = unschedulable  # the scheduler's message: never started
        self.proc: subprocess.Popen[bytes] | None = None
        if unschedulable is None:
            with open(self.log, "wb") as out:
                self.proc = subprocess.Popen(
                    cmd,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def terminated(self) -> dict[str, Any] | None:
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0:
            reason = "OOMKilled" if rc == -signal.SIGKILL and not self.killed_by_delete else "Error"
            return {"exitCode": 128 - rc, "reason": reason, "signal": -rc}
        return {"exitCode": rc, "reason": "Completed" if rc == 0 else "Error"}


class TrainJob:
    def __init__(self, cluster: StandInCluster, body: dict[str, Any]) -> None:
        self.cluster = cluster
        self.body = body
        meta = body["metadata"]
        self.name, self.namespace = meta["name"], meta["namespace"]
        meta.update(uid=f"uid-{self.name}", creationTimestamp=_now(), resourceVersion="1")
        trainer = body["spec"].get("trainer", {})
        nnodes = int(trainer.get("numNodes", 1))
        nproc = str(trainer.get("numProcPerNode", 1))
        port = str(free_port())
        base = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        for e in trainer.get("env", []):
            if "value" in e:
                base[e["name"]] = e["value"]
            elif "valueFrom" in e:  # secretKeyRef: from the stand-in's Secrets
                ref = e["valueFrom"]["secretKeyRef"]
                value = cluster.secrets.get(ref["name"], {}).get(ref["key"])
                if value is not None:
                    base[e["name"]] = value
        gpus = int(trainer.get("resourcesPerNode", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        unschedulable = (
            "0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes "
            "are available: 1 No preemption victims found for incoming pod."
            if gpus > cluster.gpus_per_node
            else None
        )
        self.nodes = [
            Node(
                self,
                rank,
                list(trainer["command"]),
                {
                    **base,
                    "PET_NNODES": str(nnodes),
                    "PET_NPROC_PER_NODE": nproc,
                    "PET_NODE_RANK": str(rank),
                    "PET_MASTER_ADDR": "127.0.0.1",
                    "PET_MASTER_PORT": port,
                },
                unschedulable,
            )
            for rank in range(nnodes)
        ]
        self.deleting = False

    def conditions(self) -> list[dict[str, Any]]:
        ends = [n.terminated() for n in self.nodes]
        failed = [(n, t) for n, t in zip(self.nodes, ends) if t and t["exitCode"] != 0]
        if failed:  # the JobSet failure policy: one failed node fails the job
            for n in self.nodes:
                if n.terminated() is None:
                    n.signal(signal.SIGKILL)
                    n.killed_by_delete = True
            pod, t = failed[0]
            return [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "JobSetFailed",
                    "message": f"jobset failed: pod {pod.name} {t['reason']}",
                    "lastTransitionTime": _now(),
                }
            ]
        if all(t is not None for t in ends):
            return [
                {
                    "type": "Complete",
                    "status": "True",
                    "reason": "JobSetCompleted",
                    "message": "TrainJob is completed",
                    "lastTransitionTime": _now(),
                }
            ]
        return [
            {
                "type": "Created",
                "status": "True",
                "reason": "JobsCreationSucceeded",
                "message": "TrainJob is created",
                "lastTransitionTime": _now(),
            }
        ]

    def view(self) -> dict[str, Any]:
        out = {**self.body, "status": {"conditions": self.conditions()}}
        if self.deleting:
            out["metadata"] = {**self.body["metadata"], "deletionTimestamp": _now()}
        return out

    def pod(self, node: Node) -> dict[str, Any]:
        t = node.terminated()
        phase = "Running" if t is None else ("Succeeded" if t["exitCode"] == 0 else "Failed")
        state = {"running": {"startedAt": _now()}} if t is None else {"terminated": t}
        image = self.body["spec"]["trainer"].get("image", "")
        labels = {
            "jobset.sigs.k8s.io/jobset-name": self.name,
            "jobset.sigs.k8s.io/replicatedjob-name": "node",
            "trainer.kubeflow.org/trainjob-name": self.name,
        }
        if node.unschedulable is not None:
            return {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": node.name, "namespace": self.namespace, "labels": labels},
                "spec": {"containers": [{"name": "node", "image": image}]},
                "status": {
                    "phase": "Pending",
                    "conditions": [
                        {
                            "type": "PodScheduled",
                            "status": "False",
                            "reason": "Unschedulable",
                            "message": node.unschedulable,
                            "lastTransitionTime": _now(),
                        }
                    ],
                },
            }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": node.name, "namespace": self.namespace, "labels": labels},
            "spec": {"containers": [{"name": "node", "image": image}]},
            "status": {
                "phase": phase,
                "containerStatuses": [
                    {
                        "name": "node",
                        "image": image,
                        "imageID": "",
                        "ready": t is None,
                        "restartCount": 0,
                        "state": state,
                    }
                ],
            },
        }

    def delete(self, grace_s: float) -> None:
        """Foreground deletion: the object goes once every pod has stopped."""
        self.deleting = True
        for n in self.nodes:
            n.killed_by_delete = True
            n.signal(signal.SIGTERM)

        def reap() -> None:
            deadline = time.monotonic() + grace_s
            procs = [n.proc for n in self.nodes if n.proc is not None]
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.1)
            for n in self.nodes:
                n.signal(signal.SIGKILL)
            for p in procs:
                p.wait()
            self.cluster.jobs.pop((self.namespace, self.name), None)

        threading.Thread(target=reap, daemon=True).start()


class StandInCluster:
    """``with StandInCluster(tmp) as k:`` — ``k.kubeconfig`` points the client at it."""

    def __init__(self, root: Path, token: str = "standin-token", grace_s: float = 5.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.grace_s = grace_s
        self.gpus_per_node = 0
        self.jobs: dict[tuple[str, str], TrainJob] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.requests: list[tuple[str, str]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kubeconfig = self.root / "kubeconfig"
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: standin\n"
            f"clusters:\n- name: standin\n  cluster:\n    server: {self.url}\n"
            f"users:\n- name: reshard\n  user:\n    token: {token}\n"
            "contexts:\n- name: standin\n  context:\n    cluster: standin\n    user: reshard\n"
        )
        self._server = uvicorn.Server(
            uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> StandInCluster:
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("stand-in API server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        for job in list(self.jobs.values()):
            for n in job.nodes:
                n.signal(signal.SIGKILL)
        self._server.should_exit = True
        self._thread.join(10)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            self.requests.append((request.method, request.url.path))
            if request.headers.get("authorization") != f"Bearer {self.token}":
                return _status(401, "Unauthorized", "Unauthorized")
            return await call_next(request)

        @app.post(GROUP_PATH)
        async def create(ns: str, request: Request) -> Any:
            body = await request.json()
            try:
                validate_trainjob(body)
            except TrainJobInvalid as e:
                return _status(422, "Invalid", f"TrainJob is invalid: {e}")
            name = body["metadata"]["name"]
            if body["metadata"].get("namespace", ns) != ns:
                return _status(400, "BadRequest", "namespace does not match the path")
            if (ns, name) in self.jobs:
                return _status(409, "AlreadyExists", f'trainjobs "{name}" already exists')
            self.jobs[(ns, name)] = job = TrainJob(self, body)
            return JSONResponse(job.view(), status_code=201)

        @app.get(GROUP_PATH + "/{name}")
        def get(ns: str, name: str) -> Any:
            job = self.jobs.get((ns, name))
            if job is None:
                return _status(404, "NotFound", f'trainjobs "{name}" not found')
            return job.view()

        @app.delete(GROUP_PATH + "/{name}")
        async def delete(ns: str, name: str, request: Request) -> Any:
            job = self.jobs.get((ns, name))
            if job is None:
                return _status(404, "NotFound", f'trainjobs "{name}" not found')
            opts = await request.json() if await request.body() else {}
            if opts.get("propagationPolicy") != "Foreground":
                return _status(400, "BadRequest", "the launcher must delete in the foreground")
            grace = opts.get("gracePeriodSeconds")
            job.delete(self.grace_s if grace is None else float(grace))
            return job.view()

        @app.get("/api/v1/namespaces/{ns}/pods")
        def pods(ns: str, labelSelector: str = "") -> Any:  # noqa: N803 - the API's name
            want = dict(kv.split("=", 1) for kv in labelSelector.split(",") if kv)
            items = [
                job.pod(node)
                for (jns, _), job in list(self.jobs.items())
                if jns == ns
                for node in job.nodes
                if all(job.pod(node)["metadata"]["labels"].get(k) == v for k, v in want.items())
            ]
            return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}

        @app.get("/api/v1/namespaces/{ns}/pods/{name}/log")
        def log(ns: str, name: str) -> Any:
            for (jns, _), job in list(self.jobs.items()):
                for node in job.nodes:
                    if jns == ns and node.name == name:
                        return PlainTextResponse(node.log.read_text(errors="replace"))
            return _status(404, "NotFound", f'pods "{name}" not found')

        return app
