"""The one job contract: what a conversion job is, how it is checked, how it travels.

The worker (``python -m reshard_svc.worker``), the server and the CLI all speak it:

- :class:`ConvertSpec` — source, target, mesh, rules, format, dtype (and what keeps its
  dtype), budgets, strategy, checksum, ``nodes`` × ``workers_per_node``.
  :meth:`ConvertSpec.checked` is the only place sizes, meshes, dtypes and choices are
  parsed; a bad value raises :class:`UsageError` naming the field. ``runtime.convert``
  runs a spec (``Conversion(spec)``), the server stores one, the CLI builds one.
- :meth:`ConvertSpec.worker_argv` / :meth:`ConvertSpec.from_argv` — the worker's command
  line, both ways (``from_argv(worker_argv(s)[2:]) == s``); every launcher starts the
  worker with it.
- Progress events — ``progress``, ``done`` and ``error`` records (:func:`check_event`),
  written as JSON lines (:func:`read_events` tolerates a half-written last line) and posted
  to the server by :mod:`reshard_svc.jobs.events`.

This module imports neither torch nor the server, so anything may use it cheaply.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from reshard_svc.errors import UsageError
from reshard_svc.layout.mesh import MAX_MESH_SIZE

__all__ = [
    "CHECKSUMS",
    "DEQUANTIZE",
    "DTYPES",
    "EVENT_KINDS",
    "FORMATS",
    "STRATEGIES",
    "WORKER_MODULE",
    "ConvertSpec",
    "Format",
    "Strategy",
    "check_event",
    "format_mesh",
    "check_count",
    "latest_events",
    "parse_dtype",
    "parse_mesh",
    "parse_rules",
    "parse_size",
    "read_events",
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
#: The module every launcher runs on every worker (``python -m reshard_svc.worker``).
WORKER_MODULE = "reshard_svc.worker"
#: What ``dtype`` may cast floating-point tensors to (short name -> accepted spellings).
DTYPES = {
    "bf16": ("bf16", "bfloat16"),
    "fp16": ("fp16", "float16", "half"),
    "fp32": ("fp32", "float32", "float"),
    "fp64": ("fp64", "float64", "double"),
}
EVENT_KINDS = ("progress", "done", "error")
MAX_WORKERS = 1 << 16
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:[eE]\+?(\d+))?\s*([A-Za-z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_size(text: str | int | None, what: str = "size") -> int | None:
    """``1GiB``, ``1Gi`` (Kubernetes), ``512MB``, ``1e9`` or an int -> a positive byte count."""
    if text is None:
        return None
    if isinstance(text, bool):
        raise UsageError(f"{what} {text!r} must be a byte count or a size like 1GiB")
    if isinstance(text, int):
        if text <= 0:
            raise UsageError(f"{what} {text} must be positive")
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(3).lower() not in _UNITS:
        raise UsageError(
            f"{what} {text!r} is not a size: use a positive number and a unit, e.g. 512MiB or 1GiB"
        )
    value = float(m.group(1)) * 10 ** int(m.group(2) or 0) * _UNITS[m.group(3).lower()]
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"{what} {text!r} must be at least one byte")
    return int(value)


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


@dataclass(frozen=True, kw_only=True)
class ConvertSpec:
    """One conversion: ``source`` -> ``target`` on ``nodes`` × ``workers_per_node`` workers."""

    source: str
    target: str
    mesh: dict[str, int] | None = None
    rules: dict[str, str | list[str]] | None = None
    format: Format = Format.NATIVE
    dtype: str | None = None
    #: tensor-name globs whose dtype a cast leaves alone (0-dim scalars never cast)
    keep_dtype: list[str] | None = None
    strategy: Strategy = Strategy.AUTO
    checksum: str = "crc32c"
    max_memory: str | None = None
    max_shard_size: str | None = None
    nodes: int = 1
    workers_per_node: int = 1
    overwrite: bool = False
    only: list[str] | None = None
    strip_prefix: str | None = None
    #: ``FROM_GLOB=TO_PATTERN`` rules applied, in order, before ``only``/``strip_prefix``
    rename: list[str] | None = None
    #: split Megatron-style stacked ``layers``/``experts`` axes into per-layer names first
    split_layers: bool = False
    #: ``fp8-block``: FP8 weights times their 128x128 block scales, cast to ``dtype`` (bf16
    #: by default); the scales are dropped (see :mod:`reshard_svc.plan.quant`)
    dequantize: str | None = None
    #: an HF export copies the source's config and tokenizer files (when it has them)
    copy_config: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def workers(self) -> int:
        return self.nodes * self.workers_per_node

    # ---- validation: the one place values are parsed

    def checked(self) -> ConvertSpec:
        """A normalised copy, or :class:`UsageError` naming the field to fix."""
        parse_size(self.max_memory, "max_memory")
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

    # ---- checks that need no worker

    def check_paths(self, storage_options: Mapping[str, Any] | None = None) -> None:
        """A :class:`UsageError` when the source and the target are the same folder."""
        from reshard_svc.storage import open_storage

        a = open_storage(self.source, storage_options)
        b = open_storage(self.target, storage_options)
        if type(a) is type(b) and a.root.rstrip("/") == b.root.rstrip("/"):
            raise UsageError(
                f"source and target are the same folder ({self.source}): convert into a new target"
            )

    def preflight(self, storage_options: Mapping[str, Any] | None = None) -> None:
        """What can be refused before any worker starts: the same folder twice, a
        committed target without ``overwrite``, a folder that is not a checkpoint, a model
        folder's weights without ``overwrite``. (The run checks the target again, under
        its lease.)"""
        from reshard_svc.format.hf import check_model_folder
        from reshard_svc.storage import open_storage

        self.check_paths(storage_options)
        target: Any = open_storage(self.target, storage_options)
        hf = self.format == Format.HF
        target.check_target(self.overwrite, foreign_ok=hf)
        if hf:
            check_model_folder(target, self.overwrite)

    # ---- the worker's argument list, both ways

    def worker_argv(self, **options: str | None) -> list[str]:
        """``-m reshard_svc.worker convert SRC DST --flag value ...``: what every launcher
        runs on every worker (after ``python``, or after ``torchrun`` and its options).

        ``options`` are per-run extras such as ``progress_file``.
        """
        return ["-m", WORKER_MODULE, *self.to_argv(**options)]

    def to_argv(self, **options: str | None) -> list[str]:
        """``convert SRC DST --flag value ...``: the worker's arguments (see
        :meth:`worker_argv`)."""
        argv = [
            "convert",
            self.source,
            self.target,
            "--format",
            str(self.format),
            "--strategy",
            str(self.strategy),
            "--checksum",
            self.checksum,
        ]
        if self.mesh:
            argv += ["--mesh", format_mesh(self.mesh)]
        if self.rules:
            argv += ["--rules", json.dumps(self.rules)]
        if self.overwrite:
            argv.append("--overwrite")
        for glob in self.only or ():
            argv += ["--only", glob]
        if self.split_layers:
            argv.append("--split-layers")
        for rule in self.rename or ():
            argv += ["--rename", rule]
        for glob in self.keep_dtype or ():
            argv += ["--keep-dtype", glob]
        if not self.copy_config:
            argv.append("--no-copy-config")
        for flag, value in (
            ("--dtype", self.dtype),
            ("--dequantize", self.dequantize),
            ("--max-memory", self.max_memory),
            ("--max-shard-size", self.max_shard_size),
            ("--strip-prefix", self.strip_prefix),
            *((f"--{k.replace('_', '-')}", v) for k, v in options.items()),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return argv

    @classmethod
    def from_argv(cls, argv: list[str], nodes: int = 1, workers_per_node: int = 1) -> ConvertSpec:
        args = build_parser().parse_args(argv)
        return cls.from_args(args, nodes, workers_per_node)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, nodes: int = 1, workers_per_node: int = 1
    ) -> ConvertSpec:
        rules: Any = args.rules
        if rules is not None:
            stripped = rules.strip()
            if stripped.startswith(("{", "[")):
                try:
                    rules = json.loads(stripped)
                except json.JSONDecodeError as e:
                    raise UsageError(f"--rules is not valid JSON: {e}") from None
            from reshard_svc.errors import LayoutError
            from reshard_svc.plan.rules import load_rules

            try:
                rules = dict(load_rules(rules))
            except LayoutError as e:
                raise UsageError(str(e)) from None
        return cls(
            source=args.src,
            target=args.dst,
            mesh=parse_mesh(args.mesh),
            rules=rules,
            format=args.format,
            dtype=args.dtype,
            strategy=args.strategy,
            checksum="none" if args.no_checksum else args.checksum,
            max_memory=args.max_memory,
            max_shard_size=args.max_shard_size,
            nodes=nodes,
            workers_per_node=workers_per_node,
            overwrite=args.overwrite,
            only=args.only,
            strip_prefix=args.strip_prefix,
            keep_dtype=args.keep_dtype,
            copy_config=not args.no_copy_config,
            rename=args.rename,
            split_layers=args.split_layers,
            dequantize=args.dequantize,
            extra={"progress_file": args.progress_file},
        ).checked()


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line (``python -m reshard_svc.worker convert ...``)."""
    ap = argparse.ArgumentParser(
        prog="python -m reshard_svc.worker",
        description="Run one conversion on this worker; start every worker with torchrun.",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert SRC into DST")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--mesh", help="target mesh, e.g. tp=4 or dp=2,tp=4")
    c.add_argument("--rules", help="YAML/JSON file (or inline JSON): tensor glob -> placements")
    c.add_argument("--format", choices=FORMATS, default="native")
    c.add_argument("--dtype", help="cast floating-point tensors on the fly: bf16, fp16, fp32, fp64")
    c.add_argument(
        "--dequantize",
        choices=DEQUANTIZE,
        help="fp8-block: FP8 weights times their 128x128 block scales, cast to --dtype "
        "(default bf16); the scales are dropped",
    )
    c.add_argument("--strategy", choices=STRATEGIES, default="auto")
    c.add_argument("--max-memory", help="byte budget per worker, e.g. 1GiB")
    c.add_argument("--max-shard-size", help="HF export: cap per file, e.g. 5GB")
    c.add_argument(
        "--checksum",
        choices=CHECKSUMS,
        default="crc32c",
        help="what the output records: block CRC32Cs (default), plus sha256, or none",
    )
    c.add_argument("--no-checksum", action="store_true", help=argparse.SUPPRESS)
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a committed checkpoint at DST (other files there are kept)",
    )
    c.add_argument(
        "--only",
        action="append",
        metavar="GLOB",
        help="keep only tensors matching this glob (repeatable), e.g. 'model.*'",
    )
    c.add_argument(
        "--rename",
        action="append",
        metavar="FROM_GLOB=TO_PATTERN",
        help="rename tensors before --only/--strip-prefix (repeatable), e.g. "
        "'layers.*.wq.weight=model.layers.*.q_proj.weight'",
    )
    c.add_argument(
        "--split-layers",
        action="store_true",
        help="split stacked layers/experts axes (Megatron-Core) into per-layer names",
    )
    c.add_argument(
        "--strip-prefix", metavar="PREFIX", help="drop this prefix from tensor names, e.g. 'model.'"
    )
    c.add_argument(
        "--keep-dtype",
        action="append",
        metavar="GLOB",
        help="with --dtype: leave tensors matching this glob as they are (repeatable)",
    )
    c.add_argument(
        "--no-copy-config",
        action="store_true",
        help="--format hf: do not copy the source's config and tokenizer files",
    )
    c.add_argument("--progress-file", help="rank 0 appends JSON progress lines here")
    return ap


