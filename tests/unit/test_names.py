"""Renames, then --only, then --strip-prefix: the names a convert writes."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import reshard_svc
from reshard_svc.errors import UsageError
from reshard_svc.format.index import TensorMeta
from reshard_svc.format.readers import open_checkpoint
from reshard_svc.jobs.argv import from_argv, to_argv
from reshard_svc.jobs.spec import ConvertSpec
from reshard_svc.plan.names import (
    Rename,
    load_renames,
    parse_renames,
    select_tensors,
    stacked_axes,
)

TITAN = {
    "tok_embeddings.weight": torch.arange(12.0).reshape(4, 3),
    "layers.0.attention.wq.weight": torch.randn(3, 3),
    "layers.1.attention.wq.weight": torch.randn(3, 3),
    "layers.0.feed_forward.w1.weight": torch.randn(6, 3),
    "layers.1.feed_forward.w1.weight": torch.randn(6, 3),
    "norm.weight": torch.ones(3),
}
TO_HF = [
    "tok_embeddings.weight=model.embed_tokens.weight",
    "layers.*.attention.wq.weight=model.layers.*.self_attn.q_proj.weight",
    "layers.*.feed_forward.w1.weight=model.layers.*.mlp.gate_proj.weight",
    "norm.weight=model.norm.weight",
]


def test_a_rule_maps_captures_in_order():
    r = Rename("layers.*.experts.*.w1", "model.layers.*.mlp.experts.*.gate_proj")
    assert r.apply("layers.3.experts.17.w1") == "model.layers.3.mlp.experts.17.gate_proj"
    assert r.apply("layers.3.attention.wq") is None
    assert Rename("model.*", "*").apply("model.a.b") == "a.b"
    assert Rename("?.w", "x.w").apply("a.w") == "x.w" and Rename("?.w", "x").apply("ab.w") is None
    assert Rename("a.*.b", "c").apply("a.1.b") == "c"  # captures may be dropped


@given(st.lists(st.text("ab.*?[]()\\$^+", min_size=1, max_size=6), min_size=1, max_size=3))
def test_glob_text_is_literal_except_star_and_question(parts):
    """Regex metacharacters in a tensor name are matched as themselves."""
    name = "".join(p.replace("*", "x").replace("?", "y") for p in parts)
    assert Rename(name, "ok").apply(name) == "ok"


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("no-equals", "FROM_GLOB=TO_PATTERN"),
        ("=x", "non-empty"),
        ("a.*=*.*", "captures only 1"),
        ("a.*=b?", "'?' belongs in the glob"),
        (["a=b"] * 1001, "at most 1000"),
    ],
)
def test_bad_rules_are_usage_errors(value, words):
    with pytest.raises(UsageError, match=words.replace("?", r"\?").replace("*", r"\*")):
        parse_renames(value)


def test_renames_then_only_then_strip(tmp_path):
    src = str(tmp_path / "titan")
    reshard_svc.save(TITAN, src)
    _, index = open_checkpoint(src)
    out = select_tensors(
        index, only=["model.layers.*"], strip_prefix="model.", renames=parse_renames(TO_HF)
    )
    assert sorted(out.tensors) == [
        "layers.0.mlp.gate_proj.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.gate_proj.weight",
        "layers.1.self_attn.q_proj.weight",
    ]
    assert out.tensors["layers.1.self_attn.q_proj.weight"].chunks == (
        index.tensors["layers.1.attention.wq.weight"].chunks
    )


def test_a_rule_matching_nothing_or_a_collision_is_named(tmp_path):
    src = str(tmp_path / "titan")
    reshard_svc.save(TITAN, src)
    _, index = open_checkpoint(src)
    with pytest.raises(UsageError, match=r"--rename output.weight=lm_head.weight matches no"):
        select_tensors(index, renames=parse_renames(["output.weight=lm_head.weight"]))
    with pytest.raises(UsageError, match=r"renames both .* to 'w'"):
        select_tensors(index, renames=parse_renames(["layers.*.attention.wq.weight=w"]))
    with pytest.raises(UsageError, match="--only 'layers.*' matches no tensor"):
        select_tensors(index, only=["layers.*"], renames=parse_renames(["layers.*=model.*"]))


def test_a_yaml_file_holds_rules_in_order(tmp_path):
    f = tmp_path / "titan_to_hf.yaml"
    f.write_text("".join(f"'{r.split('=')[0]}': '{r.split('=')[1]}'\n" for r in TO_HF))
    rules = load_renames([str(f), "output.weight=lm_head.weight"])
    assert [str(r) for r in rules] == [*TO_HF, "output.weight=lm_head.weight"]
    with pytest.raises(UsageError, match="neither FROM_GLOB=TO_PATTERN nor an existing"):
        load_renames([str(tmp_path / "missing.yaml")])
    (tmp_path / "bad.yaml").write_text("- [unclosed\n")
    with pytest.raises(UsageError, match="neither JSON nor YAML"):
        load_renames([str(tmp_path / "bad.yaml")])


def test_the_spec_carries_renames_to_the_worker():
    spec = ConvertSpec(source="/a", target="/b", rename=TO_HF).checked()
    back = from_argv(to_argv(spec))
    assert back.rename == TO_HF and back == spec
    assert ConvertSpec.from_json({"source": "/a", "target": "/b", "rename": TO_HF}) == spec


def test_convert_with_renames_is_bitwise(tmp_path):
    src, dst = str(tmp_path / "titan"), str(tmp_path / "hf")
    reshard_svc.save(TITAN, src)
    reshard_svc.convert(src, dst, format="hf", rename=TO_HF, only=["model.*"])
    from safetensors.torch import load_file

    got = load_file(f"{dst}/model-00001-of-00001.safetensors")
    assert torch.equal(
        got["model.layers.1.mlp.gate_proj.weight"], TITAN["layers.1.feed_forward.w1.weight"]
    )
    assert torch.equal(got["model.embed_tokens.weight"], TITAN["tok_embeddings.weight"])
    assert len(got) == len(TITAN)


def test_split_layers_reads_each_layer_from_stored_stacks(tmp_path):
    """Chunks spanning several layers (a raw row-major stack) are split by byte range."""
    g = torch.Generator().manual_seed(2)
    sd = {
        "decoder.layers.mlp.fc1.weight": torch.randn(3, 8, 4, generator=g),
        "decoder.layers.mlp.experts.fc1.weight": torch.randn(3, 2, 4, 4, generator=g),
        "decoder.final_norm.weight": torch.randn(4, generator=g),
    }
    src, dst = str(tmp_path / "stacked"), str(tmp_path / "split")
    reshard_svc.save(sd, src + "-plain")
    reshard_svc.convert(src + "-plain", src, mesh="tp=2", rules={"*": "S(0)"})  # 2+1 layers
    reshard_svc.convert(src, dst, split_layers=True)
    _, index = open_checkpoint(dst)
    assert len(index.tensors) == 3 + 3 * 2 + 1
    out = {n: torch.zeros(index.tensors[n].shape) for n in index.tensors}
    reshard_svc.load(out, dst)
    for i in range(3):
        assert torch.equal(
            out[f"decoder.layers.{i}.mlp.fc1.weight"], sd["decoder.layers.mlp.fc1.weight"][i]
        )
        for e in range(2):
            assert torch.equal(
                out[f"decoder.layers.{i}.mlp.experts.{e}.fc1.weight"],
                sd["decoder.layers.mlp.experts.fc1.weight"][i, e],
            )
    with pytest.raises(UsageError, match="no tensor has a stacked"):
        reshard_svc.convert(dst, str(tmp_path / "again"), split_layers=True)


def _stacked(name: str, shape: tuple[int, ...]) -> list[str]:
    meta = TensorMeta(name=name, dtype=torch.float32, shape=shape, layout=None, chunks=())
    return [f"{a.kind}@{name.split('.')[a.after]}" for a in stacked_axes(meta, "reshard")]


@pytest.mark.parametrize(
    ("name", "shape", "axes"),
    [
        # Megatron-Core 0.16's grouped and sequential experts share this key: [L, E, rows, cols]
        (
            "decoder.layers.mlp.experts.experts.linear_fc1.weight",
            (2, 2, 4, 3),
            ["layers@layers", "experts@experts"],
        ),
        (
            "optimizer.state.exp_avg_sq.decoder.layers.mlp.experts.experts.linear_fc2.weight",
            (2, 2, 3, 4),
            ["layers@layers", "experts@experts"],
        ),
        # experts already one per key (singleton_local_shards; a model's local_experts.N)
        ("decoder.layers.mlp.experts.experts.3.linear_fc1.weight", (2, 4, 3), ["layers@layers"]),
        (
            "decoder.layers.mlp.experts.local_experts.3.linear_fc1.weight",
            (2, 4, 3),
            ["layers@layers"],
        ),
        ("decoder.layers.mlp.router.weight", (2, 8, 16), ["layers@layers"]),
        ("decoder.layers.mlp.shared_experts.linear_fc1.weight", (2, 8, 16), ["layers@layers"]),
        ("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", (4, 8, 16), ["experts@experts"]),
        ("decoder.final_layernorm.weight", (16,), []),
    ],
)
def test_stacked_axes_follow_megatrons_keys(name, shape, axes):
    assert _stacked(name, shape) == axes


def test_grouped_experts_split_into_one_tensor_per_layer_and_expert(tmp_path):
    """The issue's repro: a [L, E, rows, cols] expert weight from our own format."""
    name = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    w = torch.arange(48.0).reshape(2, 2, 4, 3)
    src, dst = str(tmp_path / "ck"), str(tmp_path / "hf")
    reshard_svc.save({name: w}, src)
    reshard_svc.convert(src, dst, format="hf", split_layers=True)
    from safetensors.torch import load_file

    got = load_file(f"{dst}/model-00001-of-00001.safetensors")
    assert sorted(got) == [
        f"decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight"
        for i in range(2)
        for e in range(2)
    ]
    for i in range(2):
        for e in range(2):
            assert torch.equal(
                got[f"decoder.layers.{i}.mlp.experts.experts.{e}.linear_fc1.weight"], w[i, e]
            )


