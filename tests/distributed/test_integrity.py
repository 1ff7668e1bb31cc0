"""Block CRC32C checksums: every byte load and convert read is checked before it is used.

One bit is flipped in the first block, a middle block, the last (partial) block and a block
that only one target rank reads; one file is truncated. ``load`` on 2 and 3 gloo ranks (both
strategies), ``convert``, ``verify`` and the CLI must each fail with a typed error naming
the file, the byte range and both CRCs — every rank together, nothing committed, no
traceback on the command line.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import reshard_svc
from reshard_svc.errors import ChecksumError, CorruptCheckpointError
from reshard_svc.format.checksums import DEFAULT_BLOCK_SIZE
from tests.support import workloads
from tests.support.cli import reshard as cli
from tests.support.harness import run

ROWS = 1536  # w is ROWS x 1024 fp32: 6 MiB, so its file spans 7 blocks, the last one short


def build(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = {"w": torch.randn(ROWS, 1024, generator=g), "b": torch.randn(1000, generator=g)}
    reshard_svc.save(sd, path)
    return sd


def data_file(path: str) -> str:
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    return os.path.join(path, name)


def flip(path: str, offset: int) -> None:
    with open(data_file(path), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    base = tmp_path_factory.mktemp("integrity")
    clean = str(base / "clean")
    build(clean)
    index = reshard_svc.inspect(clean)
    (w,) = index.tensors["w"].chunks
    size = os.path.getsize(data_file(clean))
    assert size > 6 * DEFAULT_BLOCK_SIZE and size % DEFAULT_BLOCK_SIZE
    last_rank_row = ROWS - 10  # a row only the last target rank holds (Shard(0), 2 or 3 ranks)
    offsets = {
        "first-block": w.begin + 8 if w.begin < DEFAULT_BLOCK_SIZE else 100,
        "middle-block": 3 * DEFAULT_BLOCK_SIZE + 12345,
        "last-partial-block": size - 3,
        "one-rank-block": w.begin + last_rank_row * 1024 * 4 + 17,
    }
    out = {}
    for case, off in offsets.items():
        p = str(base / case)
        shutil.copytree(clean, p)
        flip(p, off)
        out[case] = (p, off)
    p = str(base / "truncated")
    shutil.copytree(clean, p)
    os.truncate(data_file(p), size - 1000)
    out["truncated"] = (p, size - 1000)
    return base, clean, out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_load_and_convert_fail_together_on_any_corrupt_block(cases, world):
    base, _, corrupt = cases
    tmp = str(base / f"w{world}")
    os.makedirs(tmp, exist_ok=True)
    res = run(workloads.integrity_cases, world, {k: p for k, (p, _) in corrupt.items()}, tmp)
    for rank, per_case in res.items():
        for key, outcome in per_case.items():
            case = key.split("/")[0]
            assert outcome != "ok", (rank, key)
            if case == "truncated":
                assert "truncated" in outcome or "CorruptCheckpointError" in outcome, outcome
                continue
            # The rank that read the block names it; its peers name that rank's failure.
            assert "ChecksumError" in outcome, (rank, key, outcome)
            assert "expected" in outcome and "got" in outcome, outcome
    # Every conversion failed before its commit: no target, no staging folder left.
    assert os.listdir(tmp) == []


def test_in_process_errors_name_file_range_and_values(cases):
    _, _, corrupt = cases
    path, off = corrupt["middle-block"]
    out = {"w": torch.zeros(ROWS, 1024), "b": torch.zeros(1000)}
    with pytest.raises(ChecksumError) as info:
        reshard_svc.load(out, path)
    e = info.value
    assert e.file.endswith(".safetensors") and e.begin <= off < e.end
    assert e.end - e.begin == DEFAULT_BLOCK_SIZE and e.expected != e.actual
    assert f"[{e.begin}, {e.end})" in str(e) and e.expected in str(e) and e.actual in str(e)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        reshard_svc.load(out, corrupt["truncated"][0])


def test_verify_names_every_bad_block(cases):
    _, clean, corrupt = cases
    assert reshard_svc.verify(clean).ok
    for case, (path, off) in corrupt.items():
        report = reshard_svc.verify(path)
        assert not report.ok, case
        text = " | ".join(report.problems)
        if case == "truncated":
            assert "truncated" in text
        else:
            block = off // DEFAULT_BLOCK_SIZE
            assert f"(block {block})" in text and "CRC32C" in text, text


@pytest.mark.distributed
def test_cli_reports_corruption_in_one_line(cases, tmp_path):
    _, _, corrupt = cases
    path, _ = corrupt["one-rank-block"]
    r = cli("verify", path)
    assert r.returncode == 1 and "CRC32C" in r.stderr and "Traceback" not in r.stderr
    for workers in ("1", "2"):
        dst = str(tmp_path / f"out{workers}")
        r = cli("convert", path, dst, "--mesh", "tp=2", "--workers", workers)
        assert r.returncode == 2, r.stderr
        assert "ChecksumError" in r.stderr and "expected" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert not os.path.exists(dst)


def test_v1_checkpoints_still_load_convert_and_verify(tmp_path):
    """A v1 index (whole-file sha256, no block table) from an earlier release."""
    import hashlib

    path = str(tmp_path / "v1")
    sd = build(path)
    idx_path = os.path.join(path, "reshard.index.json")
    index = json.load(open(idx_path))
    index["format_version"] = 1
    del index["checksum"]
    for name, f in index["files"].items():
        raw = open(os.path.join(path, name), "rb").read()
        index["files"][name] = {"size": f["size"], "sha256": hashlib.sha256(raw).hexdigest()}
    json.dump(index, open(idx_path, "w"))
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    reshard_svc.load(out, path)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    report = reshard_svc.verify(path)
    assert report.ok and report.checksum == "sha256" and report.bytes_hashed > 0
    reshard_svc.convert(path, str(tmp_path / "v2"), mesh="tp=2", rules={"*": "S(0)"})
    assert reshard_svc.inspect(str(tmp_path / "v2")).checksum == "crc32c"
    flip(path, 1000)
    assert "sha256 mismatch" in " ".join(reshard_svc.verify(path).problems)


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda f, c: f.update(blocks=f["blocks"][:-8]), "block CRCs"),
        (lambda f, c: f.update(blocks=f["blocks"] + "00000000"), "block CRCs"),
        (lambda f, c: f.update(blocks="zz" + f["blocks"][2:]), "not hexadecimal"),
        (lambda f, c: f.update(blocks=1234), "hex string"),
        (lambda f, c: f.update(crc32c="00000000"), "block table was altered"),
        (lambda f, c: c.update(block_size=1000), "block_size"),
        (lambda f, c: c.update(block_size="1MiB"), "block_size"),
        (lambda f, c: c.update(block_size=2 * DEFAULT_BLOCK_SIZE), "block CRCs"),
        (lambda f, c: c.update(algorithm="md5"), "checksum.algorithm"),
    ],
)
def test_malformed_block_tables_are_refused_before_any_data_is_read(tmp_path, edit, words):
    path = str(tmp_path / "ck")
    build(path)
    idx_path = os.path.join(path, "reshard.index.json")
    index = json.load(open(idx_path))
    (f,) = index["files"].values()
    edit(f, index["checksum"])
    json.dump(index, open(idx_path, "w"))
    os.chmod(data_file(path), 0)  # any data read would now fail with a storage error
    try:
        with pytest.raises(CorruptCheckpointError, match=words):
            reshard_svc.inspect(path)
        with pytest.raises(CorruptCheckpointError, match=words):
            reshard_svc.load({"w": torch.zeros(ROWS, 1024), "b": torch.zeros(1000)}, path)
        assert words.split()[0] in " ".join(reshard_svc.verify(path).problems)
    finally:
        os.chmod(data_file(path), 0o644)
