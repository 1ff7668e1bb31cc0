"""The lease of a local folder (:class:`~reshard_svc.storage.base.LeaseStore`): a small
record beside the target, ``.<name>.lease.json``, created by an exclusive create, renewed
by an atomic replace, taken over and dropped by renaming it aside (one contender wins),
so two runs can never both believe they hold it. What a lease operation killed midway
leaves beside it names its process, and is removed once that process is gone."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import uuid

from reshard_svc.storage.base import LeaseHeld, LeaseLost, LeaseState
from reshard_svc.storage.fsspec_store import translate_errors

__all__ = ["LocalLease", "remove_path"]

#: What a lease operation killed midway leaves beside the lease, each naming its process:
#: a renewal's record (``<lease>.<pid>.tmp``), a lease renamed aside to be dropped or taken
#: over (``<lease>.drop-<pid>-<uuid>``, ``<lease>.taken-<pid>-<token>``).
_LEASE_DEBRIS = re.compile(r"\.(?:(\d+)\.tmp|(?:drop|taken)-(\d+)-[0-9A-Za-z_]+)")


class LocalLease:
    """The lease half of :class:`~reshard_svc.storage.local.LocalStorage`."""

    def _sibling(self, kind: str, token: str = "") -> str:
        raise NotImplementedError  # LocalStorage: a name beside the target folder

    def lease_path(self) -> str:
        return self._sibling("lease") + ".json"

    def create_lease(self, record: bytes, token: str) -> str:
        path = self.lease_path()
        with translate_errors("create the lease", path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            for _ in range(3):
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    state = self.read_lease()
                    if state is not None:
                        raise LeaseHeld(state) from None
                    continue  # released meanwhile: try again
                with os.fdopen(fd, "wb") as f:
                    f.write(record)
                return _version(os.stat(path).st_ino, record)
        raise LeaseHeld(LeaseState(b"", "", None))

    def read_lease(self) -> LeaseState | None:
        return _read_lease(self.lease_path())

    def lease_debris(self) -> list[str]:
        """What lease operations of dead processes left beside the lease
        (:data:`_LEASE_DEBRIS`): a renewal killed between writing its record and renaming
        it, a release or takeover killed between renaming the lease aside and removing it."""
        parent, prefix = os.path.split(self.lease_path())
        try:
            names = os.listdir(parent or ".")
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = _LEASE_DEBRIS.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
            if m is not None and not _alive(int(m.group(1) or m.group(2))):
                out.append(os.path.join(parent, name))
        return out

    def remove_lease_debris(self, dry_run: bool = False) -> list[str]:
        found = self.lease_debris()
        if not dry_run:
            for path in found:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
        return found

    def renew_lease(self, version: str, record: bytes) -> str:
        path = self.lease_path()
        with translate_errors("renew the lease", path):
            state = _read_lease(path)
            if state is None or state.version != version:
                raise LeaseLost
            if state.record == record:
                os.utime(path)  # the mtime says it is alive
                return version
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(record)
            os.replace(tmp, path)  # never a torn record
            return _version(os.stat(path).st_ino, record)

    def replace_lease(self, version: str, record: bytes, token: str) -> str:
        """Compare-and-swap by rename: of several contenders renaming the stale lease
        aside, one succeeds; it checks that what it moved is the version it judged stale
        (else puts it back) and creates its own."""
        path = self.lease_path()
        aside = f"{path}.taken-{os.getpid()}-{token}"
        with translate_errors("take over the lease", path):
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                raise LeaseLost from None
            moved = _read_lease(aside)
            if moved is None or moved.version != version:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, path)  # not the one judged stale: put it back
                remove_path(aside)
                raise LeaseLost
            remove_path(aside)
        try:
            return self.create_lease(record, token)
        except LeaseHeld:
            raise LeaseLost from None

    def drop_lease(self, version: str) -> None:
        path = self.lease_path()
        aside = f"{path}.drop-{os.getpid()}-{uuid.uuid4().hex}"
        with translate_errors("remove the lease", path):
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return
            moved = _read_lease(aside)
            if moved is not None and moved.version != version:
                with contextlib.suppress(FileExistsError):
                    os.link(aside, path)  # another run's: put it back
            remove_path(aside)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _version(inode: int, record: bytes) -> str:
    return f"{inode}-{hashlib.blake2b(record, digest_size=8).hexdigest()}"


def _read_lease(path: str) -> LeaseState | None:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            record = f.read()
    except FileNotFoundError:
        return None
    return LeaseState(record, _version(st.st_ino, record), st.st_mtime)


def remove_path(path: str) -> None:
    """Remove a file or a folder; one already gone is no error."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
