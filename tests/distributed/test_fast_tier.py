"""The fast tier: node memory and peer copies, restored through the resharding planner.

4 ranks as 2 simulated nodes × 2 (each node its own fast path), FSDP × TP with AdamW, a
fast step every step with 2 copies, the persistent root every 4 steps. The job ends as a
kill would (nothing released); then nodes are lost, copies removed or corrupted, and the
job resumes at 4, 3 and 2 ranks, bitwise against what it held at the step it loaded."""

from __future__ import annotations

import os
import shutil

import pytest

from reshard_svc.format.fast import fast_steps
from tests.support import fast_jobs as jobs
from tests.support.harness import JOBS, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

NODES = [0, 0, 1, 1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 6-step job; each test works on its own copy of the root and fast paths."""
    base = tmp_path_factory.mktemp("fast")
    root, refs = base / "root", base / "refs"
    refs.mkdir()
    paths = [str(base / "node-a"), str(base / "node-b")]
    got = run(jobs.train_with_fast_tier, 4, str(root), str(refs), paths, NODES, 6, 2, 2)
    assert all(v == {"fast": [5, 6], "persistent": [4]} for v in got.values()), got
    return base


def _copy(trained, tmp_path):
    for name in ("root", "node-a", "node-b"):
        shutil.copytree(trained / name, tmp_path / name, symlinks=True)
    for lease in trained.glob(".*.lease.json"):  # the dead job's leases, beside each path
        shutil.copy(lease, tmp_path / lease.name)
    return str(tmp_path / "root"), [str(tmp_path / "node-a"), str(tmp_path / "node-b")]


def _step_folder(path: str, step: int) -> str:
    (found,) = [s.folder for s in fast_steps(path) if s.step == step]
    return found


def test_a_lost_node_is_restored_from_peer_copies_at_any_size(trained, tmp_path):
    root, paths = _copy(trained, tmp_path)
    shutil.rmtree(paths[1])  # node B is gone, and its fast path with it
    refs = str(trained / "refs")
    for world, nodes, tp, dp in (
        (4, [0, 0, 1, 1], 2, 2),  # the same shape, node B replaced by a fresh one
        (3, [0, 0, 1], 1, 3),  # FSDP on 3 ranks
        (2, [0, 0], 2, 1),  # TP=2 on the surviving node alone
    ):
        got = run(jobs.resume_from_fast_tier, world, root, refs, paths, nodes, tp, dp)
        for rank, r in got.items():
            assert (r["step"], r["tier"], r["bad"]) == (6, "fast", []), (world, rank, r)
            assert r["persistent"] == 0 and r["local"] + r["peer"] > 0, (world, rank, r)
        assert sum(r["peer"] for r in got.values()) > 0 or world == 2


def test_both_copies_of_a_shard_lost_falls_back_to_the_persistent_step(trained, tmp_path):
    root, paths = _copy(trained, tmp_path)
    shutil.rmtree(paths[1])
    for step in (5, 6):  # node A's copy of rank 2's part too: rank 2's bytes are gone
        shutil.rmtree(os.path.join(_step_folder(paths[0], step), "part-00002"))
    got = run(jobs.resume_from_fast_tier, 2, root, str(trained / "refs"), paths, [0, 0], 2, 1)
    for r in got.values():
        assert (r["step"], r["tier"], r["bad"]) == (4, "persistent", []), r
        assert r["persistent"] > 0 and r["local"] == r["peer"] == 0


def test_a_flipped_bit_in_one_copy_is_skipped_for_the_other(trained, tmp_path):
    root, paths = _copy(trained, tmp_path)
    part = os.path.join(_step_folder(paths[0], 6), "part-00000")
    data = sorted(n for n in os.listdir(part) if n.endswith(".safetensors"))[0]
    with open(os.path.join(part, data), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(part, data)) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    got = run(jobs.resume_from_fast_tier, 4, root, str(trained / "refs"), paths, NODES, 2, 2)
    for r in got.values():
        assert (r["step"], r["tier"], r["bad"]) == (6, "fast", []), r
        assert any("rank 0's part" in s and "CRC32C" in s for s in r["skipped"]), r


def test_a_worker_killed_mid_training_resumes_from_the_fast_tier_and_ends_as_if_never_killed(
    tmp_path,
):
    import random

    from safetensors.torch import load_file

    kill_at = random.randint(2, 6)
    clean, killed = tmp_path / "clean", tmp_path / "killed"

    def paths(base):
        return [str(base / "node-a"), str(base / "node-b")]

    run(jobs.train_until, 4, str(clean / "root"), paths(clean), NODES, 8, None, str(clean / "f"))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError):  # SIGKILL of rank 1: torchrun's agent ends the job
        run(jobs.train_until, 4, str(killed / "root"), paths(killed), NODES, 8, kill_at, "x")
    starts = run(
        jobs.train_until, 4, str(killed / "root"), paths(killed), NODES, 8, None, str(killed / "f")
    )
    assert set(starts.values()) <= {kill_at, kill_at + 1}, (kill_at, starts)  # a fast step
    want, got = load_file(str(clean / "f")), load_file(str(killed / "f"))
    assert want.keys() == got.keys()
    assert [k for k in want if not jobs._bitwise(got[k], want[k])] == [], kill_at


def _launch(args) -> None:
    run(jobs.save_until_killed, 2, *args)


def test_kill_9_at_random_points_of_fast_saves_always_resumes_a_whole_step(tmp_path):
    """Ten times: a 2-node job saving a fast step every step is killed (every rank, SIGKILL)
    at a random moment; the next launch loads a whole step, bitwise, and after its first
    save each node holds at most the two newest fast steps and nothing unfinished."""
    import json
    import random
    import time

    import psutil

    root, out = str(tmp_path / "root"), tmp_path / "out"
    out.mkdir()
    paths = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    ctx = JOBS
    loaded = []
    for launch in range(11):
        proc = ctx.Process(target=_launch, args=((root, paths, [0, 1], str(out), launch),))
        proc.start()
        records = [out / f"launch-{launch}-rank-{r}.json" for r in range(2)]
        deadline = time.time() + 180
        while not all(r.exists() for r in records) and time.time() < deadline:
            time.sleep(0.1)
        assert all(r.exists() for r in records), f"launch {launch} never saved"
        time.sleep(random.uniform(0, 1.5))
        for p in psutil.Process(proc.pid).children(recursive=True):  # forked writers too
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass  # a writer that had just finished
        proc.kill()
        proc.join(timeout=60)
        for r in records:
            got = json.loads(r.read_text())
            assert got["ok"] and got["unfinished"] == [], (launch, got)
            assert len(got["committed"]) <= 2, (launch, got)
            assert launch == 0 or got["tier"] == "fast", (launch, got)
        loaded.append(got["step"])
    assert loaded[0] is None and loaded[1:] == sorted(loaded[1:]) and loaded[-1] > 10, loaded


@pytest.mark.s3
def test_with_the_root_on_s3_a_lost_node_reads_nothing_from_it_and_a_lost_shard_does(s3, tmp_path):
    root = f"{s3}/run"
    paths = [str(tmp_path / "node-a"), str(tmp_path / "node-b")]
    run(jobs.save_values, 2, root, paths, [0, 1], 6)
    shutil.rmtree(paths[1])  # node B lost: its part survives as node A's copy
    got = run(jobs.load_values, 2, root, paths, [0, 0])
    assert all(r == {"step": 6, "ok": True, "tier": "fast", "persistent": 0} for r in got.values())
    for step in (5, 6):  # and now the last copy of rank 1's part
        shutil.rmtree(os.path.join(_step_folder(paths[0], step), "part-00001"))
    got = run(jobs.load_values, 2, root, paths, [0, 0])
    for r in got.values():
        assert (r["step"], r["ok"], r["tier"]) == (4, True, "persistent") and r["persistent"] > 0
