"""The bridge: checkpoints written by torch_checkpointing and Megatron-Core's own code.

Each source is written once per session by the real writer on gloo workers
(tests/support/foreign_writers.py), then, through the ``reshard`` CLI as a user would:
``inspect``, ``verify``, ``convert`` to our format at another TP and to HF (with
``--rename``; ``--split-layers`` for Megatron), and ``load`` at a third layout on real
workers. Every tensor is compared bitwise with what the writer was handed.
"""

from __future__ import annotations

import io
import json
import os
import zipfile

import pytest
import torch
from safetensors.torch import load_file

import reshard_svc
from tests.support import foreign_writers as fw
from tests.support.cli import reshard
from tests.support.harness import run

pytestmark = [pytest.mark.distributed]

PARALLEL = {"fsdp": 2, "tp": 2, "fsdp_tp": 4}


@pytest.fixture(scope="module", params=list(PARALLEL))
def titan(request, tmp_path_factory):
    """(folder, reference tensors) of a torch_checkpointing save under FSDP2, TP, FSDP2×TP."""
    base = tmp_path_factory.mktemp(f"tc-{request.param}")
    src, ref = str(base / "ckpt"), str(base / "ref.safetensors")
    run(fw.write_torch_checkpointing, PARALLEL[request.param], src, ref, request.param)
    return src, ref


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    base = tmp_path_factory.mktemp("megatron")
    src, ref = str(base / "ckpt"), str(base / "ref.safetensors")
    run(fw.write_megatron, 2, src, ref)
    return src, ref


def cli_json(*args: str) -> dict:
    r = reshard(*args, "--json")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return json.loads(r.stdout)


def test_torch_checkpointing_inspect_verify_convert_load(titan, tmp_path):
    src, ref_file = titan
    ref = load_file(ref_file)
    info = cli_json("inspect", src)
    assert info["source"] == "torch_checkpointing"
    got = {k: (v["dtype"], v["shape"]) for k, v in info["tensors"].items()}
    assert got == {k: (str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in ref.items()}
    assert set(info["blobs"]) >= {"step/rank0", "step/rank1"}  # the item with no resharder
    assert info["extras"]["optim"]["param_groups"][0]["weight_decay"] == 0.1
    report = cli_json("verify", src)
    assert report["ok"] and report["complete"], report  # the zip's own CRC-32s

    # to our format at TP=3 (2 workers), then loaded at a third layout on real workers
    nat = str(tmp_path / "tp3")
    r = reshard(
        "convert", src, nat, "--mesh", "tp=3", "--rules", '{"model.*": "S(0)"}', "--workers", "2"
    )
    assert r.returncode == 0, r.stderr
    assert run(fw.load_and_compare, 2, nat, ref_file) == {0: [], 1: []}
    assert reshard_svc.verify(nat).ok
    # its param_groups, written flat as save writes them (what load asks for)
    assert json.loads(open(f"{nat}/reshard.index.json").read())["extras"]["optim.param_groups"]
    # the foreign source read directly into that layout
    assert run(fw.load_and_compare, 2, src, ref_file) == {0: [], 1: []}

    # to HF, with torchtitan-ish names renamed to HF ones
    hf = str(tmp_path / "hf")
    r = reshard(
        "convert",
        src,
        hf,
        "--format",
        "hf",
        "--only",
        "model.*",
        "--rename",
        "model.tok_embeddings.weight=model.embed_tokens.weight",
        "--rename",
        "model.output.weight=model.lm_head.weight",
        "--strip-prefix",
        "model.",
    )
    assert r.returncode == 0, r.stderr
    out: dict[str, torch.Tensor] = {}
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf, f)))
    want = {k.removeprefix("model."): v for k, v in ref.items() if k.startswith("model.")}
    want["embed_tokens.weight"] = want.pop("tok_embeddings.weight")
    want["lm_head.weight"] = want.pop("output.weight")
    assert out.keys() == want.keys()
    assert all(torch.equal(out[k], want[k]) for k in want)