@pytest.mark.parametrize(
    ("name", "shape", "words"),
    [
        ("a.layers.b.layers.c.weight", (2, 2, 4), "2 stacked 'layers'"),
        ("decoder.layers.mlp.experts.experts.bias", (2, 4), "would leave no dims"),
        ("decoder.layers.norm.weight", (4,), "would leave no dims"),
    ],
)
def test_a_split_that_cannot_be_proven_is_refused(tmp_path, name, shape, words):
    src = str(tmp_path / "ck")
    reshard_svc.save({name: torch.zeros(shape)}, src)
    with pytest.raises(UsageError, match=words) as e:
        reshard_svc.convert(src, str(tmp_path / "out"), split_layers=True)
    assert name in str(e.value)
    assert not os.path.exists(tmp_path / "out" / "reshard.index.json")


def test_a_megatron_layer_axis_must_be_one_layer_per_chunk():
    from reshard_svc.format.index import Chunk
    from reshard_svc.layout import Box

    two = Chunk(box=Box((0, 0), (2, 4)), file="a.distcp", begin=0, end=100, encoding="torch_save")
    meta = TensorMeta(
        name="decoder.layers.x.weight",
        dtype=torch.float32,
        shape=(2, 4),
        layout=None,
        chunks=(two,),
    )
    with pytest.raises(UsageError, match="not the stacked layers axis"):
        stacked_axes(meta, "megatron")
    assert stacked_axes(meta, "reshard")[0].kind == "layers"  # ours: its name is the record
