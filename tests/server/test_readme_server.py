"""The README's control-plane commands run as written: start the server, submit with curl
and follow its events, the Python client, and every CLI line (against moto S3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import torch

import reshard_svc
from tests.support.docs import block
from tests.support.harness import free_port


def test_readme_control_plane(s3, tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(3)}
    reshard_svc.save(sd, str(tmp_path / "plain"))
    reshard_svc.convert(
        str(tmp_path / "plain"), f"{s3}/llama-tp8", mesh="tp=8", rules={"*": "S(0)"}
    )
    port = free_port()

    def adapt(text: str) -> str:
        text = text.replace("s3://checkpoints", s3).replace("=/data,", f"={tmp_path}/data,")
        return text.replace("8000", str(port))

    cli_lines = []
    for line in adapt(block("client-cli", "bash")).splitlines():
        line = re.sub(r"\[([^\]]+)\]", r"\1", line).replace(" ID", " $ID")
        cli_lines.append(line.replace(" ; ", "\n"))
    server_block = adapt(block("server", "bash")).replace(
        "\nreshard-server ", "\nreshard-server ", 1
    )
    server_lines = server_block.strip().splitlines()
    script = "\n".join(
        [
            "set -euo pipefail",
            server_lines[0],
            server_lines[1].split("  #")[0] + " > server.log 2>&1 &",
            "SERVER=$!",
            "trap 'kill $SERVER' EXIT",
            f"for i in $(seq 150); do curl -sf localhost:{port}/healthz >/dev/null && break; sleep 0.2; done",
            adapt(block("curl", "bash")),
            'echo "curl job: $ID"',
            f"export RESHARD_URL=http://localhost:{port}",
            "python3 - <<'PY'\n"
            + adapt(block("client-python", "python"))
            + "print('python', done.state.value)\nPY",
            *cli_lines,
        ]
    )
    (tmp_path / "readme.sh").write_text(script)
    r = subprocess.run(
        ["bash", str(tmp_path / "readme.sh")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "XDG_STATE_HOME": str(tmp_path / "state"),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        },
    )
    log = (tmp_path / "server.log").read_text() if (tmp_path / "server.log").exists() else ""
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n{log[-2000:]}"
    assert "Traceback" not in r.stderr
    assert re.search(r'event: state\ndata: \{"id":"[0-9a-f]+","state":"succeeded"', r.stdout)
    assert "python succeeded" in r.stdout
    assert (tmp_path / "state" / "reshard-server" / "jobs.db").exists()  # the default place
    for target, tp in (("llama-tp4", 4), ("llama-tp2", 2)):
        assert reshard_svc.inspect(f"{s3}/{target}").tensors["layers.0.w"].layout.mesh.shape == (
            tp,
        )
        out = {k: torch.zeros_like(v) for k, v in sd.items()}
        reshard_svc.load(out, f"{s3}/{target}")
        for k in sd:
            assert torch.equal(out[k], sd[k]), (target, k)


def test_docs_work_offline(server):
    html = httpx.get(server.url + "/docs").text
    assert "cdn." not in html
    js = re.search(r'src="([^"]*swagger-ui-bundle\.js)"', html).group(1)
    assert httpx.get(server.url + js).status_code == 200
    assert "cdn." not in httpx.get(server.url + "/redoc").text
