"""S3 (s3fs): uploads that carry their CRC32C, so the store rejects a corrupted upload, and
a lease changed only by conditional requests.

Every ``PutObject`` and every ``UploadPart`` sends ``x-amz-checksum-crc32c`` with the CRC32C
of exactly the bytes sent (multipart uploads are created with ``ChecksumAlgorithm=CRC32C``
and completed with each part's checksum). S3 recomputes it and refuses the request on a
mismatch. s3fs's own writer cannot do this: it passes no per-part checksum, and S3 then
refuses to complete a CRC32C multipart upload. So this module drives the multipart upload
itself through s3fs's ``call_s3`` (same client, credentials and endpoint settings), up to
:data:`PARTS_IN_FLIGHT` parts of one object at once (s3fs runs each request on its event
loop, so the parts travel in parallel; a writer waits only when that many are in flight).

The lease (``.reshard-lease.json`` in the folder) is created with ``If-None-Match: *``
(S3 has refused a second create with 412 since 2024), renewed and taken over with
``If-Match: <ETag>``, and deleted with ``If-Match`` too: two runs can never both hold it.
A request whose answer was lost is settled by reading the lease back.
"""

from __future__ import annotations

import base64
import logging
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import IO, Any, cast

import crc32c

from reshard_svc.errors import MissingFileError, StorageError
from reshard_svc.storage.base import LeaseHeld, LeaseLost, LeaseState
from reshard_svc.storage.fsspec_store import LEASE_NAME, FsspecStorage, translate_errors

__all__ = ["S3ChecksumWriter", "S3Storage", "crc32c_b64"]

logger = logging.getLogger(__name__)

#: botocore's "standard" retry mode: 5xx, SlowDown and throttling, connection resets and
#: timeouts, with jittered exponential backoff. s3fs adds its own retries on top. A
#: caller's own ``config_kwargs={"retries": ...}`` wins.
RETRIES = {"max_attempts": 10, "mode": "standard"}

#: Bytes per uploaded part (S3 allows 5 MiB to 5 GiB, at most 10,000 parts per object).
PART_SIZE = 32 * 1024 * 1024
MAX_PARTS = 10_000
#: Parts of one object being uploaded at once (memory: this many parts of PART_SIZE).
PARTS_IN_FLIGHT = 4


def crc32c_b64(data: Any) -> str:
    """The ``x-amz-checksum-crc32c`` value of ``data``: base64 of the big-endian CRC."""
    return base64.b64encode(struct.pack(">I", crc32c.crc32c(data))).decode()


