"""One reader protocol for every source, and the readers' pure parsers on their own.

Each format is one module of ``reshard_svc.format.readers`` implementing
:class:`reshard_svc.format.reader.Source`; ``open_checkpoint`` asks them in turn and
``verify`` only calls them (it never asks which source it has). The parsers take parsed
data (a header, a metadata object, a JSON document), so their refusals are tested here
without any storage.
"""

from __future__ import annotations

import ast
import io
import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import reshard_svc.format.inspection as inspection
from reshard_svc.errors import (
    CorruptCheckpointError,
    InconsistentIndexError,
    MissingFileError,
    UnsafePickleError,
)
from reshard_svc.format.index import FORMAT_NAME, CheckpointIndex, FileMeta
from reshard_svc.format.reader import DCP_SHARDING_INFO, Source
from reshard_svc.format.readers import (
    SOURCES,
    dcp,
    hf,
    megatron,
    ours,
    source_of,
    torch_checkpointing,
)
from reshard_svc.format.safetensors import encode_header, parse_header
from reshard_svc.format.unpickle import (
    AllowListUnpickler,
    InertUnpickler,
    PlainUnpickler,
    TensorRef,
    _Inert,
    inert_load,
)


def test_every_source_implements_the_protocol_once():
    kinds = [k for s in SOURCES for k in s.kinds]
    assert len(kinds) == len(set(kinds))
    assert set(kinds) == {FORMAT_NAME, "hf", "dcp-hf", "torch_checkpointing", "megatron", "dcp"}
    for source in SOURCES:
        assert isinstance(source, Source), type(source).__name__
        for kind in source.kinds:
            assert source_of(CheckpointIndex(tensors={}, files={}, source=kind)) is source


@pytest.mark.parametrize(
    ("listing", "expected"),
    [
        ({"reshard.index.json", "shard-00000-000.safetensors"}, ours.SOURCE),
        ({"model.safetensors", "config.json"}, hf.SOURCE),
        ({"model-00001-of-00002.safetensors", "model.safetensors.index.json"}, hf.SOURCE),
        ({"metadata.pkl", "model_0.pt", "model_1.pt"}, torch_checkpointing.SOURCE),
        ({".metadata", "__0_0.distcp", "metadata.json", "common.pt"}, megatron.SOURCE),
        ({".metadata", "__0_0.distcp", "__1_0.distcp"}, dcp.SOURCE),
    ],
)
def test_the_first_source_that_claims_a_listing_is_its_own(listing, expected):
    claimed = next(s for s in SOURCES if s.claims(frozenset(listing)))
    assert claimed is expected


def test_verify_never_asks_which_source_it_has():
    """No source kind, no ``.source`` comparison and no reader module in inspection.py."""
    tree = ast.parse(Path(inspection.__file__).read_text())
    kinds = {k for s in SOURCES for k in s.kinds}
    constants = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
    assert not constants & kinds
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            assert "source" not in ast.unparse(node), ast.unparse(node)
        if isinstance(node, ast.ImportFrom) and node.module:
            assert not node.module.startswith("reshard_svc.format.readers."), node.module


# ---------------------------------------------------------------- Hugging Face / DCP-HF


def header(tensors, metadata=None):
    raw, _ = encode_header(tensors, metadata)
    parsed = parse_header(raw, len(raw) + 10_000, "f.safetensors")
    assert not isinstance(parsed, int)
    return parsed


def test_dcp_offsets_place_each_chunk_and_plain_files_hold_tensors_whole():
    info = {DCP_SHARDING_INFO: json.dumps({"w": {"saved_offsets": [4, 0]}})}
    ((chunk, _),) = hf.header_chunks("a.safetensors", header([("w", torch.float32, (4, 8))], info))
    assert (chunk.box.offsets, chunk.box.sizes, chunk.file) == ((4, 0), (4, 8), "a.safetensors")
    ((whole, _),) = hf.header_chunks("b.safetensors", header([("w", torch.float32, (8, 8))]))
    assert whole.box.offsets == (0, 0)


@pytest.mark.parametrize(
    ("info", "words"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "is not an object"),
        (json.dumps({"w": {"saved_offsets": [1]}}), "expected 2 non-negative ints"),
        (json.dumps({"w": {"saved_offsets": [-1, 0]}}), "expected 2 non-negative ints"),
        (json.dumps({"w": "nowhere"}), "saved_offsets is None"),
    ],
)
def test_malformed_dcp_sharding_info_is_named(info, words):
    with pytest.raises(CorruptCheckpointError, match=words):
        hf.header_chunks(
            "a.safetensors", header([("w", torch.float32, (4, 8))], {DCP_SHARDING_INFO: info})
        )


def test_chunks_make_tensors_whose_shape_ends_at_the_furthest_chunk():
    info = {DCP_SHARDING_INFO: json.dumps({"w": {"saved_offsets": [4, 0]}})}
    chunks = hf.header_chunks(
        "a.safetensors", header([("w", torch.bfloat16, (4, 8))])
    ) + hf.header_chunks("b.safetensors", header([("w", torch.bfloat16, (4, 8))], info))
    (meta,) = hf.tensors_from_chunks(chunks).values()
    assert meta.shape == (8, 8) and [c.file for c in meta.chunks] == [
        "a.safetensors",
        "b.safetensors",
    ]
    other = hf.header_chunks("c.safetensors", header([("w", torch.float16, (4, 8))], info))
    with pytest.raises(InconsistentIndexError, match="disagree on dtype"):
        hf.tensors_from_chunks(chunks[:1] + other)


