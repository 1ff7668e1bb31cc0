"""The CLI's ``--help``/``--version``, the client and the job schemas import without torch
(seconds per command otherwise); the library's names still resolve, lazily."""

from __future__ import annotations

import os
import subprocess
import sys


def test_cli_client_and_schemas_do_not_import_torch():
    code = (
        "import sys, reshard_client.cli, reshard_client, reshard_server.schemas, "
        "reshard_svc.jobs.spec, reshard_svc; print(sorted(m for m in sys.modules "
        "if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_names_resolve_and_unknown_ones_raise():
    import pytest

    import reshard_svc

    for name in reshard_svc.__all__:
        assert getattr(reshard_svc, name) is not None, name
    assert set(reshard_svc.__all__) <= set(dir(reshard_svc))
    with pytest.raises(AttributeError, match="no_such_name"):
        reshard_svc.no_such_name  # noqa: B018


def test_every_public_error_is_exported():
    """As httpx's test_exported_members: each error class of errors.py is a public name
    of the package, and each name in __all__ is defined."""
    import inspect

    import reshard_svc
    from reshard_svc import errors

    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, errors.ReshardError)
    }
    assert defined <= set(reshard_svc.__all__), sorted(defined - set(reshard_svc.__all__))
    assert set(errors.__all__) == defined
    for name in reshard_svc.__all__:
        assert hasattr(reshard_svc, name), name


def test_convert_with_workers_leaves_torch_to_the_workers(tmp_path):
    """``reshard convert --workers 2``: its preflight (paths, target, renames) and the
    launch run without torch in the CLI process; each worker imports it once."""
    import re

    import torch

    import reshard_svc

    reshard_svc.save({"w": torch.arange(64.0).reshape(8, 8)}, str(tmp_path / "src"))
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "reshard_client.cli",
            "convert",
            str(tmp_path / "src"),
            str(tmp_path / "dst"),
            "--mesh",
            "tp=2",
            "--rules",
            '{"*": "S(0)"}',
            "--rename",
            "w=x",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": ""},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "import time:" in out.stderr  # the CLI's own imports are listed
    assert not re.search(r"\|\s+torch$", out.stderr, re.M), "the CLI process imported torch"
    got = {"x": torch.zeros(8, 8)}
    reshard_svc.load(got, str(tmp_path / "dst"))
    assert torch.equal(got["x"], torch.arange(64.0).reshape(8, 8))
