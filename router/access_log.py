"""The access log (`access_log:` in proxy.yaml, off by default): one JSON line per forwarded request,
written when the request ends, by a thread, so that the event loop never waits on a disk or a pipe.

The event loop's share is `AccessLogWriter.write`: it copies the request's scalar fields into a
tuple and puts it on a queue (about 2 µs of CPU). The writer thread takes whatever has queued,
encodes it (msgspec JSON, timestamps formatted there) and writes it with one `os.write`: a system
call per batch, not per line. Why not the logging module: a `QueueHandler` costs 9-14 µs per line
on the calling thread (the LogRecord, its formatting), against the gateway's ~70 µs of CPU per
JSON request (docs/gateway.md, "Access log" and "Performance design";
benchmarks/access_log_cost.py measures both).

The queue is bounded (`max_pending_lines`): past it, lines are dropped and counted
(`kvgate_access_log_dropped_total{reason="queue_full"}`), never buffered without end while a
disk stalls; a failed write drops its batch the same way (`reason="write_failed"`) with a warning.
A file is opened O_APPEND (several workers may share one) and reopened when it was rotated away
(renamed or removed: the check of logging.handlers.WatchedFileHandler, at most once a second).
"""

from __future__ import annotations

import datetime as dt
import errno
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CollectorRegistry, Counter

if TYPE_CHECKING:
    from router.config import AccessLog
    from router.policies.base import Choice, RouteRequest

log = logging.getLogger("kvgate.access_log")

# A client-sent request id is logged up to this many characters (headers are bounded, lines too).
MAX_REQUEST_ID_CHARS = 200
# A gateway error message (it may quote the request) is logged up to this many characters.
MAX_ERROR_CHARS = 500
# Lines encoded and written in one system call, at most.
_BATCH_LINES = 1024
# After a write the thread waits this long before it looks at the queue again: lines queued
# meanwhile leave together, and their puts wake nobody (a put that wakes the waiting thread costs
# the event loop a system call). An idle gateway's thread sleeps in get(): no wake-ups at all.
GATHER_S = 0.02
_REOPEN_CHECK_INTERVAL_S = 1.0
# A failing write is warned about at most this often (the dropped lines are counted meanwhile).
WARNING_INTERVAL_S = 10.0
_STOP = object()
_encoder = msgspec.json.Encoder()

# The line's keys, in the order they are written (docs/gateway.md, "Access log").
FIELDS = (
    "ts",
    "request_id",
    "path",
    "model",
    "backend",
    "policy",
    "reason",
    "prompt_tokens",
    "cached_tokens",
    "status",
    "outcome",
    "stream",
    "ttft_ms",
    "total_ms",
    "error",
)
# `outcome` values: how the request ended.
OK = "ok"  # the answer (of any status) was relayed whole
BACKEND_FAILED = "backend_failed"  # the backend failed mid-answer (status says 502 or 504)
GATEWAY_ERROR = "gateway_error"  # the gateway answered the error itself; no backend answered
CLIENT_GONE = "client_gone"  # the client disconnected first (status 499 when nothing was sent)
CANCELLED = "cancelled"  # the gateway stopped while the request ran
# nginx's "client closed request": what a request the client left before any answer is logged as.
CLIENT_CLOSED_STATUS = 499


class AccessEntry:
    """What one request's line is made of, filled in as the request goes (router/forward.py)."""

    __slots__ = (
        "backend",
        "choice",
        "error",
        "first_piece_s",
        "path",
        "policy",
        "request",
        "request_id",
        "started",
        "status",
        "stream",
        "upstream_failed",
        "upstream_started",
    )

    def __init__(self, path: str, request_id: bytes, started: float) -> None:
        self.path = path
        self.request_id = request_id
        self.started = started
        self.request: RouteRequest | None = None
        # What the policy chose for the last attempt (its reason and cached tokens go in the line).
        self.choice: Choice | None = None
        # Set when a backend answered: its name, and the policy that chose it.
        self.backend: str | None = None
        self.policy: str | None = None
        self.status: int | None = None
        self.stream = False
        self.upstream_started = 0.0
        self.upstream_failed = False
        self.first_piece_s: float | None = None
        self.error: str | None = None


