"""The index file's text: valid JSON that reads back to the same index, one entry a line."""

from __future__ import annotations

import json

import torch

import reshard_svc
from reshard_svc.format.index import INDEX_NAME, CheckpointIndex


def test_index_text_round_trips_with_one_tensor_and_file_per_line(tmp_path):
    sd = {f"layers.{i}.w": torch.randn(8, 4) for i in range(12)}
    sd['odd "name"\n'] = torch.ones(3)  # escaped on its one line
    reshard_svc.save(sd, str(tmp_path / "c"))
    text = (tmp_path / "c" / INDEX_NAME).read_text()
    index = CheckpointIndex.loads(text.encode())
    assert json.loads(text) == index.to_json()
    assert CheckpointIndex.loads(index.dumps()) == index
    lines = text.splitlines()
    for name in [*sd, *index.files]:
        assert sum(line.startswith(f"  {json.dumps(name)}: {{") for line in lines) == 1
    assert len(lines) == 11 + len(sd) + len(index.files)  # and 11 others: braces, fields, extras
