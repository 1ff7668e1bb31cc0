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
