"""``Ticker``: one long-lived daemon thread that calls ``tick()`` every interval until
stopped (the job manager's engine polls, the watcher's scans). A failing tick is logged
and the next one runs; ``first()`` runs once before the first tick."""

from __future__ import annotations

import logging
import threading

__all__ = ["Ticker"]

logger = logging.getLogger(__name__)


class Ticker:
    #: the thread's name, and the log's word for it
    thread_name = "reshard-ticker"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def interval(self) -> float:
        raise NotImplementedError

    def tick(self) -> None:
        raise NotImplementedError

    def first(self) -> None:
        """Runs once on the thread before the first tick."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        try:
            self.first()
        except Exception:  # the ticks retry what it could not do
            logger.exception("%s: its first step failed", self.thread_name)
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep the thread alive; the error is in the server log
                logger.exception("%s: tick failed", self.thread_name)
            self._stop.wait(self.interval())
