"""``RESHARD_LAUNCHER=kubernetes``: jobs as Kubeflow Trainer v2 ``TrainJob`` objects.

- **submit**: a ``trainer.kubeflow.org/v1alpha1`` TrainJob on the ``torch-distributed``
  ClusterTrainingRuntime (``RESHARD_K8S_RUNTIME``) with ``numNodes``, ``numProcPerNode``,
  ``resourcesPerNode``, image, command and env, created with the official ``kubernetes``
  client. The runtime starts one pod per node and injects ``PET_NNODES``,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``,
  which ``torchrun`` reads. Names are deterministic: ``reshard-<job id>-<attempt>``.
- Storage credentials come from the Secret ``RESHARD_K8S_STORAGE_SECRET`` (each of
  ``RESHARD_K8S_SECRET_KEYS``, optional), never from a request. The callback URL and this
  job's own callback token are plain env values: the token only lets its holder report
  this job's progress.
- **status**: the TrainJob's ``Complete``/``Failed`` conditions; exit reasons (such as
  ``OOMKilled``) from the node pods. **cancel**: delete with foreground propagation.
  **logs**: every node pod's log, node 0 first.

The client configures itself in-cluster (a ServiceAccount, see ``deploy/kubernetes``) or
from ``KUBECONFIG``.
"""

from __future__ import annotations

import logging
from typing import Any

from reshard_server.config import Settings
from reshard_server.launchers.base import EngineStatus, Handle, Launch, LauncherError
from reshard_svc.jobs.environment import WORKER_NAMES

__all__ = ["GROUP", "PLURAL", "VERSION", "KubernetesLauncher", "trainjob_body"]

logger = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
NODE_JOB = "node"  # the torch-distributed runtime's trainer replicated job
MANAGER = "reshard-server"
#: Container states that will not resolve by waiting (the image cannot be pulled or used).
_IMAGE_ERRORS = {"ImagePullBackOff", "ErrImagePull", "InvalidImageName", "ErrImageNeverPull"}
#: Worker env taken from the server's own settings (never its API token).
PASSED_ENV = ("RESHARD_ALLOW_DCP_PICKLE", "FSSPEC_S3", "LOGLEVEL")


def trainjob_body(launch: Launch, settings: Settings, namespace: str) -> dict[str, Any]:
    """The TrainJob for one attempt of a job (validated in the tests against the
    Kubeflow Trainer API schema)."""
    spec = launch.spec
    own = launch.environment()
    env: list[dict[str, Any]] = [
        {"name": name, "value": own[name]}
        for name in (*WORKER_NAMES, "PYTHONUNBUFFERED", "OMP_NUM_THREADS", *PASSED_ENV)
        if own.get(name)
    ]
    if settings.k8s_storage_secret:
        for key in settings.k8s_secret_keys:
            env.append(
                {
                    "name": key,
                    "valueFrom": {
                        "secretKeyRef": {
                            "name": settings.k8s_storage_secret,
                            "key": key,
                            "optional": True,
                        }
                    },
                }
            )
    trainer: dict[str, Any] = {
        "image": settings.k8s_image,
        "numNodes": spec.nodes,
        "numProcPerNode": spec.workers_per_node,
        "command": ["torchrun", *launch.worker_argv()],
        "env": env,
    }
    if settings.k8s_gpus_per_node:
        gpus = str(settings.k8s_gpus_per_node)
        trainer["resourcesPerNode"] = {
            "limits": {"nvidia.com/gpu": gpus},
            "requests": {"nvidia.com/gpu": gpus},
        }
    body: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": launch.name,
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": MANAGER,
                "reshard.dev/job-id": launch.job_id,
            },
        },
        "spec": {
            "runtimeRef": {
                "apiGroup": GROUP,
                "kind": "ClusterTrainingRuntime",
                "name": settings.k8s_runtime,
            },
            "trainer": trainer,
        },
    }
    if settings.k8s_service_account:
        pod_spec = {"serviceAccountName": settings.k8s_service_account}
        body["spec"]["runtimePatches"] = [
            {
                "manager": MANAGER,
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {
                                    "name": NODE_JOB,
                                    "template": {"spec": {"template": {"spec": pod_spec}}},
                                }
                            ]
                        }
                    }
                },
            }
        ]
    return body


