"""The forms an option of the job contract takes: one small type each.

A :class:`Form` knows everything about one kind of value, in every place an option of
:class:`~reshard_svc.jobs.spec.ConvertSpec` appears:

* :meth:`Form.check` — the value parsed and normalised (:meth:`ConvertSpec.checked`), or
  :class:`~reshard_svc.errors.UsageError` naming the field;
* :meth:`Form.from_text` — what a person typed on a command line, as the field's value;
* :meth:`Form.argv` / :meth:`Form.add_argument` — the worker's command line both ways
  (:mod:`reshard_svc.jobs.argv`);
* :meth:`Form.cli` — the CLI's typer option: its type, default and extra settings
  (``reshard_client.cli``);
* :meth:`Form.json_field`, :meth:`Form.before_json`, :meth:`Form.after_json` — the field of
  a JSON body and its validators (``reshard_server.schemas``; pydantic is imported only
  when a model is built).

Adding a kind of option is one new subclass; nothing else switches on forms. This module
does no I/O and imports neither torch nor the server.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal

from reshard_svc.errors import UsageError
from reshard_svc.layout.mesh import MAX_MESH_SIZE
from reshard_svc.plan.budget import parse_size

__all__ = [
    "DEQUANTIZE",
    "DTYPES",
    "MAX_WORKERS",
    "Choice",
    "Count",
    "Dtype",
    "Flag",
    "Form",
    "List",
    "Mesh",
    "Negated",
    "Renames",
    "Rules",
    "Size",
    "Text",
    "check_count",
    "format_mesh",
    "parse_dtype",
    "parse_mesh",
    "parse_rules",
]

#: What ``dtype`` may cast floating-point tensors to (short name -> accepted spellings).
DTYPES = {
    "bf16": ("bf16", "bfloat16"),
    "fp16": ("fp16", "float16", "half"),
    "fp32": ("fp32", "float32", "float"),
    "fp64": ("fp64", "float64", "double"),
}
#: What ``dequantize`` accepts (:data:`reshard_svc.plan.quant.DEQUANTIZE`, without torch).
DEQUANTIZE = ("fp8-block",)
MAX_WORKERS = 1 << 16
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---- parsing the values


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


# ---- the forms


@dataclass(frozen=True)
class Form:
    """Free text (at most 1024 characters): the base every form refines."""

    #: the command line turns the field *off* when its flag is given (``--no-...``)
    negated: ClassVar[bool] = False

    def check(self, name: str, value: Any) -> Any:
        return _text(name, value)

    def from_text(self, value: Any, *, files: bool) -> Any:
        return value

    def argv(self, flag: str, value: Any) -> list[str]:
        return [] if value is None else [flag, str(value)]

    def add_argument(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        default: Any,
        metavar: str | None,
        help: str,
    ) -> None:
        parser.add_argument(flag, metavar=metavar, help=help)

    def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
        """The typer option's type, default, and settings beyond flag, help and metavar."""
        return str | None, None, {}

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        """The JSON body field: its type and its pydantic ``Field`` (described by ``text``)."""
        from pydantic import Field

        return str | None, Field(default=None, min_length=1, max_length=1024, description=text)

    def before_json(self, value: Any) -> Any:
        """A JSON value before pydantic reads it as :meth:`json_field`'s type."""
        return value

    def after_json(self, name: str, value: Any) -> Any:
        """A JSON value once typed (never None): checked as :meth:`check` checks it."""
        return value


Text = Form


@dataclass(frozen=True)
class Dtype(Form):
    """A cast target: ``bf16``, ``fp16``, ``fp32`` or ``fp64`` (aliases accepted)."""

    def check(self, name: str, value: Any) -> Any:
        return parse_dtype(value)

    def after_json(self, name: str, value: Any) -> Any:
        return parse_dtype(value)


@dataclass(frozen=True)
class Size(Form):
    """A byte size as typed (``1GiB``, ``5GB``, ``1e9``): checked, carried as text."""

    def check(self, name: str, value: Any) -> Any:
        parse_size(value, name)
        return value

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field

        return str | None, Field(default=None, max_length=32, description=text)

    def after_json(self, name: str, value: Any) -> Any:
        parse_size(value, name)
        return value


@dataclass(frozen=True)
class Choice(Form):
    """One of ``choices``; ``kind`` (a StrEnum) is what the spec holds, when it has one."""

    choices: tuple[str, ...]
    kind: type[StrEnum] | None = None
    #: None is a value (nothing chosen)
    optional: bool = False

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        chosen = _choice(name, value, self.choices)
        return self.kind(chosen) if self.kind is not None else chosen

    def add_argument(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        default: Any,
        metavar: str | None,
        help: str,
    ) -> None:
        parser.add_argument(flag, choices=self.choices, default=default, help=help)

    def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
        return (str | None, None, {}) if default is None else (str, str(default), {})

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field

        kind: Any = Literal[self.choices]  # type: ignore[valid-type]
        if default is None:
            return kind | None, Field(default=None, description=text)
        return kind, Field(default=str(default), description=text)


