"""Target layouts for ``convert``: a new mesh, placement rules, or both.

Resolution per tensor, first that applies:

1. ``rules``: ordered ``{glob: placements}`` (YAML/JSON file or dict); the first glob that
   matches the tensor name wins. Placements are text (``"S(0),R"``) or a list, one per
   target mesh dim.
2. The source layout with the target mesh: same mesh ndim — same placements (a
   ``StridedShard`` whose split factor equals the source's later shard count on that
   dim, as FSDP2×TP writes it, is rescaled to the target's); different ndim — by mesh
   dim *name* (a dim absent from the source is Replicate).
3. No source layout (HF folders, plain tensors): Replicate on every mesh dim.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from reshard_svc.errors import LayoutError
from reshard_svc.layout import (
    Layout,
    Mesh,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    parse_placements,
)

if TYPE_CHECKING:  # the index imports torch; checking rules (the CLI) does not need it
    from reshard_svc.format.index import CheckpointIndex

__all__ = ["load_rules", "resolve_layouts"]

logger = logging.getLogger(__name__)


def load_rules(rules: str | Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    """Ordered (glob, placements) pairs from a dict, a YAML/JSON file path, or inline JSON
    (text starting with ``{`` or ``[``)."""
    if rules is None:
        return []
    if (
        isinstance(rules, str)
        and rules.lstrip().startswith(("{", "["))
        and not os.path.exists(rules)
    ):
        try:
            rules = json.loads(rules)
        except json.JSONDecodeError as e:
            raise LayoutError(f"--rules is not valid JSON: {e}") from None
    if isinstance(rules, str):
        if not os.path.exists(rules):
            raise LayoutError(f"--rules file {rules!r} does not exist")
        text = open(rules, encoding="utf-8").read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise LayoutError(f"--rules file {rules!r} is neither JSON nor YAML: {e}") from e
        rules = data
    if isinstance(rules, list):
        pairs: list[tuple[str, Any]] = []
        for item in rules:
            if not isinstance(item, Mapping) or len(item) != 1:
                raise LayoutError("rules list items must be single {glob: placements} maps")
            pairs.extend(item.items())
        return pairs
    if not isinstance(rules, Mapping):
        raise LayoutError(
            "rules must map a tensor-name glob to placements, e.g. {'*.wq.weight': 'S(0)'}"
        )
    return list(rules.items())


def _rescale(
    src: Layout, p: Placement, i: int, target_mesh: Mesh, placements: list[Placement]
) -> Placement:
    """FSDP2 x TP strided shards: keep split_factor = later shard count on the same dim."""
    if not isinstance(p, StridedShard):
        return p
    src_later = 1
    for j in range(i + 1, src.mesh.ndim):
        q = src.placements[j]
        if isinstance(q, (Shard, StridedShard)) and q.dim == p.dim:
            src_later *= src.mesh.shape[j]
    if p.split_factor != src_later:
        return p  # e.g. a fused QKV: the factor is the model's, not the mesh's
    tgt_later = 1
    for j in range(i + 1, target_mesh.ndim):
        q = placements[j]
        if isinstance(q, (Shard, StridedShard)) and q.dim == p.dim:
            tgt_later *= target_mesh.shape[j]
    return StridedShard(p.dim, tgt_later) if tgt_later > 1 else Shard(p.dim)


def _from_source(src: Layout, mesh: Mesh) -> Layout:
    if src.mesh.ndim == mesh.ndim:
        pls = list(src.placements)
    else:  # match mesh dims by name
        if src.mesh.names is None or mesh.names is None:
            raise LayoutError(
                f"source mesh {src.mesh} and target mesh {mesh} differ in dims; name the mesh "
                "dims (e.g. --mesh dp=2,tp=4) or give --rules"
            )
        by_name = dict(zip(src.mesh.names, src.placements))
        pls = [by_name.get(n, Replicate()) for n in mesh.names]
        return Layout(mesh, tuple(pls))
    pls = [_rescale(src, p, i, mesh, pls) for i, p in enumerate(pls)]
    return Layout(mesh, tuple(pls))


def resolve_layouts(
    index: CheckpointIndex,
    mesh: Mesh | str | None,
    rules: str | Mapping[str, Any] | None = None,
) -> dict[str, Layout]:
    """The target layout of every tensor in ``index``."""
    if isinstance(mesh, str):
        mesh = Mesh.parse(mesh)
    pairs = load_rules(rules)
    out: dict[str, Layout] = {}
    replicated: list[str] = []
    for name, meta in sorted(index.tensors.items()):
        layout = None
        for glob, placements in pairs:
            if fnmatch.fnmatchcase(name, glob):
                target_mesh = mesh or (meta.layout.mesh if meta.layout else None)
                if target_mesh is None:
                    raise LayoutError(
                        f"rule {glob!r} matches {name!r} but no target mesh is given (--mesh)"
                    )
                try:
                    layout = Layout(target_mesh, parse_placements(placements))
                except LayoutError as e:
                    raise LayoutError(f"rule {glob!r}: {e}") from None
                break
        if layout is None:
            if mesh is None:
                layout = meta.layout or Layout.replicated()
            elif meta.layout is None:
                layout = Layout(mesh, tuple(Replicate() for _ in mesh.shape))
                if mesh.size > 1 and meta.shape:
                    replicated.append(name)
            else:
                layout = _from_source(meta.layout, mesh)
        try:
            layout.normalized(len(meta.shape))
        except LayoutError as e:
            raise LayoutError(f"tensor {name!r} ({len(meta.shape)}-D): {e}") from None
        out[name] = layout
    if replicated:
        logger.warning(
            "%d tensor(s) have no layout in the source (e.g. %r) and match no rule: they are "
            "replicated on every rank of the target mesh; pass --rules to shard them",
            len(replicated),
            replicated[0],
        )
    return out