def test_megatron_inspect_split_layers_convert_load(megatron, tmp_path):
    src, ref_file = megatron
    ref = load_file(ref_file)
    info = cli_json("inspect", src)
    assert info["source"] == "megatron"
    assert {k: v["shape"] for k, v in info["tensors"].items()} == {
        k: list(v.shape) for k, v in ref.items()
    }
    assert "common.pt" in info["blobs"]
    report = cli_json("verify", src)
    assert report["ok"] and not report["complete"] and report["bytes_unchecked"] > 0
    assert any("no checksums" in u for u in report["unchecked"])

    # stacked tensors as they are, at TP=4 (by rows): then read back at a third layout
    nat = str(tmp_path / "tp4")
    r = reshard("convert", src, nat, "--mesh", "tp=4", "--rules", '{"*": "S(0)"}')
    assert r.returncode == 0, r.stderr
    assert run(fw.load_and_compare, 2, nat, ref_file) == {0: [], 1: []}
    # common.pt travels verbatim, and torch.load(weights_only=True) still reads it
    b = json.loads(open(f"{nat}/reshard.index.json").read())["blobs"]["common.pt"]
    with open(os.path.join(nat, b["file"]), "rb") as f:
        f.seek(b["byte_range"][0])
        blob = f.read(b["byte_range"][1] - b["byte_range"][0])
    assert blob == open(os.path.join(src, "common.pt"), "rb").read()
    common = torch.load(io.BytesIO(blob), weights_only=True)
    assert common["iteration"] == 42 and common["args"]["model"] == "gpt"

    # --split-layers: one tensor per layer (and per expert), renamed, to HF
    hf = str(tmp_path / "hf")
    r = reshard(
        "convert",
        src,
        hf,
        "--format",
        "hf",
        "--split-layers",
        "--rename",
        "decoder.layers.*.self_attention.linear_qkv.weight="
        "model.layers.*.self_attn.qkv_proj.weight",
    )
    assert r.returncode == 0, r.stderr
    out = load_file(os.path.join(hf, "model-00001-of-00001.safetensors"))
    for layer in range(fw.LAYERS):
        assert torch.equal(
            out[f"model.layers.{layer}.self_attn.qkv_proj.weight"],
            ref["decoder.layers.self_attention.linear_qkv.weight"][layer],
        )
        assert torch.equal(
            out[f"decoder.layers.{layer}.input_layernorm.weight"],
            ref["decoder.layers.input_layernorm.weight"][layer],
        )
        for e in range(4):
            assert torch.equal(
                out[f"decoder.layers.{layer}.mlp.experts.experts.{e}.linear_fc1.weight"],
                ref["decoder.layers.mlp.experts.experts.linear_fc1.weight"][layer, e],
            )
    assert torch.equal(out["decoder.final_layernorm.weight"], ref["decoder.final_layernorm.weight"])
    assert len(out) == 2 + fw.LAYERS * (3 + 4)


# ---------------------------------------------------------------- hostile folders


def _copy(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def test_unsafe_metadata_pickle_is_refused_unrun(titan, tmp_path):
    import pickle

    folder = _copy(titan[0], tmp_path / "evil")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    with open(f"{folder}/metadata.pkl", "wb") as f:
        pickle.dump({"metadata": {}, "version": "2.0", "x": Evil()}, f)
    r = reshard("inspect", folder)
    assert r.returncode != 0 and "UnsafePickleError" in r.stderr and "posix.system" in r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()


def _edit_metadata(folder: str, edit) -> None:
    import pickle

    from reshard_svc.format.unpickle import PlainUnpickler

    with open(f"{folder}/metadata.pkl", "rb") as f:
        md = PlainUnpickler(f, "metadata.pkl").load()
    edit(md)
    with open(f"{folder}/metadata.pkl", "wb") as f:
        pickle.dump(md, f)


def test_a_data_file_outside_the_folder_is_refused(titan, tmp_path):
    folder = _copy(titan[0], tmp_path / "evil")

    def outside(md):
        md["metadata"]["model"]["rank_to_layout_info"][0] = {
            "file_path": "../../etc/passwd",
            "serialization_format": {"type": "TorchSerialization"},
        }

    _edit_metadata(folder, outside)
    r = reshard("inspect", folder)
    assert r.returncode != 0 and "outside the checkpoint folder" in r.stderr, r.stderr


def test_data_pickle_is_never_run(titan, tmp_path):
    """A data file whose data.pkl calls os.system: read inertly, nothing runs, and the
    tensor it pretends to be is reported as missing."""
    import pickle

    folder = _copy(titan[0], tmp_path / "evil")
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = f"{folder}/model_0.pt"
    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i.filename) for i in z.infolist()}
    pkl = next(n for n in records if n.endswith("data.pkl"))
    records[pkl] = pickle.dumps({k: Evil() for k in ("tok_embeddings.weight", "output.weight")})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    r = reshard("inspect", folder)
    assert r.returncode != 0 and "CorruptCheckpointError" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not marker.exists()


