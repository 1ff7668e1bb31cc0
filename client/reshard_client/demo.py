"""``make demo``: a TP=8 -> TP=2 conversion through the control plane, end to end.

1. build a small TP=8 checkpoint ``ckpt-tp8`` (Llama-shaped, column/row-parallel, a fused
   QKV as strided shards) in the demo folder (``reshard-demo/`` unless ``--dir``);
2. start ``reshard-server`` on a free loopback port (token, roots, SQLite in that folder);
3. ``reshard submit ckpt-tp8 ckpt-tp2 --mesh tp=2 --workers 2 --wait`` — two gloo
   workers, progress bar;
4. ``reshard verify`` and ``reshard inspect`` the result, and check it bit for bit;
5. stop the server, keep the folder (the README's CLI examples run in it) and say where.

A second run clears only what the first one made there (``ckpt-tp8``, ``ckpt-tp2`` and
the server's state); anything else in the folder stays.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from rich.console import Console

from reshard_svc._process import free_port

console = Console()


def step(text: str) -> None:
    console.print(f"\n[bold cyan]==>[/] {text}")


def run(cmd: list[str], env: dict[str, str]) -> None:
    console.print("[dim]$ " + " ".join(cmd[2:] if cmd[1] == "-m" else cmd) + "[/]", highlight=False)
    subprocess.run(cmd, env=env, check=True)


def build_source(path: str) -> dict:
    import torch

    import reshard_svc

    g = torch.Generator().manual_seed(0)
    h, f, v = 256, 688, 1000
    sd = {"tok_embeddings.weight": torch.randn(v, h, generator=g).to(torch.bfloat16)}
    for i in range(4):
        p = f"layers.{i}."
        sd[p + "attention.wqkv.weight"] = torch.randn(3 * h, h, generator=g).to(torch.bfloat16)
        sd[p + "attention.wo.weight"] = torch.randn(h, h, generator=g).to(torch.bfloat16)
        sd[p + "feed_forward.w13.weight"] = torch.randn(2 * f, h, generator=g).to(torch.bfloat16)
        sd[p + "feed_forward.w2.weight"] = torch.randn(h, f, generator=g).to(torch.bfloat16)
        sd[p + "attention_norm.weight"] = torch.ones(h)
    reshard_svc.save({"model": sd, "step": 1000}, path + "-plain", overwrite=True)
    rules = {
        "*.wqkv.weight": "SS(0,3)",  # fused QKV: strided, three boxes per rank
        "*.w13.weight": "SS(0,2)",
        "*.wo.weight": "S(1)",
        "*.w2.weight": "S(1)",
        "*norm*": "R",
        "*": "S(0)",
    }
    reshard_svc.convert(path + "-plain", path, mesh="tp=8", rules=rules)
    shutil.rmtree(path + "-plain")
    return {"model." + k: t for k, t in sd.items()}


MARKER = ".reshard-demo"
OWN = ("ckpt-tp8", "ckpt-tp2", "ckpt-tp8-plain", "server")


def prepare(folder: Path) -> None:
    """The demo folder, with what an earlier demo made there cleared (nothing else)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (folder / MARKER).exists():
        for name in OWN:
            shutil.rmtree(folder / name, ignore_errors=True)
            for leftover in folder.glob(f".{name}.*"):  # a killed run's staging or lease
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink()
    elif any(n.name in OWN for n in folder.iterdir()):
        raise SystemExit(
            f"{folder} holds {', '.join(OWN)}-like folders the demo did not make: "
            "pass --dir to use another folder"
        )
    (folder / MARKER).write_text("made by `make demo` (python -m reshard_client.demo)\n")


def cli(*args: str) -> list[str]:
    """A ``reshard`` command line, run with this interpreter."""
    return [sys.executable, "-m", "reshard_client.cli", *args]


@contextlib.contextmanager
def server_running(port: int, env: dict[str, str]) -> Iterator[None]:
    """``reshard-server`` on 127.0.0.1:``port``, up (``/healthz`` answers) until the block
    ends, then stopped."""
    step(f"Starting reshard-server on 127.0.0.1:{port}")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reshard_server.main",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("reshard-server did not start")
            time.sleep(0.2)
        yield
    finally:
        step("Stopping the server")
        server.terminate()
        server.wait(30)


def bitwise_equal(want: dict, path: str) -> bool:
    """Load ``path`` into tensors shaped like ``want`` and compare every one, bit for bit."""
    import torch

    import reshard_svc

    out = {k: torch.zeros_like(v) for k, v in want.items()}
    reshard_svc.load(out, path, strict=False)
    same = all(torch.equal(out[k], want[k]) for k in want)
    console.print(
        f"{len(want)} tensors bitwise equal to the originals: "
        + ("[green]yes[/]" if same else "[red]NO[/]")
    )
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reshard_client.demo", description=__doc__)
    ap.add_argument("--dir", default="reshard-demo", help="the demo folder (kept afterwards)")
    folder = Path(ap.parse_args(argv).dir).resolve()
    prepare(folder)
    port = free_port()
    env = {
        **os.environ,
        "RESHARD_URL": f"http://127.0.0.1:{port}",
        "RESHARD_TOKEN": secrets.token_hex(16),
        "RESHARD_ROOTS": str(folder),
        "RESHARD_DB": f"{folder}/server/jobs.db",
        "RESHARD_DATA_DIR": f"{folder}/server",
        "RESHARD_POLL_INTERVAL_S": "0.1",
        "OMP_NUM_THREADS": "1",
    }
    src, dst = f"{folder}/ckpt-tp8", f"{folder}/ckpt-tp2"

    step("Building a small TP=8 checkpoint (fused QKV as strided shards)")
    want = build_source(src)
    run(cli("inspect", src), env)
    with server_running(port, env):
        step("Submitting TP=8 -> TP=2 on 2 gloo workers, following progress")
        run(cli("submit", src, dst, "--mesh", "tp=2", "--workers", "2", "--wait"), env)
        run(cli("jobs"), env)
        step("Verifying the result (coverage, headers, block CRC32Cs) and comparing every tensor")
        run(cli("verify", dst), env)
        run(cli("inspect", dst), env)
        if not bitwise_equal(want, dst):
            return 1
    console.print("[bold green]demo finished[/]")
    console.print(
        f"The checkpoints are kept in [bold]{folder}[/] (ckpt-tp8, ckpt-tp2): the README's CLI "
        f"examples run there: cd {folder} && reshard inspect ckpt-tp8",
        highlight=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
