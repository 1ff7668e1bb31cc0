"""The layout core against torch's own answers, over random shapes, meshes and placements."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reshard_svc.errors import LayoutError
from reshard_svc.layout import (
    Box,
    Layout,
    Mesh,
    Replicate,
    Shard,
    StridedShard,
    local_slices,
    parse_placement,
)
from reshard_svc.layout.box import check_tiling
from reshard_svc.runtime import _compat

EXAMPLES = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, family: str):
    """(global_shape, layout) for one placement family."""
    mesh_ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.integers(1, 4)) for _ in range(mesh_ndim))
    if family == "replicate":
        ndim = draw(st.integers(0, 3))
    else:
        ndim = draw(st.integers(1, 3))
    # Small dims on purpose: smaller than the mesh, zero-size, uneven.
    shape = tuple(draw(st.integers(0, 13)) for _ in range(ndim))
    placements = []
    for _ in range(mesh_ndim):
        if family == "replicate" or ndim == 0:
            placements.append(Replicate())
            continue
        kinds = ["R", "S"] if family == "shard" else ["R", "S", "SS", "SS"]
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "R":
            placements.append(Replicate())
        elif kind == "S":
            placements.append(Shard(dim))
        else:
            placements.append(StridedShard(dim, draw(st.integers(1, 4))))
    if family == "strided" and not any(isinstance(p, StridedShard) for p in placements):
        placements[-1] = StridedShard(draw(st.integers(0, ndim - 1)), draw(st.integers(2, 4)))
    return shape, Layout(Mesh(mesh_shape), tuple(placements))


def torch_local(global_tensor: torch.Tensor, layout: Layout, coord) -> torch.Tensor:
    """What distribute_tensor leaves on ``coord``: torch's own split, mesh dim by mesh dim."""
    local = global_tensor
    for i, p in enumerate(_compat.to_torch_placements(layout.placements)):
        if isinstance(layout.placements[i], Replicate):
            continue
        pieces, _ = p._split_tensor(local, layout.mesh.shape[i], with_padding=False)
        local = pieces[coord[i]]
    return local


def assemble(global_tensor: torch.Tensor, boxes: list[Box]) -> torch.Tensor:
    """A rank's local tensor built from its boxes, placed by ``local_slices``."""
    from reshard_svc.layout.sharding import _local_shape

    out = torch.full(_local_shape(boxes), -1, dtype=global_tensor.dtype)
    for box, where in zip(boxes, local_slices(boxes)):
        src = global_tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        out[where] = src
    return out


def check_against_torch(shape, layout: Layout) -> None:
    shards = layout.shards(shape)
    assert len(shards) == layout.mesh.size
    g = torch.arange(math.prod(shape)).reshape(shape) if shape else torch.tensor(7)
    for rank, boxes in enumerate(shards):
        coord = layout.mesh.coordinate(rank)
        want_shape, want_offset = _compat.torch_local_shape_and_offset(layout, shape, coord)
        assert boxes, f"rank {rank} has no box"
        assert layout.local_shape(shape, rank) == want_shape, (rank, boxes)
        assert boxes[0].offsets == want_offset, (rank, boxes)
        # Element-exact: the boxes hold what torch's split leaves on that rank, in order.
        want_local = torch_local(g, layout, coord)
        assert tuple(want_local.shape) == want_shape
        if want_local.numel():
            assert torch.equal(assemble(g, boxes), want_local), (rank, boxes)
    items = layout.write_items(shape)
    check_tiling(shape, [it.box for it in items])
    for it in items:
        assert it.writer in it.holders
        for h in it.holders:
            assert it.box in shards[h]


@EXAMPLES
@given(cases("shard"))
def test_shard_and_replicate_match_torch(case):
    check_against_torch(*case)


@EXAMPLES
@given(cases("strided"))
def test_strided_shard_mixes_match_torch(case):
    check_against_torch(*case)


@EXAMPLES
@given(cases("replicate"))
def test_replicate_only_match_torch(case):
    check_against_torch(*case)


@EXAMPLES
@given(cases("mixed"))
def test_all_placements_mixed_match_torch(case):
    check_against_torch(*case)


