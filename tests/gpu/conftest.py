"""The GPU lane: every test here runs on CUDA tensors at world size 1 and is marked
``gpu``; without a CUDA device the whole folder is skipped with one line saying so (CI is
CPU-only). Run it where a GPU is lent: ``pytest -m gpu tests/gpu``."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = __file__.rsplit("/", 1)[0]
    mine = [item for item in items if str(item.fspath).startswith(here)]
    for item in mine:
        item.add_marker(pytest.mark.gpu)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="no CUDA device here: the GPU lane runs where one is")
        for item in mine:
            item.add_marker(skip)
