"""One conformance suite over every backend: local folders, memory:// and S3 (moto)."""

from __future__ import annotations

import pytest
import torch

import reshard_svc
from reshard_svc.errors import NotACheckpointError, StorageError
from reshard_svc.storage import FsspecStorage, open_storage


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "big": torch.randn(256, 64, generator=g),
            "small": torch.randn(3, generator=g).to(torch.bfloat16),
            "flag": torch.tensor([True, False, True]),
            "step": torch.tensor(seed, dtype=torch.int64),
        },
        "epoch": seed,
    }


def zeros_like(sd: dict) -> dict:
    m = sd["model"]
    return {"model": {k: torch.zeros_like(v) for k, v in m.items()}, "epoch": None}


def assert_same(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["epoch"] == b["epoch"]


def test_round_trip_inspect_verify(root):
    uri = f"{root}/ck"
    sd = state(1)
    reshard_svc.save(sd, uri)
    out = zeros_like(sd)
    stats = reshard_svc.load(out, uri)
    assert_same(sd, out)
    info = reshard_svc.inspect(uri)
    # Reads widen to whole CRC32C blocks: here, each (small) file once.
    assert stats.bytes_total <= stats.bytes_read <= sum(f.size for f in info.files.values())
    assert info.tensors["model.big"].shape == (256, 64)
    assert info.extras == {"epoch": 1}
    report = reshard_svc.verify(uri)
    assert report.ok, report.problems
    assert report.bytes_hashed == sum(f.size for f in info.files.values())


@pytest.mark.parametrize("checksum", ["none", "crc32c"])
def test_partial_load_reads_only_the_needed_ranges(root, checksum):
    uri = f"{root}/ck"
    sd = state(2)
    reshard_svc.save(sd, uri, checksum=checksum)
    out = {"model": {"small": torch.zeros(3, dtype=torch.bfloat16)}}
    stats = reshard_svc.load(out, uri, strict=False)
    assert torch.equal(out["model"]["small"], sd["model"]["small"])
    if checksum == "none":
        assert stats.bytes_read == 6  # three bf16 values, not the whole file
    else:  # the one (short) CRC block that holds them, which is checked before use
        index = reshard_svc.inspect(uri)
        (chunk,) = index.tensors["model.small"].chunks
        table = index.files[chunk.file].blocks
        lo, hi = table.widen(chunk.begin, chunk.end)
        assert stats.bytes_read == hi - lo <= table.block_size


def _fail_commit(monkeypatch):
    def boom(self, staging, index_name, index_bytes, replaced=()):
        raise StorageError("injected failure before commit")

    monkeypatch.setattr(type(open_storage("/tmp")), "commit", boom)
    monkeypatch.setattr(FsspecStorage, "commit", boom)


def test_failed_save_leaves_no_checkpoint(root, monkeypatch):
    uri = f"{root}/ck"
    _fail_commit(monkeypatch)
    with pytest.raises(StorageError, match="injected"):
        reshard_svc.save(state(3), uri)
    with pytest.raises(NotACheckpointError):
        reshard_svc.inspect(uri)
    with pytest.raises(NotACheckpointError):
        reshard_svc.load(zeros_like(state(3)), uri)
    assert not reshard_svc.verify(uri).ok
    storage = open_storage(uri)
    assert [n for n in storage.listdir() if n.endswith(".safetensors")] == []


def test_overwrite_keeps_old_checkpoint_until_new_one_commits(root, monkeypatch):
    uri = f"{root}/ck"
    old, new = state(4), state(5)
    reshard_svc.save(old, uri)
    with monkeypatch.context() as m:
        _fail_commit(m)
        with pytest.raises(StorageError):
            reshard_svc.save(new, uri, overwrite=True)
    out = zeros_like(old)
    reshard_svc.load(out, uri)
    assert_same(old, out)
    assert reshard_svc.verify(uri).ok
    reshard_svc.save(new, uri, overwrite=True)
    out = zeros_like(new)
    reshard_svc.load(out, uri)
    assert_same(new, out)
    info = reshard_svc.inspect(uri)
    data_files = [n for n in open_storage(uri).listdir() if n.endswith(".safetensors")]
    assert sorted(data_files) == sorted(info.files)  # the replaced files are gone
    assert reshard_svc.verify(uri).ok


def test_missing_folder_is_not_a_checkpoint(root):
    with pytest.raises(NotACheckpointError):
        reshard_svc.inspect(f"{root}/nothing-here")


def test_replace_writes_a_file_in_one_step_and_leaves_nothing_beside(root):
    storage = open_storage(f"{root}/ck")
    storage.replace("record.json", b'{"step": 1}')
    storage.replace("record.json", b'{"step": 2, "more": "bytes"}')
    assert storage.read("record.json") == b'{"step": 2, "more": "bytes"}'
    assert storage.listdir() == ["record.json"]  # no temporary left beside it


def test_replace_that_fails_keeps_the_old_file_whole(root, monkeypatch):
    storage = open_storage(f"{root}/ck")
    storage.replace("record.json", b'{"step": 1}')
    if not root.startswith("/"):
        pytest.skip("an object store's PUT is the one step")
    import os

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(StorageError, match="No space left"):
        storage.replace("record.json", b'{"step": 2}')
    assert storage.read("record.json") == b'{"step": 1}'
    assert storage.listdir() == ["record.json"]


def test_remove_tree_removes_a_folder_and_all_under_it(root):
    storage = open_storage(f"{root}/tree")
    storage.write("a.json", b"1")
    inner = open_storage(f"{root}/tree/part-00001")
    inner.write("b.safetensors", b"22")
    open_storage(f"{root}/beside").write("c", b"3")
    storage.remove_tree()
    assert storage.listdir() == [] and inner.listdir() == []
    assert open_storage(f"{root}/beside").read("c") == b"3"  # only the folder named
    storage.remove_tree()  # gone already: no error


def test_every_backend_satisfies_the_three_protocols(root):
    from reshard_svc.storage import Committer, LeaseStore, Storage

    storage = open_storage(f"{root}/ck")
    assert isinstance(storage, Storage)
    assert isinstance(storage, Committer)
    assert isinstance(storage, LeaseStore)


def test_the_lease_changes_only_by_compare_and_swap(root):
    """One create wins; renew, take-over and drop need the version they knew; a stale
    version is refused everywhere (the one-owner rule rests on this)."""
    from reshard_svc.storage.base import LeaseHeld, LeaseLost

    storage = open_storage(f"{root}/ck")
    assert storage.read_lease() is None
    v1 = storage.create_lease(b'{"token": "a"}', "a" * 32)
    with pytest.raises(LeaseHeld) as held:
        storage.create_lease(b'{"token": "b"}', "b" * 32)
    assert held.value.state.record == b'{"token": "a"}' and held.value.state.version == v1
    v2 = storage.renew_lease(v1, b'{"token": "a", "n": 2}')
    with pytest.raises(LeaseLost):
        storage.renew_lease(v1, b'{"token": "a", "n": 3}')  # v1 is gone
    with pytest.raises(LeaseLost):
        storage.replace_lease(v1, b'{"token": "c"}', "c" * 32)
    v3 = storage.replace_lease(v2, b'{"token": "c"}', "c" * 32)  # a take-over: one wins
    with pytest.raises(LeaseLost):
        storage.replace_lease(v2, b'{"token": "d"}', "d" * 32)
    storage.drop_lease(v2)  # not the current one: nothing happens
    assert storage.read_lease().record == b'{"token": "c"}'
    storage.drop_lease(v3)
    assert storage.read_lease() is None
    # a renewal or take-over of a lease another run removed meanwhile: lost, not an error
    with pytest.raises(LeaseLost):
        storage.renew_lease(v3, b'{"token": "c", "n": 2}')
    with pytest.raises(LeaseLost):
        storage.replace_lease(v3, b'{"token": "f"}', "f" * 32)
    v5 = storage.create_lease(b'{"token": "e"}', "e" * 32)
    # an empty version is no condition: refused, never sent as one (S3: an empty If-Match)
    with pytest.raises(LeaseLost):
        storage.renew_lease("", b'{"token": "g"}')
    with pytest.raises(LeaseLost):
        storage.replace_lease("", b'{"token": "g"}', "g" * 32)
    storage.drop_lease("")
    assert storage.read_lease().version == v5


def test_a_lease_released_while_a_contender_looked_is_never_taken_from_its_next_holder(
    root, monkeypatch
):
    """Run C's create is refused while W holds the lease; before C reads who holds it, W
    releases and F creates. C must then be told F holds it, and F must still commit (CI
    met the old way on S3: C "took over" the empty lease it read, unconditionally)."""
    from reshard_svc.errors import TargetBusyError
    from reshard_svc.storage.base import LeaseHeld, LeaseState
    from reshard_svc.storage.leases import Lease

    w_store, f_store, c_store = (open_storage(f"{root}/ck") for _ in range(3))
    w = Lease.acquire(w_store, w_store.uri, "w" * 32, "convert", lambda *_: None)
    held: list[Lease] = []

    def refused_then_released(record: bytes, token: str) -> str:
        monkeypatch.undo()
        w.release()
        held.append(Lease.acquire(f_store, f_store.uri, "f" * 32, "convert", lambda *_: None))
        raise LeaseHeld(LeaseState(b"", "", None))  # what C read in the gap: nothing

    monkeypatch.setattr(c_store, "create_lease", refused_then_released)
    with pytest.raises(TargetBusyError, match="is being written by"):
        Lease.acquire(c_store, c_store.uri, "c" * 32, "convert", lambda *_: None)
    f = held[0]
    f.confirm()  # still F's
    assert f_store.read_lease().version == f.version
    f.release()


def test_capabilities_and_reads_into_place(root):
    """``positional`` fills buffers in order on every backend; ``root_kind`` names the
    URI; the capabilities the planner uses say what the backend is."""
    storage = open_storage(f"{root}/ck")
    assert storage.root_kind() == "missing"
    payload = bytes(range(256)) * 4
    storage.write("blob.bin", payload)
    assert storage.root_kind() == "folder"
    assert open_storage(f"{root}/ck/blob.bin").root_kind() == "file"
    runs = [memoryview(bytearray(n)) for n in (3, 0, 100, 7)]
    with storage.positional("blob.bin") as readv:
        readv(10, runs)
    assert b"".join(bytes(r) for r in runs) == payload[10:120]
    assert storage.local_files == (not root.startswith(("memory://", "s3://")))
    assert storage.latency_s > 0 and storage.bandwidth > 0