def test_uneven_and_empty_shards_follow_torch_chunk():
    layout = Layout.parse("tp=4", "S(0)")
    shards = layout.shards((5, 3))
    # torch.chunk(5, 4) -> sizes 2, 2, 1 and one empty shard at offset 5.
    assert [b[0].sizes[0] for b in shards] == [2, 2, 1, 0]
    assert shards[3] == [Box((5, 0), (0, 3))]
    items = layout.write_items((5, 3))
    assert [it.box.offsets[0] for it in items] == [0, 2, 4]


def test_strided_shard_gives_several_boxes():
    # Fused QKV: 3 pieces, each split over 2 ranks -> 3 boxes per rank.
    layout = Layout.parse("tp=2", "SS(0,3)")
    shards = layout.shards((12, 4))
    assert shards[0] == [Box((0, 0), (2, 4)), Box((4, 0), (2, 4)), Box((8, 0), (2, 4))]
    assert shards[1] == [Box((2, 0), (2, 4)), Box((6, 0), (2, 4)), Box((10, 0), (2, 4))]


def test_fsdp2_tp_strided_example_from_torch_docs():
    layout = Layout.parse("dp=2,tp=2", "SS(0,2),S(0)")
    rows = [b[0].offsets[0] for b in layout.shards((8, 8))]
    assert rows == [0, 4, 2, 6]


def test_replicated_writers_are_balanced_across_tensors():
    layout = Layout.parse("tp=4", "R")
    load = [0, 0, 0, 0]
    writers = [layout.write_items((1024,), 2, load)[0].writer for _ in range(8)]
    assert sorted(writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert load == [4096] * 4


def test_writer_choice_is_deterministic_and_not_always_rank0():
    layout = Layout.parse("dp=2,tp=2", "R,S(1)")
    a = layout.write_items((6, 6))
    b = Layout.parse("dp=2,tp=2", "R,S(1)").write_items((6, 6))
    assert a == b
    assert {it.writer for it in a} != {0}
    assert {len(it.holders) for it in a} == {2}


def test_text_and_json_round_trip():
    layout = Layout.parse("dp=2,tp=4", "SS(0,4),S(1)")
    assert str(layout) == "dp=2,tp=4|SS(0,4),S(1)"
    assert Layout.parse(str(layout)) == layout
    assert Layout.from_json(layout.to_json()) == layout
    assert Layout.parse("2x4", "R,S(0)").mesh == Mesh((2, 4))
    assert parse_placement("_StridedShard(dim=1, sf=2)") == StridedShard(1, 2)
    assert parse_placement("Shard(dim=0)") == Shard(0)
    assert parse_placement("Replicate()") == Replicate()


def test_torch_placement_conversion_round_trips():
    layout = Layout.parse("dp=2,tp=2", "SS(0,2),S(0)")
    torch_pl = _compat.to_torch_placements(layout.placements)
    assert _compat.from_torch_placements(torch_pl) == layout.placements


def test_negative_shard_dim_is_normalized_like_torch():
    a = Layout.parse("tp=2", "S(-1)").shards((3, 5))
    b = Layout.parse("tp=2", "S(1)").shards((3, 5))
    assert a == b


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: parse_placement("Q(0)"), "unknown placement 'Q(0)'"),
        (lambda: Layout.parse("tp=2", "S(2)").shards((4, 4)), "tensor dim 2"),
        (lambda: Layout.parse("dp=2,tp=2", "S(0)"), "one placement per mesh dim"),
        (lambda: Mesh((2, 0)), "mesh dim 1 has size 0"),
        (lambda: Mesh.parse("tp=-1"), "mesh dim 0 has size -1"),
        (lambda: Mesh.parse("tp=two"), "'tp=two'"),
        (lambda: Layout.parse("tp=2", "S(0)").shards((4, -1)), "dim 1 is negative"),
        (lambda: StridedShard(0, 0), "split_factor"),
        (lambda: Layout.parse("tp=2"), "MESH|PLACEMENTS"),
        (lambda: Mesh((2, 2), ("tp", "tp")), "repeat"),
    ],
)
def test_bad_input_raises_layout_error_naming_the_part(call, words):
    with pytest.raises(LayoutError) as err:
        call()
    assert words in str(err.value)
