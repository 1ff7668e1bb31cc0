"""Which tensors a convert writes, and under which names.

Four steps, in this order:

0. ``split_layers`` (opt-in): Megatron-Core stacks a module's per-layer tensors along a
   prepended axis, ``decoder.layers.mlp.linear_fc1.weight`` of shape ``[L, ...]``, and
   MoE experts along the next one: ``decoder.layers.mlp.experts.experts.linear_fc1.weight``
   of shape ``[L, E, rows, cols]`` (its grouped and its sequential experts share that key).
   A name has at most two stacked axes, in that order (see :func:`stacked_axes`): a
   ``layers`` segment not followed by a number (the layer index goes after it), and an
   expert axis when its last ``experts`` / ``local_experts`` segment is not followed by a
   number (the expert index goes after that segment). So the key above becomes
   ``decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight`` — the name Megatron itself
   gives one expert (``singleton_local_shards``); optimizer states
   (``optimizer.state.exp_avg.decoder.layers...``) split as their parameters do. A Megatron
   source must also say so in its chunks (one layer per stored chunk along the layer axis,
   as Megatron prepends it); a split that cannot be proven is refused, naming the tensor.
1. ``rename``: ordered ``FROM_GLOB=TO_PATTERN`` rules. The first rule whose glob matches a
   name renames it; each ``*`` in the glob captures text (dots included) and the n-th
   ``*`` of the pattern is replaced by the n-th capture; ``?`` matches one character.
   ``layers.*.attention.wq.weight=model.layers.*.self_attn.q_proj.weight`` maps a
   torchtitan name to a Hugging Face one; ``model.*=*`` drops a prefix. A rule that
   matches nothing, or two names renamed to one, is a :class:`UsageError`.
2. ``only``: globs over the renamed names; a glob that matches nothing is an error.
3. ``strip_prefix``: a prefix dropped from the names kept.

Reads are by file and byte range, so a renamed index reads the same bytes. Renames only
rename: what a model needs beyond that (RoPE permutations, QKV interleaving by query
group) is out of scope.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import TYPE_CHECKING, Any

from reshard_svc.errors import UsageError
from reshard_svc.layout import Box

if TYPE_CHECKING:  # the index imports torch; renaming (the CLI's preflight) does not need it
    from reshard_svc.format.index import CheckpointIndex, Chunk, TensorMeta

__all__ = [
    "Rename",
    "StackedAxis",
    "load_renames",
    "parse_renames",
    "select_tensors",
    "split_layers",
    "stacked_axes",
]

#: Most rules one convert takes (a model's worth of per-module renames is a few dozen).
MAX_RULES = 1000


@dataclass(frozen=True, slots=True)
class Rename:
    """One ``FROM_GLOB=TO_PATTERN`` rule."""

    glob: str
    pattern: str

    def __post_init__(self) -> None:
        for what, text in (("glob", self.glob), ("pattern", self.pattern)):
            if not isinstance(text, str) or not text or len(text) > 1024 or "\0" in text:
                raise UsageError(f"--rename {what} must be non-empty text (at most 1024 chars)")
        if self.pattern.count("*") > self.glob.count("*"):
            raise UsageError(
                f"--rename {self}: the pattern has {self.pattern.count('*')} '*' but the glob "
                f"captures only {self.glob.count('*')}"
            )
        if "?" in self.pattern:
            raise UsageError(f"--rename {self}: '?' belongs in the glob, not the pattern")

    def __str__(self) -> str:
        return f"{self.glob}={self.pattern}"

    @property
    def regex(self) -> re.Pattern[str]:
        return _compile(self.glob)

    def apply(self, name: str) -> str | None:
        """The new name, or None when the glob does not match ``name``."""
        m = self.regex.fullmatch(name)
        if m is None:
            return None
        captures = iter(m.groups())
        return "".join(
            part if i == 0 else next(captures) + part
            for i, part in enumerate(self.pattern.split("*"))
        )


def _compile(glob: str) -> re.Pattern[str]:
    out = []
    for ch in glob:
        out.append("(.*)" if ch == "*" else "." if ch == "?" else re.escape(ch))
    return re.compile("".join(out), re.DOTALL)


def parse_renames(value: Any) -> list[Rename] | None:
    """Rules from ``"FROM=TO"`` texts, ``[FROM, TO]`` pairs or ``{FROM: TO}`` (in order)."""
    if value is None:
        return None
    if isinstance(value, (str, Rename)):
        value = [value]
    if isinstance(value, Mapping):
        value = list(value.items())
    if not isinstance(value, (list, tuple)) or len(value) > MAX_RULES:
        raise UsageError(f"rename must be a list of at most {MAX_RULES} 'FROM_GLOB=TO_PATTERN'")
    rules: list[Rename] = []
    for item in value:
        if isinstance(item, Rename):
            rules.append(item)
        elif isinstance(item, str):
            glob, eq, pattern = item.partition("=")
            if not eq:
                raise UsageError(
                    f"--rename {item!r}: expected FROM_GLOB=TO_PATTERN, e.g. 'model.*=*'"
                )
            rules.append(Rename(glob, pattern))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            rules.append(Rename(*item))
        else:
            raise UsageError(f"--rename {item!r}: expected 'FROM_GLOB=TO_PATTERN'")
    return rules or None


def load_renames(values: Sequence[str] | None) -> list[Rename] | None:
    """``--rename`` values: each ``FROM=TO``, or the path of a YAML/JSON file holding an
    ordered ``{FROM: TO}`` map (or a list of ``FROM=TO`` texts)."""
    rules: list[Rename] = []
    for value in values or ():
        if os.path.isfile(value):
            rules.extend(parse_renames(_read_file(value)) or ())
        elif "=" in value:
            rules.extend(parse_renames(value) or ())
        else:
            raise UsageError(
                f"--rename {value!r} is neither FROM_GLOB=TO_PATTERN nor an existing YAML file"
            )
    return rules or None


def _read_file(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UsageError(f"--rename file {path!r} is neither JSON nor YAML: {e}") from None
    if not isinstance(data, (Mapping, list)):
        raise UsageError(f"--rename file {path!r} must hold a FROM: TO map or a list")
    return data


def rename_all(names: Iterable[str], rules: Sequence[Rename]) -> dict[str, str]:
    """old -> new for every name (unmatched names keep theirs); a rule that matches
    nothing, or two names that end up equal, is a :class:`UsageError`."""
    out: dict[str, str] = {}
    used = [False] * len(rules)
    for name in names:
        new = name
        for i, rule in enumerate(rules):
            hit = rule.apply(name)
            if hit is not None:
                new, used[i] = hit, True
                break
        out[name] = new
    for rule, was_used in zip(rules, used, strict=True):
        if not was_used:
            raise UsageError(
                f"--rename {rule} matches no tensor (names look like {next(iter(out), '')!r})"
            )
    _check_unique(out, "--rename")
    return out


def _check_unique(mapping: Mapping[str, str], what: str) -> None:
    seen: dict[str, str] = {}
    for old, new in mapping.items():
        if not new:
            raise UsageError(f"{what} leaves {old!r} with an empty name")
        if new in seen:
            raise UsageError(f"{what} renames both {seen[new]!r} and {old!r} to {new!r}")
        seen[new] = old


#: Segments that name a stacked expert axis (the last one in a name decides).
EXPERT_SEGMENTS = ("experts", "local_experts")


@dataclass(frozen=True, slots=True)
class StackedAxis:
    """A leading axis of a stacked tensor: ``kind`` (``layers`` / ``experts``) and the name
    segment after which its index is inserted."""

    kind: str
    after: int


def stacked_axes(meta: TensorMeta, source: str) -> list[StackedAxis]:
    """The stacked leading axes of ``meta``, in axis order (see the module doc); empty when
    its name declares none. Refuses (:class:`UsageError`, naming the tensor) a name with
    two stacked ``layers`` segments, a tensor the split would leave with no dims, and a
    Megatron tensor whose chunks contradict its name (more than one layer per chunk)."""
    parts = meta.name.split(".")

    def stacked(i: int) -> bool:
        return i + 1 < len(parts) and not parts[i + 1].isdigit()

    layers = [i for i, p in enumerate(parts) if p == "layers" and stacked(i)]
    if len(layers) > 1:
        raise UsageError(
            f"--split-layers: {meta.name!r} has {len(layers)} stacked 'layers' segments; "
            "which axis is which is ambiguous (rename it first, or leave --split-layers off)"
        )
    axes = [StackedAxis("layers", layers[0])] if layers else []
    experts = [i for i, p in enumerate(parts) if p in EXPERT_SEGMENTS]
    if experts and stacked(experts[-1]) and (not layers or experts[-1] > layers[0]):
        axes.append(StackedAxis("experts", experts[-1]))
    if not axes:
        return []
    if len(meta.shape) <= len(axes):
        raise UsageError(
            f"--split-layers: {meta.name!r} has shape {list(meta.shape)}; its name declares "
            f"{len(axes)} stacked axes ({', '.join(a.kind for a in axes)}), which would leave "
            "no dims: it is not stacked as its name says (rename it, or leave --split-layers off)"
        )
    if source == "megatron" and any(c.box.sizes[0] != 1 for c in meta.chunks):
        sizes = sorted({c.box.sizes[0] for c in meta.chunks})
        raise UsageError(
            f"--split-layers: {meta.name!r} is stored {sizes} along its leading axis per "
            "chunk, but Megatron-Core stores stacked axes one layer per chunk: its leading "
            f"axis is not the stacked {axes[0].kind} axis its name suggests"
        )
    return axes


def _split_chunk(chunk: Chunk, index: int, itemsize: int) -> Chunk | None:
    """The part of ``chunk`` at ``index`` of its leading axis, without that axis.

    Raw chunks become the byte range of that slice. A ``torch_save`` item (read whole and
    decoded) gets a selection suffix per axis taken (``torch_save@0,2``: slice 0 of the
    decoded item's first axis, then slice 2 of the next), so each slice's tensor reads the
    item and keeps its own slice."""
    from reshard_svc.format.index import Chunk

    box = chunk.box
    lo = index - box.offsets[0]
    if not 0 <= lo < box.sizes[0]:
        return None
    inner = Box(box.offsets[1:], box.sizes[1:])
    if chunk.encoding == "raw":
        step = inner.numel * itemsize
        return Chunk(
            box=inner,
            file=chunk.file,
            begin=chunk.begin + lo * step,
            end=chunk.begin + (lo + 1) * step,
        )
    picks = f"{chunk.encoding},{lo}" if "@" in chunk.encoding else f"{chunk.encoding}@{lo}"
    return Chunk(box=inner, file=chunk.file, begin=chunk.begin, end=chunk.end, encoding=picks)


def split_layers(index: CheckpointIndex) -> CheckpointIndex:
    """Stacked-layer tensors as one tensor per layer (and per expert); see the module doc."""
    tensors: dict[str, TensorMeta] = {}
    for meta in index.tensors.values():
        axes = stacked_axes(meta, index.source)
        for meta_out in _split(meta, axes):
            if meta_out.name in tensors or (
                meta_out is not meta and meta_out.name in index.tensors
            ):
                raise UsageError(f"--split-layers makes {meta_out.name!r}, which already exists")
            tensors[meta_out.name] = meta_out
    if tensors.keys() == index.tensors.keys():
        raise UsageError("--split-layers: no tensor has a stacked 'layers' or 'experts' axis")
    clash = set(tensors) & {*index.extras, *index.blobs}
    if clash:
        raise UsageError(f"--split-layers makes names that already exist: {sorted(clash)[:3]}")
    return dc_replace(index, tensors=dict(sorted(tensors.items())))


def _split(meta: TensorMeta, axes: Sequence[StackedAxis]) -> list[TensorMeta]:
    """``meta`` cut along its stacked axes, the indices inserted into its name."""
    from reshard_svc.format.index import TensorMeta

    metas = [(meta, meta.name.split("."))]
    for depth, axis in enumerate(axes):
        out = []
        for m, parts in metas:
            for i in range(m.shape[0]):
                chunks = [c for c in (_split_chunk(c, i, m.itemsize) for c in m.chunks) if c]
                at = axis.after + 1 + depth  # earlier insertions shift later positions by one
                named = [*parts[:at], str(i), *parts[at:]]
                out.append(
                    (
                        TensorMeta(
                            name=".".join(named),
                            dtype=m.dtype,
                            shape=m.shape[1:],
                            layout=None,
                            chunks=tuple(chunks),
                        ),
                        named,
                    )
                )
        metas = out
    return [m for m, _ in metas]


def select_tensors(
    index: CheckpointIndex,
    only: Sequence[str] | None = None,
    strip_prefix: str | None = None,
    renames: Sequence[Rename] | None = None,
) -> CheckpointIndex:
    """The part of ``index`` a convert writes, under its new names (see the module doc).

    A rule or glob that matches nothing, a selection that is empty, or names that end up
    equal is a :class:`UsageError`.
    """
    from reshard_svc.format.index import CheckpointIndex

    if not only and not strip_prefix and not renames:
        return index
    every = [*index.tensors, *index.extras, *index.blobs]
    renamed = rename_all(every, renames or ())
    globs = list(only or ["*"])
    for glob in globs:
        if not isinstance(glob, str) or not glob:
            raise UsageError(f"--only: glob {glob!r} must be non-empty text")
        if not any(fnmatch.fnmatchcase(n, glob) for n in renamed.values()):
            raise UsageError(
                f"--only {glob!r} matches no tensor (names look like "
                f"{renamed.get(next(iter(index.tensors), ''), '')!r})"
            )

    def strip(name: str) -> str:
        return name[len(strip_prefix) :] if strip_prefix and name.startswith(strip_prefix) else name

    def pick(names: Iterable[str]) -> dict[str, str]:
        return {
            n: strip(renamed[n])
            for n in names
            if any(fnmatch.fnmatchcase(renamed[n], g) for g in globs)
        }

    tensors = pick(index.tensors)
    if not tensors:
        raise UsageError("--only selects no tensor: nothing to write")
    if strip_prefix and not any(renamed[n].startswith(strip_prefix) for n in tensors):
        raise UsageError(
            f"--strip-prefix {strip_prefix!r} matches no tensor name (names look like "
            f"{renamed[next(iter(tensors))]!r})"
        )
    extras = pick(index.extras)
    blobs = pick(index.blobs)
    _check_unique({**tensors, **extras, **blobs}, "--strip-prefix" if strip_prefix else "--rename")
    return CheckpointIndex(
        tensors={new: dc_replace(index.tensors[old], name=new) for old, new in tensors.items()},
        files=index.files,
        extras={new: index.extras[old] for old, new in extras.items()},
        source=index.source,
        created_by=index.created_by,
        checksum=index.checksum,
        block_size=index.block_size,
        blobs={new: dc_replace(index.blobs[old], name=new) for old, new in blobs.items()},
    )
