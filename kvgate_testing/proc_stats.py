"""A process's CPU time and its descendants', and its resident memory, read from /proc (Linux)."""

from __future__ import annotations

import os
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _thread_ids(pid: int) -> list[str]:
    """The ids of a process's live threads (/proc/PID/task); none when the process is gone."""
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc: each thread's `children`)."""
    tree = [pid]
    for thread in _thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{thread}/children") as children:
                kids = [int(kid) for kid in children.read().split()]
        except OSError:
            continue
        for kid in kids:
            tree += process_tree(kid)
    return tree


def _ticks(pid: int) -> int:
    """utime + stime (fields 14 and 15 of /proc/PID/stat) of one process, all its threads; 0 when gone."""
    return _stat_ticks(f"/proc/{pid}/stat")


def _stat_ticks(stat_path: str) -> int:
    try:
        fields = Path(stat_path).read_text().rpartition(")")[2].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def thread_names(pid: int) -> dict[int, str]:
    """Each live thread's id and name (the kernel's `comm`: Python's main thread is the process's
    name, grpc's, ZMQ's and Envoy's threads carry theirs); threads that ended are not in it."""
    names: dict[int, str] = {}
    for thread in _thread_ids(pid):
        try:
            names[int(thread)] = Path(f"/proc/{pid}/task/{thread}/comm").read_text().strip()
        except OSError:
            continue
    return names


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time of each of a process's live threads, summed by thread name
    (thread_names), in seconds. Threads that ended are not in it."""
    by_name: dict[str, float] = {}
    for thread, name in thread_names(pid).items():
        seconds = _stat_ticks(f"/proc/{pid}/task/{thread}/stat") / _CLOCK_TICKS
        by_name[name] = by_name.get(name, 0.0) + seconds
    return by_name


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process, all its threads, in seconds."""
    return _ticks(pid) / _CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its descendants, in seconds."""
    return sum(_ticks(member) for member in process_tree(pid)) / _CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (VmRSS of /proc/PID/status), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
