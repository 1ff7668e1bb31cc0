"""An HF export lands in a model folder, as transformers wants one: its config, tokenizer
and README stay, weights are replaced only with --overwrite, the source's config comes
along, and ``from_pretrained`` loads the result to the same tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.support.cli import reshard

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny Llama saved by transformers itself (safetensors + config.json)."""
    folder = tmp_path_factory.mktemp("llama") / "hf"
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def loaded(folder) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    return {k: v.detach() for k, v in model.state_dict().items()}


def test_hf_source_exports_with_its_config_and_loads_in_transformers(hf_model, tmp_path):
    src, want = hf_model
    tp2 = tmp_path / "tp2"
    r = reshard(
        "convert",
        str(src),
        str(tp2),
        "--mesh",
        "tp=2",
        "--rules",
        json.dumps({"*proj.weight": "S(0)", "*": "R"}),
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"
    r = reshard("convert", str(src), str(out), "--format", "hf")
    assert r.returncode == 0, r.stderr
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    got = loaded(out)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    no_config = tmp_path / "no-config"
    r = reshard("convert", str(src), str(no_config), "--format", "hf", "--no-copy-config")
    assert r.returncode == 0, r.stderr
    assert not (no_config / "config.json").exists()


def test_export_into_a_model_folder_keeps_its_files_and_replaces_weights_only_on_overwrite(
    hf_model, tmp_path
):
    src, want = hf_model
    ckpt = tmp_path / "ckpt"  # our format, no config of its own
    assert reshard("convert", str(src), str(ckpt), "--mesh", "tp=2").returncode == 0
    folder = tmp_path / "model"
    folder.mkdir()
    config = (src / "config.json").read_text()
    (folder / "config.json").write_text(config)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "README.md").write_text("# my model\n")
    r = reshard("convert", str(ckpt), str(folder), "--format", "hf")
    assert r.returncode == 0, r.stderr
    got = loaded(folder)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # again, without --overwrite: the weights there are refused, nothing changes
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    r = reshard("convert", str(ckpt), str(folder), "--format", "hf", "--dtype", "bf16")
    assert r.returncode == 2 and "TargetExistsError" in r.stderr and "--overwrite" in r.stderr
    assert "Traceback" not in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    # with --overwrite: only the weights and the indexes are replaced
    r = reshard(
        "convert", str(ckpt), str(folder), "--format", "hf", "--dtype", "bf16", "--overwrite"
    )
    assert r.returncode == 0, r.stderr
    assert (folder / "config.json").read_text() == config
    assert (folder / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert (folder / "README.md").read_text() == "# my model\n"
    index = json.loads((folder / "reshard.index.json").read_text())
    weights = {n for n in os.listdir(folder) if n.endswith(".safetensors")}
    assert weights == set(index["files"])
    assert sorted(os.listdir(folder)) == sorted(
        {
            *weights,
            "reshard.index.json",
            "model.safetensors.index.json",
            "config.json",
            "tokenizer.json",
            "README.md",
        }
    )
    got = loaded(folder)
    assert all(torch.equal(got[k].to(torch.bfloat16), want[k].to(torch.bfloat16)) for k in want)


def test_a_plain_hf_folder_is_replaced_only_with_overwrite(hf_model, tmp_path):
    """A model folder transformers wrote (model.safetensors, no index of ours)."""
    import shutil

    src, want = hf_model
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    ckpt = tmp_path / "ckpt"
    assert reshard("convert", str(src), str(ckpt), "--mesh", "tp=2").returncode == 0
    r = reshard("convert", str(ckpt), str(folder), "--format", "hf")
    assert r.returncode == 2 and "model.safetensors" in r.stderr
    r = reshard("convert", str(ckpt), str(folder), "--format", "hf", "--overwrite")
    assert r.returncode == 0, r.stderr
    got = loaded(folder)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert (folder / "generation_config.json").exists() and (folder / "config.json").exists()
