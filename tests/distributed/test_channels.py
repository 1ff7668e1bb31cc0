"""Channels: three threads of each rank on one gloo group (a checkpoint manager's), the
caller's collectives and two background threads' tagged messages, each thread on its own
per-rank schedule, so their orders differ from rank to rank."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist

from reshard_svc.errors import DistributedError
from reshard_svc.runtime.comm import Channel, Comm
from tests.support.harness import run

pytestmark = [pytest.mark.distributed]

ROUNDS = 25


def _nap(rng: random.Random) -> None:
    time.sleep(rng.random() * 0.004)


def _agreements(ch: Comm, rank: int, world: int, seed: int, errors: list[str]) -> None:
    rng = random.Random(seed)
    for i in range(ROUNDS):
        _nap(rng)
        got = ch.all_gather_json({"rank": rank, "i": i, "pad": "x" * rng.randrange(200)})
        if [(g["rank"], g["i"]) for g in got] != [(r, i) for r in range(world)]:
            errors.append(f"{ch}: round {i} gathered {[(g['rank'], g['i']) for g in got]}")
        if ch.all_reduce_max([rank, i, -rank]) != [world - 1, i, 0]:
            errors.append(f"round {i}: a wrong maximum")
        if i % 5 == 0:
            try:
                ch.run_everywhere("a check", lambda: 1 / 0 if rank == 1 else 0)
            except ZeroDivisionError:
                pass
            except DistributedError as e:
                if list(e.failures) != [1]:
                    errors.append(f"round {i}: failures {e.failures}")
            else:
                errors.append(f"round {i}: a failure on rank 1 went unseen")


def _swaps(ch: Channel, rank: int, world: int, seed: int, errors: list[str]) -> None:
    """A ring of swaps in which the last rank sits out every third round (as a fast-tier
    rank with no peers does): nothing is sent to it then, and it calls nothing."""
    rng = random.Random(seed)
    last = world - 1
    for i in range(ROUNDS):
        _nap(rng)
        out = i % 3 == 0
        if out and rank == last:
            continue
        ring = [r for r in range(world) if not (out and r == last)]
        at = ring.index(rank)
        to, frm = ring[(at + 1) % len(ring)], ring[at - 1]
        n = 1 + (i * 7 + frm) % 50_000  # what `frm` sends this round
        send = torch.full((1 + (i * 7 + rank) % 50_000,), (rank * 31 + i) % 256, dtype=torch.uint8)
        recv = torch.empty(n, dtype=torch.uint8)
        ch.swap({to: send}, {frm: recv})
        if not bool((recv == (frm * 31 + i) % 256).all()):
            errors.append(f"swap round {i}: rank {rank} got the wrong bytes from {frm}")


def three_threads_on_one_group(seed: int) -> list[str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    comm = Comm(group)
    first, second = comm.channel("first"), comm.channel("second")
    errors: list[str] = []
    threads = [
        threading.Thread(target=_agreements, args=(first, rank, world, seed + rank, errors)),
        threading.Thread(target=_swaps, args=(second, rank, world, seed * 7 + rank, errors)),
    ]
    for t in threads:
        t.start()
    _agreements(comm, rank, world, seed * 13 + rank, errors)  # the caller's collectives
    for t in threads:
        t.join()
    # an exchange on a channel goes point to point: rank r sends r + 1 bytes to each rank
    send = torch.full(((rank + 1) * world,), rank, dtype=torch.uint8)
    got = first.exchange(send, [rank + 1] * world, [r + 1 for r in range(world)])
    want = torch.cat([torch.full((r + 1,), r, dtype=torch.uint8) for r in range(world)])
    if not torch.equal(got, want):
        errors.append(f"exchange on a channel: {got.tolist()}")
    try:
        first.channel("nested")
        errors.append("a channel opened a channel")
    except DistributedError:
        pass
    dist.destroy_process_group(group)
    return errors


def test_threads_with_their_own_orders_share_one_group_through_channels():
    assert run(three_threads_on_one_group, 3, 1234) == {r: [] for r in range(3)}
