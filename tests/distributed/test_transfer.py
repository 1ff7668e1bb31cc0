"""Live weight sync on 8 real gloo processes: trainer mesh -> inference mesh, bitwise.

Every scenario runs in one launch (see ``transfer_workloads.scenarios``); each test checks
its own scenario's per-rank results.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import transfer_workloads as w
from tests.support.harness import run

pytestmark = pytest.mark.distributed

SCENARIOS = [
    "fsdp_to_tp",
    "dp_tp_to_replicas",
    "overlapping",
    "failure",
    "mismatches",
    "pp_to_inference",
    "verify_landing",
    "verify_replicas",
]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[int, Any]]:
    out = run(w.scenarios, 8, SCENARIOS)
    return {s: {rank: out[rank][s] for rank in out} for s in SCENARIOS}


def _bytes(params: dict[str, tuple[tuple[int, ...], Any]]) -> int:
    import math

    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in params.values())


def test_fsdp_to_tp_with_fused_qkv_and_gate_up(results):
    r = results["fsdp_to_tp"]
    for rank in range(8):
        assert r[rank]["wrong_first"] == [], rank
        assert r[rank]["first"]["updated"] == sorted(w.inference_params())
        assert not r[rank]["first"]["cached"]
    for rank in range(4):
        assert r[rank]["source_full_tensor_ok"]
    # disjoint meshes: each inference rank receives each byte it holds once (replicated
    # norms once per rank); trainers send each byte once, and the inference ranks forward
    # the replicated norms among themselves (a relay), so every byte is sent once in all
    for k in range(4, 8):
        assert r[k]["first"]["received"] == r[k]["local_bytes"] > 0
    needed = sum(r[k]["local_bytes"] for k in range(4, 8))
    trainers = sum(r[k]["first"]["sent"] for k in range(4))
    assert sum(r[k]["first"]["sent"] for k in range(8)) == needed
    assert trainers < needed and all(r[k]["first"]["sent"] > 0 for k in range(4, 8))
    assert all(r[k]["first"]["received"] == 0 for k in range(4))


def test_second_call_reuses_the_plan_and_moves_new_values(results):
    r = results["fsdp_to_tp"]
    for rank in range(8):
        assert r[rank]["second"]["cached"], rank
        assert r[rank]["wrong_second"] == [], rank  # sources doubled in place in between


def test_dp_tp_trainer_to_two_inference_replicas(results):
    r = results["dp_tp_to_replicas"]
    for rank in range(8):
        assert r[rank]["wrong"] == [], rank
    # each byte is sent once per inference rank that holds it: by a trainer rank, or, for
    # a box held by one trainer rank and both engines, once by the trainer and forwarded
    # by the engine it reached (a relay) ...
    for k in range(4, 8):
        assert r[k]["received"] == r[k]["local_bytes"] > 0
    needed = sum(r[k]["local_bytes"] for k in range(4, 8))
    assert sum(r[k]["sent"] for k in range(8)) == needed
    assert sum(r[k]["sent"] for k in range(4)) < needed
    # ... the two engines (ranks 4-5 and 6-7) receive the whole model each (norms on both
    # TP ranks of an engine) ...
    norms = sum(
        shape[0] * dtype.itemsize for n, (shape, dtype) in w.trainer_params().items() if "norm" in n
    )
    assert r[4]["local_bytes"] + r[5]["local_bytes"] == _bytes(w.trainer_params()) + norms
    # ... and the dp replicas of the replicated tensors share the sending
    sent = [r[k]["sent"] for k in range(4)]
    assert max(sent) - min(sent) <= 0.05 * max(sent), sent


def test_overlapping_meshes_copy_in_place(results):
    r = results["overlapping"]
    for rank in range(8):
        assert r[rank]["wrong"] == [], rank
    assert r[4]["copied"] > 0 and r[5]["copied"] > 0  # ranks in both meshes
    assert r[6]["copied"] == r[7]["copied"] == 0
    for k in range(4, 8):
        assert r[k]["received"] + r[k]["copied"] == r[k]["local_bytes"] > 0
    assert sum(r[k]["sent"] for k in range(8)) == sum(r[k]["received"] for k in range(8))


def test_a_rank_failing_mid_transfer_fails_every_rank_and_leaves_no_half_tensor(results):
    r = results["failure"]
    first = r[0]
    assert first["raised"] == "TransferAbortedError"
    assert first["updated"], "the failure was injected in bucket 2: bucket 1 was swapped in"
    assert first["untouched"]
    assert sorted(first["updated"] + first["untouched"]) == sorted(w.inference_params())
    for rank in range(8):
        assert r[rank]["raised"] == "TransferAbortedError", rank
        assert r[rank]["updated"] == first["updated"], rank
        assert r[rank]["wrong_updated"] == [], rank
        assert r[rank]["sentinel_not_untouched"] == [], rank
        assert "injected failure" in r[rank]["message"]
    assert "rank 5" in r[0]["message"]


def test_mismatched_names_fail_closed_on_every_rank(results):
    r = results["mismatches"]
    expect = {
        "missing": "needs source(s)",
        "unused": "used by no target",
        "cat_length": "add up to 24",
        "shape": "has shape (37, 16)",
        "dtype": "transfer never converts dtypes",
        "unknown_target": "no rank passed a target",
    }
    for rank in range(8):
        for case, text in expect.items():
            assert r[rank][case] is not None and text in r[rank][case], (rank, case)
            assert r[rank][case] == r[0][case]
        assert r[rank]["untouched_after_errors"], rank
        assert r[rank]["wrong_after"] == [], rank


def test_pipeline_trainer_into_tp_dtensors_and_a_vllm_like_engine(results):
    """A 2-stage x TP 2 trainer whose stages pass their own keys, into TP 4 DTensors and
    into LocalShards with fused qkv/gate_up views, KV heads replicated past their count
    and a padded vocabulary; verify=True on every call; the cached plan moves new values."""
    r = results["pp_to_inference"]
    for rank in range(8):
        assert r[rank]["wrong_dtensors"] == [], rank
        assert r[rank]["wrong_engine"] == [], rank  # real rows equal, padding rows 0
        assert sorted(r[rank]["engine"]["updated"]) == sorted(w.trainer_params())
        assert not r[rank]["engine"]["cached"] and r[rank]["engine_cached"]["cached"]
    assert r[6]["padding_rows"] > 0 and r[7]["padding_rows"] > 0  # vocab 37 -> 64 rows
    # the KV heads are replicated on two engine ranks each: both receive them
    assert r[4]["engine"]["received"] == r[5]["engine"]["received"]


def test_verify_refuses_a_piece_that_lands_changed(results):
    r = results["verify_landing"]
    for rank in range(8):
        assert r[rank]["raised"] == "TransferAbortedError", rank
        assert "did not land as sent" in r[rank]["message"]
        assert len(r[rank]["untouched"]) == r[rank]["targets"], rank  # nothing swapped in


def test_verify_refuses_sources_whose_replicas_differ(results):
    r = results["verify_replicas"]
    for rank in range(8):
        assert r[rank]["raised"] == "ReplicaMismatchError", rank
        assert "'model.norm.weight'" in r[rank]["message"] and "rank(s) 3" in r[rank]["message"]
        assert len(r[rank]["untouched"]) == r[rank]["targets"], rank
