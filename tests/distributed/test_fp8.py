"""FP8 weights and their block scales through convert: ``--dtype`` keeps them bitwise,
``--dequantize fp8-block`` matches a reference dequantization (DeepSeek's
``fp8_cast_bf16.py`` arithmetic), from our format and from a torch DCP save, on 2 workers
with a small memory budget."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import reshard_svc
from tests.support.cli import reshard

pytestmark = [pytest.mark.distributed]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def fp8_state() -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-shaped slice: e4m3 weights (edges not multiples of 128, NaN bit
    patterns included) with float32 128x128 block scales, a stacked-experts weight, an
    e5m2 tensor without a scale, and plain float tensors."""
    g = torch.Generator().manual_seed(8)

    def e4m3(*shape: int) -> torch.Tensor:
        bits = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        bits.view(-1)[:3] = torch.tensor([0x7F, 0xFF, 0x80], dtype=torch.uint8)  # NaN, NaN, -0
        return bits.view(E4M3)

    def scale(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=g) * 0.01 + 1e-4

    return {
        "model.layers.0.mlp.up_proj.weight": e4m3(300, 260),
        "model.layers.0.mlp.up_proj.weight_scale_inv": scale(3, 3),
        "model.layers.0.self_attn.o_proj.weight": e4m3(128, 384),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": scale(1, 3),
        "model.layers.0.mlp.experts.w": e4m3(3, 130, 64),
        "model.layers.0.mlp.experts.w_scale_inv": scale(3, 2, 1),
        "model.layers.0.mlp.gate.e5m2": torch.randint(
            0, 256, (16, 8), generator=g, dtype=torch.uint8
        ).view(E5M2),
        "model.layers.0.mlp.gate.e5m2_scale_inv": scale(1, 1),
        "model.norm.weight": torch.randn(260, generator=g),
        "model.embed_tokens.weight": torch.randn(64, 260, generator=g),
    }


def reference_dequant(w: torch.Tensor, s: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """What DeepSeek's weight_dequant computes: float32(w) * its block's scale, then cast."""
    rows, cols = w.shape[-2:]
    full = s.repeat_interleave(128, -2)[..., :rows, :].repeat_interleave(128, -1)[..., :cols]
    return (w.to(torch.float32) * full.to(torch.float32)).to(out)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare as integers: NaN payloads count."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    sd = fp8_state()
    ours, theirs = str(base / "ours"), str(base / "dcp")
    reshard_svc.save(sd, ours + "-1")
    reshard_svc.convert(ours + "-1", ours, mesh="tp=2", rules={"*": "S(0)"})  # stored TP=2
    dcp.save(sd, checkpoint_id=theirs, no_dist=True)
    return sd, {"ours": ours, "dcp": theirs}


@pytest.mark.parametrize("kind", ["ours", "dcp"])
def test_dtype_keeps_fp8_and_scales_bitwise(sources, kind, tmp_path):
    sd, src = sources
    dst = str(tmp_path / "hf")
    r = reshard(
        "convert",
        src[kind],
        dst,
        "--format",
        "hf",
        "--dtype",
        "bf16",
        "--workers",
        "2",
        "--max-memory",
        "64KiB",
    )
    assert r.returncode == 0, r.stderr
    assert "2 cast, 8 kept their dtype" in " ".join(r.stdout.split())
    got = load_file(f"{dst}/model-00001-of-00001.safetensors")
    for name, want in sd.items():
        if want.dtype in (E4M3, E5M2) or name.endswith("_scale_inv"):
            assert got[name].dtype == want.dtype and torch.equal(bits(got[name]), bits(want)), name
        else:
            assert torch.equal(got[name], want.to(torch.bfloat16)), name


@pytest.mark.parametrize(("kind", "out"), [("ours", "bf16"), ("dcp", "fp32")])
def test_dequantize_matches_the_reference(sources, kind, out, tmp_path):
    sd, src = sources
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[out]
    dst = str(tmp_path / "hf")
    r = reshard(
        "convert",
        src[kind],
        dst,
        "--format",
        "hf",
        "--dequantize",
        "fp8-block",
        "--dtype",
        out,
        "--workers",
        "2",
        "--max-memory",
        "64KiB",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["dequantized"] == 4
    got = load_file(f"{dst}/model-00001-of-00001.safetensors")
    assert not any(n.endswith("_scale_inv") for n in got)
    for name, want in sd.items():
        if name.endswith("_scale_inv"):
            continue
        if want.dtype in (E4M3, E5M2):
            ref = reference_dequant(want, sd[name + "_scale_inv"], dtype)
            assert got[name].dtype == dtype and torch.equal(bits(got[name]), bits(ref)), name
            if want.dtype == E4M3:  # its 0x7F: NaN in, NaN out
                assert math.isnan(float(got[name].reshape(-1)[0]))
        else:
            assert torch.equal(got[name], want.to(dtype)), name


def test_dequantize_to_another_layout_from_column_shards(sources, tmp_path):
    """A Shard(1) target of a TP=2 source: every worker's bands need other columns' scales."""
    sd, src = sources
    dst = str(tmp_path / "tp2")
    reshard_svc.convert(
        src["ours"],
        dst,
        mesh="tp=3",
        rules={"*proj.weight": "S(1)", "*experts.w": "S(2)", "*": "S(0)"},
        dequantize="fp8-block",
        max_memory=64 * 1024,
    )
    out = {
        n: torch.zeros(
            sd[n].shape, dtype=torch.bfloat16 if sd[n].dtype in (E4M3, E5M2) else sd[n].dtype
        )
        for n in sd
        if not n.endswith("_scale_inv")
    }
    reshard_svc.load(out, dst)
    for name, t in out.items():
        want = sd[name]
        if want.dtype in (E4M3, E5M2):
            want = reference_dequant(want, sd[name + "_scale_inv"], torch.bfloat16)
        assert torch.equal(bits(t), bits(want)), name


def test_a_missing_or_mistiled_scale_is_named(tmp_path):
    src = str(tmp_path / "ck")
    reshard_svc.save(
        {
            "w": torch.zeros(256, 256).to(E4M3),
            "w_scale_inv": torch.ones(2, 3),
            "v": torch.zeros(8, 8).to(E4M3),
        },
        src,
    )
    r = reshard("convert", src, str(tmp_path / "o"), "--format", "hf", "--dequantize", "fp8-block")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "'v_scale_inv'" in r.stderr or "'w_scale_inv' has shape [2, 3]" in r.stderr


def test_readme_fp8_commands(sources, tmp_path):
    """The README's FP8 commands, as written, in a folder holding ``fp8-ckpt``."""
    import shlex
    import shutil

    from tests.support.docs import block

    sd, src = sources
    shutil.copytree(src["ours"], tmp_path / "fp8-ckpt")
    lines = [ln.split("  #")[0].strip() for ln in block("fp8", "bash").splitlines()]
    cmds = [shlex.split(ln)[1:] for ln in lines if ln.startswith("reshard ")]
    assert len(cmds) == 2
    for argv in cmds:
        r = reshard(*argv, cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr)
    kept = load_file(str(tmp_path / "fp8-hf" / "model-00001-of-00001.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(bits(kept[name]), bits(sd[name]))
    deq = load_file(str(tmp_path / "bf16-hf" / "model-00001-of-00001.safetensors"))
    ref = reference_dequant(sd[name], sd[name + "_scale_inv"], torch.bfloat16)
    assert torch.equal(bits(deq[name]), bits(ref)) and name + "_scale_inv" not in deq
