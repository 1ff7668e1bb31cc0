"""Interop with torch DCP's Hugging Face safetensors reader and writer, both ways."""

from __future__ import annotations

import pytest

import reshard_svc
from tests.support import workloads
from tests.support.harness import run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("world", "save_mesh", "load_mesh"), [(2, [2], [2]), (4, [2, 2], [4])])
def test_torch_hf_reader_loads_our_checkpoint_into_another_layout(
    tmp_path, world, save_mesh, load_mesh
):
    path = str(tmp_path / "ours")
    res = run(workloads.torch_reads_ours, world, path, save_mesh, load_mesh)
    assert all(bad == [] for bad in res.values()), res


def test_we_load_what_torch_hf_writer_saved(tmp_path):
    path = str(tmp_path / "theirs")
    res = run(workloads.we_read_torch, 2, path, [2], [2])
    assert all(bad == [] for bad in res.values()), res
    info = reshard_svc.inspect(path)
    assert info.source == "dcp-hf"
    assert "model.layers.0.qkv.weight" in info.tensors