def test_corrupted_bytes_fail_verify_and_rank_files_without_metadata_are_named(titan, tmp_path):
    folder = _copy(titan[0], tmp_path / "bad")
    path = f"{folder}/model_1.pt"
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        head = f.read(4)
        f.seek(
            info.header_offset
            + 30
            + int.from_bytes(head[:2], "little")
            + int.from_bytes(head[2:], "little")
            + 8
        )
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = reshard("verify", folder)
    assert r.returncode == 1 and "zip CRC-32" in r.stderr + r.stdout
    os.remove(f"{folder}/metadata.pkl")
    r = reshard("inspect", folder)
    assert r.returncode != 0 and "no metadata.pkl" in r.stderr and "resharder" in r.stderr


@pytest.mark.slow
def test_converting_a_torch_checkpointing_save_keeps_the_memory_budget(tmp_path):
    from tests.support import workloads

    src = str(tmp_path / "big")
    run(fw.write_torch_checkpointing_big, 2, src, 160)  # 160 MiB: each worker writes 80
    budget = 8 * 2**20
    res = run(
        workloads.convert_stage,
        2,
        src,
        str(tmp_path / "dst"),
        {"mesh": "tp=2", "rules": {"*": "S(1)"}, "max_memory": budget, "strategy": "exchange"},
    )
    for r in res.values():
        # as for our own and DCP sources (test_convert_limits): twice the budget plus a
        # fixed overhead, far below the 80 MiB each worker writes
        assert r["peak_rss_mb"] - r["rss_before_mb"] < 2 * budget / 2**20 + 24, r
    want = fw.big_tensors(160)
    out = {f"model.{k}": torch.zeros_like(v) for k, v in want.items()}
    reshard_svc.load(out, str(tmp_path / "dst"))
    assert all(torch.equal(out[f"model.{k}"], v) for k, v in want.items())


