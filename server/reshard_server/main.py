"""``reshard-server``: serve the control plane with uvicorn.

Start-up order: take the job database's lock (a second server on the same database stops
here, naming the first, and touches nothing), bind the port (a port clash is found
before any job is looked at), then serve; the jobs a previous process left running are
re-attached in the background, so ``/healthz`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from reshard_server.config import Settings

__all__ = ["main"]


def _settings_help() -> str:
    """Every setting, its environment variable and default (the README has the table)."""
    lines = ["settings (environment variables; the README's 'The control plane' explains them):"]
    for name, field in Settings.model_fields.items():
        default = field.default if field.default_factory is None else field.default_factory()  # type: ignore[call-arg]
        shown = ",".join(default) if isinstance(default, list) else default
        desc = f"  {field.description}" if field.description else ""
        lines.append(f"  RESHARD_{name.upper():<26} default {shown!r}{desc}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    from reshard_svc._version import __version__

    ap = argparse.ArgumentParser(
        prog="reshard-server",
        description="Run checkpoint conversion jobs behind a REST API (one server per job "
        "database).",
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="port (default 8000)")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--version", action="version", version=f"reshard-server {__version__}")
    return ap


def _fail(message: str) -> None:
    sys.stderr.write(f"reshard-server: error: {message}\n")
    raise SystemExit(1)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        _fail(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    overrides: dict[str, Any] = {
        k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None
    }
    try:
        settings = Settings(**overrides)
    except Exception as e:  # a bad RESHARD_* value: say which, no traceback
        _fail(f"bad settings: {e}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    log = logging.getLogger("reshard_server")
    from reshard_server.db import DatabaseInUse, ServerLock

    try:
        lock = ServerLock(settings.db)
    except DatabaseInUse as e:
        _fail(str(e))
    sock = _bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    lock.bound(f"http://{host}:{port}")
    if not settings.token:
        log.warning("RESHARD_TOKEN is empty: every API call will be refused")
    if not settings.roots:
        log.warning(
            "RESHARD_ROOTS is empty: every job will be refused; set the comma-separated "
            "paths or URI prefixes jobs may read and write"
        )
    log.info("jobs in %s, logs in %s", settings.db, settings.data_dir)
    import uvicorn

    from reshard_server.app import create_app

    app = create_app(settings, lock=lock)
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
