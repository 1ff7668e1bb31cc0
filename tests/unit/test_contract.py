"""The job contract is declared once: every other spelling of the options agrees with it.

:class:`reshard_svc.jobs.spec.ConvertSpec` declares each option (name, default, help,
form). The worker's command line, the CLI's ``convert``, ``plan``, ``submit`` and ``watch``,
the server's request models and ``reshard_svc.convert(**options)`` are made from it or
checked against it here; :func:`disagreements` is shown to find a wrong one.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Annotated, Any

import click
import pytest
import typer
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard_svc
from reshard_client.cli import app
from reshard_server.schemas import JobCreate, PlanCreate, WatchCreate
from reshard_svc.jobs.argv import build_parser, from_argv, to_argv
from reshard_svc.jobs.forms import Choice, Count, Flag, Form
from reshard_svc.jobs.spec import WORKERS, ConvertSpec, Format, Strategy, options

LOCAL = {name for name, _, _ in options(placement=False)}
ALL = {name for name, _, _ in options()}


def cli_default(default: Any, form: Form) -> Any:
    """What a command line shows as the default: flags off, choices by value, else unset."""
    if isinstance(form, Flag):  # Negated too
        return False
    if isinstance(form, Choice) and default is not None:
        return str(default)
    return None


def disagreements(params: dict[str, click.Parameter], placement: bool) -> list[str]:
    """How a click command's options differ from the spec's (flag, help, default)."""
    wrong = []
    for name, default, opt in options(placement=placement):
        p = params.get(opt.param(name))
        if p is None:
            wrong.append(f"{name}: missing")
            continue
        if opt.flag(name) not in p.opts:
            wrong.append(f"{name}: flag {p.opts} is not {opt.flag(name)}")
        if getattr(p, "help", None) != opt.flag_help():
            wrong.append(f"{name}: help differs")
        if p.default != cli_default(default, opt.form):
            wrong.append(f"{name}: default {p.default!r}")
    return wrong


def command_params(name: str) -> dict[str, click.Parameter]:
    group = typer.main.get_command(app)
    command = group.commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name}


def test_every_field_is_an_argument_an_option_or_the_extras():
    for f in dataclasses.fields(ConvertSpec):
        declared = "argument" in f.metadata or "option" in f.metadata or f.name == "extra"
        assert declared, f"{f.name}: declare it with _option(...) (help, form)"
    assert len(ALL) >= 18


@pytest.mark.parametrize(
    ("command", "placement"),
    [("convert", False), ("plan", False), ("submit", True), ("watch", True)],
)
def test_the_cli_commands_take_the_spec_options(command, placement):
    params = command_params(command)
    assert disagreements(params, placement) == []
    if placement:  # and the `workers` shorthand of a job body
        assert params["workers"].help == WORKERS.help


def test_a_command_that_disagrees_is_named():
    wrong = typer.Typer()

    @wrong.command()
    def convert(
        mesh: Annotated[str | None, typer.Option(help="some mesh")] = None,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="other words")] = False,
        format: Annotated[
            str, typer.Option(help={n: o for n, _, o in options()}["format"].help)
        ] = "hf",
    ) -> None: ...

    command = typer.main.get_command(wrong)  # one command: the command itself
    found = disagreements({p.name: p for p in command.params if p.name}, placement=False)
    assert "mesh: help differs" in found
    assert "rules: missing" in found
    assert "overwrite: help differs" in found
    assert "format: default 'hf'" in found


def test_the_worker_parser_takes_the_spec_options():
    sub = build_parser()._subparsers._group_actions[0].choices["convert"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in sub._actions}
    for name, default, opt in options(placement=False):
        action = actions[opt.param(name)]
        assert opt.flag(name) in action.option_strings, name
        assert action.help == opt.flag_help(), name
        if isinstance(opt.form, Choice):
            assert tuple(action.choices) == opt.form.choices and action.default == default, name
    assert (
        not {a.dest for a in sub._actions}
        - {opt.param(n) for n, _, opt in options()}
        - {"help", "src", "dst", "no_checksum", "progress_file"}
    )


@pytest.mark.parametrize("model", [JobCreate, PlanCreate, WatchCreate])
def test_the_request_models_take_the_spec_options(model):
    fields = model.model_fields
    for name, default, opt in options():
        f = fields[name]
        assert f.description is not None and f.description.startswith(opt.help), name
        if isinstance(opt.form, Count):
            assert f.default is None, name  # unset: the spec's default, or from `workers`
        else:
            assert f.default == cli_default(default, opt.form) or f.default == default, name
    assert fields["workers"].description == WORKERS.help
    assert set(fields) - ALL <= {
        "source",
        "target",
        "workers",
        "world",
        "load",
        "root",
        "every",
        "existing",
    }


def test_convert_takes_the_spec_options_with_its_defaults():
    params = inspect.signature(reshard_svc.convert).parameters
    for name, default, _ in options(placement=False):
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert params[name].default == default, name


specs = st.builds(
    ConvertSpec,
    source=st.sampled_from(["/a/src", "s3://b/src"]),
    target=st.sampled_from(["/a/dst", "s3://b/dst"]),
    mesh=st.none() | st.sampled_from([{"tp": 2}, {"dp": 2, "tp": 4}]),
    rules=st.none() | st.just({"*.w": "S(0)", "*": ["R", "S(1)"]}),
    format=st.sampled_from(list(Format)),
    dtype=st.none() | st.sampled_from(["bf16", "fp32"]),
    strategy=st.sampled_from(list(Strategy)),
    checksum=st.sampled_from(["crc32c", "sha256", "none"]),
    max_memory=st.none() | st.just("1GiB"),
    max_shard_size=st.none() | st.just("5GB"),
    nodes=st.integers(1, 4),
    workers_per_node=st.integers(1, 8),
    overwrite=st.booleans(),
    only=st.none() | st.just(["model.*", "optim.*"]),
    strip_prefix=st.none() | st.just("model."),
    rename=st.none() | st.just(["a.*=b.*"]),
    split_layers=st.booleans(),
    dequantize=st.none() | st.just("fp8-block"),
    copy_config=st.booleans(),
    io_threads=st.none() | st.integers(1, 64),
    device=st.sampled_from(["auto", "cpu", "cuda"]),
)


@settings(max_examples=60, deadline=None)
@given(specs)
def test_the_worker_argv_carries_every_option(spec):
    spec = dataclasses.replace(spec, keep_dtype=["*norm*"] if spec.dtype else None).checked()
    assert from_argv(to_argv(spec), spec.nodes, spec.workers_per_node) == spec


def test_nothing_switches_on_a_form():
    """Each place an option appears asks its form (``opt.form.argv(...)``...): no module
    compares a form or tests its class, so adding a form is one new class in jobs/forms.py."""
    import ast
    import re
    from pathlib import Path

    import reshard_client
    import reshard_server

    roots = [Path(p.__file__).parent for p in (reshard_svc, reshard_server, reshard_client)]
    wrong = []
    for root in roots:
        for path in root.rglob("*.py"):
            if path.name == "forms.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and re.search(r"\.form\b", ast.unparse(node.left)):
                    wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
                if (
                    isinstance(node, ast.Call)
                    and ast.unparse(node.func) == "isinstance"
                    and re.search(r"\.form\b", ast.unparse(node.args[0]))
                ):
                    wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


def test_a_new_form_is_one_class_that_every_place_takes():
    """A form defined here (a percentage) works on the worker's parser and argv, as a typer
    option and as a JSON field, with nothing else changed."""
    import argparse

    from pydantic import create_model

    from reshard_client.cli._app import _typer_param
    from reshard_svc.errors import UsageError
    from reshard_svc.jobs.forms import Form
    from reshard_svc.jobs.spec import Option

    class Percent(Form):
        def check(self, name: str, value: Any) -> Any:
            if not isinstance(value, int) or not 0 <= value <= 100:
                raise UsageError(f"{name} {value!r} must be 0 to 100")
            return value

        def cli(self, default: Any) -> tuple[Any, Any, dict[str, Any]]:
            return int | None, None, {"min": 0, "max": 100}

        def json_field(self, default: Any, text: str) -> tuple[Any, Any]:
            from pydantic import Field

            return int | None, Field(default=None, ge=0, le=100, description=text)

    opt = Option(help="how much", form=Percent())
    parser = argparse.ArgumentParser()
    opt.form.add_argument(parser, opt.flag("share"), None, opt.metavar, opt.flag_help())
    assert parser.parse_args(opt.form.argv(opt.flag("share"), 40)).share == "40"
    assert opt.form.check("share", 40) == 40
    with pytest.raises(UsageError, match="share"):
        opt.form.check("share", 140)
    param = _typer_param("share", None, opt)
    assert param.name == "share" and param.default is None
    model = create_model("M", share=opt.form.json_field(None, opt.help))
    assert model(share=40).share == 40
    with pytest.raises(ValueError):
        model(share=140)
