"""The one job contract: what a conversion job is and how it is checked.

- :class:`ConvertSpec` — source, target, mesh, rules, format, dtype (and what keeps its
  dtype), budgets, strategy, checksum, ``nodes`` × ``workers_per_node``.
  :meth:`ConvertSpec.checked` is the only place sizes, meshes, dtypes and choices are
  parsed; a bad value raises :class:`UsageError` naming the field. ``runtime.convert``
  runs a spec (``Conversion(spec)``), the server stores one, the CLI builds one.

How a spec travels is in ``jobs/``: the worker's command line both ways
(:mod:`reshard_svc.jobs.argv`) and the progress events rank 0 sends
(:mod:`reshard_svc.jobs.events`). What a target may be is checked by
:mod:`reshard_svc.format.target`, before the workers start and again under the run's lease.

This module does no I/O and imports neither torch nor the server, so anything may use it
cheaply.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, Literal

from reshard_svc.errors import UsageError
from reshard_svc.layout.mesh import MAX_MESH_SIZE
from reshard_svc.plan.budget import Budget, Verb, parse_size

__all__ = [
    "CHECKSUMS",
    "DEQUANTIZE",
    "DTYPES",
    "FORMATS",
    "STRATEGIES",
    "WORKERS",
    "ConvertSpec",
    "Option",
    "argument_help",
    "options",
    "Format",
    "Strategy",
    "format_mesh",
    "check_count",
    "parse_dtype",
    "parse_mesh",
    "parse_rules",
    "parse_size",
]


class Format(StrEnum):
    """What a conversion writes: our format, or one consolidated Hugging Face folder."""

    NATIVE = "native"
    HF = "hf"


class Strategy(StrEnum):
    """How a conversion reads: each stored byte once and the rest moved between workers
    (``exchange``), each worker reading what it needs (``direct``), or the cheaper of the
    two under the storage's cost model (``auto``)."""

    AUTO = "auto"
    EXCHANGE = "exchange"
    DIRECT = "direct"


FORMATS = tuple(f.value for f in Format)
STRATEGIES = tuple(s.value for s in Strategy)
CHECKSUMS = ("crc32c", "sha256", "none")
#: What ``dtype`` may cast floating-point tensors to (short name -> accepted spellings).
DTYPES = {
    "bf16": ("bf16", "bfloat16"),
    "fp16": ("fp16", "float16", "half"),
    "fp32": ("fp32", "float32", "float"),
    "fp64": ("fp64", "float64", "double"),
}
MAX_WORKERS = 1 << 16
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_mesh(mesh: str | Mapping[str, int] | None) -> dict[str, int] | None:
    """``"dp=2,tp=4"`` or ``{"dp": 2, "tp": 4}`` -> an ordered dict of named dims."""
    if mesh is None:
        return None
    if isinstance(mesh, str):
        items: list[tuple[str, Any]] = []
        for part in (p.strip() for p in mesh.split(",")):
            name, eq, size = part.partition("=")
            if not eq:
                raise UsageError(f"mesh {mesh!r}: name every dim, e.g. tp=4 or dp=2,tp=4")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise UsageError(f"mesh {mesh!r}: {part!r} is not name=size") from None
    elif isinstance(mesh, Mapping):
        items = list(mesh.items())
    else:
        raise UsageError(f"mesh {mesh!r} must be text like 'dp=2,tp=4' or a name -> size map")
    if not 1 <= len(items) <= 8:
        raise UsageError("mesh needs 1 to 8 named dims, e.g. tp=4 or dp=2,tp=4")
    out: dict[str, int] = {}
    for name, size in items:
        if not isinstance(name, str) or not _NAME.match(name) or name in out:
            raise UsageError(f"mesh dim name {name!r} must be a new identifier such as tp or dp")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise UsageError(f"mesh dim {name}={size!r} must be a positive integer")
        out[name] = size
    if math.prod(out.values()) > MAX_MESH_SIZE:
        raise UsageError(f"mesh {format_mesh(out)} spans more than {MAX_MESH_SIZE} ranks")
    return out


