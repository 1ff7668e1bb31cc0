"""Every command of the README's quick start and of the CLI guide (docs/cli.md) runs, in order,
with the guide's rules file."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest
import torch

import reshard_svc
from tests.support.cli import reshard
from tests.support.docs import block


def section(name: str, lang: str) -> str:
    return block(name, lang)


def commands(name: str = "cli") -> list[list[str]]:
    """Each ``reshard ...`` line, comment dropped; ``[--opt]`` parts run without, then with."""
    out = []
    for line in section(name, "bash").splitlines():
        line = line.split("  #")[0].strip()
        if not line.startswith("reshard "):
            continue
        optional = re.findall(r"\[([^\]]+)\]", line)
        base = shlex.split(re.sub(r"\s*\[[^\]]+\]", "", line))[1:]
        out.append(base)
        if optional:
            out.append(base + [a for opt in optional for a in shlex.split(opt)])
    return out


def _tp8(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "model.layers.0.wqkv.weight": torch.randn(48, 32, generator=g),
        "model.layers.0.wo.weight": torch.randn(32, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
        "model.embed.weight": torch.randn(64, 32, generator=g),
        "optim.state.embed.exp_avg": torch.randn(64, 32, generator=g),
    }
    reshard_svc.save(sd, str(tmp_path / "plain"))
    reshard_svc.convert(
        str(tmp_path / "plain"), str(tmp_path / "ckpt-tp8"), mesh="tp=8", rules={"*": "S(0)"}
    )
    return sd


def test_readme_quickstart(tmp_path):
    """The README's few commands, in the folder ``make demo`` leaves."""
    sd = _tp8(tmp_path)
    cmds = commands("quickstart")
    assert len(cmds) >= 3
    for argv in cmds:
        r = reshard(*argv, cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (
            f"reshard {' '.join(argv)}: {r.stderr[-1500:]}"
        )
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, str(tmp_path / "ckpt-tp4"))
    assert all(torch.equal(out[k], sd[k]) for k in sd)


@pytest.mark.slow
def test_cli_guide_commands(tmp_path):
    sd = _tp8(tmp_path)
    (tmp_path / "rules.yaml").write_text(section("rules", "yaml"))
    cmds = commands()
    assert len(cmds) >= 8
    for argv in cmds:
        r = reshard(*argv, cwd=tmp_path)
        assert r.returncode == 0, f"reshard {' '.join(argv)}: {r.stderr[-1500:]}"
        assert "Traceback" not in r.stderr
    two_d = reshard_svc.inspect(str(tmp_path / "ckpt-2d"))
    assert two_d.tensors["model.layers.0.wo.weight"].dtype == torch.bfloat16
    assert two_d.tensors["model.norm.weight"].dtype == torch.float32  # --keep-dtype '*norm*'
    assert two_d.tensors["model.layers.0.wo.weight"].layout.mesh.shape == (2, 2)
    with open(tmp_path / "model-hf" / "model.safetensors.index.json") as f:
        names = set(json.load(f)["weight_map"])
    assert names == {n.removeprefix("model.") for n in sd if n.startswith("model.")}
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, str(tmp_path / "ckpt-tp4"))
    for k in sd:
        assert torch.equal(out[k], sd[k]), k


@pytest.mark.s3
def test_readme_python_section(s3, tmp_path, monkeypatch):
    """The "Python" section, as written (one process; its S3 bucket is moto's)."""
    fast = str(tmp_path / "shm" / "run")  # each node's memory: here, this test's folder
    code = section("python", "python").replace("s3://bucket", s3)
    code = code.replace("/dev/shm/reshard/run", fast)
    g = torch.Generator().manual_seed(0)
    model_sd = {"w": torch.randn(16, 8, generator=g)}
    optim_sd = {"state": {"w": {"exp_avg": torch.randn(16, 8, generator=g)}}}
    reshard_svc.save({"w": torch.randn(32, 8, generator=g)}, str(tmp_path / "plain"))
    reshard_svc.convert(
        str(tmp_path / "plain"), str(tmp_path / "ckpt-tp8"), mesh="tp=8", rules={"*": "S(0)"}
    )
    monkeypatch.chdir(tmp_path)
    scope = {"model_sd": model_sd, "optim_sd": optim_sd}
    expected = {k: v.clone() for k, v in model_sd.items()}
    exec(compile(code, "README.md:python", "exec"), scope)
    assert torch.equal(scope["model_sd"]["w"], expected["w"])  # loaded back in place
    assert reshard_svc.inspect("ckpt-tp4").tensors["w"].layout.mesh.shape == (4,)
    assert reshard_svc.inspect("ckpt-hf").tensors["w"].dtype == torch.bfloat16
    with reshard_svc.CheckpointManager(f"{s3}/run") as mgr:  # the loop's steps, on S3
        assert mgr.steps() == [20, 30]
        assert mgr.load({"model": {"w": torch.zeros(16, 8)}}, strict=False) == 30
    assert sorted(n.split(".")[0] for n in os.listdir(fast)) == [
        "step-0000000028",
        "step-0000000030",
    ]
