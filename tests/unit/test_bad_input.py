"""Every malformed checkpoint gets a typed error naming what to fix — never a crash."""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch

import reshard_svc
from reshard_svc.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InconsistentIndexError,
    MissingFileError,
    NotACheckpointError,
    StateDictError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from reshard_svc.format.index import INDEX_NAME


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    sd = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    reshard_svc.save(sd, path)
    return path


def data_file(path: str) -> str:
    (name,) = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    return os.path.join(path, name)


def edit_index(path: str, fn) -> None:
    p = os.path.join(path, INDEX_NAME)
    data = json.loads(open(p).read())
    fn(data)
    open(p, "w").write(json.dumps(data))


def load_into(path: str):
    out = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    reshard_svc.load(out, path)
    return out


def problems(path: str) -> str:
    report = reshard_svc.verify(path)
    assert not report.ok
    return " | ".join(report.problems)


def test_truncated_data_file(ckpt):
    f = data_file(ckpt)
    size = os.path.getsize(f)
    os.truncate(f, size - 10)
    assert "truncated" in problems(ckpt)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        load_into(ckpt)


def test_truncated_foreign_file_is_caught_from_its_header(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "hf"
    p.mkdir()
    save_file({"w": torch.ones(100)}, str(p / "model.safetensors"))
    os.truncate(p / "model.safetensors", os.path.getsize(p / "model.safetensors") - 4)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        reshard_svc.inspect(str(p))


def st_header(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


F32x2 = {"dtype": "F32", "shape": [2]}


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (struct.pack("<Q", 10**6), "runs past the end"),
        (struct.pack("<Q", 10**12), "exceeds"),
        (struct.pack("<Q", 5) + b"{nope", "not valid JSON"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (st_header({"w": {**F32x2, "data_offsets": [0, 4]}}), "needs 8"),
        (
            st_header(
                {"w": {**F32x2, "data_offsets": [0, 8]}, "v": {**F32x2, "data_offsets": [4, 12]}}
            ),
            "overlap",
        ),
        (st_header({"w": {**F32x2, "data_offsets": [8, 16]}}), "truncated"),
        (st_header({"w": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}), "unknown dtype"),
        (st_header({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "bad shape"),
        (st_header({"w": {**F32x2, "data_offsets": [8, 0]}}), "bad data_offsets"),
    ],
)
def test_malformed_safetensors_headers(tmp_path, header, words):
    p = tmp_path / "hf"
    p.mkdir()
    (p / "model.safetensors").write_bytes(header + b"\0" * 12)
    with pytest.raises(CorruptCheckpointError, match=words):
        reshard_svc.inspect(str(p))
    assert words.split()[0] in problems(str(p))


def test_data_offsets_outside_the_file(ckpt):
    edit_index(
        ckpt, lambda d: d["tensors"]["a"]["chunks"][0].update(byte_range=[10**6, 10**6 + 48])
    )
    with pytest.raises(InconsistentIndexError, match="outside"):
        load_into(ckpt)


def test_overlapping_byte_ranges(ckpt):
    def fn(d):
        d["tensors"]["b"]["chunks"][0]["byte_range"] = list(
            d["tensors"]["a"]["chunks"][0]["byte_range"][:1]
        )
        d["tensors"]["b"]["chunks"][0]["byte_range"].append(
            d["tensors"]["b"]["chunks"][0]["byte_range"][0] + 20
        )

    edit_index(ckpt, fn)
    with pytest.raises(InconsistentIndexError, match="overlap"):
        reshard_svc.inspect(ckpt)


def test_index_chunks_that_overlap_or_leave_gaps(ckpt):
    def overlap(d):
        c = dict(d["tensors"]["a"]["chunks"][0])
        c["offsets"], c["sizes"] = [0, 0], [2, 4]
        c2 = dict(c)
        c2["offsets"], c2["sizes"] = [1, 0], [2, 4]
        c2["byte_range"] = [c["byte_range"][0] + 8, c["byte_range"][0] + 40]
        c["byte_range"] = [c["byte_range"][0], c["byte_range"][0] + 32]
        d["tensors"]["a"]["chunks"] = [c, c2]

    edit_index(ckpt, overlap)
    with pytest.raises(InconsistentIndexError, match="overlap"):
        load_into(ckpt)


def test_index_chunks_that_fail_to_cover(ckpt):
    def gap(d):
        c = d["tensors"]["a"]["chunks"][0]
        c["sizes"] = [2, 4]
        c["byte_range"] = [c["byte_range"][0], c["byte_range"][0] + 32]

    edit_index(ckpt, gap)
    with pytest.raises(InconsistentIndexError, match="cover 8 of 12"):
        reshard_svc.inspect(ckpt)


def test_dtype_mismatch_between_shards(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "dcp"
    p.mkdir()
    for i, dt in enumerate([torch.float32, torch.float16]):
        save_file(
            {"w": torch.ones(2, 4, dtype=dt)},
            str(p / f"shard-{i}.safetensors"),
            metadata={"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [2 * i, 0]}})},
        )
    with pytest.raises(InconsistentIndexError, match="disagree on dtype"):
        reshard_svc.inspect(str(p))


def test_shape_mismatch_between_index_and_header(ckpt):
    edit_index(ckpt, lambda d: d["tensors"]["b"].update(dtype="int32"))
    assert "disagrees with the index" in problems(ckpt)


def test_shape_mismatch_with_state_dict(ckpt):
    with pytest.raises(StateDictError, match="shape"):
        reshard_svc.load({"a": torch.zeros(4, 3), "b": torch.zeros(5)}, ckpt)


def test_missing_data_file(ckpt):
    os.remove(data_file(ckpt))
    assert "missing" in problems(ckpt)
    with pytest.raises(MissingFileError):
        load_into(ckpt)


def test_sha256_mismatch(tmp_path):
    ckpt = str(tmp_path / "ck")
    reshard_svc.save({"a": torch.arange(12.0)}, ckpt, checksum="sha256")
    f = data_file(ckpt)
    raw = bytearray(open(f, "rb").read())
    raw[-1] ^= 0xFF
    open(f, "wb").write(raw)
    found = problems(ckpt)
    assert "sha256 mismatch" in found and "CRC32C" in found


def test_unknown_format_version(ckpt):
    edit_index(ckpt, lambda d: d.update(format_version=99))
    with pytest.raises(UnsupportedFormatError, match="format_version 99"):
        reshard_svc.inspect(ckpt)


def test_index_not_json(ckpt):
    open(os.path.join(ckpt, INDEX_NAME), "w").write("{")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        reshard_svc.inspect(ckpt)


def test_index_file_name_escaping_the_folder(ckpt):
    edit_index(ckpt, lambda d: d["tensors"]["a"]["chunks"][0].update(file="../../etc/passwd"))
    with pytest.raises(CorruptCheckpointError, match="not a plain file name"):
        reshard_svc.inspect(ckpt)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_dcp_pickle_outside_allow_list_raises(tmp_path):
    p = tmp_path / "dcp"
    p.mkdir()
    (p / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(UnsafePickleError, match=r"(posix|os)\.system"):
        reshard_svc.inspect(str(p))


def test_dcp_pickle_refused_when_operator_disallows(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    monkeypatch.setenv("RESHARD_ALLOW_DCP_PICKLE", "0")
    with pytest.raises(UnsafePickleError, match="refuses pickles"):
        reshard_svc.inspect(str(tmp_path / "dcp"))


def test_dcp_distcp_folder_loads_through_the_allow_list(tmp_path):
    import torch.distributed.checkpoint as dcp

    sd = {"w": torch.randn(6, 4), "s": torch.tensor(3, dtype=torch.int64), "cfg": {"x": 1}}
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    info = reshard_svc.inspect(str(tmp_path / "dcp"))
    assert info.source == "dcp" and set(info.tensors) == {"w", "s"}
    out = {"w": torch.zeros(6, 4), "s": torch.tensor(0, dtype=torch.int64)}
    reshard_svc.load(out, str(tmp_path / "dcp"))
    assert torch.equal(out["w"], sd["w"]) and out["s"].item() == 3
    assert reshard_svc.verify(str(tmp_path / "dcp")).ok


@pytest.mark.parametrize(
    ("sd", "words"),
    [
        ({"x": object()}, "'x' is a object"),
        ({"opt": {"lst": [torch.ones(1)]}}, "'opt.lst' nests tensors"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, "same name 'a.b'"),
    ],
)
def test_unsupported_state_dict_values_name_the_key(tmp_path, sd, words):
    with pytest.raises(StateDictError, match=words):
        reshard_svc.save(sd, str(tmp_path / "ck"))
    assert not os.path.exists(tmp_path / "ck")


def test_missing_keys_are_errors_and_keys_nobody_asks_for_are_fine(ckpt):
    with pytest.raises(StateDictError, match="missing from the checkpoint: 'c'"):
        reshard_svc.load({"a": torch.zeros(3, 4), "b": torch.zeros(5), "c": torch.zeros(1)}, ckpt)
    only_a = {"a": torch.zeros(3, 4)}  # 'b' is in the checkpoint; nobody asks for it
    stats = reshard_svc.load(only_a, ckpt)
    assert only_a["a"].sum().item() == 66 and stats.bytes_total == 3 * 4 * 4
    out = {"a": torch.zeros(3, 4), "c": torch.zeros(1)}
    reshard_svc.load(out, ckpt, strict=False)
    assert out["a"].sum().item() == 66


def test_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        reshard_svc.save({"a": torch.ones(1)}, str(tmp_path / "precious"))
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_empty_and_zero_size_tensors_round_trip(tmp_path):
    reshard_svc.save({}, str(tmp_path / "empty"))
    reshard_svc.load({}, str(tmp_path / "empty"))
    assert reshard_svc.verify(str(tmp_path / "empty")).ok
    sd = {"z": torch.zeros(0, 4), "w": torch.arange(3.0)}
    reshard_svc.save(sd, str(tmp_path / "z"))
    out = {"z": torch.zeros(0, 4), "w": torch.zeros(3)}
    reshard_svc.load(out, str(tmp_path / "z"))
    assert torch.equal(out["w"], sd["w"])
    reshard_svc.convert(str(tmp_path / "z"), str(tmp_path / "hf"), format="hf")
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    assert set(weight_map) == {"z", "w"}


def test_unstorable_dtype_names_the_key(tmp_path):
    with pytest.raises(StateDictError, match="'c' has dtype torch.complex128"):
        reshard_svc.save({"c": torch.zeros(2, dtype=torch.complex128)}, str(tmp_path / "c"))


def test_hostile_layout_in_index_is_bounded(ckpt):
    edit_index(
        ckpt,
        lambda d: d["tensors"]["a"].update(
            layout={"mesh": {"shape": [4096, 4096]}, "placements": ["R", "R"]}
        ),
    )
    with pytest.raises(CorruptCheckpointError, match="at most"):
        reshard_svc.inspect(ckpt)


def test_hf_index_that_disagrees_with_the_files(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "hf"
    p.mkdir()
    save_file({"a": torch.ones(2)}, str(p / "model-00001-of-00002.safetensors"))
    index = {
        "metadata": {},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingFileError, match="'b'"):
        reshard_svc.inspect(str(p))
    index["weight_map"] = {"a": "model-00001-of-00002.safetensors"}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))
    assert set(reshard_svc.inspect(str(p)).tensors) == {"a"}


def test_deeply_nested_json_is_a_typed_error(ckpt, tmp_path):
    open(os.path.join(ckpt, INDEX_NAME), "w").write("[" * 200_000)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        reshard_svc.inspect(ckpt)
    p = tmp_path / "deep"
    p.mkdir()
    raw = b"[" * 100_000
    (p / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        reshard_svc.inspect(str(p))


def test_paths_that_are_not_checkpoint_folders_say_why(tmp_path):
    with pytest.raises(NotACheckpointError, match="does not exist"):
        reshard_svc.inspect(str(tmp_path / "nope"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "one.safetensors"))
    with pytest.raises(NotACheckpointError, match="is a file"):
        reshard_svc.inspect(str(tmp_path / "one.safetensors"))


def test_loading_into_meta_tensors_is_refused(ckpt):
    with pytest.raises(StateDictError, match="meta tensor"):
        reshard_svc.load({"a": torch.empty(3, 4, device="meta")}, ckpt, strict=False)


def test_a_dtype_cast_on_load_is_logged_once_per_family(tmp_path, caplog):
    reshard_svc.save({"a": torch.ones(4), "b": torch.ones(4)}, str(tmp_path / "ck"))
    out = {"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(4, dtype=torch.float64)}
    with caplog.at_level("WARNING"):
        reshard_svc.load(out, str(tmp_path / "ck"))
    casts = [r for r in caplog.records if "casting" in r.getMessage()]
    assert len(casts) == 1 and "2 tensor(s)" in casts[0].getMessage()
    assert torch.equal(out["a"], torch.ones(4, dtype=torch.float64))
