"""The pool of checking writers: a rank's files written by ``io_threads`` threads at their
planned offsets, block CRC32Cs built from the parts each thread summed.

Real files, one process: every file verifies and each of its block CRC32Cs equals a direct
CRC32C of the file's bytes; the state loads back bitwise; a writer thread's error fails
the save with nothing committed and no thread left over."""

from __future__ import annotations

import errno
import json
import os
import threading

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard_svc
from reshard_svc.errors import StorageError, UsageError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE
from reshard_svc.plan.budget import IO_THREADS_ENV, io_threads
from reshard_svc.runtime import io_pool


def _state(sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, n in enumerate(sizes):
        t = torch.randint(0, 255, (n,), generator=g, dtype=torch.uint8)
        out[f"t{i}"] = t.view(torch.bfloat16) if n % 2 == 0 else t
    out["strided"] = torch.arange(3000, dtype=torch.float32).view(60, 50)[:, ::3]
    return out


def _direct_blocks(path: str) -> list[int]:
    out = []
    with open(path, "rb") as f:
        while block := f.read(DEFAULT_BLOCK_SIZE):
            out.append(crc32c.crc32c(block))
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_saved_whole(root: str, state: dict[str, torch.Tensor]) -> None:
    assert reshard_svc.verify(root).ok
    index = json.loads(open(os.path.join(root, "reshard.index.json")).read())
    for name, meta in index["files"].items():
        want = bytes.fromhex(meta["blocks"])
        got = b"".join(c.to_bytes(4, "big") for c in _direct_blocks(os.path.join(root, name)))
        assert got == want, name
    back = {k: torch.empty_like(v) for k, v in state.items()}
    reshard_svc.load(back, root)
    for k, v in state.items():
        assert torch.equal(_bytes(back[k]), _bytes(v)), k


@settings(max_examples=12, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3 * DEFAULT_BLOCK_SIZE + 17), min_size=1, max_size=5),
    threads=st.sampled_from([1, 2, 7]),
    seed=st.integers(0, 2**16),
)
def test_files_written_by_the_pool_verify_and_match_a_direct_crc32c(
    tmp_path_factory, sizes, threads, seed
):
    root = str(tmp_path_factory.mktemp("pool") / "ckpt")
    state = _state(sizes, seed)
    reshard_svc.save(state, root, io_threads=threads)
    _assert_saved_whole(root, state)


def test_tasks_cut_a_long_range_at_block_bounds(tmp_path, monkeypatch):
    monkeypatch.setattr(io_pool, "TASK", 2 * DEFAULT_BLOCK_SIZE)  # many tasks per file
    state = _state([5 * DEFAULT_BLOCK_SIZE + 3, 7], 1)
    reshard_svc.save(state, str(tmp_path / "ckpt"), io_threads=3)
    _assert_saved_whole(str(tmp_path / "ckpt"), state)


def _disk_full_at(monkeypatch, nth: int) -> None:
    """The ``nth`` positional write of local storage fails with ENOSPC (the others write)."""
    from reshard_svc.storage import local

    real = local._pwrite_all
    calls = []

    def full_disk(fd, path, offset, data):
        calls.append(offset)
        if len(calls) == nth:
            raise StorageError(f"write {path}: [Errno {errno.ENOSPC}] No space left on device")
        real(fd, path, offset, data)

    monkeypatch.setattr(local, "_pwrite_all", full_disk)


def test_a_writer_threads_error_fails_the_save_and_nothing_is_committed(tmp_path, monkeypatch):
    _disk_full_at(monkeypatch, 3)
    before = {t.name for t in threading.enumerate()}
    root = tmp_path / "ckpt"
    with pytest.raises(StorageError, match="No space left"):
        reshard_svc.save(_state([3 * DEFAULT_BLOCK_SIZE], 2), str(root), io_threads=2)
    assert not (root / "reshard.index.json").exists()
    assert _io_threads_alive() == [], before


def _io_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("reshard-io")]