class AccessLogWriter:
    """The access log of one gateway process: `write` on the event loop, the rest on its thread."""

    def __init__(self, settings: AccessLog, registry: CollectorRegistry) -> None:
        self.path = settings.path
        self.max_pending = settings.max_pending_lines
        self.dropped = Counter(
            "kvgate_access_log_dropped",
            "Access log lines not written: the queue was full (max_pending_lines) or the write failed",
            ["reason"],
            registry=registry,
        )
        self._queue_full = self.dropped.labels("queue_full")
        self._write_failed = self.dropped.labels("write_failed")
        self._queue: queue.SimpleQueue[tuple | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self._checked_at = 0.0
        self._warned_at = -WARNING_INTERVAL_S
        self._unwarned_failures = 0

    # ---- the event loop's side ----

    def start(self) -> None:
        """Open the file (a clear error now, not a silent log later) and start the writer thread."""
        if self.path is not None:
            self._open()
        self._thread = threading.Thread(target=self._run, name="kvgate-access-log", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Write what is queued, then stop the thread and close the file."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def write(self, entry: AccessEntry, client_gone: bool, cancelled: bool) -> None:
        """Queue the line of a request that has ended; never blocks."""
        if self._queue.qsize() >= self.max_pending:
            self._queue_full.inc()
            return
        ended = time.perf_counter()
        status = entry.status
        if client_gone:
            outcome = CLIENT_GONE
        elif cancelled:
            outcome = CANCELLED
        elif entry.upstream_failed:
            outcome = BACKEND_FAILED
        elif entry.backend is None and status is not None:
            outcome = GATEWAY_ERROR
        else:
            outcome = OK
        if status is None:
            status = CLIENT_CLOSED_STATUS
        ttft_s = None
        if entry.first_piece_s is not None:
            ttft_s = (entry.upstream_started - entry.started) + entry.first_piece_s
        model = reason = prompt_tokens = cached_tokens = None
        request = entry.request
        if request is not None:
            model = request.model
            choice = entry.choice
            if choice is not None:
                reason, cached_tokens = choice.reason, choice.cached_tokens
            if request.tokens is None:
                # Not tokenized (a policy that needs no tokens, or no tokenizer): counts unknown.
                cached_tokens = None
            else:
                prompt_tokens = len(request.tokens)
        self._queue.put(
            (
                time.time(),
                entry.request_id,
                entry.path,
                model,
                entry.backend,
                entry.policy,
                reason,
                prompt_tokens,
                cached_tokens,
                status,
                outcome,
                entry.stream,
                ttft_s,
                ended - entry.started,
                entry.error,
            )
        )

    # ---- the writer thread ----

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH_LINES:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stopping = any(item is _STOP for item in batch)
            lines = b"".join(_line(item) for item in batch if item is not _STOP)
            if lines:
                self._emit(lines, len(batch) - stopping)
            if stopping:
                return
            time.sleep(GATHER_S)

    def _emit(self, data: bytes, count: int) -> None:
        try:
            if self.path is None:
                _write_all(2, data)
                return
            self._reopen_if_rotated()
            assert self._fd is not None
            _write_all(self._fd, data)
        except OSError as exc:
            self._write_failed.inc(count)
            # At most one warning per interval: a full disk must not turn into a line per batch.
            self._unwarned_failures += count
            now = time.monotonic()
            if now - self._warned_at >= WARNING_INTERVAL_S:
                log.warning(
                    "access log: %d lines not written to %s since the last warning: %s",
                    self._unwarned_failures, self.path or "stderr", exc,
                )  # fmt: skip
                self._warned_at, self._unwarned_failures = now, 0

    def _open(self) -> None:
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = fd
        stat = os.fstat(fd)
        self._identity = (stat.st_dev, stat.st_ino)

    def _reopen_if_rotated(self) -> None:
        """Reopen the file when the path no longer names the one open (logrotate's rename or
        remove; `copytruncate` needs nothing: O_APPEND writes follow the truncation)."""
        now = time.monotonic()
        if self._fd is not None and now - self._checked_at < _REOPEN_CHECK_INTERVAL_S:
            return
        self._checked_at = now
        assert self.path is not None
        try:
            stat = os.stat(self.path)
            current = (stat.st_dev, stat.st_ino)
        except FileNotFoundError:
            current = None
        if self._fd is None or current != self._identity:
            self._open()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except BlockingIOError:  # a non-blocking stderr pipe that is full: wait for the reader
            time.sleep(0.01)
            continue
        if written == 0:
            raise OSError(errno.EIO, "write returned 0")
        view = view[written:]


_second_text: tuple[int, str] = (-1, "")


def _timestamp(ts: float) -> str:
    """ISO 8601 UTC to the millisecond; the date and time of a second are formatted once."""
    global _second_text
    second = int(ts)
    if second != _second_text[0]:
        _second_text = (second, dt.datetime.fromtimestamp(second, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second_text[1]}.{int((ts - second) * 1000):03d}Z"


def _line(item: tuple) -> bytes:  # type: ignore[type-arg]
    (ts, request_id, path, model, backend, policy, reason, prompt_tokens, cached_tokens, status,
     outcome, stream, ttft_s, total_s, error) = item  # fmt: skip
    record = {
        "ts": _timestamp(ts),
        "request_id": request_id.decode("latin-1")[:MAX_REQUEST_ID_CHARS],
        "path": path,
        "model": model,
        "backend": backend,
        "policy": policy,
        "reason": reason,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "status": status,
        "outcome": outcome,
        "stream": stream,
        # Whole microseconds, in milliseconds (round() costs ten times this).
        "ttft_ms": None if ttft_s is None else int(ttft_s * 1e6) / 1000,
        "total_ms": int(total_s * 1e6) / 1000,
        "error": None if error is None else error[:MAX_ERROR_CHARS],
    }
    return _encoder.encode(record) + b"\n"
