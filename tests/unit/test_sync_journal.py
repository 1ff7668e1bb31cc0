"""The undo journal of a weight-sync push (``sessions.sync.journal.Journal``): whatever a
push overwrote — whole regions, a delta's changed elements by mask or by position, in
strided views, NaN payloads and -0.0 included — comes back bitwise, newest first; past
its budget it says it cannot."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.runtime import delta
from reshard_svc.sessions.sync.journal import Journal


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), density=st.sampled_from([0.0, 0.01, 0.3, 1.0]))
def test_undo_puts_back_every_overwritten_element_bitwise(seed: int, density: float) -> None:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(-(2**15), 2**15, (24, 40), generator=g, dtype=torch.int16)
    target = target.view(torch.bfloat16)
    before = target.clone()
    journal = Journal(1 << 20)
    regions = [target[:8], target[8:16, ::3], target.t()[5:20]]  # contiguous and strided
    for i, region in enumerate(regions):
        new = torch.randint(-(2**15), 2**15, region.shape, generator=g, dtype=torch.int16)
        new = new.view(torch.bfloat16)
        if i == 0:  # a whole piece
            journal.keep(region)
            region.copy_(new)
            continue
        where = torch.rand(region.shape, generator=g) < density
        if i == 2:  # positions rather than a mask
            where = torch.nonzero(where.reshape(-1)).reshape(-1)
            values = _ints(new).reshape(-1)[where]
        else:
            values = _ints(new).reshape(-1)[where.reshape(-1)]
        journal.keep(region, where)
        delta.patch(region, where, values)
    assert journal.undo()
    assert torch.equal(_ints(target), _ints(before))
    assert journal.entries == [] and journal.nbytes == 0


def test_a_journal_past_its_budget_cannot_undo() -> None:
    target = torch.arange(64, dtype=torch.float32)
    journal = Journal(100)
    journal.keep(target[:16])  # 64 bytes: kept
    target[:16] = -1
    journal.keep(target[16:32])  # 64 more: past the budget, nothing kept from now on
    target[16:32] = -2
    assert journal.complete is False and journal.entries == []
    assert journal.undo() is False
    assert journal.complete  # ready for the next push
