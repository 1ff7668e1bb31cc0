"""RESHARD_LAUNCHER=kubernetes, in two layers (no API server can run here):

1. the TrainJobs the launcher writes are validated against the Kubeflow Trainer API
   schema (tests/k8s_schema.py);
2. the server drives the real ``kubernetes`` client against a stand-in API server whose
   "kubelet" runs one local torchrun per node with the Trainer's ``PET_*`` env
   (tests/k8s_standin.py): a 2-node conversion, a cancel, an OOM-killed node.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path

import pytest

from reshard_server.config import Settings
from reshard_server.launchers import Launch
from reshard_server.launchers.kubernetes import trainjob_body
from reshard_svc.jobs.argv import from_argv
from reshard_svc.jobs.spec import ConvertSpec
from tests.server.conftest import assert_holds, make_tp4, tensors
from tests.support.k8s_schema import TrainJobInvalid, validate_trainjob

pytest.importorskip("kubeflow_trainer_api")


def launch(**spec) -> Launch:
    body = {"source": "s3://bkt/a", "target": "s3://bkt/b", "mesh": {"tp": 8}, **spec}
    env = {
        "RESHARD_CALLBACK_URL": "http://reshard:8000/v1/jobs/j1/events",
        "RESHARD_CALLBACK_TOKEN": "tok",
        "RESHARD_TOKEN": "admin",
    }
    return Launch(
        job_id="j1",
        attempt=2,
        spec=ConvertSpec.from_json(body),
        env=env,
        log_path=Path("/nonexistent"),
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"k8s_image": "ghcr.io/x/reshard:1"},
        {
            "k8s_image": "img",
            "k8s_gpus_per_node": 8,
            "k8s_service_account": "reshard-worker",
            "k8s_storage_secret": "s3-creds",
        },
    ],
)
def test_trainjob_matches_the_trainer_schema(settings):
    body = trainjob_body(launch(nodes=4, workers_per_node=8), Settings(**settings), "ml")
    validate_trainjob(body)
    trainer = body["spec"]["trainer"]
    assert body["metadata"]["name"] == "reshard-j1-2"  # deterministic: job id + attempt
    assert trainer["numNodes"] == 4 and trainer["numProcPerNode"] == 8
    assert trainer["command"][:3] == ["torchrun", "-m", "reshard_svc.worker"]
    assert from_argv(trainer["command"][3:], 4, 8) == launch(nodes=4, workers_per_node=8).spec
    env = {e["name"]: e for e in trainer["env"]}
    assert len(env) == len(trainer["env"])  # each variable once
    assert env["RESHARD_JOB_ID"]["value"] == "j1"
    assert "RESHARD_TOKEN" not in env  # never the admin token
    assert env["RESHARD_CALLBACK_TOKEN"]["value"] == "tok"
    if settings.get("k8s_storage_secret"):
        ref = env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "s3-creds"


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "trainer", "numNodes"), "2"),
        (("spec", "trainer", "nodes"), 2),
        (("spec", "runtimeRef"), None),
        (("spec", "trainer", "env", 0), {"value": "no name"}),
    ],
)
def test_schema_refuses_broken_trainjobs(path, value):
    body = copy.deepcopy(trainjob_body(launch(), Settings(k8s_image="img"), "ml"))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(TrainJobInvalid):
        validate_trainjob(body)


def test_deploy_manifests_are_valid_kubernetes():
    kv = pytest.importorskip("kubernetes_validate")
    import yaml

    folder = Path(__file__).parents[2] / "deploy" / "kubernetes"
    kinds = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kv.validate(doc, "1.31", strict=True)
            kinds.append(doc["kind"])
            if doc["kind"] == "Role":  # least privilege: trainjobs, pods and their logs
                resources = {r for rule in doc["rules"] for r in rule["resources"]}
                assert resources == {"trainjobs", "pods", "pods/log"}, resources
    for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding"):
        assert kind in kinds, kind


def k8s_server(make_server, k8s, tmp_path, **settings):
    return make_server(
        env={"KUBECONFIG": str(k8s.kubeconfig)},
        launcher="kubernetes",
        k8s_image="reshard-svc:test",
        k8s_namespace="ml",
        **settings,
    )


@pytest.mark.distributed
@pytest.mark.kubernetes
def test_two_node_trainjob_converts(make_server, k8s, tmp_path):
    sd = tensors(4, rows=96)
    data = tmp_path / "data"
    make_tp4(str(data / "tp4"), str(tmp_path / "scratch"), sd)
    server = k8s_server(make_server, k8s, tmp_path)
    with server.client() as c:
        job = c.submit(
            {
                "source": str(data / "tp4"),
                "target": str(data / "out"),
                "mesh": {"tp": 2},
                "nodes": 2,
                "workers_per_node": 1,
            }
        )
        done = c.wait(job.id, timeout=240)
        logs = c.logs(job.id).text
        assert done.state.value == "succeeded", (done.error, logs)
        assert done.handle == {"name": f"reshard-{job.id}-1", "namespace": "ml"}
        assert done.progress.bytes_done == done.progress.bytes_total > 0  # via the callback
        assert f"==> pod reshard-{job.id}-1-node-0-1 <==" in logs
    assert ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs") in k8s.requests
    assert_holds(str(data / "out"), sd)


def running_job(server, k8s, tmp_path, name):
    from tests.server.test_jobs import slow_job

    job_id, dst = slow_job(server, tmp_path, name, nodes=2)
    job = k8s.jobs[("ml", f"reshard-{job_id}-1")]
    return job_id, dst, job


@pytest.mark.distributed
@pytest.mark.kubernetes
def test_cancel_deletes_the_trainjob_and_stops_its_nodes(make_server, k8s, tmp_path):
    server = k8s_server(make_server, k8s, tmp_path)
    job_id, dst, trainjob = running_job(server, k8s, tmp_path, "cancel")
    with server.client() as c:
        c.cancel(job_id)
        final = c.wait(job_id, timeout=60)
    assert final.state.value == "cancelled", final.error
    assert (
        "DELETE",
        f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/ml/trainjobs/reshard-{job_id}-1",
    ) in k8s.requests
    assert all(n.proc.poll() is not None for n in trainjob.nodes)
    # Foreground deletion: the object goes once its pods are reaped, a moment after they
    # exit (the stand-in's reaper thread), as on a real API server.
    deadline = time.monotonic() + 10
    while ("ml", f"reshard-{job_id}-1") in k8s.jobs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ("ml", f"reshard-{job_id}-1") not in k8s.jobs
    time.sleep(1)
    assert not os.path.exists(os.path.join(dst, "reshard.index.json"))


@pytest.mark.distributed
@pytest.mark.kubernetes
def test_oom_killed_node_fails_the_job_with_the_engine_reason(make_server, k8s, tmp_path):
    server = k8s_server(make_server, k8s, tmp_path)
    job_id, dst, trainjob = running_job(server, k8s, tmp_path, "oom")
    os.killpg(trainjob.nodes[1].proc.pid, signal.SIGKILL)  # what the OOM killer does
    with server.client() as c:
        final = c.wait(job_id, timeout=120)
    assert final.state.value == "failed"
    assert "OOMKilled" in final.error, final.error
    assert not os.path.exists(os.path.join(dst, "reshard.index.json"))


@pytest.mark.distributed
@pytest.mark.kubernetes
def test_readme_trainjob_is_valid_and_runs(k8s, tmp_path):
    """The README's own TrainJob: valid against the Trainer schema, and it converts when
    applied (on the stand-in, with the example URIs pointed at local folders)."""
    import yaml
    from kubernetes import client, config

    from tests.server.test_slurm import readme_block

    body = yaml.safe_load(readme_block("trainjob-direct"))
    validate_trainjob(body)
    sd = tensors(6)
    src, dst = tmp_path / "tp4", tmp_path / "tp4-again"
    make_tp4(str(src), str(tmp_path / "scratch"), sd)
    command = body["spec"]["trainer"]["command"]
    body["spec"]["trainer"]["command"] = [
        {"s3://checkpoints/llama-tp8": str(src), "s3://checkpoints/llama-tp4": str(dst)}.get(a, a)
        for a in command
    ]
    body["spec"]["trainer"]["numProcPerNode"] = 1  # two cores here, not 8 GPUs ...
    body["spec"]["trainer"].pop("resourcesPerNode")  # ... which the stand-in's node lacks
    api = client.CustomObjectsApi(config.new_client_from_config(str(k8s.kubeconfig)))
    api.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", "ml", "trainjobs", body)
    deadline = time.monotonic() + 240
    while True:
        obj = api.get_namespaced_custom_object(
            "trainer.kubeflow.org", "v1alpha1", "ml", "trainjobs", "reshard-llama-tp4"
        )
        kinds = {c["type"] for c in obj["status"]["conditions"]}
        if kinds & {"Complete", "Failed"}:
            break
        assert time.monotonic() < deadline
        time.sleep(0.5)
    logs = [n.log.read_text()[-2000:] for n in k8s.jobs[("ml", "reshard-llama-tp4")].nodes]
    assert "Complete" in kinds, logs
    assert_holds(str(dst), sd)
