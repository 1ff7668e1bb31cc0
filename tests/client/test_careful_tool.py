"""What a new user trips on, fixed: casts that keep step counters, progress and errors
printed once, and the small frictions of the local commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reshard_svc
from tests.support import docs
from tests.support.cli import reshard


@pytest.fixture
def ckpt(tmp_path) -> str:
    """Weights, a norm, and an optimizer's 0-dim step counter (12345.0 is not a bf16)."""
    path = str(tmp_path / "ck")
    g = torch.Generator().manual_seed(0)
    reshard_svc.save(
        {
            "model": {
                "w": torch.randn(64, 32, generator=g),
                "norm.weight": torch.randn(32, generator=g),
            },
            "optim": {"step": torch.tensor(12345.0)},
            "ids": torch.arange(5),
        },
        path,
    )
    return path


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_cast_never_rounds_scalars_and_keeps_what_it_is_told(ckpt, tmp_path, workers):
    out = str(tmp_path / "bf16")
    r = reshard(
        "convert",
        ckpt,
        out,
        "--mesh",
        "tp=2",
        "--dtype",
        "bf16",
        "--keep-dtype",
        "*norm*",
        "--workers",
        workers,
    )
    assert r.returncode == 0, r.stderr
    assert "1 cast, 2 kept their dtype" in r.stdout, r.stdout
    index = reshard_svc.inspect(out)
    assert index.tensors["model.w"].dtype == torch.bfloat16
    assert index.tensors["model.norm.weight"].dtype == torch.float32
    assert index.tensors["optim.step"].dtype == torch.float32
    assert index.tensors["ids"].dtype == torch.int64
    got = {"optim.step": torch.zeros(())}
    reshard_svc.load(got, out, strict=False)
    assert got["optim.step"].item() == 12345.0  # bf16 would have made it 12352


def test_cast_options_that_cannot_be_right_are_usage_errors(ckpt, tmp_path):
    r = reshard("convert", ckpt, str(tmp_path / "a"), "--keep-dtype", "*norm*")
    assert r.returncode == 2 and "only matters with a dtype" in r.stderr
    r = reshard("convert", ckpt, str(tmp_path / "b"), "--dtype", "bf16", "--keep-dtype", "nope*")
    assert r.returncode == 2 and "'nope*' matches no tensor" in r.stderr
    assert not os.path.exists(tmp_path / "b")
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_off_a_terminal_progress_is_json_lines_and_an_error_prints_once(ckpt, tmp_path, workers):
    r = reshard("convert", ckpt, str(tmp_path / "out"), "--mesh", "tp=2", "--workers", workers)
    assert r.returncode == 0, r.stderr
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert events and events[-1]["event"] == "progress"
    assert events[-1]["bytes_done"] == events[-1]["bytes_total"] > 0
    assert "\x1b" not in r.stderr + r.stdout  # no ANSI codes in a log
    data = next(n for n in os.listdir(ckpt) if n.endswith(".safetensors"))
    with open(os.path.join(ckpt, data), "r+b") as f:  # a flipped byte in the source
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    r = reshard("convert", ckpt, str(tmp_path / "bad"), "--mesh", "tp=2", "--workers", workers)
    assert r.returncode == 2
    assert r.stderr.count("ChecksumError") == 1 and r.stderr.count("error:") == 1, r.stderr


def test_on_a_terminal_one_worker_drives_the_bar(ckpt, tmp_path):
    """--workers 1 in a pseudo-terminal: the bar counts bytes and tensors to the end."""
    import pty

    out = str(tmp_path / "tty")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, on the terminal
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "reshard_client.cli",
                "convert",
                ckpt,
                out,
                "--mesh",
                "tp=2",
                "--max-memory",
                "2KiB",
            ],
        )
    chunks = []
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    _, status = os.waitpid(pid, 0)
    text = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", b"".join(chunks)).decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "converting" in text and "4/4 tensors" in text, text
    assert "converted" in text


def test_small_frictions_of_the_local_commands(ckpt, tmp_path):
    r = reshard("gc", str(tmp_path / "DOES-NOT-EXIST"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = reshard("convert", ckpt, str(tmp_path / "x"), "--only", "model.*", "--strip-prefix", "foo.")
    assert r.returncode == 2 and "--strip-prefix 'foo.' matches no tensor" in r.stderr
    r = reshard("convert", ckpt, ckpt + "/")
    assert r.returncode == 2 and "UsageError" in r.stderr and "same folder" in r.stderr
    existing = str(tmp_path / "existing")
    reshard_svc.save({"w": torch.ones(2)}, existing)
    r = reshard("convert", ckpt, existing, "--workers", "2")
    assert r.returncode == 2 and "TargetExistsError" in r.stderr
    assert "worker logs" not in r.stderr  # refused before any worker started
    for cmd in (["reshard", "--version"], ["reshard-server", "--version"]):
        v = subprocess.run(
            [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]], capture_output=True, text=True
        )
        assert v.returncode == 0 and reshard_svc.__version__ in v.stdout, v


def test_server_help_names_every_setting():
    from reshard_server.config import Settings

    r = subprocess.run(
        [sys.executable, "-m", "reshard_server.main", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0
    for name in Settings.model_fields:
        assert f"RESHARD_{name.upper()}" in r.stdout, name


def test_the_readme_says_metrics_needs_the_token():
    text = docs.text()
    assert "`GET /healthz` | liveness; the only route that needs no token" in text
    assert "`GET /metrics` | Prometheus text (with the token" in text
