"""``POST /v1/plans``: the dry run on the server, for sources under its roots."""

from __future__ import annotations

import pytest
import torch

import reshard_svc
from reshard_client import Forbidden


def test_the_server_plans_what_reshard_plan_plans(server, tmp_path):
    src = tmp_path / "data" / "ck"
    reshard_svc.save({"w": torch.randn(128, 32), "n": torch.randn(32)}, str(src))
    body = {"source": str(src), "mesh": {"tp": 8}, "rules": {"w": "S(0)", "n": "R"}}
    with server.client() as c:
        convert = c.plan({**body, "world": 4})
        load = c.plan({**body, "load": True})
        with pytest.raises(Forbidden, match="outside the allowed roots"):
            c.plan({**body, "source": str(tmp_path / "elsewhere")})
    from reshard_svc.jobs.spec import ConvertSpec
    from reshard_svc.runtime.dry_run import dry_run

    here = dry_run(
        ConvertSpec(
            source=str(src), target=str(src) + ".x", mesh={"tp": 8}, rules={"w": "S(0)", "n": "R"}
        ).checked(),
        4,
    ).to_json()
    for key in ("strategy", "bytes_total", "read", "sent", "received", "peak_memory", "waves"):
        assert convert[key] == here[key], key
    assert load["mode"] == "load" and load["world"] == 8
    assert load["bytes_total"] == 128 * 32 * 4 + 32 * 4 * 8
