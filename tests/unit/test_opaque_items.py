"""DCP non-tensor state (BytesStorageMetadata: train state, dataloader state) is carried
through convert as opaque bytes, listed by inspect, checked by verify, never unpickled."""

from __future__ import annotations

import io
import json
import math
import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard_svc
from reshard_svc.errors import ChecksumError, StateDictError
from tests.support.cli import reshard


class Exploding:
    """Unpickling this would run code: nothing here may ever unpickle it."""

    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


@pytest.fixture
def dcp_ckpt(tmp_path):
    sd = {
        "model": {"w": torch.randn(8, 4), "b": torch.randn(4)},
        "train_state": {"step": 41, "tokens_seen": 123456},
        "dataloader": {"epoch": 2, "cursor": [3, 1, 4]},
    }
    path = str(tmp_path / "dcp")
    dcp.save(sd, checkpoint_id=path, no_dist=True)
    return path, sd


def test_convert_carries_opaque_items_verbatim(dcp_ckpt, tmp_path):
    src, sd = dcp_ckpt
    info = reshard_svc.inspect(src)
    assert {"train_state.step", "dataloader.cursor"} <= set(info.blobs)
    before = {k: reshard_svc.read_blob(src, k) for k in info.blobs}
    tp2 = str(tmp_path / "tp2")
    reshard_svc.convert(src, tp2, mesh="tp=2", rules={"*": "S(0)"})
    again = str(tmp_path / "again")
    reshard_svc.convert(tp2, again, mesh="tp=1")  # native -> native keeps them too
    for uri in (tp2, again):
        assert reshard_svc.verify(uri).ok
        assert set(reshard_svc.inspect(uri).blobs) == set(before)
        for k, data in before.items():
            assert reshard_svc.read_blob(uri, k) == data, (uri, k)
    # The caller may decode them, safely, with torch's weights-only loader.
    step = torch.load(
        io.BytesIO(reshard_svc.read_blob(again, "train_state.step")), weights_only=True
    )
    assert step == 41
    r = reshard("inspect", again)
    assert r.returncode == 0 and "opaque items" in " ".join(r.stdout.split())
    r = reshard("inspect", again, "--json")
    assert "dataloader.cursor" in json.loads(r.stdout)["blobs"]


def test_opaque_items_are_never_unpickled(tmp_path):
    path = str(tmp_path / "dcp")
    dcp.save({"w": torch.ones(2), "evil": {"x": Exploding()}}, checkpoint_id=path, no_dist=True)
    reshard_svc.convert(path, str(tmp_path / "out"), mesh="tp=1")  # would exit if unpickled
    data = reshard_svc.read_blob(str(tmp_path / "out"), "evil.x")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(data), weights_only=True)


def test_opaque_bytes_are_checked(dcp_ckpt, tmp_path):
    src, _ = dcp_ckpt
    out = tmp_path / "out"
    reshard_svc.convert(src, str(out), mesh="tp=1")
    blob = reshard_svc.inspect(str(out)).blobs["train_state.step"]
    with open(out / blob.file, "r+b") as f:
        f.seek(blob.begin + 5)
        byte = f.read(1)
        f.seek(blob.begin + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(ChecksumError):
        reshard_svc.read_blob(str(out), "train_state.step")
    assert not reshard_svc.verify(str(out)).ok
    with pytest.raises(StateDictError, match="no opaque item"):
        reshard_svc.read_blob(str(out), "nope")


def test_hf_export_says_it_drops_them(dcp_ckpt, tmp_path, caplog):
    src, _ = dcp_ckpt
    with caplog.at_level("WARNING"):
        reshard_svc.convert(src, str(tmp_path / "hf"), format="hf")
    assert any("not exported" in r.getMessage() for r in caplog.records)


def test_plain_values_of_a_dcp_checkpoint_load_without_unpickling(tmp_path):
    """DCP stores non-tensor values as pickled items: plain data loads into the state dict
    (built by an unpickler that runs nothing), under torchtitan's flattened optimizer keys
    and under get_optimizer_state_dict's list of param groups alike."""
    path = str(tmp_path / "dcp")
    groups = [
        {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "params": ["w", "b"]},
        {"lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6, "params": ["n"]},
    ]
    dcp.save(
        {
            "model": {"w": torch.randn(4, 4)},
            "train_state": {"step": 41, "name": "run-7", "loss": float("nan")},
            "optimizer": {"param_groups.w.lr": 3e-4, "param_groups.w.weight_decay": 0.1},
            "optim": {"param_groups": groups},
        },
        checkpoint_id=path,
        no_dist=True,
    )
    want = {
        "model": {"w": torch.zeros(4, 4)},
        "train_state": {"step": 0, "name": "", "loss": 0.0},
        "optimizer": {"param_groups.w.lr": 0.0, "param_groups.w.weight_decay": 0.0},
        "optim": {"param_groups": []},
    }
    reshard_svc.load(want, path)
    state = want["train_state"]
    assert state["step"] == 41 and state["name"] == "run-7" and math.isnan(state["loss"])
    assert want["optimizer"] == {"param_groups.w.lr": 3e-4, "param_groups.w.weight_decay": 0.1}
    assert want["optim"]["param_groups"] == groups
    # converted to our format, it loads the same (the items travel with their keys)
    ours = str(tmp_path / "ours")
    reshard_svc.convert(path, ours, mesh="tp=1")
    again = {
        k: {
            kk: type(vv)() if not isinstance(vv, torch.Tensor) else torch.zeros(4, 4)
            for kk, vv in v.items()
        }
        for k, v in want.items()
    }
    again["optim"]["param_groups"] = []
    reshard_svc.load(again, ours)
    assert again["train_state"]["step"] == 41 and math.isnan(again["train_state"]["loss"])
    assert again["optim"]["param_groups"] == groups


def test_a_pickled_object_that_is_not_plain_data_is_named_not_missing(tmp_path):
    path = str(tmp_path / "dcp")
    marker = tmp_path / "ran"
    dcp.save(
        {"w": torch.ones(2), "state": {"rng": Exploding(), "step": 3}},
        checkpoint_id=path,
        no_dist=True,
    )
    sd = {"w": torch.zeros(2), "state": {"rng": None, "step": 0}}
    with pytest.raises(StateDictError) as e:
        reshard_svc.load(sd, path)
    text = str(e.value)
    assert re.search(r"'state.rng' is stored as a pickled object of type \w+\.exec", text)
    assert "read_blob" in text and "missing" not in text
    assert not marker.exists()
    reshard_svc.load(sd, path, strict=False)  # the rest loads; the object is left alone
    assert sd["state"] == {"rng": None, "step": 3} and torch.equal(sd["w"], torch.ones(2))
