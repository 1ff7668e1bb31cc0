"""Every data file reaches the disk (fsync) before the index that names it is written."""

from __future__ import annotations

import os

import pytest
import torch

import reshard_svc
from reshard_svc.errors import UsageError
from reshard_svc.format.index import INDEX_NAME
from reshard_svc.storage import LocalStorage, open_storage


@pytest.fixture
def journal(monkeypatch):
    """The order of fsyncs (by path) and index writes in this process."""
    monkeypatch.delenv("RESHARD_SYNC_FILES", raising=False)
    events: list[tuple[str, str]] = []
    real_fsync = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}") if isinstance(fd, int) else str(fd)
        events.append(("fsync", path))
        return real_fsync(fd)

    def noting(real):  # the index is written (``write``) or written beside and renamed in
        def write(self, name, data):
            if name == INDEX_NAME:
                events.append(("index", self.path(name)))
            return real(self, name, data)

        return write

    monkeypatch.setattr(os, "fsync", fsync)
    for method in ("write", "replace"):
        monkeypatch.setattr(LocalStorage, method, noting(getattr(LocalStorage, method)))
    return events


def _state():
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.w": torch.randn(64, 32, generator=g) for i in range(3)}


def _data_files_synced_before_index(events, uri):
    names = set(reshard_svc.inspect(uri).files)
    assert names, "the checkpoint has no data files"
    index_at = next(i for i, (kind, _) in enumerate(events) if kind == "index")
    synced = {os.path.basename(p) for kind, p in events[:index_at] if kind == "fsync"}
    return names - synced


def test_save_fsyncs_every_data_file_before_the_index(tmp_path, journal):
    uri = str(tmp_path / "ck")
    reshard_svc.save(_state(), uri)
    assert _data_files_synced_before_index(journal, uri) == set()


def test_convert_fsyncs_every_data_file_before_the_index(tmp_path, journal):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    reshard_svc.save(_state(), src, checksum="none")
    journal.clear()
    reshard_svc.convert(src, dst, mesh="tp=2", rules={"*": "S(0)"})
    assert _data_files_synced_before_index(journal, dst) == set()


def test_sync_files_off_skips_every_fsync(tmp_path, journal, monkeypatch):
    state = _state()
    reshard_svc.save(state, str(tmp_path / "a"), storage_options={"sync_files": False})
    monkeypatch.setenv("RESHARD_SYNC_FILES", "0")
    reshard_svc.save(state, str(tmp_path / "b"))
    reshard_svc.convert(str(tmp_path / "b"), str(tmp_path / "c"), mesh="tp=2")
    assert [e for e in journal if e[0] == "fsync"] == []
    for uri in (tmp_path / "a", tmp_path / "b", tmp_path / "c"):
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        reshard_svc.load(out, str(uri))
        assert all(torch.equal(out[k], state[k]) for k in state)


def test_an_abandoned_file_is_closed_without_a_sync(tmp_path, journal):
    import gc

    storage = open_storage(str(tmp_path / "x"))
    f = storage.open_write("a.safetensors")
    f.write(b"partial")
    fd = f.fileno()
    del f
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    g = storage.open_write("b.safetensors")
    g.discard()
    assert journal == []
    h = storage.open_write("c.safetensors")
    h.close()
    assert [os.path.basename(p) for _, p in journal] == ["c.safetensors"]


@pytest.mark.parametrize("bad", ["maybe", "2"])
def test_bad_sync_setting_is_a_usage_error(tmp_path, monkeypatch, bad):
    monkeypatch.setenv("RESHARD_SYNC_FILES", bad)
    with pytest.raises(UsageError, match="RESHARD_SYNC_FILES"):
        open_storage(str(tmp_path / "x"))
    monkeypatch.delenv("RESHARD_SYNC_FILES")
    with pytest.raises(UsageError, match="sync_files"):
        open_storage(str(tmp_path / "x"), {"sync_files": bad})


def test_writeback_starts_while_a_file_is_written(tmp_path, monkeypatch):
    """Every ``WRITEBACK_BYTES`` written, the kernel is asked to start writing them
    (``sync_file_range``): contiguous ranges from the start of the file, none past its end."""
    from reshard_svc.storage import local

    if not os.uname().sysname == "Linux":
        pytest.skip("sync_file_range is Linux's")
    real = local._start_writeback
    assert real is not None, "sync_file_range not found in the C library"
    kicks: list[tuple[str, int, int]] = []

    def start(fd, offset, nbytes):
        kicks.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, nbytes))
        real(fd, offset, nbytes)  # the real call, on a real file: must not raise

    monkeypatch.setattr(local, "_start_writeback", start)
    monkeypatch.setattr(local.DurableFile, "WRITEBACK_BYTES", 4096)
    storage = open_storage(str(tmp_path / "x"), {"sync_files": True})
    f = storage.open_write("a.safetensors")
    data = os.urandom(30_000)
    for i in range(0, len(data), 3000):
        f.write(data[i : i + 3000])
    f.close()
    assert (tmp_path / "x" / "a.safetensors").read_bytes() == data
    assert [k[0] for k in kicks] == ["a.safetensors"] * len(kicks) and len(kicks) == 5
    ends = [0] + [off + n for _, off, n in kicks]
    assert [off for _, off, _ in kicks] == ends[:-1] and ends[-1] <= len(data)
    assert all(n >= 4096 for _, _, n in kicks)

    # converting writes its data files through the same path
    kicks.clear()
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    reshard_svc.save(_state(), src, checksum="none")
    kicks.clear()
    reshard_svc.convert(src, dst, mesh="tp=2", rules={"*": "S(0)"})
    assert {k[0] for k in kicks} == set(reshard_svc.inspect(dst).files)
