"""Writing chunks into a slower tier behind the store: one writer thread per tier, fed batches of the
chunks a store committed to L1, so that a store returns after its CPU copy. Each batch carries the
clear() generation it was queued under: the tier's writer drops a batch queued before a clear.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from cachelayer.storage.tier import ChunkMeta

log = logging.getLogger(__name__)

# A batch: the clear() generation when it was queued, and the metadata of the chunks to copy.
Batch = tuple[int, list[ChunkMeta]]


class WriteBehind:
    """One daemon thread that runs `write(generation, metas)` for each submitted batch, in order.

    `max_batches` bounds the queue (0: unbounded); a batch that finds it full is not queued
    (`submit` returns False): the tier behind is a best-effort copy, and a store never waits for it.
    A batch that raises is logged and the thread goes on with the next."""

    def __init__(
        self, write: Callable[[int, list[ChunkMeta]], None], *, name: str, what: str, max_batches: int = 0
    ) -> None:
        self._write = write
        self._what = what
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=max_batches)
        self._backlog = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, generation: int, metas: list[ChunkMeta]) -> bool:
        """Queue a batch; False (nothing queued) when the queue is full."""
        with self._idle:
            try:
                self._queue.put_nowait((generation, metas))
            except queue.Full:
                return False
            self._backlog += 1
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every batch queued so far was written (or skipped); False when `timeout_s`
        passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._backlog == 0, timeout=timeout_s)

    def close(self, flush_timeout_s: float | None = None) -> None:
        """Write what is queued (waiting at most `flush_timeout_s`), then stop the thread."""
        if self._thread is None:
            return
        self.flush(flush_timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._thread = None

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self._write(*batch)
            except Exception:  # the writer must outlive one bad batch
                log.exception("cachelayer: writing chunks to %s failed", self._what)
            finally:
                with self._idle:
                    self._backlog -= 1
                    self._idle.notify_all()