class S3ChecksumWriter:
    """A write-only binary stream to one S3 object; the object appears on ``close``."""

    def __init__(
        self, fs: Any, path: str, part_size: int = PART_SIZE, parallel: int = PARTS_IN_FLIGHT
    ) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size = part_size
        self.parallel = max(1, parallel)
        self.buffer = bytearray()
        self.parts: list[dict[str, Any]] = []  # uploaded, in the order they finished
        self.upload_id: str | None = None
        self.closed = False
        self.size = 0
        self._numbered = 0  # parts handed out
        self._inflight: deque[Future[dict[str, Any]]] = deque()
        self._pool: ThreadPoolExecutor | None = None

    def _call(self, method: str, **kwargs: Any) -> dict[str, Any]:
        with translate_errors(method, self.path):
            return cast(dict[str, Any], self.fs.call_s3(method, **kwargs))

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.buffer += view
        self.size += view.nbytes
        while len(self.buffer) >= self.part_size:
            if self._numbered >= MAX_PARTS - 1:
                self.part_size *= 2  # keep very large objects within S3's part limit
                if len(self.buffer) < self.part_size:
                    break
            chunk = bytes(self.buffer[: self.part_size])
            del self.buffer[: self.part_size]
            try:
                self._upload_part(chunk)
            except BaseException:
                self.discard()  # a part failed: no object, no upload left behind
                raise
        return view.nbytes

    def _upload_part(self, chunk: bytes) -> None:
        """Send ``chunk`` as the next part, beside the parts in flight (at most
        :attr:`parallel`: the oldest is waited for first; its error is raised here)."""
        if self.upload_id is None:
            mpu = self._call(
                "create_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                ChecksumAlgorithm="CRC32C",
            )
            self.upload_id = mpu["UploadId"]
        self._numbered += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.parallel, thread_name_prefix="reshard-s3-part")
        while len(self._inflight) >= self.parallel:
            self.parts.append(self._inflight.popleft().result())
        self._inflight.append(self._pool.submit(self._put_part, self._numbered, chunk))

    def _put_part(self, number: int, chunk: bytes) -> dict[str, Any]:
        checksum = crc32c_b64(chunk)
        out = self._call(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=chunk,
            ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=checksum,
        )
        return {"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32C": checksum}

    def _settle(self) -> None:
        """Wait for every part in flight (the first error raised, after all have ended),
        and stop the part threads."""
        try:
            wait(self._inflight)
            while self._inflight:
                self.parts.append(self._inflight.popleft().result())
        finally:
            self._inflight.clear()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def flush(self) -> None:
        """Parts go out as they fill; the object is committed by :meth:`close`."""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.upload_id is None:
            body = bytes(self.buffer)
            self._call(
                "put_object",
                Bucket=self.bucket,
                Key=self.key,
                Body=body,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc32c_b64(body),
            )
        else:
            try:
                if self.buffer:
                    self._upload_part(bytes(self.buffer))
                self._settle()
            except BaseException:
                self.discard()  # a part failed: no object, no upload left behind
                raise
            self.parts.sort(key=lambda p: int(p["PartNumber"]))
            try:
                self._call(
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    MultipartUpload={"Parts": self.parts},
                )
            except StorageError:
                # The answer to a completion that took effect can be lost; the client's
                # retry then finds no such upload. The object tells whether it happened.
                if not self._completed():
                    raise
        self.buffer = bytearray()
        self.fs.invalidate_cache(self.path)

    def _completed(self) -> bool:
        """Whether this upload's object exists: same size, one ETag suffix per part."""
        try:
            head = self.fs.call_s3("head_object", Bucket=self.bucket, Key=self.key)
        except Exception:
            return False
        return int(head.get("ContentLength", -1)) == self.size and str(head.get("ETag", "")).strip(
            '"'
        ).endswith(f"-{len(self.parts)}")

    def discard(self) -> None:
        """Drop what was uploaded (an unfinished multipart upload leaves no object)."""
        self.closed = True
        self.buffer = bytearray()
        try:
            self._settle()
        except Exception:  # a part that failed: the upload is aborted anyway
            logger.debug("a part of %s failed before the abort", self.path, exc_info=True)
        if self.upload_id is not None:
            try:
                self._call(
                    "abort_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                )
            except StorageError:  # already aborted (a lost answer), or the store expires it
                logger.warning("could not abort the upload of %s", self.path)
            finally:
                self.upload_id = None

    def __enter__(self) -> S3ChecksumWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.discard()


class S3Storage(FsspecStorage):
    """A checkpoint folder on S3 (or an S3-compatible store) whose uploads carry CRC32C."""

    def __init__(self, uri: str, storage_options: Any = None, **kwargs: Any) -> None:
        if "_fs" not in kwargs:
            options = dict(storage_options or {})
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", dict(RETRIES))
            options["config_kwargs"] = config
            storage_options = options
        super().__init__(uri, storage_options, **kwargs)

    def open_write(self, name: str) -> IO[bytes]:
        return cast(IO[bytes], S3ChecksumWriter(self.fs, self.path(name)))

    def write(self, name: str, data: bytes) -> None:
        with S3ChecksumWriter(self.fs, self.path(name)) as w:
            w.write(data)

    # ---- the lease, by conditional requests

    def _lease_key(self) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path(LEASE_NAME))
        return bucket, key

    def read_lease(self) -> LeaseState | None:
        bucket, key = self._lease_key()
        try:
            with translate_errors("read the lease", self.lease_path()):
                out = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
                body = out["Body"]
                record = _read_body(self.fs, body)
        except MissingFileError:
            return None
        modified = out.get("LastModified")
        return LeaseState(
            record,
            str(out["ETag"]).strip('"'),
            modified.timestamp() if modified is not None else None,
        )

    def _put(self, record: bytes, **condition: str) -> str | None:
        """PUT the lease under ``condition``; its ETag, or None when the condition failed."""
        bucket, key = self._lease_key()
        try:
            out = self.fs.call_s3(
                "put_object",
                Bucket=bucket,
                Key=key,
                Body=record,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=crc32c_b64(record),
                **condition,
            )
        except (FileExistsError, OSError) as e:
            # If-Match on a lease another run removed meanwhile: S3 answers 404, not 412
            gone = "IfMatch" in condition and _no_such_key(e)
            if not (_precondition_failed(e) or gone):
                raise StorageError(f"write the lease {self.lease_path()}: {e}") from e
            return None
        return str(out["ETag"]).strip('"')

    def _settle(self, record: bytes) -> str | None:
        """After a refused conditional PUT: if the lease holds exactly ``record``, an
        earlier try of the same request took effect and its answer was lost."""
        state = self.read_lease()
        return state.version if state is not None and state.record == record else None

    def create_lease(self, record: bytes, token: str) -> str:
        for _ in range(3):
            etag = self._put(record, IfNoneMatch="*") or self._settle(record)
            if etag is not None:
                return etag
            state = self.read_lease()
            if state is not None:
                raise LeaseHeld(state)
            # released between the refusal and the read: try again
        raise LeaseHeld(LeaseState(b"", "", None))

    def renew_lease(self, version: str, record: bytes) -> str:
        if not version:  # an empty If-Match is no condition at all: never send one
            raise LeaseLost
        etag = self._put(record, IfMatch=version) or self._settle(record)
        if etag is None:
            raise LeaseLost
        return etag

    def replace_lease(self, version: str, record: bytes, token: str) -> str:
        return self.renew_lease(version, record)

    def drop_lease(self, version: str) -> None:
        if not version:
            return  # not a version this run held (an empty If-Match deletes any)
        bucket, key = self._lease_key()
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except (FileNotFoundError, OSError) as e:
            if isinstance(e, FileNotFoundError) or _precondition_failed(e):
                return  # gone already, or another run's now
            raise StorageError(f"remove the lease {self.lease_path()}: {e}") from e
        finally:
            self.fs.invalidate_cache(self.path(LEASE_NAME))


def _read_body(fs: Any, body: Any) -> bytes:
    read = getattr(body, "read", None)
    if read is None:
        return bytes(body)
    data = read()
    if hasattr(data, "__await__"):  # aiobotocore streams are read on s3fs's loop
        from fsspec.asyn import sync

        return bytes(sync(fs.loop, _awaited, data))
    return bytes(data)


async def _awaited(data: Any) -> Any:
    return await data


def _precondition_failed(e: BaseException) -> bool:
    """A 412: the condition of a conditional request did not hold (s3fs raises
    FileExistsError for If-None-Match and an EINVAL OSError for If-Match)."""
    if isinstance(e, FileExistsError):
        return True
    text = f"{e} {e.__cause__!r}"
    return "PreconditionFailed" in text or "412" in text or "At least one of the pre" in text


def _no_such_key(e: BaseException) -> bool:
    """A 404 for the object itself (s3fs raises FileNotFoundError, or an OSError naming
    NoSuchKey)."""
    if isinstance(e, FileNotFoundError):
        return True
    text = f"{e} {e.__cause__!r}"
    return "NoSuchKey" in text or "The specified key does not exist" in text
