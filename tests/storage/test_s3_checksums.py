"""Uploads to S3 carry their CRC32C (``x-amz-checksum-crc32c``), single-part and multipart.

Real S3 recomputes the value and refuses a corrupted upload. moto (the S3 server these tests
talk to) stores the value it is sent without recomputing it, so these tests read it back
with ``ChecksumMode=ENABLED`` and check it against the stored bytes.
"""

from __future__ import annotations

import base64
import struct

import fsspec
import pytest
import torch

import reshard_svc
from reshard_svc.format.checksums import crc32c
from reshard_svc.storage import S3Storage, open_storage
from reshard_svc.storage.s3 import S3ChecksumWriter

pytestmark = pytest.mark.s3


def stored_checksum(fs, path: str) -> tuple[str | None, bytes]:
    bucket, key, _ = fs.split_path(path)
    head = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    return head.get("ChecksumCRC32C"), fs.cat_file(path)


def b64(value: int) -> str:
    return base64.b64encode(struct.pack(">I", value)).decode()


def test_single_part_upload_carries_its_crc32c(s3):
    storage = open_storage(f"{s3}/ck")
    assert isinstance(storage, S3Storage)
    storage.write("small.bin", b"hello world")
    sent, data = stored_checksum(storage.fs, storage.path("small.bin"))
    assert data == b"hello world" and sent == b64(crc32c(data))


def test_multipart_upload_sends_a_crc32c_per_part(s3):
    storage = open_storage(f"{s3}/ck")
    payload = torch.randint(0, 256, (13 * 2**20,), dtype=torch.uint8).numpy().tobytes()
    w = S3ChecksumWriter(storage.fs, storage.path("big.bin"), part_size=5 * 2**20)
    for i in range(0, len(payload), 3 * 2**20 + 7):  # writes that straddle part bounds
        w.write(payload[i : i + 3 * 2**20 + 7])
    w.close()
    assert [p["PartNumber"] for p in w.parts] == [1, 2, 3]
    starts = [0, 5 * 2**20, 10 * 2**20, len(payload)]
    for part, lo, hi in zip(w.parts, starts, starts[1:]):
        assert part["ChecksumCRC32C"] == b64(crc32c(payload[lo:hi]))
    assert storage.fs.cat_file(storage.path("big.bin")) == payload


def test_discarded_upload_leaves_no_object(s3):
    storage = open_storage(f"{s3}/ck")
    w = S3ChecksumWriter(storage.fs, storage.path("gone.bin"), part_size=5 * 2**20)
    w.write(b"x" * (6 * 2**20))
    assert w.upload_id is not None
    w.discard()
    assert not storage.exists("gone.bin")
    bucket, key, _ = storage.fs.split_path(storage.path("gone.bin"))
    uploads = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"] == key]


def test_saved_checkpoint_files_carry_crc32c_and_load_checks_blocks(s3):
    uri = f"{s3}/run/step1"
    sd = {"w": torch.randn(512, 1024), "b": torch.randn(7)}
    index = reshard_svc.save(sd, uri)
    fs = fsspec.filesystem("s3")
    for name in [*index.files, "reshard.index.json"]:
        sent, data = stored_checksum(fs, f"{uri}/{name}".removeprefix("s3://"))
        assert sent == b64(crc32c(data)), name
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, uri)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    assert reshard_svc.verify(uri).ok


def test_parts_of_one_object_are_in_flight_at_once_and_complete_in_order(s3):
    """7 parts of 5 MiB through moto, up to 3 at once: the server sees overlapping part
    requests, the parts complete in order, the object is the bytes written."""
    import threading
    import time

    storage = open_storage(f"{s3}/ck")
    payload = torch.randint(0, 256, (33 * 2**20,), dtype=torch.uint8).numpy().tobytes()
    w = S3ChecksumWriter(storage.fs, storage.path("wide.bin"), part_size=5 * 2**20, parallel=3)
    busy, most, lock = [0], [0], threading.Lock()
    real = w._call

    def counted(method, **kwargs):
        if method != "upload_part":
            return real(method, **kwargs)
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.2)  # long enough for the next part to start meanwhile
            return real(method, **kwargs)
        finally:
            with lock:
                busy[0] -= 1

    w._call = counted
    for i in range(0, len(payload), 4 * 2**20):
        w.write(payload[i : i + 4 * 2**20])
    w.close()
    assert most[0] == 3, most
    assert [p["PartNumber"] for p in w.parts] == list(range(1, 8))
    assert storage.fs.cat_file(storage.path("wide.bin")) == payload
    assert not [t for t in threading.enumerate() if t.name.startswith("reshard-s3-part")]


def test_a_failed_part_leaves_no_object_and_no_upload(s3):
    from reshard_svc.errors import StorageError

    storage = open_storage(f"{s3}/ck")
    w = S3ChecksumWriter(storage.fs, storage.path("torn.bin"), part_size=5 * 2**20, parallel=2)
    real = w._call

    def third_fails(method, **kwargs):
        if method == "upload_part" and kwargs["PartNumber"] == 3:
            raise StorageError("upload_part: connection reset")
        return real(method, **kwargs)

    w._call = third_fails
    with pytest.raises(StorageError, match="connection reset"):
        w.write(b"y" * (26 * 2**20))
        w.close()
    assert not storage.exists("torn.bin")
    bucket, key, _ = storage.fs.split_path(storage.path("torn.bin"))
    uploads = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert not [u for u in uploads if u["Key"] == key]
