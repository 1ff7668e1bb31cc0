"""Progress events: their schema (``progress``, ``done``, ``error``: :func:`check_event`,
read back by :func:`read_events`, which skips a half-written last line) and rank 0's
reporter: events to a JSON-lines file and/or POSTed to the server.

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
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from reshard_svc.errors import UsageError
from reshard_svc.jobs.environment import CALLBACK_TIMEOUT_ENV, CALLBACK_TOKEN_ENV, CALLBACK_URL_ENV

EVENT_KINDS = ("progress", "done", "error")

_EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "progress": {"bytes_done": int, "bytes_total": int, "tensors_done": int, "tensors_total": int},
    "done": {
        "strategy": str,
        "seconds": (int, float),
        "bytes_read": int,
        "bytes_written": int,
        "bytes_exchanged": int,
        "tensors": int,
    },
    "error": {"error": str},
}


#: Fields an event may carry: a done event says how many tensors a cast changed or kept.
_OPTIONAL_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "done": {"cast": int, "kept": int, "dequantized": int},
}


class Finished(Protocol):
    """What a ``done`` event reports of a finished conversion
    (:class:`~reshard_svc.runtime.convert.ConvertResult` has it)."""

    @property
    def strategy(self) -> str: ...
    @property
    def bytes_read_total(self) -> int: ...
    @property
    def bytes_written_total(self) -> int: ...
    @property
    def bytes_exchanged(self) -> int: ...
    @property
    def tensors(self) -> int: ...
    @property
    def cast(self) -> int: ...
    @property
    def kept(self) -> int: ...
    @property
    def dequantized(self) -> int: ...


def done_event(result: Finished, seconds: float) -> dict[str, Any]:
    """The ``done`` event of a finished conversion (the CLI prints it, the worker posts it)."""
    return {
        "event": "done",
        "strategy": result.strategy,
        "seconds": round(seconds, 3),
        "bytes_read": result.bytes_read_total,
        "bytes_written": result.bytes_written_total,
        "bytes_exchanged": result.bytes_exchanged,
        "tensors": result.tensors,
        "cast": result.cast,
        "kept": result.kept,
        "dequantized": result.dequantized,
    }


def check_event(record: Any) -> dict[str, Any]:
    """A well-formed event (``event`` in :data:`EVENT_KINDS` with its fields), or UsageError."""
    if not isinstance(record, Mapping):
        raise UsageError("an event must be a JSON object")
    kind = record.get("event")
    if kind not in _EVENT_FIELDS:
        raise UsageError(f"event {kind!r} must be one of {', '.join(EVENT_KINDS)}")
    out: dict[str, Any] = {"event": kind}
    optional = _OPTIONAL_FIELDS.get(kind, {})
    for name, typ in {**_EVENT_FIELDS[kind], **optional}.items():
        value = record.get(name)
        if name in optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, typ):
            raise UsageError(f"{kind} event: {name} is missing or not a {typ}")
        if isinstance(value, int | float) and value < 0:
            raise UsageError(f"{kind} event: {name} must not be negative")
        out[name] = value[:4000] if isinstance(value, str) else value
    if isinstance(record.get("time"), int | float):
        out["time"] = record["time"]
    return out


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every well-formed event in a JSON-lines file; a half-written last line is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return []
    events = []
    for line in text.splitlines():
        try:
            events.append(check_event(json.loads(line)))
        except (json.JSONDecodeError, UsageError):
            continue
    return events


def latest_events(
    events: Iterable[dict[str, Any]],
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(newest ``progress`` event, first ``done``/``error`` event)."""
    progress = final = None
    for ev in events:
        if ev["event"] == "progress":
            progress = ev
        elif final is None:
            final = ev
    return progress, final


__all__ = [
    "EVENT_KINDS",
    "EventReporter",
    "check_event",
    "done_event",
    "latest_events",
    "read_events",
]

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
        self._deadline: float | None = None  # set by close(): final events give up then
        self._closed = threading.Event()  # wakes a retry's back-off when close() comes
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
            self._deadline = time.monotonic() + self.final_timeout_s
            self._cond.notify()
        self._closed.set()
        if self._thread is not None:
            self._thread.join(self.final_timeout_s + 5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                event = self._pending[0]
            if self._post(event):
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

    def _post(self, event: dict[str, Any]) -> bool:
        """POST with backoff; progress gives up after a few tries, final events at the
        deadline :meth:`close` sets (also when close comes while this post is retrying)."""
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
                deadline = self._deadline
            if not final and newer:
                return False  # a newer progress event supersedes this one
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                logger.warning("callback: giving up on the %s event (%s)", event["event"], why)
                return False
            logger.debug("callback: %s, retrying in %.1f s", why, delay)
            pause = delay * (0.5 + random.random())
            self._closed.wait(pause if deadline is None else min(pause, deadline - now))
            delay = min(delay * 2, 5.0)
