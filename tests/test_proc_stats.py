"""kvgate_testing.proc_stats.thread_cpu_seconds: a process's CPU time split by thread name, as the
picker's benchmark reports it (the event loop's thread against grpc's and ZMQ's)."""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

from kvgate_testing.proc_stats import cpu_seconds, thread_cpu_seconds

_PR_SET_NAME = 15


def _busy(seconds: float) -> None:
    stop = time.thread_time() + seconds
    while time.thread_time() < stop:
        pass


def test_a_busy_threads_cpu_time_is_counted_under_its_own_name():
    pid = os.getpid()
    named, go, burned, done = (threading.Event() for _ in range(4))

    def named_worker() -> None:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, b"kvgate-busy", 0, 0, 0)
        named.set()
        go.wait(10)
        _busy(0.3)
        burned.set()
        done.wait(10)  # alive while the caller reads its time

    worker = threading.Thread(target=named_worker)
    worker.start()
    assert named.wait(10)
    main_name = Path(f"/proc/{pid}/task/{pid}/comm").read_text().strip()
    before = thread_cpu_seconds(pid)
    go.set()  # the worker burns 0.3 s of its own CPU time while this thread waits
    assert burned.wait(30)
    after = thread_cpu_seconds(pid)
    done.set()
    worker.join(10)
    assert after["kvgate-busy"] - before.get("kvgate-busy", 0.0) >= 0.25
    assert after[main_name] - before[main_name] < 0.1
    # Together the threads account for no more than the whole process.
    assert sum(after.values()) <= cpu_seconds(pid) + 0.05


def test_a_process_that_is_gone_has_no_threads():
    assert thread_cpu_seconds(2**22 + 12345) == {}
