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

__all__ = ["app", "jobs", "local", "main"]
