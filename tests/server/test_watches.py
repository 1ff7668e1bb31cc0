"""``reshard watch``: a real server converts each newly committed step of a training root
(torch DCP ``step-N`` folders, the CheckpointManager's) once, never a half-written one,
none missed across a kill -9 and restart; ``reshard watches`` / ``unwatch``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import reshard_svc
from reshard_server.watches import committed_steps
from reshard_svc import CheckpointManager
from tests.server.conftest import TOKEN, cli

SCAN = "0.3"  # RESHARD_WATCH_INTERVAL_S of the test servers


def weights(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


def dcp_step(root: Path, step: int) -> None:
    dcp.save(weights(step), checkpoint_id=str(root / f"step-{step}"), no_dist=True)


def hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """An HF export's tensors, read as transformers does: through its index."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    return {k: v for f in files for k, v in load_file(str(folder / f)).items()}


def until(what, timeout: float = 120.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (got := what()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what.__doc__ or what}")
        time.sleep(every)
    return got


def submitted(client, watch_id: str) -> dict[int, str]:
    """step -> job id of what the watch submitted."""
    return {s.step: s.job_id for s in client.get_watch(watch_id).steps if s.outcome == "submitted"}


@pytest.mark.slow
def test_each_committed_step_becomes_one_job_across_a_server_restart(make_server, tmp_path):
    data = tmp_path / "data"
    server = make_server(watch_interval_s=SCAN, env={"RESHARD_ALLOW_DCP_PICKLE": "1"})
    client = server.client()
    titan, run = data / "titan", data / "run"
    dcp_step(titan, 2)  # committed before the watch: left alone
    r = cli(
        server,
        "watch",
        str(titan),
        "--every",
        "2",
        "--format",
        "hf",
        "--to",
        str(data / "hf-{step}"),
    )
    assert r.returncode == 0, r.stderr
    assert "1 step(s) already committed are left alone" in r.stdout
    dcp_watch = r.stdout.split()[0]
    with CheckpointManager(str(run), async_save=False) as mgr:
        mgr.save(1, weights(1))
    ours = client.watch(
        {
            "root": str(run),
            "target": str(data / "tp2-{step}"),
            "every": 2,
            "mesh": {"tp": 2},
            "rules": {"*": "S(0)"},
        }
    ).id

    dcp_step(titan, 3)  # not a multiple of 2
    dcp_step(titan, 4)
    (titan / "step-6").mkdir()  # half-written: data, no .metadata yet
    (titan / "step-6" / "__0_0.distcp").write_bytes(b"partial")
    with CheckpointManager(str(run), async_save=False) as mgr:
        mgr.save(2, weights(2))
    until(lambda: 4 in submitted(client, dcp_watch) and 2 in submitted(client, ours))
    time.sleep(3 * float(SCAN))  # a few more scans: the half-written step stays alone
    assert sorted(submitted(client, dcp_watch)) == [4]

    server.kill9()  # steps commit while no server runs
    dcp_step(titan, 6)
    with CheckpointManager(str(run), async_save=False) as mgr:
        mgr.save(4, weights(4))
    server.start()
    until(lambda: 6 in submitted(client, dcp_watch) and 4 in submitted(client, ours))

    jobs = {
        **{("hf", s): j for s, j in submitted(client, dcp_watch).items()},
        **{("tp2", s): j for s, j in submitted(client, ours).items()},
    }
    assert sorted(jobs) == [("hf", 4), ("hf", 6), ("tp2", 2), ("tp2", 4)]
    assert client.list().total == 4  # none twice, though the server died mid-way
    for (kind, step), job_id in jobs.items():
        job = client.wait(job_id, timeout=300)
        assert job.state.value == "succeeded", (kind, step, job.error)
        want = weights(step)
        if kind == "hf":
            got = hf_weights(data / f"hf-{step}")
        else:
            got = {k: torch.zeros_like(v) for k, v in want.items()}
            reshard_svc.load(got, str(data / f"tp2-{step}"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    r = cli(server, "watches", "--json")
    assert r.returncode == 0, r.stderr
    listed = {w["id"]: w for w in json.loads(r.stdout)["items"]}
    assert set(listed) == {dcp_watch, ours} and listed[dcp_watch]["submitted"] == 2
    assert cli(server, "watches").returncode == 0
    r = cli(server, "unwatch", dcp_watch)
    assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
    dcp_step(titan, 8)
    time.sleep(4 * float(SCAN))
    assert sorted(submitted(client, dcp_watch)) == [4, 6]  # a stopped watch submits nothing
    assert client.list().total == 4
    r = cli(server, "watches", "--json")
    assert [w["id"] for w in json.loads(r.stdout)["items"]] == [ours]
    r = cli(server, "watches", "--all", "--json")
    assert {w["id"]: w["state"] for w in json.loads(r.stdout)["items"]}[dcp_watch] == "stopped"


def test_bad_watches_are_refused_naming_what_to_fix(make_server, tmp_path):
    """Without running a job: the server's queue takes none (RESHARD_MAX_QUEUED=0), so a
    committed step waits unrecorded for a later scan."""
    data = tmp_path / "data"
    server = make_server(watch_interval_s=SCAN, max_queued="0")
    run = data / "run"
    run.mkdir()
    cases = [  # straight to the API, as a hostile client would send them
        ({"target": str(data / "hf")}, 422, "must hold {step}"),
        ({"target": str(data / "hf-{step}-{step.__class__}")}, 422, "no placeholder but {step}"),
        ({"target": str(tmp_path / "elsewhere-{step}")}, 403, "outside the allowed roots"),
        ({"target": str(run / "step-{step}")}, 422, "into the watched root"),
        ({"target": str(data / "x-{step}"), "every": 0}, 422, "every"),
        ({"target": str(data / "x-{step}"), "dtype": "int8"}, 422, "dtype"),
        ({"target": str(data / "x-{step}"), "root": str(tmp_path)}, 403, "outside the allowed"),
        ({"target": str(data / "x-{step}"), "root": "data/run"}, 422, "relative path"),
    ]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for body, code, says in cases:
        r = httpx.post(f"{server.url}/v1/watches", json={"root": str(run), **body}, headers=headers)
        assert r.status_code == code and says in r.text, (body, r.status_code, r.text)
    assert httpx.post(f"{server.url}/v1/watches", json={"root": str(run)}).status_code == 401
    r = cli(server, "watch", str(run), "--to", str(data / "hf"))  # the CLI checks it first
    assert r.returncode == 2 and "must hold {step}" in r.stderr and "Traceback" not in r.stderr
    r = cli(server, "watch", str(tmp_path), "--to", str(data / "x-{step}"))
    assert r.returncode == 2 and "outside the allowed roots" in r.stderr
    r = cli(server, "watch", str(run), "--to", str(data / "x-{step}"), "--json")
    assert r.returncode == 0, r.stderr
    watch_id = json.loads(r.stdout)["id"]
    r = cli(server, "watch", str(run), "--to", str(data / "x-{step}"))
    assert r.returncode == 2 and f"reshard unwatch {watch_id}" in r.stderr  # 409
    r = cli(server, "unwatch", "nope")
    assert r.returncode == 2 and "no watch 'nope'" in r.stderr

    client = server.client()
    with CheckpointManager(str(run), async_save=False) as mgr:
        mgr.save(5, weights(5))
    time.sleep(4 * float(SCAN))
    watch = client.get_watch(watch_id)
    assert watch.steps == [] and watch.last_scan_at is not None  # the queue was full
    assert client.list().total == 0


def test_committed_steps_of_each_writer(tmp_path):
    """The names and commit files of reshard, torch DCP and torch_checkpointing steps."""
    root = tmp_path / "root"
    marks = {
        "step-0000000010": "reshard.index.json",
        "step_20": "metadata.pkl",
        "iter_0000030": ".metadata",
        "global_step_40": ".metadata",
        "checkpoint-50": "reshard.index.json",
        "step-60": None,
        "step-70": "data.bin",
        "notes": "reshard.index.json",
        ".step-80.staging-x": "reshard.index.json",
        "step-90": ".metadata",
        "step_90": ".metadata",
    }
    for name, marker in marks.items():
        (root / name).mkdir(parents=True)
        if marker:
            (root / name / marker).write_bytes(b"{}")
    got = committed_steps(str(root))
    assert got == {
        s: f"{root}/{n}"
        for s, n in (
            (10, "step-0000000010"),
            (20, "step_20"),
            (30, "iter_0000030"),
            (40, "global_step_40"),
            (50, "checkpoint-50"),
        )
    }
    assert sorted(committed_steps(str(root), skip={10}, every=20)) == [20, 40]


@pytest.mark.parametrize("template", ["/x/{step}/{step}", "s3://b/hf-{step}"])
def test_a_template_may_repeat_step_or_be_remote(template):
    from reshard_server.schemas import WatchCreate

    spec = WatchCreate(root="/r", target=template)
    assert spec.target_for(12) == template.replace("{step}", "12")


def test_a_crash_between_submitting_and_recording_a_step_makes_no_second_job(tmp_path):
    """The server dies after a step's job is stored but before the step is recorded: the
    next scan finds the same job by its idempotency key."""
    from reshard_server.admission import admit
    from reshard_server.auth import ADMIN, Principal
    from reshard_server.config import Settings
    from reshard_server.db import JobStore
    from reshard_server.schemas import WatchCreate
    from reshard_server.watches import Watcher

    root = tmp_path / "run"
    settings = Settings(roots=[str(tmp_path)], db=str(tmp_path / "jobs.db"))
    store = JobStore(settings.db)
    spec = WatchCreate(root=str(root), target=str(tmp_path / "out-{step}"))
    watch = store.create_watch(spec.model_dump(mode="json", exclude_none=True), {})
    admin = Principal(name=ADMIN, scopes=frozenset({ADMIN}))
    watcher = Watcher(
        settings, store, lambda job, key, owner: admit(job, settings, store, 1, key, admin)[0]
    )
    with CheckpointManager(str(root), async_save=False) as mgr:
        mgr.save(3, weights(3))
    real = store.record_step

    def crash(*args, **kwargs):
        raise SystemExit("killed")

    store.record_step = crash
    with pytest.raises(SystemExit):
        watcher.scan(watch)
    store.record_step = real
    watcher.scan(watch)
    watcher.scan(watch)
    jobs, total = store.list(None, 10, 0)
    assert total == 1 and jobs[0].spec["source"] == f"{root}/step-0000000003"
    assert [(s.step, s.job_id) for s in store.watch_steps(watch.id)] == [(3, jobs[0].id)]
    store.close()


def test_readme_watch_lines(make_server, tmp_path):
    import os
    import re
    import subprocess
    import sys

    from tests.support.docs import block

    data = tmp_path / "data"
    lines = [
        re.sub(r"\[([^\]]+)\]", r"\1", line.split("  #")[0].strip())
        .replace("/data/", f"{data}/")
        .replace("WATCH_ID", "$WATCH_ID")
        for line in block("watch", "bash").strip().splitlines()
    ]
    server = make_server(watch_interval_s=SCAN)
    env = {
        **os.environ,
        "RESHARD_URL": server.url,
        "RESHARD_TOKEN": TOKEN,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }

    def bash(script: str) -> str:
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and "Traceback" not in r.stderr, (script, r.stdout, r.stderr)
        return r.stdout

    with CheckpointManager(str(data / "run"), async_save=False) as mgr:
        mgr.save(500, weights(500))  # committed before: left alone
    watch_id = bash(lines[0]).split()[0]
    with CheckpointManager(str(data / "run"), async_save=False) as mgr:
        mgr.save(1000, weights(1000))
    client = server.client()
    job_id = until(lambda: submitted(client, watch_id).get(1000))
    assert client.wait(job_id, timeout=300).state.value == "succeeded"
    got = hf_weights(data / "exports" / "hf-1000")
    want = {k: v.to(torch.bfloat16) for k, v in weights(1000).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    listing = bash(lines[1] + "\n" + lines[1].replace(" --all --json", ""))
    assert watch_id in listing
    assert watch_id in bash(f"WATCH_ID={watch_id}\n{lines[2]}")
    assert client.get_watch(watch_id).state == "stopped"
    assert sorted(submitted(client, watch_id)) == [1000]
