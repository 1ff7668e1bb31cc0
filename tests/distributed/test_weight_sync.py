"""The RL loop's weight sync session (``reshard_svc.WeightSync``) on real gloo processes:
versioned pushes that send only what changed, bitwise equal to the trainer's tensors after
every push, through restarts, foreign writes, aborted pushes, dead receivers, re-layouts,
overlapping meshes, pipeline stages and fused targets.

Four scenarios share one 8-process launch (see ``sync_workloads.scenarios``); the kill
sweep runs in four processes of its own (an elastic agent would stop the others), a fresh
one taking each killed one's place.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import sync_workloads as w
from tests.support.harness import JOBS, free_port, run

pytestmark = pytest.mark.distributed

SCENARIOS = ["rl_loop", "overlapping_fused_pp", "atomic_waves", "gqa_relay"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[int, Any]]:
    out = run(w.scenarios, 8, SCENARIOS)
    return {s: {rank: out[rank][s] for rank in out} for s in SCENARIOS}


@pytest.mark.slow
def test_twenty_pushes_are_bitwise_and_send_only_what_changed(results):
    r = results["rl_loop"]
    for rank in range(8):
        assert r[rank]["wrong"] == [[]] * 19, rank  # after every committed push
    for rank in range(4):  # trainers: the first push whole, later ones deltas
        pushes = {p["step"]: p for p in r[rank]["pushes"]}
        assert pushes[1]["wholes"] > 0 and pushes[1]["deltas"] == 0
        assert pushes[1]["sent"] == pushes[1]["full"] > 0
        for step in (2, 6, 10, 14, 18):  # 1 % changed since the previous push
            assert pushes[step]["wholes"] == 0 and pushes[step]["deltas"] > 0
            assert pushes[step]["sent"] < 0.15 * pushes[step]["full"], (rank, step)
        for step in (4, 16, 20):  # everything changed: never more than a whole push
            assert pushes[step]["full"] * 0.9 < pushes[step]["sent"] <= pushes[step]["full"]
        # one copy of each region it sends (a region sent to several engine ranks: once)
        assert 0.8 * pushes[1]["full"] < r[rank]["snapshot_bytes"] <= pushes[1]["full"]
    for rank in range(4, 8):
        assert r[rank]["snapshot_bytes"] == 0


def test_update_writes_nothing_until_commit(results):
    r = results["rl_loop"]
    for rank in range(4, 8):
        assert all(p["held"] for p in r[rank]["pushes"])
        # between update() and commit() the engine still held the previous version
        assert sum(r[rank]["before_commit_wrong"]) > 0, rank


def test_a_restarted_or_overwritten_engine_gets_whole_pieces(results):
    r = results["rl_loop"]
    step = {rank: {p["step"]: p for p in r[rank]["pushes"]} for rank in range(8)}
    # step 7: rank 6 restarted (zeros, a new session): it receives its whole share ...
    assert step[6][7]["received"] == step[6][1]["received"]
    assert not step[6][7]["cached"]  # every rank re-planned with the new session
    # ... the trainers sent whole pieces to it only, deltas to the others
    assert any(step[k][7]["wholes"] > 0 for k in range(4))
    assert all(step[k][7]["deltas"] > 0 for k in range(4))
    # step 9: rank 5's weights written behind the session's back: noticed, whole pieces
    assert step[5][9]["received"] == step[5][1]["received"]
    assert step[4][9]["received"] < 0.2 * step[4][1]["received"]


def test_an_aborted_push_leaves_every_engine_on_the_previous_version(results):
    r = results["rl_loop"]
    for rank in range(8):
        aborted = r[rank]["aborted"]
        assert aborted is not None and aborted["updated"] == [], rank
        assert "rank 7" in aborted["message"] or rank == 7
        assert "injected failure while landing" in aborted["message"]
        assert r[rank]["abort_kept_previous"], rank
        assert r[rank]["version_after_abort"] == 11
    # the next push (13) carries the aborted step's changes too and is bitwise (above)


def test_versions_must_go_up_and_agree(results):
    r = results["rl_loop"]
    for rank in range(8):
        e = r[rank]["errors"]
        assert "version 5 does not come after version 20" in e["backwards"]
        assert "version 20 does not come after version 20" in e["same"]
        assert "every rank must push the same version" in e["differs"]
        # a bad version on one rank fails every rank at the agreement (nobody waits forever)
        assert "a push's version is an int >= 0, got -1" in e["negative_on_one_rank"]
        assert e["negative_on_one_rank"].startswith("UsageError" if rank == 3 else "Distributed")
        assert r[rank]["version"] == 20


def test_a_new_trainer_layout_replans_everywhere_and_pushes_whole(results):
    r = results["rl_loop"]
    for rank in range(8):
        re, after = r[rank]["relayout"], r[rank]["after_relayout"]
        assert re["wrong"] == [] and after["wrong"] == [], rank
        assert not re["cached"] and after["cached"]
        if rank < 4:
            assert re["deltas"] == 0 and re["sent"] == re["full"] > 0
            assert after["wholes"] == 0 and after["sent"] < 0.15 * after["full"]


def test_overlapping_meshes_fused_targets_waves_and_verify(results):
    r = results["overlapping_fused_pp"]
    for rank in range(8):
        pushes = r[rank]["overlapping"]
        assert [p["wrong"] for p in pushes] == [[]] * 5, rank
        assert all(p["waves"] > 1 and not p["held"] for p in pushes)
        assert r[rank]["bad_patch"] is not None and "did not land as sent" in r[rank]["bad_patch"]
        assert r[rank]["bad_patch_kept"] == 5  # verify refused it before anything was written
        assert r[rank]["after_bad_patch"]["wrong"] == []
    assert r[4]["overlapping"][1]["sent"] < r[4]["overlapping"][0]["sent"]  # 4 is in both


def test_pipeline_stages_into_a_vllm_like_engine(results):
    r = results["overlapping_fused_pp"]
    for rank in range(8):
        assert [p["wrong"] for p in r[rank]["pipeline"]] == [[]] * 3, rank
    for rank in range(4):
        first, second, third = r[rank]["pipeline"]
        assert first["waves"] > 1
        for later in (second, third):  # no wave taken for overwritten by its neighbours
            assert later["wholes"] == 0 and later["deltas"] > 0
            assert later["sent"] < 0.15 * first["sent"]


ENGINE = range(4, 8)


def test_a_failure_at_any_wave_leaves_every_engine_on_the_last_committed_version(results):
    """A receiver (rank 5) and a sender (rank 1) fail at every wave boundary and inside
    every wave of a push of 8 waves: every rank raises, every engine rank holds version
    2 bitwise (fused buffers, replicated KV heads and padding included), and the records
    survive: the next push is a delta."""
    r = results["atomic_waves"]
    for rank in range(8):
        o = r[rank]
        assert o["waves"] >= 4
        assert len(o["failures"]) == 4 * o["waves"]
        assert all(f[3] == "TransferAbortedError" for f in o["failures"]), o["failures"]
        assert o["mixed"] == 0, (rank, o["failures"])
        if rank in ENGINE:
            assert {f[4] for f in o["failures"]} == {2}
        after = o["after_failures"]
        assert after["wrong"] == [] and after["version"] == 3
        if rank < 4:
            assert after["wholes"] == 0 and after["deltas"] > 0


def test_every_density_is_bitwise_and_reports_its_encodings(results):
    r = results["atomic_waves"]
    for rank in range(8):
        for push in r[rank]["densities"]:
            assert push["wrong"] == [], (rank, push)
    for rank in range(4):
        by = {p["density"]: p for p in r[rank]["densities"]}
        for push in by.values():
            assert sum(push["encodings"].values()) == push["deltas"] + push["wholes"] > 0
            assert push["sent"] <= push["full"]
        assert by[0.0]["sent"] < 0.05 * by[0.0]["full"]
        assert "raw" in by[1.0]["encodings"]
        assert set(by[0.0001]["encodings"]) <= {"mask", "runs", "gaps"}
    assert any("runs" in r[rank]["densities"][-1]["encodings"] for rank in range(4))  # PULSE


def test_a_write_failing_on_one_rank_inside_commit_switches_no_rank(results):
    r = results["atomic_waves"]
    for label, version, held in (("commit_waves", 10, False), ("commit_one_wave", 12, True)):
        for rank in range(8):
            o = r[rank][label]
            assert o["raised"] == "TransferAbortedError", (label, rank)
            assert o["wrong"] == [] and o["version"] == version and o["held"] is held
            assert o["again_wrong"] == []


def test_a_push_that_outgrew_its_undo_memory_fences_the_engine_then_refills_it(results):
    r = results["atomic_waves"]
    fenced = [rank for rank in ENGINE if r[rank]["fenced"]["raised"] == "EngineFencedError"]
    assert fenced, {rank: r[rank]["fenced"] for rank in ENGINE}
    for rank in range(8):
        o = r[rank]
        assert o["fenced"]["raised"] in ("TransferAbortedError", "EngineFencedError")
        if rank in fenced:
            assert o["fenced"]["version"] is None
            assert "must be refilled" in o["fenced_message"]
        else:
            assert o["fenced"]["version"] == 14
        assert o["refilled"]["wrong"] == [] and o["refilled"]["version"] == 15


def test_kv_heads_replicated_on_four_engine_ranks_are_relayed_not_sent_four_times(results):
    """The busiest trainer rank sends one copy of what it holds, whole or as deltas (its
    push report); the engine ranks forward the replicated stripes; bitwise everywhere."""
    r = results["gqa_relay"]
    for rank in range(8):
        for push in r[rank]["pushes"]:
            assert push["wrong"] == [], (rank, push)
    for rank in range(4):
        first, sparse, dense = r[rank]["pushes"]
        assert first["sent"] == first["full"] == r[rank]["local_bytes"] > 0  # once, not 4x
        assert sparse["wholes"] == 0 and sparse["deltas"] > 0
        assert sparse["sent"] < 0.2 * first["sent"]
        assert dense["sent"] <= dense["full"]
    for rank in ENGINE:  # each forwards stripes of k, v and the norm to the other three
        assert r[rank]["pushes"][0]["sent"] > 0


WAVES = 6  # the kill sweep's push: max_memory=2048 over the sweep's model


def _points() -> list[list[Any]]:
    """Every wave killed twice: at its boundary and inside it, one by a receiver (rank 3)
    and one by a sender (rank 1), alternating; then a group with no kill."""
    points: list[list[Any]] = []
    for wave in range(WAVES):
        first, second = (3, 1) if wave % 2 == 0 else (1, 3)
        points += [[first, wave, "boundary"], [second, wave, "inside"]]
    return [*points, [None, 0, ""]]


@pytest.mark.slow
def test_a_process_killed_at_any_wave_leaves_every_survivor_on_the_last_version():
    """SIGKILL of a receiver or a sender at every wave boundary and inside every wave of a
    6-wave push: every survivor raises and holds version 2 bitwise (or says it is fenced);
    a fresh process takes the dead one's place in a re-formed group, whose new session
    lands bitwise. The mixed states counted over every kill point: 0."""
    points = _points()
    ports = [free_port() for _ in points]
    ctx = JOBS
    results = ctx.Queue()
    procs = {
        r: ctx.Process(target=w.kill_sweep, args=(r, points, ports, results, 0)) for r in range(4)
    }
    for p in procs.values():
        p.start()
    exits = []
    try:
        for i, (victim, _, _) in enumerate(points):
            if victim is None:
                continue
            procs[victim].join(120)
            exits.append(procs[victim].exitcode)
            procs[victim] = ctx.Process(
                target=w.kill_sweep, args=(victim, points, ports, results, i + 1)
            )
            procs[victim].start()
        outs = [results.get(timeout=240) for _ in range(3 * (len(points) - 1) + 4)]
    finally:
        for p in procs.values():
            p.join(60)
            if p.is_alive():
                p.kill()
    assert exits == [-9] * (len(points) - 1)  # every victim died by SIGKILL
    mixed = []
    for o in outs:
        assert "error" not in o, o
        assert o["first"]["wrong"] == [] and o["first"]["waves"] == WAVES, o
        assert o["first"]["deltas"] == 0  # a new session: whole pieces
        if points[o["point"]][0] is None:
            assert o["wrong"] == []
            continue
        assert o["raised"] in ("TransferAbortedError", "EngineFencedError"), o
        if not (o["kept"] and o["version"] == 2) and not (o["fenced"] and o["version"] is None):
            mixed.append(o)
    assert mixed == []
