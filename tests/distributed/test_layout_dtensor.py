"""The layout core against the local tensors that ``distribute_tensor`` really produces."""

from __future__ import annotations

import pytest

from tests.support.harness import run

CASES = [
    ((2,), ("SS(0,3)",), (12, 5)),  # fused QKV on 2 ranks
    ((2,), ("SS(0,3)",), (13, 3)),  # uneven fused QKV
    ((4,), ("SS(1,2)",), (3, 9)),
    ((2, 2), ("SS(0,2)", "S(0)"), (8, 8)),  # FSDP2 x TP
    ((2, 2), ("SS(0,2)", "S(0)"), (7, 3)),
    ((2, 2), ("S(0)", "SS(1,3)"), (5, 11)),
    ((2, 2), ("R", "S(1)"), (3, 1)),
    ((4,), ("S(0)",), (3, 2)),  # fewer rows than ranks
]


def _world(mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    return world


def _check(mesh_shape, placements, shape):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from reshard_svc.layout import Layout, Mesh, local_slices
    from reshard_svc.runtime import _compat

    layout = Layout(Mesh(mesh_shape), placements)
    mesh = init_device_mesh("cpu", mesh_shape)
    g = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    torch_pl = _compat.to_torch_placements(layout.placements)
    try:
        dt = distribute_tensor(g, mesh, torch_pl)
    except AssertionError:
        # torch's scatter path refuses uneven _StridedShard; its local-split path does not.
        dt = distribute_tensor(g, mesh, torch_pl, src_data_rank=None)
    local = dt.to_local()
    assert _compat.layout_of(dt) == layout
    rank = dist.get_rank()
    boxes = layout.rank_boxes(shape, rank)
    assert tuple(local.shape) == layout.local_shape(shape, rank)
    covered = 0
    for box, where in zip(boxes, local_slices(boxes)):
        if box.is_empty:
            continue
        want = g[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        assert torch.equal(local[where], want), (rank, box)
        covered += box.numel
    assert covered == local.numel()
    return covered


def _check_all(cases):
    """Every case of one world size in one launch: (case, covered elements) or (case, error)."""
    import torch.distributed as dist

    out = []
    for case in cases:
        try:
            out.append((case, _check(*case)))
        except AssertionError as e:
            out.append((case, f"mismatch: {e!r}"))
        dist.barrier()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", sorted({_world(c[0]) for c in CASES}))
def test_boxes_match_distribute_tensor(world):
    cases = [c for c in CASES if _world(c[0]) == world]
    result = run(_check_all, world, cases)
    assert set(result) == set(range(world))
    for rank, per_case in result.items():
        assert [c for c, _ in per_case] == cases
        bad = [(c, r) for c, r in per_case if isinstance(r, str)]
        assert not bad, f"rank {rank}: {bad}"
