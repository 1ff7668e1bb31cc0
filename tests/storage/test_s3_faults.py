"""S3 behind a throttling, answer-losing proxy (tests/s3_faults.py) in front of moto.

Every request has a 20% chance of ``503 SlowDown`` and a 3% chance of taking effect with
its answer lost. Save, convert and verify of a 72 MiB checkpoint (multipart uploads, many
ranged reads) must pass every run, bitwise exact; and lost answers to the commit steps
(CompleteMultipartUpload, the index PUT, an abort) must not fail or corrupt anything.
"""

from __future__ import annotations

import fsspec
import fsspec.config
import pytest
import torch

import reshard_svc
from reshard_svc.storage import open_storage
from tests.support.s3_faults import FaultProxy

pytestmark = pytest.mark.s3


def state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(18 * 1024 * 1024, generator=g),  # 72 MiB: a 3-part upload
        "w": torch.randn(512, 1024, generator=g),
        "n": torch.randn(5, generator=g).to(torch.bfloat16),
    }


@pytest.fixture
def faulty(s3, moto_server, monkeypatch, request):
    """(bucket URI, proxy): s3fs, in-process and in spawned workers, talks to the proxy."""
    opts = {"endpoint_url": None, "key": "testing", "secret": "testing"}
    params = getattr(request, "param", {})
    with FaultProxy(moto_server, **params) as proxy:
        opts["endpoint_url"] = proxy.url
        monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))
        yield s3, proxy
    monkeypatch.setitem(fsspec.config.conf, "s3", {**opts, "endpoint_url": moto_server})


def healthy_load(uri: str, like: dict, moto_server: str) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    reshard_svc.load(out, uri, storage_options={"endpoint_url": moto_server})
    return out


@pytest.mark.parametrize("faulty", [{"seed": s} for s in range(1, 4)], indirect=True)
def test_save_convert_verify_through_faults(faulty, moto_server):
    bucket, proxy = faulty
    sd = state()
    reshard_svc.save(sd, f"{bucket}/ck")
    reshard_svc.convert(f"{bucket}/ck", f"{bucket}/tp2", mesh="tp=2", max_memory="8MiB")
    report = reshard_svc.verify(f"{bucket}/tp2")
    assert report.ok, report.problems
    assert reshard_svc.verify(f"{bucket}/ck").ok
    assert proxy.counts["slowdown"] > 0 and proxy.counts["ok"] > 0
    for uri in (f"{bucket}/ck", f"{bucket}/tp2"):
        got = healthy_load(uri, sd, moto_server)
        for k in sd:
            assert torch.equal(got[k], sd[k]), (uri, k)


@pytest.mark.parametrize(
    "faulty",
    [
        {
            "slowdown": 0.0,
            "lose": 0.0,
            "lose_once": ("POST uploadId=", "PUT reshard.index.json", "DELETE .safetensors"),
        }
    ],
    indirect=True,
)
def test_lost_answers_to_commit_steps(faulty, moto_server):
    bucket, proxy = faulty
    sd = state()
    reshard_svc.save({**sd, "big": sd["big"] * 0}, f"{bucket}/ck")
    reshard_svc.save(sd, f"{bucket}/ck", overwrite=True)  # deletes the replaced files
    assert proxy.counts["lost POST uploadId="] == 1
    assert proxy.counts["no such upload"] >= 1  # the client retried the completion
    assert proxy.counts["lost PUT reshard.index.json"] == 1
    assert proxy.counts["lost DELETE .safetensors"] == 1
    got = healthy_load(f"{bucket}/ck", sd, moto_server)
    for k in sd:
        assert torch.equal(got[k], sd[k]), k
    storage = open_storage(f"{bucket}/ck", {"endpoint_url": moto_server})
    data = sorted(n for n in storage.listdir() if n.endswith(".safetensors"))
    assert len(data) == len(reshard_svc.inspect(f"{bucket}/ck").files)


@pytest.mark.parametrize("faulty", [{"slowdown": 0.0, "lose": 0.0}], indirect=True)
def test_a_background_save_that_s3_refuses_past_its_retries_fails_the_next_save(faulty):
    """A CheckpointManager on S3: data uploads start failing after step 1 (503 past every
    retry); the snapshot of step 2 returns, the next save raises naming step 2, step 2
    never lists as committed, and once S3 is back the loop goes on."""
    from reshard_svc import CheckpointManager, SaveFailedError

    bucket, proxy = faulty
    few = {"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}}
    small = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    with CheckpointManager(f"{bucket}/run", storage_options=few) as mgr:
        assert mgr.save(1, small)
        mgr.wait()
        proxy.fail_always = ["PUT .safetensors"]
        assert mgr.save(2, small)  # the snapshot returns; the uploads fail behind it
        with pytest.raises(SaveFailedError, match="step 2") as e:
            mgr.save(3, small)
        assert e.value.step == 2 and proxy.counts["failed PUT .safetensors"] > 0
        assert mgr.steps() == [1]
        proxy.fail_always = []
        assert mgr.save(3, small)
        mgr.wait()
        assert mgr.steps() == [1, 3]