# ---------------------------------------------------------------- progress events

_EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "progress": {"bytes_done": int, "bytes_total": int, "tensors_done": int, "tensors_total": int},
    "done": {
        "strategy": str,
        "seconds": (int, float),
        "bytes_read": int,
        "bytes_written": int,
        "bytes_exchanged": int,
        "tensors": int,
    },
    "error": {"error": str},
}


#: Fields an event may carry: a done event says how many tensors a cast changed or kept.
_OPTIONAL_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "done": {"cast": int, "kept": int, "dequantized": int},
}


def check_event(record: Any) -> dict[str, Any]:
    """A well-formed event (``event`` in :data:`EVENT_KINDS` with its fields), or UsageError."""
    if not isinstance(record, Mapping):
        raise UsageError("an event must be a JSON object")
    kind = record.get("event")
    if kind not in _EVENT_FIELDS:
        raise UsageError(f"event {kind!r} must be one of {', '.join(EVENT_KINDS)}")
    out: dict[str, Any] = {"event": kind}
    optional = _OPTIONAL_FIELDS.get(kind, {})
    for name, typ in {**_EVENT_FIELDS[kind], **optional}.items():
        value = record.get(name)
        if name in optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, typ):
            raise UsageError(f"{kind} event: {name} is missing or not a {typ}")
        if isinstance(value, int | float) and value < 0:
            raise UsageError(f"{kind} event: {name} must not be negative")
        out[name] = value[:4000] if isinstance(value, str) else value
    if isinstance(record.get("time"), int | float):
        out["time"] = record["time"]
    return out


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every well-formed event in a JSON-lines file; a half-written last line is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(check_event(json.loads(line)))
        except (json.JSONDecodeError, UsageError):
            continue
    return events


def latest_events(
    events: Iterable[dict[str, Any]],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(newest ``progress`` event, first ``done``/``error`` event)."""
    progress = final = None
    for ev in events:
        if ev["event"] == "progress":
            progress = ev
        elif final is None:
            final = ev
    return progress, final