def format_mesh(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={n}" for k, n in mesh.items())


def parse_dtype(dtype: str | None) -> str | None:
    """A cast target's canonical short name (``bfloat16`` -> ``bf16``); others are refused."""
    if dtype is None:
        return None
    key = str(dtype).strip().lower().removeprefix("torch.")
    for short, names in DTYPES.items():
        if key in names:
            return short
    raise UsageError(
        f"dtype {dtype!r}: cast floating-point tensors only to bf16, fp16, fp32 or fp64 "
        "(int and float8 casts would destroy weights; quantize with a quantization tool)"
    )


def parse_rules(rules: Any) -> dict[str, str | list[str]] | None:
    if rules is None:
        return None
    from reshard_svc.errors import LayoutError
    from reshard_svc.layout.placements import parse_placements

    if not isinstance(rules, Mapping):
        raise UsageError("rules must map a tensor-name glob to placements, e.g. {'*.wq*': 'S(0)'}")
    if len(rules) > 1000:
        raise UsageError("rules: at most 1000 globs")
    out: dict[str, str | list[str]] = {}
    for glob, pls in rules.items():
        if not isinstance(glob, str) or not glob:
            raise UsageError(f"rules: glob {glob!r} must be non-empty text")
        if not isinstance(pls, str) and not (
            isinstance(pls, list) and all(isinstance(p, str) for p in pls)
        ):
            raise UsageError(f"rule {glob!r}: placements must be text like 'S(0)' or a list")
        try:
            parse_placements(pls)
        except LayoutError as e:
            raise UsageError(f"rule {glob!r}: {e}") from None
        out[glob] = pls
    return out


def _choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise UsageError(f"{name} {value!r} must be one of {', '.join(choices)}")
    return str(value)


def check_count(name: str, value: Any, high: int = 4096) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise UsageError(f"{name} {value!r} must be an integer from 1 to {high}")
    return value


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{name} {value!r} must be true or false")
    return value


def _text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 1024 or "\0" in value:
        raise UsageError(f"{name} must be non-empty text (at most 1024 characters)")
    return value


def _glob_list(name: str, value: Any, *, required: bool = False) -> list[str] | None:
    """A glob (or ``FROM=TO`` rule) or a list of up to 1000; ``required``: at least one."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > 1000 or (required and not value):
        raise UsageError(f"{name} must be a tensor-name glob or a list of at most 1000")
    return [str(_text(name, g)) for g in value] or None


#: What ``dequantize`` accepts (:data:`reshard_svc.plan.quant.DEQUANTIZE`, without torch).
DEQUANTIZE = ("fp8-block",)


def _dequantize(value: Any) -> str | None:
    if value is None:
        return None
    return _choice("dequantize", value, DEQUANTIZE)


def _renames(value: Any) -> list[str] | None:
    from reshard_svc.plan.names import parse_renames

    rules = parse_renames(value)
    return [str(r) for r in rules] if rules else None


def _uri(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 4096 or "\0" in value:
        raise UsageError(f"{name} must be a path or URI (1 to 4096 characters)")
    return value


Form = Literal[
    "text", "dtype", "size", "choice", "flag", "negated", "list", "count", "mesh", "rules"
]


@dataclass(frozen=True, kw_only=True)
class Option:
    """How one field of :class:`ConvertSpec` is offered: its help and its form. The CLI's
    ``convert``, ``plan``, ``submit`` and ``watch`` options, the worker's command line
    (:mod:`reshard_svc.jobs.argv`) and the server's request models are made from these.

    ``form``: ``text``, ``dtype`` (``bf16``...), ``size`` (``1GiB``), ``choice`` (one of ``choices``), ``flag`` (off
    unless given), ``negated`` (on unless ``--no-...`` is given), ``list`` (repeatable),
    ``count`` (an int from 1), ``mesh`` (``dp=2,tp=4`` / a JSON object), ``rules`` (a
    YAML/JSON file or inline JSON / a JSON object). ``placement`` marks where a job runs
    (``nodes``, ``workers_per_node``) rather than what it does: a local ``convert`` takes
    ``--workers`` instead, and the worker learns it from torchrun.
    """

    help: str
    form: Form = "text"
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    placement: bool = False

    def param(self, name: str) -> str:
        """The command line's name for field ``name``: itself, ``no_copy_config`` for a
        negated one."""
        return f"no_{name}" if self.form == "negated" else name

    def flag(self, name: str) -> str:
        """The command-line flag: ``--max-memory``; ``--no-copy-config`` for a negated one."""
        return "--" + self.param(name).replace("_", "-")

    def flag_help(self) -> str:
        """The flag's help (a negated flag turns the field's behaviour off)."""
        return f"turn off: {self.help}" if self.form == "negated" else self.help


def _option(default: Any, help: str, form: Form = "text", **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(help=help, form=form, **kw)})


@dataclass(frozen=True, kw_only=True)
class ConvertSpec:
    """One conversion: ``source`` -> ``target`` on ``nodes`` × ``workers_per_node`` workers.

    The only place the options are declared: each field's :class:`Option` (its help and
    form) and default make every other spelling of them (see :func:`options`)."""

    source: str = field(metadata={"argument": "checkpoint to read: a folder or URI"})
    target: str = field(metadata={"argument": "new checkpoint (or HF model folder) to write"})
    mesh: dict[str, int] | None = _option(
        None, "target mesh, e.g. tp=4 or dp=2,tp=4 (without rules: the source's placements)", "mesh"
    )
    rules: dict[str, str | list[str]] | None = _option(
        None,
        "tensor-name glob -> placements, first match wins (a YAML/JSON file, or inline JSON)",
        "rules",
    )
    format: Format = _option(
        Format.NATIVE,
        "native, or hf for one consolidated Hugging Face folder",
        "choice",
        choices=FORMATS,
    )
    dtype: str | None = _option(
        None,
        "cast floating-point tensors of 1+ dims to bf16, fp16, fp32 or fp64 (0-dim scalars, "
        "such as an optimizer's step, and FP8 tensors keep theirs)",
        "dtype",
    )
    keep_dtype: list[str] | None = _option(
        None,
        "with dtype: leave tensors matching this glob as they are (repeatable)",
        "list",
        metavar="GLOB",
    )
    strategy: Strategy = _option(
        Strategy.AUTO,
        "how to read: exchange (each byte once, then moved), direct, or auto (the cheaper)",
        "choice",
        choices=STRATEGIES,
    )
    checksum: str = _option(
        "crc32c",
        "what the output records: crc32c (block CRCs, checked on every read), sha256 (those "
        "plus a whole-file sha256) or none",
        "choice",
        choices=CHECKSUMS,
    )
    max_memory: str | None = _option(
        None,
        "byte budget per worker, e.g. 1GiB (default: 1GiB for a convert, 512MiB for a load)",
        "size",
    )
    max_shard_size: str | None = _option(
        None, "HF export: cap per file, e.g. 5GB (the default)", "size"
    )
    nodes: int = _option(1, "nodes (torchrun agents) the job runs on", "count", placement=True)
    workers_per_node: int = _option(
        1,
        "workers per node (GPUs per node; default: workers / nodes, else 1)",
        "count",
        placement=True,
    )
    overwrite: bool = _option(
        False, "replace a committed checkpoint at the target (other files there are kept)", "flag"
    )
    only: list[str] | None = _option(
        None,
        "keep only tensors matching this glob (repeatable), e.g. 'model.*'",
        "list",
        metavar="GLOB",
    )
    strip_prefix: str | None = _option(
        None, "drop this prefix from tensor names, e.g. 'model.'", metavar="PREFIX"
    )
    rename: list[str] | None = _option(
        None,
        "rename tensors before only/strip-prefix (repeatable, first match wins; the CLI also "
        "takes a YAML file of FROM: TO), e.g. 'layers.*.wq.weight=model.layers.*.q_proj.weight'",
        "list",
        metavar="FROM_GLOB=TO_PATTERN",
    )
    split_layers: bool = _option(
        False,
        "split Megatron-Core's stacked layers/experts axes into per-layer tensors "
        "(decoder.layers.mlp.linear_fc1.weight [L, ...] -> decoder.layers.{i}.mlp...), before rename",
        "flag",
    )
    dequantize: str | None = _option(
        None,
        "fp8-block: block-scaled FP8 weights times their *_scale_inv per 128x128 block (in "
        "float32), cast to dtype (default bf16); the scales are dropped. Without it, FP8 "
        "tensors and their scales keep their dtype",
        "choice",
        choices=DEQUANTIZE,
    )
    copy_config: bool = _option(
        True,
        "an HF export copies the source's config and tokenizer files (when it has them)",
        "negated",
    )
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    def budget(self, verb: Verb = "convert") -> Budget:
        """``max_memory`` as a :class:`~reshard_svc.plan.budget.Budget` (``verb``'s default
        when unset): the one place it is parsed."""
        return Budget.of(self.max_memory, verb)

    # ---- validation: the one place values are parsed

    def checked(self) -> ConvertSpec:
        """A normalised copy, or :class:`UsageError` naming the field to fix."""
        self.budget()
        parse_size(self.max_shard_size, "max_shard_size")
        nodes = check_count("nodes", self.nodes, 4096)
        per_node = check_count("workers_per_node", self.workers_per_node, 4096)
        if nodes * per_node > MAX_WORKERS:
            raise UsageError(f"nodes × workers_per_node = {nodes * per_node} exceeds {MAX_WORKERS}")
        if self.keep_dtype and not self.dtype:
            raise UsageError("keep_dtype (--keep-dtype) only matters with a dtype (--dtype) cast")
        return replace(
            self,
            source=_uri("source", self.source),
            target=_uri("target", self.target),
            mesh=parse_mesh(self.mesh),
            rules=parse_rules(self.rules),
            format=Format(_choice("format", self.format, FORMATS)),
            dtype=parse_dtype(self.dtype),
            keep_dtype=_glob_list("keep_dtype", self.keep_dtype),
            strategy=Strategy(_choice("strategy", self.strategy, STRATEGIES)),
            checksum=_choice("checksum", self.checksum, CHECKSUMS),
            overwrite=_flag("overwrite", self.overwrite),
            only=_glob_list("only", self.only, required=True),
            rename=_renames(self.rename),
            split_layers=_flag("split_layers", self.split_layers),
            dequantize=_dequantize(self.dequantize),
            strip_prefix=_text("strip_prefix", self.strip_prefix),
            copy_config=_flag("copy_config", self.copy_config),
        )

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ConvertSpec:
        """From a job body; ``workers`` is read as ``workers_per_node`` on one node."""
        if not isinstance(data, Mapping):
            raise UsageError("a job spec must be a JSON object")
        data = dict(data)
        workers = data.pop("workers", None)
        names = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(data) - names)
        if unknown:
            raise UsageError(f"unknown job field(s) {', '.join(unknown)}")
        for key in ("source", "target"):
            if key not in data:
                raise UsageError(f"a job needs a {key}")
        if workers is not None:
            check_count("workers", workers, MAX_WORKERS)
            nodes = data.get("nodes", 1)
            per_node = data.get("workers_per_node")
            if per_node is None and isinstance(nodes, int) and nodes >= 1:
                if workers % nodes:
                    raise UsageError(f"workers={workers} is not a multiple of nodes={nodes}")
                data["workers_per_node"] = workers // nodes
            elif per_node is not None and workers != nodes * per_node:
                raise UsageError(
                    f"workers={workers} but nodes × workers_per_node = {nodes} × {per_node}"
                )
        return cls(**data).checked()

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("extra")
        out["format"], out["strategy"] = str(self.format), str(self.strategy)
        out["workers"] = self.workers
        return out


#: ``workers`` in a job body (and ``--workers`` of ``submit``): nodes × workers_per_node,
#: a shorthand :meth:`ConvertSpec.from_json` reads as ``workers_per_node`` on ``nodes``
WORKERS = Option(help="total workers = nodes x workers_per_node (a shorthand)", form="count")


def options(*, placement: bool = True) -> list[tuple[str, Any, Option]]:
    """``(name, default, option)`` of every :class:`ConvertSpec` option, in declaration
    order (``placement=False`` leaves out ``nodes`` and ``workers_per_node``)."""
    out = []
    for f in fields(ConvertSpec):
        opt = f.metadata.get("option")
        if opt is not None and (placement or not opt.placement):
            out.append((f.name, f.default, opt))
    return out


def argument_help(name: str) -> str:
    """The help of ``source`` or ``target``."""
    return str(next(f for f in fields(ConvertSpec) if f.name == name).metadata["argument"])


def options_from_text(
    values: Mapping[str, Any], *, placement: bool = True, files: bool = True
) -> dict[str, Any]:
    """Command-line values (keyed by :meth:`Option.param`, as typed) as spec fields: a mesh
    parsed (``dp=2,tp=4``), rules read (a YAML/JSON file, or inline JSON), renames read
    (``FROM=TO`` texts, or, with ``files``, YAML/JSON files of them: a person's command
    line; the worker's holds the rules themselves); a negated flag given turns its field
    off. Options not given (None, False, empty) are left out: they keep their defaults."""
    out: dict[str, Any] = {}
    for name, _, opt in options(placement=placement):
        value = values.get(opt.param(name))
        if value is None or value is False or (isinstance(value, list | tuple) and not value):
            continue
        if opt.form == "negated":
            value = False
        elif opt.form == "mesh":
            value = parse_mesh(value)
        elif opt.form == "rules":
            value = _rules_text(value)
        elif name == "rename" and files:
            from reshard_svc.plan.names import load_renames

            value = [str(r) for r in load_renames(list(value)) or ()] or None
        elif opt.form == "list":
            value = list(value)
        out[name] = value
    return out


def _rules_text(text: str) -> dict[str, Any]:
    from reshard_svc.errors import LayoutError
    from reshard_svc.plan.rules import load_rules

    try:
        return dict(load_rules(text))
    except LayoutError as e:
        raise UsageError(str(e)) from None
