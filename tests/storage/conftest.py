"""Storage fixtures: ``root`` parametrized over local folders, memory:// and S3 (moto)."""

from __future__ import annotations

import uuid

import fsspec
import pytest


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path)
    elif request.param == "memory":
        base = f"memory://t-{uuid.uuid4().hex[:8]}"
        yield base
        mem = fsspec.filesystem("memory")
        if mem.exists(base.replace("memory://", "/")):
            mem.rm(base.replace("memory://", "/"), recursive=True)
    else:
        yield request.getfixturevalue("s3")
