"""The conversion matrix on real gloo workers: every output bitwise equal to the source
tensors, verified, and readable by torch's HuggingFaceStorageReader."""

from __future__ import annotations

import json
import os

import pytest
import torch

import reshard_svc
from tests.support import workloads
from tests.support.harness import run

pytestmark = pytest.mark.distributed


def source_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(37, 12, generator=g),  # uneven rows
        "layers.0.qkv.weight": torch.randn(30, 12, generator=g).to(torch.bfloat16),  # fused QKV
        "layers.0.o.weight": torch.randn(12, 19, generator=g),  # uneven columns
        "layers.0.up.weight": torch.randn(25, 12, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(12, generator=g),
        "tiny": torch.randn(2, generator=g),  # fewer rows than ranks
        "step": torch.tensor(17, dtype=torch.int64),
    }


RULES_1D = {
    "*qkv*": "SS(0,3)",
    "*.o.weight": "S(1)",
    "*norm*": "R",
    "step": "R",
    "*": "S(0)",
}
RULES_2D = {
    "*qkv*": "SS(0,2),S(0)",  # FSDP2 x TP
    "*.o.weight": "S(0),S(1)",
    "*norm*": "S(0),R",
    "step": "R,R",
    "*": "R,S(0)",
}


def check(path: str, want: dict[str, torch.Tensor], torch_reader: bool = True) -> None:
    report = reshard_svc.verify(path)
    assert report.ok, report.problems
    out = {k: torch.zeros_like(v) for k, v in want.items()}
    reshard_svc.load(out, path)
    for k in want:
        assert out[k].dtype == want[k].dtype and torch.equal(out[k], want[k]), k
    if torch_reader:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        theirs = {k: torch.zeros_like(v) for k, v in want.items()}
        dcp.load(theirs, storage_reader=HuggingFaceStorageReader(path), no_dist=True)
        for k in want:
            assert torch.equal(theirs[k], want[k]), f"torch reader: {k}"


def layouts(path: str) -> dict[str, str]:
    return {k: str(t.layout) for k, t in reshard_svc.inspect(path).tensors.items()}


def test_tp_round_trip_1_2_4_3_1(tmp_path):
    want = source_tensors()
    plain = str(tmp_path / "plain")
    reshard_svc.save({**want, "config": {"hidden": 12}}, plain)
    tp2 = str(tmp_path / "tp2")
    reshard_svc.convert(plain, tp2, mesh="tp=2", rules=RULES_1D)  # one process, no group
    assert layouts(tp2)["layers.0.qkv.weight"] == "tp=2|SS(0,3)"
    check(tp2, want)
    prev = tp2
    for workers, mesh, strategy in (
        (2, "tp=4", "exchange"),
        (3, "tp=3", "direct"),
        (2, "tp=1", "auto"),
    ):
        nxt = str(tmp_path / mesh.replace("=", ""))
        res = run(
            workloads.convert_stage,
            workers,
            prev,
            nxt,
            {"mesh": mesh, "strategy": strategy, "max_memory": 2048},
        )
        assert res[0]["waves"] > 1
        assert layouts(nxt)["layers.0.o.weight"] == f"{mesh}|S(1)"
        check(nxt, want)
        prev = nxt
    assert reshard_svc.inspect(prev).extras == {"config.hidden": 12}


def test_2d_to_1d_and_back_with_replicate_shard_swaps(tmp_path):
    want = source_tensors()
    plain = str(tmp_path / "plain")
    reshard_svc.save(want, plain)
    dd = str(tmp_path / "dp2tp2")
    run(
        workloads.convert_stage,
        4,
        plain,
        dd,
        {"mesh": "dp=2,tp=2", "rules": RULES_2D, "max_memory": 4096},
    )
    assert layouts(dd)["layers.0.qkv.weight"] == "dp=2,tp=2|SS(0,2),S(0)"
    check(dd, want)
    # 2-D -> 1-D by mesh dim name: tp keeps its placement, dp goes away.
    one = str(tmp_path / "tp4")
    run(
        workloads.convert_stage,
        2,
        dd,
        one,
        {"mesh": "tp=4", "strategy": "exchange", "max_memory": 4096},
    )
    assert layouts(one)["layers.0.o.weight"] == "tp=4|S(1)"
    assert layouts(one)["layers.0.norm.weight"] == "tp=4|R"
    check(one, want)
    # 1-D -> 2-D: Replicate <-> Shard swaps via rules, and a bf16 cast on the way.
    back = str(tmp_path / "back")
    swap = {
        "step": "R,R",
        "tiny": "S(0),R",
        "*norm*": "S(0),S(0)",
        "*.o.weight": "R,R",
        "*": "S(1),R",
    }
    run(
        workloads.convert_stage, 3, one, back, {"mesh": "dp=2,tp=2", "rules": swap, "dtype": "bf16"}
    )
    assert layouts(back)["layers.0.norm.weight"] == "dp=2,tp=2|S(0),S(0)"
    check(
        back,
        {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v.to(torch.bfloat16)
            for k, v in want.items()
        },
    )


def test_strategies_write_identical_bytes_and_hf_export(tmp_path):
    want = source_tensors()
    plain = str(tmp_path / "plain")
    reshard_svc.save(want, plain)
    src = str(tmp_path / "tp4")
    reshard_svc.convert(plain, src, mesh="tp=4", rules=RULES_1D)
    shas = {}
    for strategy in ("exchange", "direct"):
        dst = str(tmp_path / strategy)
        res = run(
            workloads.convert_stage,
            2,
            src,
            dst,
            {
                "mesh": "tp=2",
                "rules": {"step": "R", "*norm*": "R", "tiny": "R", "*": "S(1)"},
                "strategy": strategy,
                "max_memory": 1024,
            },
        )
        assert res[0]["strategy"] == strategy
        index = json.load(open(os.path.join(dst, "reshard.index.json")))
        shas[strategy] = {k: (v["crc32c"], v["blocks"]) for k, v in index["files"].items()}
    assert shas["exchange"] == shas["direct"]
    # Consolidated HF export, size-capped files, loadable with safetensors alone.
    hf = str(tmp_path / "hf")
    run(
        workloads.convert_stage,
        2,
        src,
        hf,
        {"format": "hf", "max_shard_size": 1500, "max_memory": 2048},
    )
    from safetensors.torch import load_file

    files = sorted(n for n in os.listdir(hf) if n.endswith(".safetensors"))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for n in files:
        loaded.update(load_file(os.path.join(hf, n)))
    assert set(loaded) == set(want)
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    weight_map = json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]
    assert set(weight_map) == set(want) and set(weight_map.values()) == set(files)
    check(hf, want)