def test_a_real_full_tmpfs_fails_the_pooled_save_and_commits_nothing(small_tmpfs):
    """4 MiB into a 1 MiB tmpfs, 3 writer threads: ENOSPC from the kernel on some lane
    fails the save naming it; no index, no thread of the pool left; the next save to a
    roomy place works."""
    where = small_tmpfs("1m")
    state = _state([2 * 1024 * 1024, 2 * 1024 * 1024 + 6], 4)
    root = where / "ckpt"
    with pytest.raises(StorageError, match="No space left"):
        reshard_svc.save(state, str(root), io_threads=3)
    assert not (root / "reshard.index.json").exists()
    assert _io_threads_alive() == []
    with pytest.raises(reshard_svc.errors.NotACheckpointError):
        reshard_svc.load({k: torch.empty_like(v) for k, v in state.items()}, str(root))
    reshard_svc.save(state, str(where.parent / "roomy"), io_threads=3)
    _assert_saved_whole(str(where.parent / "roomy"), state)


@pytest.fixture
def through_a_small_ring(monkeypatch):
    """Every band goes through a ring of 3 slots of 1 MiB + 7 bytes (as device bands do:
    CPU bands here, in pageable slots), pieces split mid-block."""
    from reshard_svc.runtime import ring as ring_module
    from reshard_svc.runtime import save as save_module

    ring = ring_module.PinnedRing(slots=3, slot_bytes=(1 << 20) + 7)
    monkeypatch.setattr(save_module, "_through_ring", lambda band: True)
    monkeypatch.setattr(ring_module, "_RING", ring)
    return ring


@pytest.mark.parametrize("threads, checksum", [(1, "crc32c"), (2, "crc32c"), (7, "crc32c"),
                                               (2, "sha256")])  # fmt: skip
def test_bands_through_the_ring_verify_load_and_reuse_its_slots(
    tmp_path, through_a_small_ring, threads, checksum
):
    import psutil

    ring = through_a_small_ring
    buffers = [slot.buf.data_ptr() for slot in ring.slots]
    state = _state([5 * DEFAULT_BLOCK_SIZE + 3, 3 << 20, 11], threads)
    rss = []
    for i in range(5):
        root = str(tmp_path / f"ckpt{i}")
        reshard_svc.save(state, root, io_threads=threads, checksum=checksum)
        rss.append(psutil.Process().memory_info().rss)
        assert all(slot.free.is_set() for slot in ring.slots)
    _assert_saved_whole(root, state)
    assert [slot.buf.data_ptr() for slot in ring.slots] == buffers  # allocated once
    assert abs(rss[-1] - rss[0]) <= 0.01 * rss[0], rss
    assert _io_threads_alive() == []


def test_a_failed_write_through_the_ring_frees_its_slots(
    tmp_path, through_a_small_ring, monkeypatch
):
    with monkeypatch.context() as patched:
        _disk_full_at(patched, 2)
        state = _state([3 << 20, 2 << 20], 5)
        with pytest.raises(StorageError, match="No space left"):
            reshard_svc.save(state, str(tmp_path / "full"), io_threads=2)
    assert all(slot.free.is_set() for slot in through_a_small_ring.slots)
    reshard_svc.save(state, str(tmp_path / "ok"), io_threads=2)  # no slot left taken
    _assert_saved_whole(str(tmp_path / "ok"), state)


_SAVES_UNTIL_KILLED = """
import os, random, signal, sys, time, torch, reshard_svc
g = torch.Generator().manual_seed(7)
state = {f"t{i}": torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8)
         for i in range(4)}
for attempt in range(int(sys.argv[2])):  # torch imported once; each saver a fresh child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        for n in range(1000):
            reshard_svc.save(state, f"{sys.argv[1]}/{attempt}-{n}", io_threads=4)
            os.write(write, b".")
        os._exit(0)
    os.read(read, 1)  # one save committed: the next is in flight
    time.sleep(random.uniform(0.0, 0.2))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print("killed", flush=True)
"""


