"""The protocol every checkpoint format we read implements, and what readers share.

A :class:`Source` is one format (ours, Hugging Face safetensors, torch DCP ``.distcp``,
torch_checkpointing, Megatron-Core ``torch_dist``), one module in
:mod:`reshard_svc.format.readers`. It

- **claims a folder** by its listing (:meth:`Source.claims`; the first that claims opens it);
- **opens its index** (:meth:`Source.open`): a :class:`CheckpointIndex` whose ``source``
  is one of the source's :attr:`Source.kinds`, from headers and metadata alone;
- **says how its bytes are checked** (:meth:`Source.checksum`: ``crc32c`` blocks recorded
  in our index, a zip's CRC-32 per record, or nothing, with :meth:`Source.unchecked`
  saying why), and checks a data file's bytes its own way when it has one
  (:meth:`Source.data_check`);
- **adds its own verify checks** (:meth:`Source.verify_more`), and may explain why a
  folder it does not claim is none of its own (:meth:`Source.not_mine`).

``verify`` and ``open_checkpoint`` only call these: they never ask which source they have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from reshard_svc.errors import CorruptCheckpointError
from reshard_svc.format.safetensors import ParsedHeader, parse_header

if TYPE_CHECKING:
    from reshard_svc.format.index import CheckpointIndex, FileMeta
    from reshard_svc.storage import Storage

__all__ = [
    "DCP_SHARDING_INFO",
    "SAVE_TOKEN_KEY",
    "SPAN",
    "BaseSource",
    "DataCheck",
    "Source",
    "read_header",
    "read_json",
]

#: Metadata key our data files carry; a folder of such files without an index is an
#: uncommitted save and must not be mistaken for a foreign checkpoint.
SAVE_TOKEN_KEY = "RESHARD_SAVE"
#: torch DCP's safetensors metadata key: each tensor's offsets in the global tensor.
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
_PROBE = 64 * 1024
#: Bytes a check reads at a time (a whole number of blocks).
SPAN = 64 * 1024 * 1024

#: ``check(storage, name, size, problems, advance) -> bytes checked``: one data file's
#: bytes against the source's own record of them (problems appended, never raised).
DataCheck = Callable[["Storage", str, int, list[str], Callable[[int], None]], int]


@runtime_checkable
class Source(Protocol):
    """One checkpoint format reshard reads (see the module's text)."""

    @property
    def kinds(self) -> tuple[str, ...]:
        """The ``CheckpointIndex.source`` values this source's indexes carry."""
        ...

    def claims(self, names: Collection[str]) -> bool:
        """Whether a folder with these entries is this source's."""
        ...

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        """The folder's index, checked (typed errors for anything malformed)."""
        ...

    def checksum(self, index: CheckpointIndex) -> str:
        """What checks the data bytes: ``crc32c``, ``sha256``, ``zip-crc32`` or ``none``."""
        ...

    def unchecked(self, index: CheckpointIndex) -> str:
        """Why a data file's bytes cannot be checked (when nothing records them)."""
        ...

    def data_check(self, name: str, meta: FileMeta) -> DataCheck | None:
        """The source's own check of data file ``name``, or None: its index's blocks and
        sha256 are checked (or, without any, the file is counted unchecked)."""
        ...

    def verify_more(self, storage: Storage, index: CheckpointIndex) -> list[str]:
        """Checks of its own, after every data byte passed (problems, not raised)."""
        ...

    def not_mine(self, storage: Storage, names: Collection[str]) -> None:
        """Raise a :class:`~reshard_svc.errors.NotACheckpointError` that says what a folder
        nobody claims lacks, when it looks like this source's; else nothing."""
        ...


class BaseSource:
    """Defaults: the index's own checksum, no checks of its own, nothing to explain."""

    kinds: tuple[str, ...] = ()
    #: Why the data bytes cannot be checked, when nothing records them.
    why_unchecked = "no checksums recorded"

    def checksum(self, index: CheckpointIndex) -> str:
        return index.checksum

    def unchecked(self, index: CheckpointIndex) -> str:
        return self.why_unchecked

    def data_check(self, name: str, meta: FileMeta) -> DataCheck | None:
        return None

    def verify_more(self, storage: Storage, index: CheckpointIndex) -> list[str]:
        return []

    def not_mine(self, storage: Storage, names: Collection[str]) -> None:
        return None


def read_header(storage: Storage, name: str, size: int) -> ParsedHeader:
    """Parse one safetensors file's header with at most two ranged reads."""
    want = min(size, _PROBE)
    (prefix,) = storage.read_ranges([(name, 0, want)]) if want else [memoryview(b"")]
    result = parse_header(bytes(prefix), size, name)
    if isinstance(result, int):
        (prefix,) = storage.read_ranges([(name, 0, result)])
        result = parse_header(bytes(prefix), size, name)
    if isinstance(result, int):  # pragma: no cover - parse_header asked for bytes it has
        raise CorruptCheckpointError(f"{name}: could not read its header")
    return result


def read_json(storage: Storage, name: str) -> tuple[str, Any]:
    """(where, parsed) of a small JSON file of the folder; unparsable is corrupt."""
    where = f"{storage.uri}/{name}"
    return where, parse_json(storage.read(name), where)


def parse_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON: {e}") from e
