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
    """Every setting, its environment variable and default (docs/control-plane.md explains them)."""
    lines = ["settings (environment variables; docs/control-plane.md explains them):"]
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
    ap.epilog = "users and tokens: reshard-server token add|list|revoke (--help for each)\n\n" + (
        ap.epilog or ""
    )
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


def _token_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="reshard-server token",
        description="Manage users' API tokens in the auth file (RESHARD_AUTH_FILE). Only "
        "hashes are stored; a running server sees changes on its next request.",
    )
    ap.add_argument("--auth-file", default=None, help="default: $RESHARD_AUTH_FILE")
    sub = ap.add_subparsers(dest="action", required=True)
    add = sub.add_parser("add", help="a new token for USER, printed once")
    add.add_argument("user")
    add.add_argument(
        "--scopes",
        default="read,submit,cancel",
        help="comma-separated: read, submit, cancel, admin (default: read,submit,cancel)",
    )
    add.add_argument(
        "--roots",
        default=None,
        help="comma-separated paths or URI prefixes, within RESHARD_ROOTS (default: all of them)",
    )
    add.add_argument("--max-running", type=int, default=None, help="the user's running jobs")
    add.add_argument("--max-queued", type=int, default=None, help="the user's queued jobs")
    lst = sub.add_parser("list", help="users, their scopes, roots, quotas and token ids")
    lst.add_argument("--json", action="store_true")
    rev = sub.add_parser("revoke", help="remove a token (by the id `list` shows)")
    rev.add_argument("token_id")
    return ap


def token_main(argv: list[str]) -> None:
    """``reshard-server token add|list|revoke``."""
    import json

    from reshard_server.auth import SCOPES, AuthFile, AuthFileError

    args = _token_parser().parse_args(argv)
    path = args.auth_file or Settings().auth_file
    if not path:
        _fail("no auth file: set RESHARD_AUTH_FILE or pass --auth-file")
    auth = AuthFile(path)
    try:
        if args.action == "add":
            scopes = [s.strip() for s in args.scopes.split(",") if s.strip()]
            bad = [s for s in scopes if s not in SCOPES]
            if bad or not scopes:
                _fail(
                    f"unknown scope(s) {', '.join(bad) or '(none given)'}; choose from "
                    f"{', '.join(SCOPES)}"
                )
            roots = [r.strip() for r in args.roots.split(",") if r.strip()] if args.roots else None
            for what, v in (("--max-running", args.max_running), ("--max-queued", args.max_queued)):
                if v is not None and v < 0:
                    _fail(f"{what} must be 0 or more")
            token, token_id = auth.add_token(
                args.user, scopes, roots, args.max_running, args.max_queued
            )
            sys.stderr.write(f"token {token_id} for {args.user} (shown once; store it now):\n")
            sys.stdout.write(token + "\n")
        elif args.action == "list":
            users = auth.load_raw()["users"]
            rows = [
                {
                    "user": name,
                    "scopes": e["scopes"],
                    "roots": e.get("roots"),
                    "max_running": e.get("max_running"),
                    "max_queued": e.get("max_queued"),
                    "tokens": [{"id": t["id"], "created": t.get("created")} for t in e["tokens"]],
                }
                for name, e in sorted(users.items())
            ]
            if args.json:
                sys.stdout.write(json.dumps(rows, indent=2) + "\n")
                return
            for r in rows:
                shown = ",".join(r["roots"]) if r["roots"] is not None else "(all roots)"
                ids = ",".join(t["id"] for t in r["tokens"]) or "(no tokens)"
                sys.stdout.write(
                    f"{r['user']}\t{','.join(r['scopes'])}\t{shown}\t"
                    f"running={r['max_running']}\tqueued={r['max_queued']}\t"
                    f"tokens={ids}\n"
                )
        else:
            try:
                user = auth.revoke(args.token_id)
            except KeyError:
                _fail(f"no token with id {args.token_id!r} (see `reshard-server token list`)")
            sys.stdout.write(f"revoked token {args.token_id} of {user}\n")
    except AuthFileError as e:
        _fail(str(e))
    except OSError as e:
        _fail(f"cannot use the auth file {path}: {e}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["token"]:
        return token_main(argv[1:])
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
    if settings.auth_file:
        from reshard_server.auth import AuthFile

        problem = AuthFile(settings.auth_file).error
        if problem:
            _fail(f"RESHARD_AUTH_FILE: {problem}")
    if settings.jwt_issuer:
        from reshard_server.auth import jwt_verifier

        try:
            jwt_verifier(settings)
        except Exception as e:  # a missing or malformed JWKS: say so, no traceback
            _fail(f"RESHARD_JWT_*: {e}")
    if not (settings.auth_file or settings.token or settings.jwt_issuer):
        log.warning(
            "RESHARD_TOKEN is empty and neither RESHARD_AUTH_FILE nor "
            "RESHARD_JWT_ISSUER is set: every API call will be refused"
        )
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
