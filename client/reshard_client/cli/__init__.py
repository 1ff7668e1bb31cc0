"""The ``reshard`` command line.

Local commands (``inspect``, ``verify``, ``convert``, ``gc``, ``steps``, ``plan``) are in
:mod:`~reshard_client.cli.local` and call reshard_svc directly; the server's commands are
in :mod:`~reshard_client.cli.jobs`. Both register on the one ``app`` of
:mod:`~reshard_client.cli._app` and import nothing else of the CLI; only this package's
``__init__`` imports them all. Exit codes: 0 ok, 1 the checkpoint has problems (verify) or
the job did not succeed, 2 bad input or an error.
"""

from __future__ import annotations

from reshard_client.cli._app import app, main

# isort: off
# the order the commands register in is the order --help lists them: local ones first
from reshard_client.cli import local
from reshard_client.cli import jobs

# isort: on


def _one_line_summaries() -> None:
    """``reshard --help`` lists each command by the first paragraph of its docstring; a
    docstring wraps at 100 columns, so its line breaks would reach the terminal: join them
    (rich wraps the line to the terminal's width)."""
    for info in app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if info.short_help is None and doc:
            info.short_help = " ".join(doc.strip().split("\n\n")[0].split())


_one_line_summaries()

__all__ = ["app", "jobs", "local", "main"]
