"""The local CLI commands, run as real subprocesses."""

from __future__ import annotations

import json
import os

import pytest
import torch

import reshard_svc
from tests.support.cli import reshard


def make(tmp_path) -> str:
    path = str(tmp_path / "ck")
    reshard_svc.save(
        {"w": torch.randn(8, 4), "b": torch.ones(3, dtype=torch.bfloat16), "step": 9}, path
    )
    return path


def test_inspect_json_describes_tensors(tmp_path):
    path = make(tmp_path)
    r = reshard("inspect", path, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["tensors"]["w"]["shape"] == [8, 4]
    assert info["tensors"]["b"]["dtype"] == "bfloat16"
    assert info["total_bytes"] == 8 * 4 * 4 + 3 * 2
    assert info["extras"] == {"step": 9}


def test_inspect_table(tmp_path):
    r = reshard("inspect", make(tmp_path))
    assert r.returncode == 0 and "bfloat16" in r.stdout and "2 tensors" in r.stdout


def test_verify_exit_codes(tmp_path):
    path = make(tmp_path)
    assert reshard("verify", path).returncode == 0
    data = [n for n in os.listdir(path) if n.endswith(".safetensors")][0]
    with open(os.path.join(path, data), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    r = reshard("verify", path, "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and "CRC32C" in report["problems"][0]


def test_not_a_checkpoint_is_exit_2(tmp_path):
    r = reshard("inspect", str(tmp_path / "missing"))
    assert r.returncode == 2 and "NotACheckpointError" in r.stderr


def test_convert_with_workers_and_hf_export(tmp_path):
    src = make(tmp_path)
    tp2 = str(tmp_path / "tp2")
    r = reshard(
        "convert", src, tp2, "--mesh", "tp=2", "--workers", "2", "--json",
        "--io-threads", "3", "--device", "cpu",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["event"] == "done"
    assert reshard_svc.inspect(tp2).tensors["w"].layout.mesh.shape == (2,)
    assert reshard_svc.verify(tp2).ok
    hf = str(tmp_path / "hf")
    r = reshard("convert", tp2, hf, "--format", "hf", "--dtype", "fp16", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert reshard_svc.inspect(hf).tensors["w"].dtype == torch.float16
    r = reshard("convert", src, str(tmp_path / "bad"), "--mesh", "tp=two")
    assert r.returncode == 2 and "tp=two" in r.stderr


def test_version():
    r = reshard("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"reshard {reshard_svc.__version__}"


def test_integer_and_float8_casts_are_refused(tmp_path):
    src = make(tmp_path)
    for dtype in ("int8", "float8_e4m3fn", "q4"):
        dst = str(tmp_path / f"out-{dtype}")
        r = reshard("convert", src, dst, "--dtype", dtype)
        assert r.returncode == 2 and "error:" in r.stderr and dtype in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not os.path.exists(dst)


def test_cast_leaves_integer_tensors_alone(tmp_path):
    src = str(tmp_path / "ck")
    reshard_svc.save({"w": torch.randn(4, 4), "step": torch.tensor(7)}, src)
    dst = str(tmp_path / "half")
    reshard_svc.convert(src, dst, dtype="bf16")
    index = reshard_svc.inspect(dst)
    assert index.tensors["w"].dtype == torch.bfloat16
    assert index.tensors["step"].dtype == torch.int64


def test_submit_with_invalid_values_prints_one_error_line(tmp_path):
    for args in (
        ["--dtype", "int3"],
        ["--format", "zip"],
        ["--strategy", "fast"],
        ["--max-memory", "lots"],
        ["--checksum", "md5"],
    ):
        r = reshard("submit", "/a", "/b", *args, "--url", "http://127.0.0.1:9")
        assert r.returncode == 2, (args, r.stderr)
        assert "error: invalid job" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_hf_export_of_the_model_only(tmp_path):
    """--only/--strip-prefix turn a training checkpoint into a loadable model folder."""
    from safetensors.torch import load_file

    model = {"embed.weight": torch.randn(16, 8), "layers.0.mlp.weight": torch.randn(8, 8)}
    optim = {"state": {"embed.weight": {"exp_avg": torch.randn(16, 8)}}}
    src = str(tmp_path / "train")
    reshard_svc.save({"model": model, "optim": optim, "step": 5}, src)
    hf = str(tmp_path / "hf")
    r = reshard(
        "convert", src, hf, "--format", "hf", "--only", "model.*", "--strip-prefix", "model."
    )
    assert r.returncode == 0, r.stderr
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert sorted(weight_map) == sorted(model)
    loaded = {}
    for name in set(weight_map.values()):
        loaded.update(load_file(os.path.join(hf, name)))
    assert loaded.keys() == model.keys()
    for k, v in model.items():
        assert torch.equal(loaded[k], v), k
    r = reshard("convert", src, str(tmp_path / "none"), "--format", "hf", "--only", "nope.*")
    assert r.returncode == 2 and "matches no tensor" in r.stderr and "Traceback" not in r.stderr


def _workers_of(launcher: int) -> list[int]:
    """pids of ``reshard_svc.worker`` processes descended from the launcher (torchrun puts
    its workers in sessions of their own, so the family tree is what links them)."""
    parent, cmds = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                parent[int(entry)] = int(f.read().rsplit(b")", 1)[-1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmds[int(entry)] = f.read()
        except OSError:
            continue

    def descends(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 0)
            if pid == launcher:
                return True
        return False

    return [
        p
        for p, cmd in cmds.items()
        if b"reshard_svc.worker" in cmd and b"torch.distributed.run" not in cmd and descends(p)
    ]


def test_ctrl_c_prints_one_line_and_commits_nothing(tmp_path):
    import functools
    import signal
    import subprocess
    import sys
    import time

    src = str(tmp_path / "src")
    reshard_svc.save({f"w{i}": torch.randn(512, 512) for i in range(64)}, src)  # seconds of work
    dst = tmp_path / "dst"
    scratch = tmp_path.parent / (tmp_path.name + "-tmp")  # the CLI's TMPDIR: worker logs
    scratch.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reshard_client.cli",
            "convert",
            src,
            str(dst),
            "--mesh",
            "tp=2",
            "--rules",
            '{"*": "S(0)"}',
            "--workers",
            "2",
            "--max-memory",
            "64KiB",
        ],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(scratch)},
        # as from a terminal: a runner that started us in the background (SIGINT ignored,
        # which children inherit) must not turn Ctrl-C into a no-op for the CLI
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    # Interrupt once the workers run (a Ctrl-C while the interpreter is still importing
    # is Python's own business), however slow this machine is at the moment.
    deadline = time.monotonic() + 60
    while not _workers_of(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:  # finished before the signal: nothing to check
        proc.wait()
        return  # what a terminal's Ctrl-C does: the whole group
    _, stderr = proc.communicate(timeout=60)
    if proc.returncode == 0:  # finished before the signal: nothing to check
        return
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.count("error:") == 1, stderr
    text = " ".join(stderr.split())
    # nothing left in the temp folder but a worker log the message names
    assert all(str(scratch / n) in text for n in os.listdir(scratch)), (os.listdir(scratch), text)
    if (dst / "reshard.index.json").exists():  # the commit won the race: it is whole, and said
        assert "interrupted after the commit" in text, stderr
        assert reshard_svc.verify(str(dst)).ok
    else:
        assert "interrupted: nothing was committed" in text, stderr
        # the workers stopped cleanly: no staging data, no lease, and no gc needed
        assert sorted(os.listdir(tmp_path)) == ["src"], os.listdir(tmp_path)
        assert "reshard gc" not in text


def test_warnings_name_what_to_fix(tmp_path):
    """An unmeetable budget and a silent replication are said once, by rank 0, with its id."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.randn(16, 64)}, str(hf / "model.safetensors"))
    r = reshard(
        "convert",
        str(hf),
        str(tmp_path / "out"),
        "--mesh",
        "tp=2",
        "--max-memory",
        "16",
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stderr.split())
    assert text.count("cannot be met") == 1, r.stderr  # said once, not once per rank
    r = reshard("convert", str(hf), str(tmp_path / "out1"), "--mesh", "tp=2", "--max-memory", "16")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stderr.split())  # rich wraps long lines
    assert text.count("cannot be met") == 1 and "give at least 1024 B" in text
    assert text.count("replicated on every rank") == 1 and "--rules" in text


def test_a_worker_failure_is_one_error_line(tmp_path):
    """A corrupt block found by one of 2 workers: one ``error:`` naming it, no torchrun dump."""
    src = make(tmp_path)
    data = next(n for n in os.listdir(src) if n.endswith(".safetensors"))
    with open(os.path.join(src, data), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    dst = str(tmp_path / "out")
    r = reshard("convert", src, dst, "--mesh", "tp=2", "--workers", "2")
    assert r.returncode != 0
    text = " ".join(r.stderr.split())
    assert text.count("error:") == 1 and "ChecksumError" in text and "CRC32C" in text, r.stderr
    assert "Traceback" not in r.stderr and "ChildFailedError" not in r.stderr, r.stderr
    assert "worker logs:" in text
    assert not os.path.exists(dst) and not [p for p in os.listdir(tmp_path) if "staging" in p]


def test_device_cuda_without_a_gpu_each_and_io_threads_of_zero_name_what_to_fix(tmp_path):
    """``--device cuda`` with more workers than GPUs (here: none) is one error line naming
    the counts, from the workers (2) or this process (1); ``--io-threads 0`` is refused
    before anything starts. Nothing is written either way."""
    src, dst = make(tmp_path), str(tmp_path / "out")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        pytest.skip("this host has a GPU for each of 2 workers")
    r = reshard("convert", src, dst, "--mesh", "tp=2", "--workers", "2", "--device", "cuda")
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and text.count("error:") == 1, r.stderr
    assert f"2 worker(s) on this node but {gpus} GPU(s)" in text, r.stderr
    assert "Traceback" not in r.stderr and not os.path.exists(dst)
    if gpus == 0:
        r = reshard("convert", src, dst, "--device", "cuda")
        assert r.returncode == 2 and "device cuda: no CUDA GPU here" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not os.path.exists(dst)
    r = reshard("convert", src, dst, "--io-threads", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--io-threads" in r.stderr or "io_threads" in r.stderr, r.stderr


def test_negative_budget_is_named(tmp_path):
    r = reshard("convert", make(tmp_path), str(tmp_path / "out"), "--max-memory", "-5GiB")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    text = " ".join(r.stderr.split())
    assert "max_memory '-5GiB' is not a size" in text and "expected one argument" not in text


def test_verify_says_when_nothing_was_hashed(tmp_path):
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"w": torch.randn(4, 4)}, str(hf / "model.safetensors"))
    r = reshard("verify", str(hf))
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert text.startswith("no problems found in what could be checked"), text
    assert "of data NOT checked: Hugging Face safetensors files record no checksums" in text
    assert "0 B hashed" not in text and not text.startswith("ok")
    report = json.loads(reshard("verify", str(hf), "--json").stdout)
    assert report["ok"] and not report["complete"]
    assert report["bytes_unchecked"] == os.path.getsize(hf / "model.safetensors")


def test_inspect_layout_draws_each_box_with_its_holders(tmp_path):
    """``inspect --layout``: the picture's cells cover the tensor with its boxes, each with
    its holders' mesh coordinates, replicas named; on a 3-D mesh and for a tensor whose
    layout is not recorded; an unknown tensor is a one-line error."""
    from reshard_svc.layout import Layout

    plain = str(tmp_path / "plain")
    g = torch.Generator().manual_seed(0)
    reshard_svc.save(
        {
            "w": torch.randn(12, 40, generator=g),
            "n": torch.randn(40, generator=g),
            "e": torch.randn(4, 6, 8, generator=g),
        },
        plain,
    )
    rules = {"w": "S(0),S(1),R", "n": "R,S(0),R", "e": "S(2),R,S(0)"}
    ck = str(tmp_path / "3d")
    reshard_svc.convert(plain, ck, mesh="pp=2,dp=2,tp=2", rules=rules)
    from reshard_svc.format.picture import layout_picture

    index = reshard_svc.inspect(ck)
    for name, shape in (("w", (12, 40)), ("n", (40,)), ("e", (4, 6, 8))):
        pic = layout_picture(index.tensors[name])  # what --layout --json prints
        want = Layout.parse("pp=2,dp=2,tp=2", rules[name]).write_items(shape, 4)
        got = {(tuple(b["offsets"]), tuple(b["sizes"])): b for b in pic["boxes"]}
        assert set(got) == {(it.box.offsets, it.box.sizes) for it in want}
        for it in want:
            b = got[(it.box.offsets, it.box.sizes)]
            assert b["holders"] == list(it.holders)
            assert b["coords"][0] == dict(
                zip(
                    ("pp", "dp", "tp"),
                    Layout.parse("pp=2,dp=2,tp=2", "R,R,R").mesh.coordinate(it.holders[0]),
                )
            )
        cells = {k for row in pic["grid"] for k in row}
        assert -1 not in cells and cells <= set(range(len(pic["boxes"])))
    drawn = reshard("inspect", ck, "--layout", "n")
    assert drawn.returncode == 0 and "replicas" in drawn.stdout, drawn.stderr
    plain_pic = json.loads(reshard("inspect", plain, "--layout", "w", "--json").stdout)
    assert plain_pic["layout"] is None and plain_pic["boxes"][0]["file"]
    assert plain_pic["grid"] and plain_pic["dims_drawn"] == [0, 1]
    bad = reshard("inspect", ck, "--layout", "nope")
    assert (
        bad.returncode == 2 and "no tensor 'nope'" in bad.stderr and "Traceback" not in bad.stderr
    )


def test_help_lists_each_command_in_sentences_that_wrap_where_the_terminal_does():
    """A docstring's own line breaks never reach ``reshard --help``: each command's summary
    is its first paragraph on one line (at 80 columns rich wraps it, never mid-line)."""
    from reshard_client.cli import app

    for info in app.registered_commands:
        assert info.short_help and "\n" not in info.short_help, info.name
    env = {**os.environ, "COLUMNS": "400"}
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "reshard_client.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    ).stdout
    steps = [line for line in out.splitlines() if " steps " in line]
    assert len(steps) == 1 and steps[0].rstrip(" │").endswith("Changes nothing."), steps
