"""Our own format: ``reshard.index.json`` and the safetensors files it lists, each with its
block CRC32Cs (and, when asked for, a whole-file sha256)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from reshard_svc.errors import CorruptCheckpointError, MissingFileError
from reshard_svc.format.index import FORMAT_NAME, INDEX_NAME, CheckpointIndex, FileMeta
from reshard_svc.format.reader import BaseSource
from reshard_svc.storage import Storage

__all__ = ["SOURCE", "Ours", "check_sizes"]


class Ours(BaseSource):
    kinds = (FORMAT_NAME,)
    why_unchecked = "saved with checksum='none': no checksums recorded"

    def claims(self, names: Collection[str]) -> bool:
        return INDEX_NAME in names

    def open(self, storage: Storage, names: Collection[str]) -> CheckpointIndex:
        index = CheckpointIndex.loads(storage.read(INDEX_NAME), f"{storage.uri}/{INDEX_NAME}")
        index.check()
        check_sizes(storage.uri, index.files, storage.sizes())
        return index


def check_sizes(where: str, files: Mapping[str, FileMeta], sizes: Mapping[str, int]) -> None:
    """Every data file the index lists exists with the size it records (one listing)."""
    for name, meta in sorted(files.items()):
        if name not in sizes:
            raise MissingFileError(f"{where}: data file {name} is missing")
        if sizes[name] != meta.size:
            raise CorruptCheckpointError(
                f"{where}: {name} is {sizes[name]} bytes but the index records "
                f"{meta.size}: truncated or overwritten"
            )


SOURCE = Ours()
