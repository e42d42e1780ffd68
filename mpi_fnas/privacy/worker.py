"""The ledger's one background thread: ε computed while the parties compute
(:mod:`mpi_fnas.privacy.federation_ledger`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class OrderedWorker:
    """One daemon thread running submitted calls in order. Daemon: a crashing run does not wait for it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="privacy-epsilon", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Run `fn` after every call submitted before it; its result (or exception) in the future returned."""
        future: Future[Any] = Future()
        self._queue.put((future, fn))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Stop after the calls already submitted; wait at most `timeout` seconds for them."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():  # cancelled by close()
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever reads the row
                future.set_exception(exc)