class KubernetesLauncher:
    """Create, watch, delete TrainJobs and read their pods' logs."""

    name = "kubernetes"
    max_nodes = 1 << 16

    def __init__(self, settings: Settings, api_client: Any = None) -> None:
        from kubernetes import client, config

        if not settings.k8s_image:
            raise LauncherError("RESHARD_LAUNCHER=kubernetes needs RESHARD_K8S_IMAGE")
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.settings = settings
        self.namespace = settings.k8s_namespace
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self._client = client

    def _api(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, **kwargs)
        except ApiException as e:
            if e.status == 404:
                return None
            raise LauncherError(f"kubernetes {what}: {e.status} {e.reason}: {e.body}") from e

    def submit(self, launch: Launch) -> Handle:
        body = trainjob_body(launch, self.settings, self.namespace)
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.create_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, body
            )
        except ApiException as e:
            if e.status != 409:  # 409: this attempt was created before a restart
                raise LauncherError(f"creating TrainJob {launch.name}: {e.status} {e.body}") from e
        logger.info("job %s: TrainJob %s/%s", launch.job_id, self.namespace, launch.name)
        return {"name": launch.name, "namespace": self.namespace}

    def status(self, handle: Handle) -> EngineStatus:
        obj = self._api(
            "get TrainJob",
            self.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            handle["namespace"],
            PLURAL,
            handle["name"],
        )
        if obj is None:
            return EngineStatus("lost", f"TrainJob {handle['name']} no longer exists")
        conditions = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
        if conditions.get("Complete", {}).get("status") == "True":
            return EngineStatus("succeeded")
        failed = conditions.get("Failed", {})
        if failed.get("status") == "True":
            reason = failed.get("message") or failed.get("reason") or "TrainJob failed"
            pods = self._pod_exit_reasons(handle)
            return EngineStatus("failed", f"kubernetes: {reason}" + (f" ({pods})" if pods else ""))
        if conditions.get("Suspended", {}).get("status") == "True":
            return EngineStatus("pending", "Kubernetes: the TrainJob is suspended")
        return self._pending(handle) or EngineStatus("running")

    def _pending(self, handle: Handle) -> EngineStatus | None:
        """Pending while a node pod waits: the scheduler cannot place it (``Unschedulable``,
        which may resolve as the cluster frees or grows), or its image cannot be pulled
        (``ImagePullBackOff``, which will not by itself)."""
        for pod in self._pods(handle):
            status = pod.status
            if status is None or status.phase != "Pending":
                continue
            for c in status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False":
                    why = f"Kubernetes: {c.reason or 'Unschedulable'}"
                    return EngineStatus("pending", f"{why}: {c.message}" if c.message else why)
            for cs in status.container_statuses or []:
                waiting = cs.state and cs.state.waiting
                if waiting is not None and waiting.reason in _IMAGE_ERRORS:
                    text = f"Kubernetes: {waiting.reason}: {waiting.message or pod.metadata.name}"
                    return EngineStatus("pending", text, hopeless=True)
            return EngineStatus("pending", f"Kubernetes: pod {pod.metadata.name} is Pending")
        return None

    def _pods(self, handle: Handle) -> list[Any]:
        selector = f"{JOBSET_LABEL}={handle['name']},{REPLICATED_JOB_LABEL}={NODE_JOB}"
        pods = self._api(
            "list pods", self.core.list_namespaced_pod, handle["namespace"], label_selector=selector
        )
        items = list(pods.items) if pods is not None else []
        return sorted(items, key=lambda p: p.metadata.name)

    def _pod_exit_reasons(self, handle: Handle) -> str:
        out = []
        for pod in self._pods(handle):
            for cs in (pod.status and pod.status.container_statuses) or []:
                t = cs.state and cs.state.terminated
                if t is not None and (t.exit_code or 0) != 0:
                    out.append(
                        f"{pod.metadata.name}: {t.reason or 'Error'}, exit code {t.exit_code}"
                    )
        return "; ".join(out)

    def cancel(self, handle: Handle, force: bool = False) -> None:
        options = self._client.V1DeleteOptions(
            propagation_policy="Foreground", grace_period_seconds=0 if force else None
        )
        self._api(
            "delete TrainJob",
            self.custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            handle["namespace"],
            PLURAL,
            handle["name"],
            body=options,
        )

    def logs(self, handle: Handle, offset: int, limit: int) -> tuple[bytes, int]:
        parts = []
        for pod in self._pods(handle):
            text = self._api(
                "read pod log",
                self.core.read_namespaced_pod_log,
                pod.metadata.name,
                handle["namespace"],
            )
            parts.append(f"==> pod {pod.metadata.name} <==\n{text or ''}")
        data = "\n".join(parts).encode()
        return data[offset : offset + max(0, limit)], len(data)
