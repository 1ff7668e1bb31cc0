"""Rank 0's progress reporter: events to a JSON-lines file and/or POSTed to the server.

Under ``reshard-server`` the workers find ``RESHARD_CALLBACK_URL`` (the job's event route)
and ``RESHARD_CALLBACK_TOKEN`` (a token the server minted for this job alone) in their
environment. Posts run on a background thread with retries and exponential backoff, so a
slow or restarting server never stalls the conversion, and a lost event never fails it:
the server also takes the final state from the engine (torchrun's exit, Slurm, Kubernetes).

Only the newest ``progress`` event is kept while posts fail; ``done`` and ``error`` are
retried until :meth:`EventReporter.close` gives up (``RESHARD_CALLBACK_TIMEOUT_S``, 30 s).
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from reshard_svc.jobs.environment import CALLBACK_TIMEOUT_ENV, CALLBACK_TOKEN_ENV, CALLBACK_URL_ENV
from reshard_svc.plan.spec import check_event

__all__ = ["EventReporter"]

logger = logging.getLogger(__name__)

_RETRYABLE = {408, 425, 429, 500, 502, 503, 504}


class EventReporter:
    """``send(event)`` appends to ``path`` (if any) and queues a POST to ``url`` (if any)."""

    def __init__(
        self,
        path: str | None = None,
        url: str | None = None,
        token: str | None = None,
        final_timeout_s: float | None = None,
    ) -> None:
        self.path = path
        self.url = url
        self.token = token
        self.final_timeout_s = (
            final_timeout_s
            if final_timeout_s is not None
            else float(os.environ.get(CALLBACK_TIMEOUT_ENV, "30"))
        )
        self._cond = threading.Condition()
        self._pending: list[dict[str, Any]] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self.posted = 0
        self.dropped = 0

    @classmethod
    def from_env(cls, path: str | None = None) -> EventReporter:
        return cls(path, os.environ.get(CALLBACK_URL_ENV), os.environ.get(CALLBACK_TOKEN_ENV))

    def send(self, event: dict[str, Any]) -> None:
        event = {"time": time.time(), **event}
        check_event(event)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(event) + "\n")
        if not self.url:
            return
        with self._cond:
            if event["event"] == "progress":  # only the newest progress matters
                kept = [e for e in self._pending if e["event"] != "progress"]
                self.dropped += len(self._pending) - len(kept)
                self._pending = kept
            self._pending.append(event)
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="reshard-callback", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Flush: wait up to ``final_timeout_s`` for queued events to be delivered."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(self.final_timeout_s + 5)

    def _run(self) -> None:
        deadline: float | None = None
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                if self._closing and deadline is None:
                    deadline = time.monotonic() + self.final_timeout_s
                event = self._pending[0]
            if self._post(event, deadline):
                self.posted += 1
            else:
                self.dropped += 1
            with self._cond:
                if self._pending and self._pending[0] is event:
                    self._pending.pop(0)

    def _send(self, event: dict[str, Any]) -> tuple[int, str]:
        """One POST of ``event`` (the standard library: the worker needs no HTTP client):
        (status, the start of the body)."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(
            str(self.url), data=json.dumps(event).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=10.0) as response:  # noqa: S310
                return int(response.status), ""
        except urllib.error.HTTPError as e:
            return int(e.code), e.read(200).decode(errors="replace")

    def _post(self, event: dict[str, Any], deadline: float | None) -> bool:
        """POST with backoff; progress gives up after a few tries, final events at close."""
        delay, tries = 0.2, 0
        while True:
            tries += 1
            try:
                status, body = self._send(event)
                if status < 300:
                    return True
                if status not in _RETRYABLE:
                    logger.warning(
                        "callback %s refused the %s event: %d %s",
                        self.url,
                        event["event"],
                        status,
                        body,
                    )
                    return False
                why = f"HTTP {status}"
            except Exception as e:  # connection refused/reset, timeouts: retry
                why = f"{type(e).__name__}: {e}"
            final = event["event"] != "progress"
            if not final and tries >= 3:
                return False
            with self._cond:
                newer = any(e["event"] == "progress" for e in self._pending[1:])
                closing = self._closing
            if not final and newer:
                return False  # a newer progress event supersedes this one
            now = time.monotonic()
            if closing and deadline is not None and now >= deadline:
                logger.warning("callback: giving up on the %s event (%s)", event["event"], why)
                return False
            logger.debug("callback: %s, retrying in %.1f s", why, delay)
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
