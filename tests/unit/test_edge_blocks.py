"""A read that starts or ends inside a CRC32C block checks that whole block.

Three tensors of a little over 2.5 MiB each sit back to back in one file, so the
boundaries between them fall inside blocks. Loading only the middle one reads straight
into its destination; a bit flipped in the neighbours' bytes of either edge block must
still fail the load, and a clean file must load bitwise.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import reshard_svc
from reshard_svc.errors import ChecksumError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE as BS

N = 640 * 1024 + 3  # fp32 elements: 2.5 MiB + 12 bytes


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("edges") / "ckpt")
    g = torch.Generator().manual_seed(3)
    sd = {k: torch.randn(N, generator=g) for k in ("a", "b", "c")}
    reshard_svc.save(sd, path)
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    (b,) = reshard_svc.inspect(path).tensors["b"].chunks
    return path, name, sd, b


def corrupt(src: str, dst: str, name: str, offset: int) -> None:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, name), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x04]))


def test_clean_middle_tensor_loads_bitwise(saved):
    path, _, sd, b = saved
    assert b.begin % BS and b.end % BS  # both edges inside blocks
    out = {"b": torch.zeros(N)}
    reshard_svc.load(out, path, strict=False)
    assert torch.equal(out["b"], sd["b"])


@pytest.mark.parametrize("edge", ["head", "tail"])
def test_flip_in_a_neighbours_bytes_of_an_edge_block_fails_the_load(saved, tmp_path, edge):
    path, name, _, b = saved
    offset = b.begin - 5 if edge == "head" else b.end + 5
    block = (b.begin if edge == "head" else b.end) // BS
    assert offset // BS == block  # the flip is outside b, inside its edge block
    bad = str(tmp_path / "bad")
    corrupt(path, bad, name, offset)
    out = {"b": torch.zeros(N)}
    with pytest.raises(ChecksumError) as err:
        reshard_svc.load(out, bad, strict=False)
    assert f"[{block * BS}, {(block + 1) * BS})" in str(err.value)
