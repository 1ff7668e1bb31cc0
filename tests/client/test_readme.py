"""The README's "Checkpointing a training loop" code runs: 2 ranks, then resumed at 1."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def training_loop_code() -> str:
    text = README.read_text()
    block = re.search(
        r"<!-- training-loop:start -->\s*```python\n(.*?)```\s*<!-- training-loop:end -->",
        text,
        re.S,
    )
    assert block, "README lost its training-loop section"
    return block.group(1)


@pytest.mark.distributed
def test_readme_training_loop_saves_and_resumes_at_another_size(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(training_loop_code())
    env = {**os.environ, "CKPT_DIR": str(tmp_path / "ckpt"), "OMP_NUM_THREADS": "1"}
    for nproc in (2, 1):
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-4000:]
    index = json.loads((tmp_path / "ckpt" / "latest" / "reshard.index.json").read_text())
    assert index["extras"]["step"] == 40  # 20 steps at TP=2, then 20 more after resuming at 1
    assert index["tensors"]["model.0.weight"]["layout"]["mesh"]["shape"] == [1]
