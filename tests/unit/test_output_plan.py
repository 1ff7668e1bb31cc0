"""Which worker writes which output file (``output_plan.assign_files``), and what that
costs the read plan: runs of neighbouring files per worker, balanced, each source byte
read once by a convert that splits shards."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.format.index import CheckpointIndex
from reshard_svc.layout import Layout
from reshard_svc.plan.budget import Budget
from reshard_svc.plan.output import assign_files, plan_native, target_bands
from reshard_svc.plan.read import StorageCost, choose_plan
from reshard_svc.plan.save import FileSpec
from tests.unit.test_read_plan import ISZ, stored


def specs(sizes: list[int]) -> list[FileSpec]:
    return [
        FileSpec(name=f"shard-{i:05d}", writer=0, entries=(), header=b"", size=n)
        for i, n in enumerate(sizes)
    ]


def best_contiguous_max(sizes: list[int], workers: int) -> int:
    """Brute force: the smallest largest load over every split into <= workers runs."""
    best = sum(sizes)
    for k in range(min(workers, len(sizes))):
        for cuts in itertools.combinations(range(1, len(sizes)), k):
            bounds = (0, *cuts, len(sizes))
            best = min(best, max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.integers(1, 5))
def test_files_go_to_workers_in_runs_with_the_smallest_largest_load(sizes, workers):
    out = assign_files(specs(sizes)[::-1], workers)  # input order does not matter
    assert [f.name for f in out] == sorted(f.name for f in out)
    owners = [f.writer for f in out]
    assert owners == sorted(owners) and 0 <= owners[0] and owners[-1] < workers
    load = [sum(f.size for f in out if f.writer == w) for w in range(workers)]
    assert max(load) == best_contiguous_max(sizes, workers)


def test_equal_files_split_evenly_in_rank_order():
    assert [f.writer for f in assign_files(specs([8] * 4), 2)] == [0, 0, 1, 1]
    assert [f.writer for f in assign_files(specs([8] * 6), 3)] == [0, 0, 1, 1, 2, 2]
    assert [f.writer for f in assign_files(specs([8] * 3), 4)] == [0, 1, 2]


def test_splitting_tp2_into_tp4_on_two_workers_reads_each_source_byte_once():
    """TP=2 -> TP=4: targets 0 and 1 are halves of source 0. Interleaved writers made both
    workers read every column-split source band (1.3x the checkpoint in the CLI bench)."""
    src, dst = Layout.parse("tp=2", "S(1)"), Layout.parse("tp=4", "S(1)")
    rows = Layout.parse("tp=2", "S(0)"), Layout.parse("tp=4", "S(0)")
    shape = (64, 128)
    tensors = {"col": stored("col", shape, src), "row": stored("row", shape, rows[0])}
    index = CheckpointIndex(tensors=tensors, files={})
    layouts = {"col": dst, "row": rows[1]}
    dtypes = dict.fromkeys(tensors, torch.float32)
    out = plan_native(index, layouts, dtypes, 2, "t", "")
    wanted, _ = target_bands(out, index, Budget(1 << 20))
    local = StorageCost(latency_s=5e-5, bandwidth=3e9, local=True)
    plan = choose_plan(index, wanted, 2, Budget(1 << 20), "direct", local)
    assert plan.bytes_read() == [64 * 128 * ISZ] * 2  # each worker reads one source shard
