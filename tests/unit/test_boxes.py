"""The overlap planner against a brute-force all-pairs oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.errors import InconsistentIndexError
from reshard_svc.layout import Box, Layout, Mesh, Replicate, Shard, StridedShard
from reshard_svc.layout.box import check_tiling, overlaps


@st.composite
def box_sets(draw):
    ndim = draw(st.integers(0, 3))

    def one_box():
        offs = tuple(draw(st.integers(0, 10)) for _ in range(ndim))
        sizes = tuple(draw(st.integers(0, 6)) for _ in range(ndim))
        return Box(offs, sizes)

    src = [one_box() for _ in range(draw(st.integers(0, 12)))]
    dst = [one_box() for _ in range(draw(st.integers(0, 12)))]
    return src, dst


def brute(src, dst):
    out = []
    for j, t in enumerate(dst):
        for i, s in enumerate(src):
            if s.is_empty or t.is_empty:
                continue
            box = s.intersect(t)
            if box is not None:
                out.append((j, i, box))
    return sorted(out, key=lambda x: (x[0], x[1]))


@settings(max_examples=500, deadline=None)
@given(box_sets())
def test_overlaps_equal_brute_force_on_random_boxes(case):
    src, dst = case
    got = [(o.dst, o.src, o.box) for o in overlaps(src, dst)]
    assert got == brute(src, dst)


@st.composite
def layout_pairs(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 17)) for _ in range(ndim))

    def layout():
        mesh = tuple(draw(st.integers(1, 4)) for _ in range(draw(st.integers(1, 2))))
        pls = []
        for _ in mesh:
            k = draw(st.sampled_from(["R", "S", "SS"]))
            d = draw(st.integers(0, ndim - 1))
            pls.append(
                Replicate()
                if k == "R"
                else Shard(d)
                if k == "S"
                else StridedShard(d, draw(st.integers(1, 3)))
            )
        return Layout(Mesh(mesh), tuple(pls))

    return shape, layout(), layout()


@settings(max_examples=300, deadline=None)
@given(layout_pairs())
def test_overlaps_between_real_layouts_cover_every_target_box(case):
    shape, a, b = case
    src = [it.box for it in a.write_items(shape)]
    dst = [it.box for it in b.write_items(shape)]
    got = overlaps(src, dst)
    assert [(o.dst, o.src, o.box) for o in got] == brute(src, dst)
    # The pieces of each target box tile it exactly.
    for j, t in enumerate(dst):
        pieces = [o.box.relative_to(t) for o in got if o.dst == j]
        check_tiling(t.sizes, pieces, what=f"target {t}")


def test_overlaps_scale_with_output_not_all_pairs():
    # Row shards vs row shards of a different count: output is ~|S|+|T|, not |S|*|T|.
    src = [Box((i * 10, 0), (10, 4)) for i in range(2000)]
    dst = [Box((i * 7, 0), (7, 4)) for i in range(2857)] + [Box((19999, 0), (1, 4))]
    got = overlaps(src, dst)
    assert len(got) < len(src) + len(dst)
    assert sum(o.box.numel for o in got) == 20000 * 4


def test_check_tiling_names_the_problem():
    with pytest.raises(InconsistentIndexError, match="overlap"):
        check_tiling((4,), [Box((0,), (3,)), Box((2,), (2,))])
    with pytest.raises(InconsistentIndexError, match="cover 3 of 4"):
        check_tiling((4,), [Box((0,), (3,))])
    with pytest.raises(InconsistentIndexError, match="outside shape"):
        check_tiling((4,), [Box((0,), (5,))])
    check_tiling((), [Box((), ())])