@dataclass(frozen=True)
class Flag(Form):
    """Off unless given (``--overwrite``)."""

    def check(self, name: str, value: Any) -> Any:
        return _flag(name, value)

    def argv(self, flag: str, value: Any) -> list[str]:
        return [flag] if value else []

    def add_argument(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        default: Any,
        metavar: str | None,
        help: str,
    ) -> None:
        parser.add_argument(flag, action="store_true", help=help)

    def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
        return bool, False, {}

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field, StrictBool

        return StrictBool, Field(default=default, description=text)


@dataclass(frozen=True)
class Negated(Flag):
    """On unless ``--no-...`` is given (``--no-copy-config``); JSON bodies say true/false."""

    negated: ClassVar[bool] = True

    def from_text(self, value: Any, *, files: bool) -> Any:
        return False  # given: turned off

    def argv(self, flag: str, value: Any) -> list[str]:
        return [] if value else [flag]


@dataclass(frozen=True)
class List(Form):
    """Repeatable (``--only a --only b``): up to 1000 tensor-name globs; ``required``: at
    least one when given."""

    required: bool = False

    def check(self, name: str, value: Any) -> Any:
        return _glob_list(name, value, required=self.required)

    def from_text(self, value: Any, *, files: bool) -> Any:
        return list(value)

    def argv(self, flag: str, value: Any) -> list[str]:
        return [part for item in value or () for part in (flag, item)]

    def add_argument(
        self,
        parser: argparse.ArgumentParser,
        flag: str,
        default: Any,
        metavar: str | None,
        help: str,
    ) -> None:
        parser.add_argument(flag, action="append", metavar=metavar, help=help)

    def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
        return list[str] | None, None, {}

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from typing import Annotated

        from pydantic import Field

        glob = Annotated[str, Field(min_length=1, max_length=1024)]
        return list[glob] | None, Field(default=None, max_length=1000, description=text)  # type: ignore[valid-type]


@dataclass(frozen=True)
class Renames(List):
    """Repeatable ``FROM=TO`` rules; a person's command line may also name YAML/JSON files
    of them (``files``: the worker's holds the rules themselves)."""

    def check(self, name: str, value: Any) -> Any:
        from reshard_svc.plan.names import parse_renames

        rules = parse_renames(value)
        return [str(r) for r in rules] if rules else None

    def from_text(self, value: Any, *, files: bool) -> Any:
        if not files:
            return list(value)
        from reshard_svc.plan.names import load_renames

        return [str(r) for r in load_renames(list(value)) or ()] or None


@dataclass(frozen=True)
class Count(Form):
    """A whole number from 1 to ``high`` (a JSON body: to :data:`MAX_WORKERS`);
    ``optional``: None is a value too (unset: decided where it is used)."""

    high: int = 4096
    optional: bool = False

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        return check_count(name, value, self.high)

    def from_text(self, value: Any, *, files: bool) -> Any:
        text = value.strip() if isinstance(value, str) else None
        return int(text) if text is not None and text.isdigit() else value

    def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
        return int | None, None, {"min": 1}

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field, StrictInt

        unset = "" if default is None else f" (default {default})"
        return StrictInt | None, Field(default=None, description=text + unset)

    def after_json(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return None
        return check_count(name, value, MAX_WORKERS)


@dataclass(frozen=True)
class Mesh(Form):
    """Named dims: ``dp=2,tp=4`` on a command line, ``{"dp": 2, "tp": 4}`` in JSON."""

    def check(self, name: str, value: Any) -> Any:
        return parse_mesh(value)

    def from_text(self, value: Any, *, files: bool) -> Any:
        return parse_mesh(value)

    def argv(self, flag: str, value: Any) -> list[str]:
        return [] if value is None else [flag, format_mesh(value)]

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field, StrictInt

        return dict[str, StrictInt] | None, Field(default=None, description=text)

    def before_json(self, value: Any) -> Any:
        return parse_mesh(value) if isinstance(value, dict) else value


@dataclass(frozen=True)
class Rules(Form):
    """Tensor-name glob -> placements: a YAML/JSON file or inline JSON on a command line, a
    JSON object in a body."""

    def check(self, name: str, value: Any) -> Any:
        return parse_rules(value)

    def from_text(self, value: Any, *, files: bool) -> Any:
        from reshard_svc.errors import LayoutError
        from reshard_svc.plan.rules import load_rules

        try:
            return dict(load_rules(value))
        except LayoutError as e:
            raise UsageError(str(e)) from None

    def argv(self, flag: str, value: Any) -> list[str]:
        return [] if value is None else [flag, json.dumps(value)]

    def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
        from pydantic import Field

        return dict[str, str | list[str]] | None, Field(default=None, description=text)

    def after_json(self, name: str, value: Any) -> Any:
        return parse_rules(value)
