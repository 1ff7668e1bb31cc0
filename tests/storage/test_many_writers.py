"""Many writers, one truth: concurrent runs aimed at one target, on local files and S3.

Real processes: ``reshard convert`` CLIs started together (each with its own workers), and
two torchrun ``save`` jobs at once. After every round, and after ``reshard gc``, the target
is exactly one whole checkpoint: ``verify`` passes, its data files are exactly its index's,
nothing else of any run is left beside or in it, and no command printed a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import reshard_svc
from reshard_svc.format.index import INDEX_NAME
from reshard_svc.storage import open_storage
from tests.support.cli import Command, reshard, start

ROOTS = ["local", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture(params=ROOTS)
def base(request, tmp_path):
    return str(tmp_path) if request.param == "local" else request.getfixturevalue("s3")


def source(base: str) -> tuple[str, dict]:
    g = torch.Generator().manual_seed(5)
    sd = {f"layer{i}.w": torch.randn(256, 128, generator=g) for i in range(6)}
    src = f"{base}/src"
    reshard_svc.save(sd, src)
    return src, sd


def start_convert(src: str, dst: str, tp: int, workers: int, *extra: str) -> Command:
    return start(
        "convert",
        src,
        dst,
        "--mesh",
        f"tp={tp}",
        "--rules",
        '{"*": "S(0)"}',
        "--workers",
        str(workers),
        *extra,
    )


def one_whole_checkpoint(base: str, name: str, sd: dict) -> dict:
    """The target is one whole checkpoint and nothing else of any run is there."""
    dst = f"{base}/{name}"
    assert reshard_svc.verify(dst).ok
    storage = open_storage(dst)
    index = json.loads(storage.read(INDEX_NAME))
    data = {n for n in storage.listdir() if n.endswith((".safetensors", ".bin"))}
    assert data == set(index["files"]), sorted(data ^ set(index["files"]))
    assert set(storage.listdir()) <= {*index["files"], INDEX_NAME}, storage.listdir()
    if not base.startswith("s3://"):
        assert [p for p in os.listdir(base) if p.startswith(f".{name}.")] == []
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, dst)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    return index


def finish(procs: list[Command]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each, in start order."""
    errs = [p.communicate()[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


def test_concurrent_converts_into_a_new_target(base):
    src, sd = source(base)
    procs = [start_convert(src, f"{base}/tgt", tp, 1 + tp % 2) for tp in range(1, 6)]
    results = finish(procs)
    codes = [c for c, _ in results]
    assert codes.count(0) == 1, results
    winner = codes.index(0) + 1
    for code, err in results:
        assert "Traceback" not in err
        if code:
            assert code == 2, err
            assert "is being written by" in err or "already holds a committed checkpoint" in err
            assert "reshard gc" not in err or "is being written by" in err
    index = one_whole_checkpoint(base, "tgt", sd)
    assert {t["layout"]["mesh"]["shape"][0] for t in index["tensors"].values()} == {winner}
    r = reshard("gc", f"{base}/tgt", "--json")
    assert r.returncode == 0 and not json.loads(r.stdout)["rolled_forward"]
    one_whole_checkpoint(base, "tgt", sd)


def test_concurrent_overwrites_end_with_one_whole_commit(base):
    src, sd = source(base)
    reshard_svc.convert(src, f"{base}/tgt", mesh="tp=1", rules={"*": "S(0)"})
    procs = [start_convert(src, f"{base}/tgt", tp, 1 + tp % 2, "--overwrite") for tp in range(2, 7)]
    results = finish(procs)
    ok = {i + 2 for i, (code, _) in enumerate(results) if code == 0}
    assert ok, results
    for code, err in results:
        assert "Traceback" not in err
        assert code == 0 or "is being written by" in err, err
    index = one_whole_checkpoint(base, "tgt", sd)
    # The commits were serialised by the lease, each replacing the last whole; which one
    # committed last is not the one whose process ended last (torchrun's teardown follows the
    # commit), so the check is that the target is exactly one of the runs that succeeded.
    tps = {t["layout"]["mesh"]["shape"][0] for t in index["tensors"].values()}
    assert len(tps) == 1 and tps <= ok, (tps, ok)
    assert reshard("gc", f"{base}/tgt").returncode == 0
    one_whole_checkpoint(base, "tgt", sd)


SAVE = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    import reshard_svc
    from reshard_svc.errors import ReshardError
    dist.init_process_group("gloo")
    sd = {"w": torch.full((64, 32), float(sys.argv[2])), "step": int(sys.argv[2])}
    try:
        reshard_svc.save(sd, sys.argv[1])
        verdict = "SAVED"
    except ReshardError as e:
        verdict = f"REFUSED {type(e).__name__}: {e}"
    dist.barrier()
    if dist.get_rank() == 0:
        print(verdict, flush=True)
    dist.destroy_process_group()
    """
)


def test_two_torchrun_save_jobs_into_one_target(base, tmp_path):
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    dst = f"{base}/saved"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(script),
                dst,
                str(value),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for value in (1, 2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    verdicts = [o.strip().splitlines()[-1] for o, _ in outs]
    assert sorted(v.split()[0] for v in verdicts) == ["REFUSED", "SAVED"], verdicts
    refused = next(v for v in verdicts if v.startswith("REFUSED"))
    assert "TargetBusyError" in refused or "TargetExistsError" in refused
    step = 1 if verdicts[0] == "SAVED" else 2
    one_whole_checkpoint(base, "saved", {"w": torch.full((64, 32), float(step))})
    assert reshard_svc.inspect(dst).extras == {"step": step}


def test_a_busy_target_names_its_holder(tmp_path):
    from reshard_svc.errors import TargetBusyError
    from reshard_svc.format.collect import TargetRun

    dst = str(tmp_path / "held")
    run = TargetRun(open_storage(dst), "convert")
    try:
        with pytest.raises(TargetBusyError) as e:
            reshard_svc.save({"w": torch.ones(2)}, dst)
        assert f"pid {os.getpid()}" in str(e.value) and "Wait for it to finish" in str(e.value)
        assert e.value.age >= 0 and str(os.getpid()) in e.value.holder
    finally:
        run.abort(open_storage(dst).staging(run.token))
    reshard_svc.save({"w": torch.ones(2)}, dst)  # released: the next run takes it


def test_gc_never_rolls_forward_a_run_that_did_not_hold_the_lease(tmp_path):
    """A decided commit left by a run that was not the owner of record (it lost the lease)
    is removed, never published; the committed checkpoint stays as it is."""
    dst = str(tmp_path / "ck")
    reshard_svc.save({"w": torch.full((4,), 1.0)}, dst)
    other = str(tmp_path / "other")
    reshard_svc.save({"w": torch.full((4,), 2.0)}, other)
    token = "ef" * 16
    os.rename(other, str(tmp_path / f".ck.staging-{token}"))  # a loser's decided staging
    r = reshard("gc", dst, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["rolled_forward"] == [] and len(report["removed"]) == 1
    got = {"w": torch.zeros(4)}
    reshard_svc.load(got, dst)
    assert torch.equal(got["w"], torch.full((4,), 1.0))
    assert sorted(os.listdir(tmp_path)) == ["ck"]
