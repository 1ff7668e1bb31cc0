"""The ``reshard`` app and what its commands share: the consoles, the error line, sizes,
the options ``convert`` and ``submit`` both take. Imports no other part of the CLI."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console

__all__ = [
    "DequantizeOpt",
    "OnlyOpt",
    "OverwriteOpt",
    "RenameOpt",
    "SplitLayersOpt",
    "StripPrefixOpt",
    "app",
    "err",
    "fail",
    "main",
    "out",
    "parse_mesh_option",
    "parse_rules_option",
    "size_text",
]

# Options that `convert` (local.py) and `submit` (jobs.py) share, spelled once.
OverwriteOpt = Annotated[
    bool,
    typer.Option(
        "--overwrite", help="Replace a committed checkpoint at DST (other files are kept)."
    ),
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option(help="Keep only tensors matching this glob (repeatable), e.g. 'model.*'."),
]
RenameOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="FROM_GLOB=TO_PATTERN",
        help="Rename tensors before --only/--strip-prefix (repeatable; or a YAML file of "
        "FROM: TO), e.g. 'layers.*.wq.weight=model.layers.*.self_attn.q_proj.weight'.",
    ),
]
SplitLayersOpt = Annotated[
    bool,
    typer.Option(
        "--split-layers",
        help="Split Megatron-Core's stacked layers/experts axes into per-layer tensors "
        "(decoder.layers.mlp.linear_fc1.weight [L, ...] -> decoder.layers.{i}.mlp...), "
        "before --rename.",
    ),
]
DequantizeOpt = Annotated[
    str | None,
    typer.Option(
        help="fp8-block: dequantize block-scaled FP8 weights (x their *_scale_inv per "
        "128x128 block, in float32) to --dtype (default bf16) and drop the scales. Without "
        "it, FP8 tensors and their scales keep their dtype under --dtype."
    ),
]
StripPrefixOpt = Annotated[
    str | None, typer.Option(help="Drop this prefix from tensor names, e.g. 'model.'.")
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


#: box colours, cycled (distinct on dark and light terminals)
def parse_mesh_option(mesh: str | None) -> dict[str, int] | None:
    from reshard_svc.plan.spec import parse_mesh

    return parse_mesh(mesh) if mesh else None


def parse_rules_option(rules: str | None) -> dict[str, Any] | None:
    if not rules:
        return None
    from reshard_svc.plan.rules import load_rules

    return dict(load_rules(rules))


def main(argv: list[str] | None = None) -> Any:
    """Console-script entry point."""
    return app(args=argv)
