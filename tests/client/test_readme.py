"""The README's Python scripts run as written: "Checkpointing a training loop" (4 ranks,
then resumed at 2), "Live weight sync" (FSDP2 trainer and TP inference in one job) and its
sync session (versions, deltas)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.docs import block


def readme_code(marker: str) -> str:
    return block(marker, "python")


def torchrun(script: Path, nproc: int, **env: str) -> subprocess.CompletedProcess[str]:
    """Run a README script under torchrun on ``nproc`` gloo ranks; it must exit 0."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def training_loop_code() -> str:
    return readme_code("training-loop")


@pytest.mark.slow
@pytest.mark.distributed
def test_readme_training_loop_saves_and_resumes_at_another_size(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(training_loop_code())
    root = tmp_path / "ckpt"
    for nproc in (4, 2):
        torchrun(script, nproc, CKPT_DIR=str(root))
    # 20 steps at TP=4, then 20 more after resuming at TP=2; keep_last=2
    assert sorted(os.listdir(root)) == ["step-0000000030", "step-0000000040"]
    index = json.loads((root / "step-0000000040" / "reshard.index.json").read_text())
    assert index["extras"]["checkpoint_manager.step"] == 40
    assert index["tensors"]["model.0.weight"]["layout"]["mesh"]["shape"] == [2]
    assert {"rank_local.0.rng", "rank_local.1.rng"} <= set(index["tensors"])
    assert "rank_local.2.rng" not in index["tensors"]


@pytest.mark.distributed
def test_readme_live_sync_moves_the_trained_weights_every_step(tmp_path):
    script = tmp_path / "live_sync.py"
    script.write_text(readme_code("live-sync"))
    r = torchrun(script, 4)
    lines = re.findall(
        r"step (\d) rank (\d) qkv (\w+) sent (\d+) received (\d+) cached plan (True|False)",
        r.stdout,
    )
    assert len(lines) == 12, r.stdout
    digests = {}
    for step, rank, digest, sent, received, cached in lines:
        digests.setdefault(step, set()).add(digest)
        assert cached == ("True" if step != "0" else "False")
        if rank in "01":
            assert int(sent) > 0 and int(received) == 0
        else:
            assert int(received) > 0 and int(sent) == 0
    # every rank sees the same q|k|v bytes each step, and training changes them
    assert all(len(d) == 1 for d in digests.values()), digests
    assert len({next(iter(d)) for d in digests.values()}) == 3


@pytest.mark.distributed
def test_readme_weight_sync_session_sends_only_what_changed(tmp_path):
    script = tmp_path / "weight_sync.py"
    script.write_text(readme_code("weight-sync"))
    r = torchrun(script, 4)
    lines = re.findall(
        r"version (\d) rank (\d) weights (\w+) sent (\d+) of (\d+) received (\d+) deltas (\d+) "
        r"whole (\d+)",
        r.stdout,
    )
    assert len(lines) == 16, r.stdout
    got = {(int(v), int(k)): (d, *map(int, rest)) for v, k, d, *rest in lines}
    for v in range(1, 5):  # trainer and engine hold the same full tensors after every push
        assert len({got[v, k][0] for k in range(4)}) == 1, (v, r.stdout)
    assert len({got[v, 0][0] for v in range(1, 5)}) == 4  # and training changed them
    for k in (0, 1):
        _, sent, full, _, deltas, whole = got[1, k]
        assert sent == full > 0 and deltas == 0 and whole > 0  # the first push: whole
        for v in (2, 4):  # then only what changed
            _, sent, full, _, deltas, whole = got[v, k]
            assert deltas > 0 and whole == 0 and sent < full / 2, (v, k, got[v, k])
    # version 3: rank 3 invalidated its weights and received them whole; rank 2 a delta
    assert got[3, 3][3] == got[1, 3][3] > 0
    assert got[3, 2][3] < got[1, 2][3] / 2


@pytest.mark.distributed
def test_readme_stages_script_saves_per_stage_keys_and_loads_elsewhere(tmp_path):
    script = tmp_path / "stages.py"
    script.write_text(readme_code("stages"))
    r = torchrun(script, 4, CKPT_DIR=str(tmp_path))
    lines = re.findall(
        r"rank (\d) stage (\d): saved (\d) layers; TP 4 load equal (True|False); engine rows "
        r"(\d+) real, padding zero (True|False); divergent replicas refused (True|False)",
        r.stdout,
    )
    assert sorted(int(x[0]) for x in lines) == [0, 1, 2, 3], r.stdout
    for rank, stage, layers, tp4, real, padded, refused in lines:
        assert (stage, layers, tp4, padded, refused) == (
            str(int(rank) // 2),
            "2",
            "True",
            "True",
            "True",
        )
        assert int(real) == max(0, min(16, 37 - 16 * int(rank)))
    index = json.loads((tmp_path / "stages" / "reshard.index.json").read_text())
    assert set(index["tensors"]) == {f"model.{i}.weight" for i in range(4)} | {"embed"}
    assert not (tmp_path / "stages-bad").exists()
    assert (
        len(json.loads((tmp_path / "stages-ep" / "reshard.index.json").read_text())["tensors"]) == 4
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_docs_fast_tier_resumes_a_lost_node_from_peer_copies(tmp_path):
    """The training page's fast-tier script as 2 nodes × 2 ranks (two torchrun agents,
    each node its own FAST_DIR), then node 1's fast path wiped and the job resumed on
    node 0 alone at 2 ranks: from the fast tier, no byte from the root."""
    from reshard_svc._process import free_port

    script = tmp_path / "fast.py"
    script.write_text(readme_code("fast-tier"))
    root, fast = tmp_path / "ckpt", [tmp_path / "node-0", tmp_path / "node-1"]
    port = free_port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={n}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(script),
            ],
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "CKPT_DIR": str(root),
                "FAST_DIR": str(fast[n]),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    for a in agents:
        _, err = a.communicate(timeout=300)
        assert a.returncode == 0, err[-4000:]
    # 20 steps: the root holds 8 and 16, each node the fast steps 15 and 20
    assert sorted(os.listdir(root)) == ["step-0000000008", "step-0000000016"]
    shutil.rmtree(fast[1])
    r = torchrun(script, 2, CKPT_DIR=str(root), FAST_DIR=str(fast[0]))
    lines = re.findall(
        r"rank (\d) restored step (\d+) from (\w+): local (\d+) peer (\d+) persistent (\d+)",
        r.stdout,
    )
    assert len(lines) == 2, r.stdout
    for _, step, tier, local, peer, persistent in lines:  # node 0 holds node 1's copies
        assert (step, tier, peer, persistent) == ("20", "fast", "0", "0"), r.stdout
        assert int(local) > 0, r.stdout
