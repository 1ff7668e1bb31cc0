"""The ``reshard`` app and what its commands share: the consoles, the error line, sizes,
the options ``convert`` and ``submit`` both take. Imports no other part of the CLI."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from reshard_svc.jobs.spec import Option, options

__all__ = [
    "app",
    "err",
    "fail",
    "main",
    "out",
    "size_text",
    "spec_options",
]

app = typer.Typer(
    name="reshard",
    help="Inspect, verify and reshard PyTorch distributed checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True)  # long lines are not broken (logs, pipes)
err = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        from reshard_svc import __version__

        out.print(f"reshard {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Inspect, verify and reshard PyTorch distributed checkpoints."""


def fail(e: Exception, code: int = 2) -> typer.Exit:
    err.print(f"[bold red]error:[/] {type(e).__name__}: {e}", highlight=False)
    return typer.Exit(code)


def size_text(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return app(args=argv)


F = TypeVar("F", bound=Callable[..., Any])


def _typer_param(name: str, default: Any, opt: Option) -> inspect.Parameter:
    """One ConvertSpec option as a typer option: flag, type, default and help from the spec."""
    kind, value, more = opt.form.cli(default)
    info: dict[str, Any] = {"help": opt.flag_help(), **more}
    if opt.metavar:
        info["metavar"] = opt.metavar
    return inspect.Parameter(
        opt.param(name),
        inspect.Parameter.KEYWORD_ONLY,
        annotation=Annotated[kind, typer.Option(opt.flag(name), **info)],
        default=value,
    )


def spec_options(*, placement: bool) -> Callable[[F], F]:
    """Give a command the options :class:`reshard_svc.jobs.spec.ConvertSpec` declares (after
    its arguments; ``placement``: ``--nodes`` and ``--workers-per-node`` too). The command
    takes them as ``**options``, keyed by :meth:`~reshard_svc.jobs.spec.Option.param`, and
    turns them into spec fields with :func:`~reshard_svc.jobs.spec.options_from_text`."""
    added = [
        _typer_param(name, default, opt) for name, default, opt in options(placement=placement)
    ]

    def wrap(fn: F) -> F:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())
        arguments = [p for p in own if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        rest = [p for p in own if p.kind is inspect.Parameter.KEYWORD_ONLY]
        fn.__signature__ = inspect.Signature([*arguments, *added, *rest])  # type: ignore[attr-defined]
        return fn

    return wrap
