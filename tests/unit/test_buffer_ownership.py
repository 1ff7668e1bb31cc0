"""RESHARD_DEBUG_BUFFERS=1: a buffer written after its owner released it is named in an
error when it is taken again, and one read after release reads the poison pattern."""

from __future__ import annotations

import pytest
import torch

from reshard_svc.errors import BufferReuseError
from reshard_svc.runtime.buffers import POISON, Arena, BufferPool, reclaim, release
from reshard_svc.sessions.sync.journal import Journal, journal_pool


@pytest.fixture
def debugging(monkeypatch):
    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "1")


def test_a_pooled_buffer_written_after_release_is_named_when_taken_again(debugging):
    pool = BufferPool(1 << 20)
    buf = pool.take((8, 8), torch.float32)
    pool.give(buf)
    assert torch.all(buf.view(torch.uint8) == POISON)  # a late reader sees the pattern
    buf[3, 1] = 1.0  # a late writer
    with pytest.raises(BufferReuseError, match="a pooled staging buffer") as e:
        pool.take((8, 8), torch.float32)
    assert e.value.buffer == "a pooled staging buffer"
    again = BufferPool(1 << 20)
    clean = again.take((4,), torch.int64)
    again.give(clean)
    assert again.take((4,), torch.int64).data_ptr() == clean.data_ptr()  # reused, unharmed


@pytest.mark.parametrize("size", [1, 100, 4096])
def test_an_arena_view_written_after_reset_fails_the_next_take_of_that_memory(debugging, size):
    arena = Arena(name="the test's arena")
    old = arena.take(size)
    old.fill_(7)
    arena.reset()
    assert torch.all(old == POISON)
    assert arena.take(size).data_ptr() == old.data_ptr()  # the same memory, untouched
    arena.reset()
    old[size - 1] = 1
    with pytest.raises(BufferReuseError, match="the test's arena"):
        arena.take(size)


def test_a_journal_dropped_then_written_is_caught_by_the_next_push(debugging):
    pool = journal_pool()
    region = torch.arange(64, dtype=torch.float32)
    first = Journal(1 << 20, pool)
    first.keep(region)
    (_, _, kept) = first.entries[0]
    first.drop()
    kept.view(torch.uint8)[0] = 0  # written after the journal let it go
    with pytest.raises(BufferReuseError, match="undo journal"):
        Journal(1 << 20, pool).keep(region)


def test_without_the_debug_mode_nothing_is_poisoned_or_checked(monkeypatch):
    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "0")
    buf = torch.ones(16, dtype=torch.uint8)
    release(buf, "x")
    assert torch.all(buf == 1)
    reclaim(buf, "x")  # no error: nothing was checked
    arr = bytearray(b"abc")
    monkeypatch.setenv("RESHARD_DEBUG_BUFFERS", "1")
    release(arr, "a message")
    assert arr == bytes([POISON] * 3)
