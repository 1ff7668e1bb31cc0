"""moto's S3 server, with its conditional writes made atomic as S3's are.

Real S3 applies a conditional ``PutObject`` or ``DeleteObject`` (``If-Match``,
``If-None-Match: *``) atomically: of two creates of one key, one gets 412. moto 5.2 checks
the condition and then writes, with nothing held between (``S3Response.put_object``), and
its server is threaded, so two concurrent creates can both succeed. That is a race real S3
never has; CI met it as two converts that both held one target's lease.

This runs moto's own server app (``python -m tests.support.moto_s3 -H HOST -p PORT``) with
one lock held across each conditional request; every other request stays concurrent.
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.threaded_moto_server import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import run_simple

CONDITIONS = ("HTTP_IF_MATCH", "HTTP_IF_NONE_MATCH")


class AtomicConditions:
    """WSGI middleware: a request with a write condition runs alone among such requests."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("REQUEST_METHOD") in ("PUT", "DELETE", "POST") and any(
            h in environ for h in CONDITIONS
        ):
            with self.lock:
                return list(self.app(environ, start_response))
        return self.app(environ, start_response)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(
        args.host,
        args.port,
        AtomicConditions(app),
        threaded=True,
        request_handler=MotoRequestHandler,
    )


if __name__ == "__main__":
    main()
