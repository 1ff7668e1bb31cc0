"""What a conversion's target may be, checked before any worker starts and again under the
run's lease (:class:`reshard_svc.format.collect.TargetRun`): one set of rules for both.

Refused: the source and the target being one folder; a committed checkpoint without
``overwrite``; a folder that is not a checkpoint (an HF export may land in a model folder:
its config, tokenizer and README stay, its weights are replaced only with ``overwrite``).
Imports no torch: the CLI runs :func:`preflight` before it starts its workers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.format.hf import check_model_folder
from reshard_svc.storage import open_storage
from reshard_svc.storage.base import Target

__all__ = ["check_distinct", "check_target", "preflight"]


def check_distinct(
    source: str, target: str, storage_options: Mapping[str, Any] | None = None
) -> None:
    """A :class:`UsageError` when the source and the target are the same folder."""
    a = open_storage(source, storage_options)
    b = open_storage(target, storage_options)
    if type(a) is type(b) and a.root.rstrip("/") == b.root.rstrip("/"):
        raise UsageError(
            f"source and target are the same folder ({source}): convert into a new target"
        )


def check_target(target: Target, overwrite: bool, model_folder: bool) -> None:
    """The target may be written: empty, or a checkpoint with ``overwrite``, or (an HF
    export, ``model_folder``) a model folder whose weights go only with ``overwrite``."""
    target.check_target(overwrite, foreign_ok=model_folder)
    if model_folder:
        check_model_folder(target, overwrite)


def preflight(
    source: str,
    target: str,
    *,
    overwrite: bool,
    model_folder: bool,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """What can be refused before any worker starts (the run checks the target again,
    under its lease)."""
    check_distinct(source, target, storage_options)
    check_target(open_storage(target, storage_options), overwrite, model_folder)
