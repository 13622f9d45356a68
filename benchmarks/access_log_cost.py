"""CPU per request of the access log (router/access_log.py), on the event loop and in all.

A request's line is `AccessLogWriter.write` on the event loop; the writer thread encodes and writes
it. This times both with the real writer, to a real file, for requests whose fields are what a
kv_aware request fills in:
- loop: CPU of the calling thread (time.thread_time) per `write`: what a request pays on the loop;
- total: CPU of the whole process (time.process_time) per line, from the first write until the
  writer has written everything: the loop's share plus the thread's;
in two rhythms: a burst (lines queue up and leave in large batches, as under load) and paced (one
line at a time, so each costs its own system call, as when the gateway is nearly idle). Beside them,
the logging module's QueueHandler on the calling thread, the alternative it was measured against.

    .venv/bin/python -m benchmarks.access_log_cost  # writes benchmarks/results/access_log_cost.json
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import tempfile
import time
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.provenance import with_source
from router.access_log import AccessEntry, AccessLogWriter
from router.backends import BackendState
from router.config import AccessLog
from router.policies.base import Choice, RouteRequest

BURST_LINES = 50_000
PACED_LINES = 3_000
PACE_S = 0.0002
_BACKEND = BackendState(name="sim-1", url="http://127.0.0.1:9000")


def _entry(n: int) -> AccessEntry:
    request = RouteRequest(f"{n:032x}", "tiny-qwen3", {}, None)
    request.tokens = np.zeros(466, dtype=np.uint32)
    entry = AccessEntry("/v1/chat/completions", b"%032x" % n, time.perf_counter())
    entry.choice = Choice(_BACKEND, "cache_hit", cached_tokens=448, prefill_tokens=18)
    entry.request, entry.backend, entry.policy, entry.status = request, "sim-1", "kv_aware", 200
    entry.stream, entry.upstream_started, entry.first_piece_s = True, entry.started, 0.0123
    return entry


def _pacing_cpu_s(lines: int, pace_s: float) -> float:
    """The CPU the paced loop itself costs (its sleeps), without any write: subtracted."""
    started = time.process_time()
    for _ in range(lines):
        time.thread_time()
        time.thread_time()
        time.sleep(pace_s)
    return time.process_time() - started


def _measure(lines: int, pace_s: float, directory: Path) -> dict[str, float]:
    path = directory / f"access-{lines}.log"
    writer = AccessLogWriter(
        AccessLog(enabled=True, path=str(path), max_pending_lines=lines + 1), CollectorRegistry()
    )
    writer.start()
    entries = [_entry(n) for n in range(lines)]
    loop_cpu = 0.0
    process_started = time.process_time()
    for entry in entries:
        started = time.thread_time()
        writer.write(entry, client_gone=False, cancelled=False)
        loop_cpu += time.thread_time() - started
        if pace_s:
            time.sleep(pace_s)
    writer.stop(timeout_s=60)
    total_cpu = time.process_time() - process_started
    if pace_s:
        total_cpu -= _pacing_cpu_s(lines, pace_s)
    written = path.read_bytes().count(b"\n")
    assert written == lines, f"{written} of {lines} lines written"
    return {"loop_us_per_line": loop_cpu / lines * 1e6, "total_us_per_line": total_cpu / lines * 1e6}


def _queue_handler_us(lines: int) -> float:
    logger = logging.getLogger("benchmarks.access_log_cost")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.handlers.QueueHandler(queue.SimpleQueue()))
    line = json.dumps({"request_id": "0" * 32, "path": "/v1/chat/completions", "status": 200})
    started = time.thread_time()
    for _ in range(lines):
        logger.info("%s", line)
    return (time.thread_time() - started) / lines * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        burst = _measure(BURST_LINES, 0.0, Path(directory))
        paced = _measure(PACED_LINES, PACE_S, Path(directory))
    queue_handler = _queue_handler_us(BURST_LINES)
    results = {
        "burst": {"lines": BURST_LINES, **burst},
        "paced": {"lines": PACED_LINES, "pace_s": PACE_S, **paced},
        "logging_queue_handler_us_per_line": queue_handler,
    }
    print(json.dumps(results, indent=2))
    out = REPO_ROOT / "benchmarks" / "results" / "access_log_cost.json"
    out.write_text(json.dumps(with_source(results), indent=2) + "\n")


if __name__ == "__main__":
    main()