def test_a_weight_map_must_agree_with_the_files():
    chunks = hf.header_chunks("m-1.safetensors", header([("a", torch.float32, (2,))]))
    index = CheckpointIndex(
        tensors=hf.tensors_from_chunks(chunks),
        files={"m-1.safetensors": FileMeta(100)},
        source="hf",
    )
    hf.check_weight_map({"weight_map": {"a": "m-1.safetensors"}}, index, "idx")
    with pytest.raises(CorruptCheckpointError, match="no weight_map"):
        hf.check_weight_map({"metadata": {}}, index, "idx")
    with pytest.raises(MissingFileError, match="m-2.safetensors, which is missing"):
        hf.check_weight_map({"weight_map": {"a": "m-2.safetensors"}}, index, "idx")
    with pytest.raises(InconsistentIndexError, match="does not hold it"):
        hf.check_weight_map({"weight_map": {"b": "m-1.safetensors"}}, index, "idx")


# ---------------------------------------------------------------- Megatron, DCP


def test_megatron_metadata_must_say_torch_dist():
    extras = megatron.megatron_extras(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "nested": {"x": 1}}, "m"
    )
    assert extras == {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    for meta in ({"sharded_backend": "zarr"}, [], {"other": 1}):
        with pytest.raises(CorruptCheckpointError, match="reads Megatron-Core's torch_dist"):
            megatron.megatron_extras(meta, "m")


def dcp_metadata(with_bytes=True, entry=True):
    props = TensorProperties(dtype=torch.bfloat16)
    chunks = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4])),
        ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 4])),
    ]
    sdm = {"w": TensorStorageMetadata(props, torch.Size([4, 4]), chunks)}
    storage = {}
    for k, c in enumerate(chunks if entry else chunks[:1]):
        storage[MetadataIndex("w", c.offsets)] = _StorageInfo(f"__{k}_0.distcp", 0, 100)
    if with_bytes:
        sdm["step"] = BytesStorageMetadata()
        storage[MetadataIndex("step")] = _StorageInfo("__0_0.distcp", 100, 20)
    return Metadata(state_dict_metadata=sdm, storage_data=storage)


def test_a_dcp_metadata_object_becomes_items_and_blobs():
    sizes = {"__0_0.distcp": 120, "__1_0.distcp": 100}
    index = dcp.index_from_metadata(dcp_metadata(), sizes.__getitem__, "x/.metadata")
    w = index.tensors["w"]
    assert w.shape == (4, 4) and w.dtype == torch.bfloat16
    assert [(c.file, c.begin, c.end, c.encoding) for c in w.chunks] == [
        ("__0_0.distcp", 0, 100, "torch_save"),
        ("__1_0.distcp", 0, 100, "torch_save"),
    ]
    assert (index.blobs["step"].begin, index.blobs["step"].end) == (100, 120)
    with pytest.raises(CorruptCheckpointError, match=r"chunk \[2, 0\] has no storage entry"):
        dcp.index_from_metadata(dcp_metadata(entry=False), sizes.__getitem__, "x")
    with pytest.raises(CorruptCheckpointError, match="is not DCP Metadata"):
        dcp.index_from_metadata({"state_dict_metadata": {}}, sizes.__getitem__, "x/.metadata")


def test_torch_checkpointing_placements_and_shapes_are_checked():
    assert torch_checkpointing._placement({"type": "Shard", "dim": 1}, "w").dim == 1
    with pytest.raises(CorruptCheckpointError, match="supported: Shard, StridedShard, Replicate"):
        torch_checkpointing._placement({"type": "Partial"}, "w")
    with pytest.raises(CorruptCheckpointError, match="has shape"):
        torch_checkpointing._shape([2, -1], "w")


# ---------------------------------------------------------------- the unpicklers


class _Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_no_unpickler_runs_what_a_file_names(tmp_path):
    marker = tmp_path / "ran"
    raw = pickle.dumps({"x": _Boom(marker)})
    with pytest.raises(UnsafePickleError, match="not on the allow-list"):
        AllowListUnpickler(io.BytesIO(raw)).load()
    with pytest.raises(UnsafePickleError, match="names posix.system"):
        PlainUnpickler(io.BytesIO(raw), "metadata.pkl").load()
    walked = InertUnpickler(io.BytesIO(raw)).load()
    assert set(walked) == {"x"} and isinstance(walked["x"], _Inert)  # a stand-in, not a call
    assert not marker.exists()


def test_plain_data_passes_the_builtins_only_unpickler():
    value = {"a": [1, 2.5, "s", None, True], "b": (1, 2)}
    assert PlainUnpickler(io.BytesIO(pickle.dumps(value)), "m").load() == value


def test_the_inert_walk_finds_a_tensors_record_and_nothing_runs():
    buf = io.BytesIO()
    torch.save({"w": torch.arange(12, dtype=torch.int16).reshape(3, 4)[1:], "lr": 0.1}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    tree = inert_load(data)
    ref = tree["w"]
    assert isinstance(ref, TensorRef)
    assert (ref.dtype, ref.offset, ref.size, ref.stride) == (torch.int16, 4, (2, 4), (4, 1))
    assert tree["lr"] == 0.1
