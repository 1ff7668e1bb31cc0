"""``reshard-server``: serve the control plane with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from reshard_server.app import create_app
from reshard_server.config import Settings


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="reshard-server",
        description="Run checkpoint conversion jobs behind a REST API. Configure with "
        "RESHARD_TOKEN, RESHARD_ROOTS (comma-separated paths or URI prefixes), RESHARD_DB, "
        "RESHARD_DATA_DIR, RESHARD_MAX_RUNNING, RESHARD_MAX_QUEUED.",
    )
    ap.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=None, help="port (default 8000)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    log = logging.getLogger("reshard_server")
    if not settings.token:
        log.warning("RESHARD_TOKEN is empty: every API call will be refused")
    if not settings.roots:
        log.warning(
            "RESHARD_ROOTS is empty: every job will be refused; set the comma-separated "
            "paths or URI prefixes jobs may read and write"
        )
    log.info("jobs in %s, logs in %s", settings.db, settings.data_dir)
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level
    )


if __name__ == "__main__":
    main()