def test_kill_9_mid_parallel_write_leaves_only_whole_checkpoints(tmp_path):
    """A process saving 12 MiB again and again with 4 writer threads is killed (SIGKILL)
    at a random moment, three times: every checkpoint it left either verifies and loads
    bitwise, or has no index (never a torn one)."""
    import subprocess
    import sys

    got = subprocess.run(
        [sys.executable, "-c", _SAVES_UNTIL_KILLED, str(tmp_path), "3"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert got.stdout.strip() == "killed", got.stderr[-2000:]
    g = torch.Generator().manual_seed(7)
    want = {
        f"t{i}": torch.randint(0, 255, (3 << 20,), generator=g, dtype=torch.uint8) for i in range(4)
    }
    whole = {}
    for folder in sorted(tmp_path.iterdir()):  # not the staging folders (".N-M.staging-...")
        if not folder.name.startswith(".") and (folder / "reshard.index.json").exists():
            _assert_saved_whole(str(folder), want)
            attempt = folder.name.split("-")[0]
            whole[attempt] = whole.get(attempt, 0) + 1
    assert sorted(whole) == ["0", "1", "2"], (whole, sorted(p.name for p in tmp_path.iterdir()))


@pytest.mark.parametrize("bad", [0, -2, "x", "1.5", "", True])
def test_io_threads_that_is_not_a_count_is_a_usage_error_naming_it(bad, tmp_path):
    with pytest.raises(UsageError, match="io_threads must be a count"):
        reshard_svc.save({"t": torch.ones(3)}, str(tmp_path / "c"), io_threads=bad)


def test_io_threads_defaults_from_the_environment_then_the_host(monkeypatch):
    monkeypatch.setenv(IO_THREADS_ENV, "5")
    assert io_threads() == 5
    monkeypatch.setenv(IO_THREADS_ENV, "many")
    with pytest.raises(UsageError, match=IO_THREADS_ENV):
        io_threads()
    monkeypatch.delenv(IO_THREADS_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    host = io_threads()
    assert 1 <= host <= 16 and host <= len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1000")
    assert io_threads() == 1


def test_a_ranks_boxes_spread_over_one_file_per_thread_verify_and_load(tmp_path, monkeypatch):
    from reshard_svc.plan import save as plan_save_module

    monkeypatch.setattr(plan_save_module, "MIN_SPLIT_BYTES", 1 << 20)
    state = _state(
        [3 * DEFAULT_BLOCK_SIZE + 5, 2 * DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE + 7, 9], 3
    )
    root = str(tmp_path / "ckpt")
    reshard_svc.save(state, root, io_threads=3)
    index = json.loads(open(os.path.join(root, "reshard.index.json")).read())
    assert len(index["files"]) == 3, sorted(index["files"])
    _assert_saved_whole(root, state)


def _fsyncs_on_lanes(monkeypatch, fail: bool = False) -> list[tuple[int, int]]:
    """Record (thread id, files in fsync at once) for every fsync of an open data file; the
    fsyncs wait for each other a moment, so fsyncs run at once are counted as such."""
    import time

    from reshard_svc.storage import local

    real, seen, lock, inside = os.fsync, [], threading.Lock(), [0]

    def fsync(fd: int) -> None:
        if not threading.current_thread().name.startswith("reshard-io"):
            return real(fd)  # the index and the folders, from the saver
        with lock:
            inside[0] += 1
            seen.append((threading.get_ident(), inside[0]))
        time.sleep(0.2)
        with lock:
            inside[0] -= 1
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(local.os, "fsync", fsync)
    monkeypatch.setenv("RESHARD_SYNC_FILES", "1")
    return seen


def test_each_file_is_fsynced_on_its_own_lane_and_the_files_at_once(tmp_path, monkeypatch):
    seen = _fsyncs_on_lanes(monkeypatch)
    root, state = _three_files(tmp_path, monkeypatch)
    assert len(seen) == 3 and len({lane for lane, _ in seen}) == 3, seen
    assert max(at_once for _, at_once in seen) >= 2, seen
    _assert_saved_whole(root, state)


def test_a_failed_fsync_on_a_lane_fails_the_save_and_commits_nothing(tmp_path, monkeypatch):
    _fsyncs_on_lanes(monkeypatch, fail=True)
    with pytest.raises(StorageError, match="Input/output error"):
        _three_files(tmp_path, monkeypatch)
    assert not (tmp_path / "ckpt" / "reshard.index.json").exists()
    assert _io_threads_alive() == []


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    files=st.integers(1, 6),
    world=st.integers(1, 3),
)
def test_the_plan_spreads_each_ranks_boxes_over_files_once_in_order(sizes, files, world):
    from reshard_svc.layout import Box
    from reshard_svc.plan import save as plan_save_module
    from reshard_svc.plan.items import Held, Holdings

    unit = plan_save_module.MIN_SPLIT_BYTES // 8  # a box of 8 units fills a split file
    tensors = {
        f"t{i:02d}": Holdings(
            dtype="uint8",
            itemsize=1,
            shape=(n * unit,),
            held=(Held(box=Box((0,), (n * unit,)), holders=(i % world,)),),
            layout=None,
        )
        for i, n in enumerate(sizes)
    }
    one = plan_save_module.plan_save(tensors, world)
    split = plan_save_module.plan_save(tensors, world, files_per_rank=files)
    assert one.chunks.keys() == split.chunks.keys()
    for rank in range(world):
        flat = [e for spec in split.files_of(rank) for e in spec.entries]
        assert flat == [e for spec in one.files_of(rank) for e in spec.entries]  # once, in order
        specs = split.files_of(rank)
        total = sum(spec.size - len(spec.header) for spec in specs)
        assert len(specs) <= max(1, min(files, len(flat), total // (8 * unit)))
        names = [spec.name for spec in specs]
        assert len(set(names)) == len(names)


def test_the_manager_and_async_save_take_io_threads_and_refuse_a_bad_one_first(tmp_path):
    state = _state([2 * DEFAULT_BLOCK_SIZE + 1], 4)
    with pytest.raises(UsageError, match="io_threads must be a count"):
        reshard_svc.CheckpointManager(str(tmp_path / "bad"), io_threads="x")
    assert not (tmp_path / "bad").exists()  # refused before the root was taken
    with reshard_svc.CheckpointManager(str(tmp_path / "run"), io_threads=3) as mgr:
        assert mgr.io_threads == 3
        mgr.save(1, state)
        mgr.wait()
    _assert_saved_whole(str(tmp_path / "run" / "step-0000000001"), state)
    reshard_svc.async_save(state, str(tmp_path / "async"), io_threads=2).result()
    _assert_saved_whole(str(tmp_path / "async"), state)
    with pytest.raises(UsageError, match="io_threads must be a count"):
        reshard_svc.async_save(state, str(tmp_path / "async2"), io_threads=0)


def _three_files(tmp_path, monkeypatch) -> tuple[str, dict[str, torch.Tensor]]:
    from reshard_svc.plan import save as plan_save_module

    monkeypatch.setattr(plan_save_module, "MIN_SPLIT_BYTES", 1 << 20)
    state = _state([3 * DEFAULT_BLOCK_SIZE + 5, 2 * DEFAULT_BLOCK_SIZE + 1, DEFAULT_BLOCK_SIZE], 6)
    root = str(tmp_path / "ckpt")
    reshard_svc.save(state, root, io_threads=3)
    return root, state


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_the_reading_pool_loads_each_file_on_a_thread_of_its_own_bitwise(
    tmp_path, monkeypatch, threads
):
    from reshard_svc.runtime.reading import StorageSource

    root, state = _three_files(tmp_path, monkeypatch)
    who: set[str] = set()
    real = StorageSource._read_in_place

    def spy(self, r, *target):
        who.add(threading.current_thread().name.split("_")[0])
        return real(self, r, *target)

    monkeypatch.setattr(StorageSource, "_read_in_place", spy)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    stats = reshard_svc.load(back, root, io_threads=threads)
    for k, v in state.items():
        assert torch.equal(_bytes(back[k]), _bytes(v)), k
    assert who == ({"MainThread"} if threads == 1 else {"reshard-read"}), who
    assert stats.bytes_read >= sum(v.numel() * v.element_size() for v in state.values())
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-read")]


def test_a_bad_block_read_by_the_pool_names_it_and_no_reader_outlives_the_load(
    tmp_path, monkeypatch
):
    root, state = _three_files(tmp_path, monkeypatch)
    index = json.loads(open(os.path.join(root, "reshard.index.json")).read())
    name = sorted(index["files"])[1]
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(DEFAULT_BLOCK_SIZE + 100)
        byte = f.read(1)
        f.seek(DEFAULT_BLOCK_SIZE + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(reshard_svc.ChecksumError, match=rf"{name}: bytes .* \(block 1\) fail"):
        reshard_svc.load(back, root, io_threads=3)
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-read")]
    with pytest.raises(UsageError, match="io_threads must be a count"):
        reshard_svc.load(back, root, io_threads=0)


def test_strided_and_zero_dim_bands_go_through_the_ring(tmp_path, through_a_small_ring):
    """A column slice's rows (stride 3) and a 0-dim scalar: their bytes, not the storage's
    (seen on a GPU host: a strided band could not be viewed as bytes)."""
    state = {
        "strided": torch.randn(512, 300)[:, ::3],
        "row_strided": torch.randn(4000)[::3],
        "scalar": torch.tensor(7.0),
        "whole": torch.randn(64, 64),
    }
    root = str(tmp_path / "ckpt")
    reshard_svc.save(state, root, io_threads=2)
    _assert_saved_whole(root, state)
    assert all(slot.free.is_set() for slot in through_a_small_ring.slots)


@pytest.fixture
def loading_through_a_small_ring(monkeypatch, through_a_small_ring):
    """Loads fill their destinations as device tensors are filled: each read cut into
    slot-sized runs of whole blocks, read and checked in a slot on the reading pool, then
    copied out (CPU destinations here). Counts the runs each thread read."""
    from reshard_svc.runtime import reading

    monkeypatch.setattr(reading, "_through_ring", lambda view: True)
    runs: list[str] = []
    real = reading.StorageSource._read_to_device

    def spy(self, ring, r, flat, a, b):
        runs.append(threading.current_thread().name.split("_")[0])
        return real(self, ring, r, flat, a, b)

    monkeypatch.setattr(reading.StorageSource, "_read_to_device", spy)
    return through_a_small_ring, runs


@pytest.mark.parametrize("threads", [1, 2, 7])
def test_a_load_through_the_ring_is_bitwise_and_frees_every_slot(
    tmp_path, monkeypatch, loading_through_a_small_ring, threads
):
    ring, runs = loading_through_a_small_ring
    root, state = _three_files(tmp_path, monkeypatch)
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    reshard_svc.load(back, root, io_threads=threads)
    for k, v in state.items():
        assert torch.equal(_bytes(back[k]), _bytes(v)), k
    assert len(runs) >= 6  # the big reads, a block per run (1 MiB slots)
    assert set(runs) == ({"MainThread"} if threads == 1 else {"reshard-read"}), runs
    assert all(slot.free.is_set() for slot in ring.slots)
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-read")]


def test_a_bad_block_read_through_the_ring_names_it_and_frees_every_slot(
    tmp_path, monkeypatch, loading_through_a_small_ring
):
    ring, runs = loading_through_a_small_ring
    root, state = _three_files(tmp_path, monkeypatch)
    index = json.loads(open(os.path.join(root, "reshard.index.json")).read())
    name = sorted(index["files"])[0]
    with open(os.path.join(root, name), "r+b") as f:
        f.seek(2 * DEFAULT_BLOCK_SIZE + 7)
        byte = f.read(1)
        f.seek(2 * DEFAULT_BLOCK_SIZE + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(reshard_svc.ChecksumError, match=rf"{name}: bytes .* \(block 2\) fail"):
        reshard_svc.load(back, root, io_threads=3)
    assert runs and all(slot.free.is_set() for slot in ring.slots)
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-read")]


def test_a_task_waits_for_its_bytes_before_it_sums_and_writes_them(tmp_path):
    """A device copy into a ring slot is only queued when the slot is handed to the pool:
    each task calls ``ready`` before reading (here ``ready`` is what fills the bytes)."""
    from reshard_svc.storage import open_storage

    size = 3 * DEFAULT_BLOCK_SIZE + 11
    want = os.urandom(size)
    buf = bytearray(size)  # still empty when put
    storage = open_storage(str(tmp_path / "files"))
    with io_pool.WritePool(3, 1 << 30) as pool:
        with pool.files(storage, [("f.bin", size)], "crc32c", DEFAULT_BLOCK_SIZE) as (out,):
            out.put(0, memoryview(buf), ready=lambda: buf.__setitem__(slice(None), want))
            name, n, sums = out.close()
    assert open(tmp_path / "files" / "f.bin", "rb").read() == want
    assert bytes.fromhex(sums["blocks"]) == b"".join(
        c.to_bytes(4, "big") for c in _direct_blocks(str(tmp_path / "files" / "f.bin"))
    )