@pytest.mark.slow
def test_readme_bridge_commands(megatron, tmp_path):
    """The README's "Coming from torchtitan or Megatron" commands, as written, in order."""
    import shlex
    import shutil

    from tests.support.docs import block

    run(fw.write_torch_checkpointing, 2, str(tmp_path / "titan-ckpt"), str(tmp_path / "t.st"), "tp")
    shutil.copytree(megatron[0], tmp_path / "megatron-ckpt")
    (tmp_path / "megatron_to_hf.yaml").write_text(block("bridge-renames", "yaml"))
    lines = [ln.split("  #")[0].strip() for ln in block("bridge", "bash").splitlines()]
    cmds = [shlex.split(ln)[1:] for ln in lines if ln.startswith("reshard ")]
    assert len(cmds) >= 6
    for argv in cmds:
        r = reshard(*argv, cwd=tmp_path)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr)
    ref = load_file(megatron[1])
    out = load_file(str(tmp_path / "megatron-hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(out["model.norm.weight"], ref["decoder.final_layernorm.weight"])
    assert torch.equal(
        out["model.layers.1.mlp.experts.3.gate_up_proj.weight"],
        ref["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1, 3],
    )
    assert torch.equal(
        out["model.layers.0.self_attn.o_proj.weight"],
        ref["decoder.layers.self_attention.linear_proj.weight"][0],
    )
    titan_ref = load_file(str(tmp_path / "t.st"))
    hf = load_file(str(tmp_path / "titan-hf" / "model-00001-of-00001.safetensors"))
    assert torch.equal(hf["embed_tokens.weight"], titan_ref["model.tok_embeddings.weight"])
    assert run(fw.load_and_compare, 2, str(tmp_path / "titan-tp4"), str(tmp_path / "t.st")) == {
        0: [],
        1: [],
    }


@pytest.mark.s3
def test_a_torch_checkpointing_save_on_s3_converts_with_ranged_reads(tmp_path, s3):
    """torch_checkpointing itself writes local files only; once uploaded (as teams keep
    checkpoints), we read it in place on S3, records as ranged GETs, and verify its CRCs."""
    import fsspec

    src = str(tmp_path / "titan")
    ref = str(tmp_path / "ref.safetensors")
    run(fw.write_torch_checkpointing, 2, src, ref, "tp")
    fs = fsspec.filesystem("s3")
    fs.put(src, f"{s3}/titan", recursive=True)
    report = reshard_svc.verify(f"{s3}/titan")
    assert report.ok and report.complete, report
    r = reshard(
        "convert",
        f"{s3}/titan",
        f"{s3}/titan-tp2",
        "--mesh",
        "tp=2",
        "--rules",
        '{"*norm*": "R", "model.*": "S(1)"}',
        "--workers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert run(fw.load_and_compare, 2, f"{s3}/titan-tp2", ref) == {0: [], 1: []}


def test_verify_finds_replicas_the_writer_kept_apart(tmp_path):
    """torch_checkpointing 0.1.1 saves per-rank plain tensors as "replicated" (one copy
    per rank file); verify compares the copies and names the ranks that differ."""
    src = str(tmp_path / "div")
    run(fw.write_torch_checkpointing_divergent, 2, src)
    r = reshard("verify", src)
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "model.experts.w" in out and "copies differ" in out and "rank(s) [1]" in out
    assert "model.bias" not in out  # equal copies are fine


def _split_name(key: str, layer: int, expert: int | None) -> str:
    """Where --split-layers puts layer ``layer`` (and expert ``expert``) of sharded ``key``:
    after its ``layers`` segment, and after its last ``experts`` segment."""
    parts = key.split(".")
    if expert is not None:
        last = max(i for i, p in enumerate(parts) if p == "experts")
        parts.insert(last + 1, str(expert))
    parts.insert(parts.index("layers") + 1, str(layer))
    return ".".join(parts)


@pytest.fixture(scope="module", params=["grouped", "sequential"])
def megatron_gpt(request, tmp_path_factory):
    """A real GPTModel with MoE experts at TP 2 × EP 2, and Megatron's own TP 1 reading of it."""
    grouped = request.param == "grouped"
    base = tmp_path_factory.mktemp(f"gpt-{request.param}")
    src, ref = str(base / "ckpt"), str(base / "megatron-tp1.safetensors")
    run(fw.write_megatron_gpt, 4, src, grouped)
    run(fw.megatron_gpt_stacks, 1, src, grouped, ref)
    return src, load_file(ref)


@pytest.mark.slow
def test_megatron_gpt_moe_split_layers_matches_megatrons_own_load(megatron_gpt, tmp_path):
    src, stacks = megatron_gpt
    info = cli_json("inspect", src)
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert info["tensors"][fc1]["shape"][:2] == [fw.GPT_LAYERS, fw.GPT_EXPERTS]
    ours = str(tmp_path / "ours")
    r = reshard("convert", src, ours, "--mesh", "tp=2", "--rules", '{"*": "S(0)"}')
    assert r.returncode == 0, r.stderr
    for source in (src, ours):  # the Megatron folder, and our format after a conversion
        hf = str(tmp_path / f"hf-{os.path.basename(source)}")
        r = reshard("convert", source, hf, "--format", "hf", "--split-layers")
        assert r.returncode == 0, r.stderr
        got = load_file(os.path.join(hf, "model-00001-of-00001.safetensors"))
        seen = set()
        for key, full in stacks.items():
            if "layers" not in key.split("."):
                assert torch.equal(got[key], full), key
                seen.add(key)
                continue
            experts = "experts" in key.split(".")
            for layer in range(fw.GPT_LAYERS):
                for e in range(fw.GPT_EXPERTS) if experts else [None]:
                    name = _split_name(key, layer, e)
                    want = full[layer] if e is None else full[layer, e]
                    assert torch.equal(got[name], want), name
                    seen.add(name)
                    # Adam's moments split exactly as their parameter does
                    for moment in ("exp_avg", "exp_avg_sq"):
                        opt = f"optimizer.state.{moment}.{name}"
                        assert got[opt].shape == want.shape, opt
        assert seen == {n for n in got if not n.startswith("optimizer.")}
        per_expert = [n for n in got if ".experts.experts." in n and "optimizer" not in n]
        assert len(per_expert) == 2 * fw.GPT_LAYERS * fw.GPT_EXPERTS  # fc1 and fc2


@pytest.mark.slow
def test_torch_checkpointing_hsdp_optimizer_state_loads_with_its_param_groups(tmp_path):
    """HSDP (2 × 2) with AdamW, loaded at FSDP2 on 3 ranks: every tensor and every
    param_groups value (lr, betas, weight_decay...), from the folder and from its conversion."""
    src, ref = str(tmp_path / "hsdp"), str(tmp_path / "ref.safetensors")
    run(fw.write_torch_checkpointing_hsdp, 4, src, ref)
    assert run(fw.load_fsdp_and_compare, 3, src, ref) == {0: [], 1: [], 2: []}
    ours = str(tmp_path / "ours")
    r = reshard("convert", src, ours, "--mesh", "dp=2", "--rules", '{"*.step": "R", "*": "S(0)"}')
    assert r.returncode == 0, r.stderr
    assert run(fw.load_fsdp_and_compare, 3, ours, ref) == {0: [], 1: [], 2: []}
