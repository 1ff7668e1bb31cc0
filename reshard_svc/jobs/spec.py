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

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.jobs.forms import (
    DEQUANTIZE,
    DTYPES,
    MAX_WORKERS,
    Choice,
    Count,
    Dtype,
    Flag,
    Form,
    List,
    Mesh,
    Negated,
    Renames,
    Rules,
    Size,
    Text,
    check_count,
    format_mesh,
    parse_dtype,
    parse_mesh,
    parse_rules,
)
from reshard_svc.plan.budget import Budget, Verb, parse_size

#: the form of an option that says none: free text
TEXT: Form = Text()

__all__ = [
    "CHECKSUMS",
    "DEQUANTIZE",
    "DTYPES",
    "FORMATS",
    "MAX_WORKERS",
    "STRATEGIES",
    "WORKERS",
    "ConvertSpec",
    "Option",
    "argument_help",
    "options",
    "Device",
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


class Device(StrEnum):
    """Where a conversion's workers exchange bytes: on their GPUs over NCCL when every
    worker on a node has one of its own (``auto``; else on the CPU over gloo, saying why),
    always on the CPU (``cpu``), or on the GPUs, refusing a host with too few (``cuda``)."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


DEVICES = tuple(d.value for d in Device)


def _uri(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > 4096 or "\0" in value:
        raise UsageError(f"{name} must be a path or URI (1 to 4096 characters)")
    return value


@dataclass(frozen=True, kw_only=True)
class Option:
    """How one field of :class:`ConvertSpec` is offered: its help and its form. The CLI's
    ``convert``, ``plan``, ``submit`` and ``watch`` options, the worker's command line
    (:mod:`reshard_svc.jobs.argv`) and the server's request models are made from these.

    ``form`` is a :class:`~reshard_svc.jobs.forms.Form`: how the value is checked, typed
    on a command line, carried on the worker's and typed in a JSON body (``Text()``,
    ``Size()``, ``Choice(...)``, ``Flag()``, ``Negated()``, ``List()``, ``Count()``,
    ``Mesh()``, ``Rules()`` ...). ``placement`` marks where a job runs
    (``nodes``, ``workers_per_node``) rather than what it does: a local ``convert`` takes
    ``--workers`` instead, and the worker learns it from torchrun.
    """

    help: str
    form: Form = TEXT
    metavar: str | None = None
    placement: bool = False

    def param(self, name: str) -> str:
        """The command line's name for field ``name``: itself, ``no_copy_config`` for a
        negated one."""
        return f"no_{name}" if self.form.negated else name

    def flag(self, name: str) -> str:
        """The command-line flag: ``--max-memory``; ``--no-copy-config`` for a negated one."""
        return "--" + self.param(name).replace("_", "-")

    def flag_help(self) -> str:
        """The flag's help (a negated flag turns the field's behaviour off)."""
        return f"turn off: {self.help}" if self.form.negated else self.help


def _option(default: Any, help: str, form: Form = TEXT, **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(help=help, form=form, **kw)})


@dataclass(frozen=True, kw_only=True)
class ConvertSpec:
    """One conversion: ``source`` -> ``target`` on ``nodes`` × ``workers_per_node`` workers.

    The only place the options are declared: each field's :class:`Option` (its help and
    form) and default make every other spelling of them (see :func:`options`)."""

    source: str = field(metadata={"argument": "checkpoint to read: a folder or URI"})
    target: str = field(metadata={"argument": "new checkpoint (or HF model folder) to write"})
    mesh: dict[str, int] | None = _option(
        None, "target mesh, e.g. tp=4 or dp=2,tp=4 (without rules: the source's placements)", Mesh()
    )
    rules: dict[str, str | list[str]] | None = _option(
        None,
        "tensor-name glob -> placements, first match wins (a YAML/JSON file, or inline JSON)",
        Rules(),
    )
    format: Format = _option(
        Format.NATIVE,
        "native, or hf for one consolidated Hugging Face folder",
        Choice(FORMATS, Format),
    )
    dtype: str | None = _option(
        None,
        "cast floating-point tensors of 1+ dims to bf16, fp16, fp32 or fp64 (0-dim scalars, "
        "such as an optimizer's step, and FP8 tensors keep theirs)",
        Dtype(),
    )
    keep_dtype: list[str] | None = _option(
        None,
        "with dtype: leave tensors matching this glob as they are (repeatable)",
        List(),
        metavar="GLOB",
    )
    strategy: Strategy = _option(
        Strategy.AUTO,
        "how to read: exchange (each byte once, then moved), direct, or auto (the cheaper)",
        Choice(STRATEGIES, Strategy),
    )
    checksum: str = _option(
        "crc32c",
        "what the output records: crc32c (block CRCs, checked on every read), sha256 (those "
        "plus a whole-file sha256) or none",
        Choice(CHECKSUMS),
    )
    max_memory: str | None = _option(
        None,
        "byte budget per worker, e.g. 1GiB (default: 1GiB for a convert, 512MiB for a load)",
        Size(),
    )
    max_shard_size: str | None = _option(
        None, "HF export: cap per file, e.g. 5GB (the default)", Size()
    )
    io_threads: int | None = _option(
        None,
        "checking writer threads per worker (default: RESHARD_IO_THREADS, else the CPUs "
        "this process may use over the workers on its node, at most 16)",
        Count(high=1024, optional=True),
        metavar="N",
    )
    device: Device = _option(
        Device.AUTO,
        "where workers exchange bytes: auto (their GPUs over NCCL when each worker on a node "
        "has its own, else the CPU over gloo), cpu, or cuda (too few GPUs is an error)",
        Choice(DEVICES, Device),
    )
    nodes: int = _option(1, "nodes (torchrun agents) the job runs on", Count(), placement=True)
    workers_per_node: int = _option(
        1,
        "workers per node (GPUs per node; default: workers / nodes, else 1)",
        Count(),
        placement=True,
    )
    overwrite: bool = _option(
        False, "replace a committed checkpoint at the target (other files there are kept)", Flag()
    )
    only: list[str] | None = _option(
        None,
        "keep only tensors matching this glob (repeatable), e.g. 'model.*'",
        List(required=True),
        metavar="GLOB",
    )
    strip_prefix: str | None = _option(
        None, "drop this prefix from tensor names, e.g. 'model.'", metavar="PREFIX"
    )
    rename: list[str] | None = _option(
        None,
        "rename tensors before only/strip-prefix (repeatable, first match wins; the CLI also "
        "takes a YAML file of FROM: TO), e.g. 'layers.*.wq.weight=model.layers.*.q_proj.weight'",
        Renames(),
        metavar="FROM_GLOB=TO_PATTERN",
    )
    split_layers: bool = _option(
        False,
        "split Megatron-Core's stacked layers/experts axes into per-layer tensors "
        "(decoder.layers.mlp.linear_fc1.weight [L, ...] -> decoder.layers.{i}.mlp...), before rename",
        Flag(),
    )
    dequantize: str | None = _option(
        None,
        "fp8-block: block-scaled FP8 weights times their *_scale_inv per 128x128 block (in "
        "float32), cast to dtype (default bf16); the scales are dropped. Without it, FP8 "
        "tensors and their scales keep their dtype",
        Choice(DEQUANTIZE, optional=True),
    )
    copy_config: bool = _option(
        True,
        "an HF export copies the source's config and tokenizer files (when it has them)",
        Negated(),
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
        """A normalised copy, or :class:`UsageError` naming the field to fix: each option
        checked by its form, then what the options say together."""
        source, target = _uri("source", self.source), _uri("target", self.target)
        values = {name: opt.form.check(name, getattr(self, name)) for name, _, opt in options()}
        workers = values["nodes"] * values["workers_per_node"]
        if workers > MAX_WORKERS:
            raise UsageError(f"nodes × workers_per_node = {workers} exceeds {MAX_WORKERS}")
        if values["keep_dtype"] and not values["dtype"]:
            raise UsageError("keep_dtype (--keep-dtype) only matters with a dtype (--dtype) cast")
        return replace(self, source=source, target=target, **values)

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
WORKERS = Option(help="total workers = nodes x workers_per_node (a shorthand)", form=Count())


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
        out[name] = opt.form.from_text(value, files=files)
    return out
