"""A fault-injecting HTTP proxy for the moto S3 server: what a throttled store does.

Each request, at random (seeded):

* with probability ``slowdown``, it is answered ``503 SlowDown`` and never reaches the store;
* with probability ``lose``, it is forwarded (so it takes effect) and then the connection is
  dropped without an answer: the client cannot tell whether it happened.

A completion whose answer was lost is then answered ``404 NoSuchUpload`` when retried, as
S3 does once an upload is complete. Everything else is forwarded as is. The proxy speaks plain HTTP/1.1 with keep-alive and
de-chunks chunked request bodies before forwarding them.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
NO_SUCH_UPLOAD = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchUpload</Code>'
    b"<Message>The specified upload does not exist.</Message></Error>"
)
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        slowdown: float = 0.2,
        lose: float = 0.03,
        seed: int = 0,
        lose_once: tuple[str, ...] = (),
    ):
        """``lose_once``: ``"METHOD substring"`` patterns; the first request matching each
        is forwarded and its answer lost (deterministic faults for the commit steps)."""
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.slowdown, self.lose = slowdown, lose
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.lose_once = list(lose_once)
        #: ``"METHOD substring"`` patterns answered ``503 SlowDown`` every time while listed
        #: (an outage of some requests: set and cleared by a test as it goes)
        self.fail_always: list[str] = []
        #: uploads whose completion answer was lost: S3 answers a retry NoSuchUpload
        self.completed: set[str] = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _fate(self, method: str, path: str) -> str:
        with self.lock:
            for pattern in self.lose_once:
                want_method, _, part = pattern.partition(" ")
                if method == want_method and part in path:
                    self.lose_once.remove(pattern)
                    self.counts[f"lost {pattern}"] += 1
                    if method == "POST" and "uploadId=" in path:
                        self.completed.add(path)
                    return "lose"
            for pattern in self.fail_always:
                want_method, _, part = pattern.partition(" ")
                if method == want_method and part in path:
                    self.counts[f"failed {pattern}"] += 1
                    return "slowdown"
            if method == "POST" and path in self.completed:
                self.counts["no such upload"] += 1
                return "nosuchupload"
            x = self.rng.random()
            fate = (
                "slowdown"
                if x < self.slowdown
                else "lose"
                if x < self.slowdown + self.lose
                else "ok"
            )
            self.counts[fate] += 1
            return fate

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _any(self) -> None:
                body = self._body()
                fate = proxy._fate(self.command, self.path)
                if fate == "slowdown":
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN_BODY)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOWDOWN_BODY)
                    return
                if fate == "nosuchupload":
                    self.send_response(404)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(NO_SUCH_UPLOAD)))
                    self.end_headers()
                    self.wfile.write(NO_SUCH_UPLOAD)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if fate == "lose":  # it happened; the client never hears of it
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        return Handler
