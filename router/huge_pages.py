"""The gateway process's heap on transparent huge pages (Linux), once it has loaded what it keeps.

Why: a request's path through the gateway runs cold. Between two requests the core runs other
processes (the client, the engine's front end, Envoy), so the gateway's data (tokenizer tables,
caches, code objects, the index) has left the caches and the TLB, and each page it reads again
costs a page walk; in a virtual machine a page walk is two-dimensional (the guest's tables, then
the host's for each of their entries). With 4 KiB pages a request touches hundreds of them; with
2 MiB pages the same memory is a few dozen TLB entries. Measured on these machines (docs/benchmarks.md,
"kv_aware's request path, stamped in the live gateway, and the heap on huge pages"), over one
simulated engine: 0.03-0.07 ms less added per request
through kv_aware, 0.01-0.04 through least_loaded, on every request shape, and 4-5 % less CPU per
request.

What: after start-up (the tokenizers, templates and modules loaded), every private anonymous
writable mapping (the C heap, the interpreter's object arenas, the libraries' allocations) is
marked MADV_HUGEPAGE and collapsed into huge pages with MADV_COLLAPSE (Linux 6.1+), 2 MiB-aligned
part by part, in a thread of its own: the calls release the GIL and the kernel keeps the memory's
contents, so the event loop serves meanwhile. It costs about 0.6 s of that thread's CPU for a
400 MB process, once, and a few MB of memory (a huge page fills the 4 KiB pages a part lacked).
Memory allocated later in those mappings comes as huge pages where the kernel has them; new
mappings stay as they are.

Where the system says `never` for transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled),
nothing is done: the operator turned them off. `listen.huge_pages: false` turns this off for one gateway.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvgate.huge_pages")

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE_PAGE_BYTES = 2 << 20
# The collapsing thread's name in the kernel (`top -H`, /proc/<pid>/task/*/comm; 15 characters at most).
THREAD_NAME = "kvgate-hugepage"
_PR_SET_NAME = 15
THP_ENABLED_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass
class HugePageReport:
    """What a collapse did: the parts it asked for and how many the kernel collapsed whole."""

    parts: int = 0
    part_bytes: int = 0
    collapsed_parts: int = 0
    # The process's AnonHugePages after it (/proc/self/smaps_rollup), None where unreadable.
    anon_huge_bytes: int | None = None
    seconds: float = 0.0
    # Why nothing was asked, when nothing was.
    skipped: str | None = None


def thp_mode(text: str) -> str | None:
    """The selected mode in the text of transparent_hugepage/enabled ("always [madvise] never")."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def heap_parts(maps: str) -> list[tuple[int, int]]:
    """(start, end) of the 2 MiB-aligned parts, each at least one huge page, of the private
    anonymous writable mappings listed in `maps` (the text of /proc/self/maps): unnamed ones and the
    `[heap]`; never a file's mapping, the stack or a shared one."""
    parts = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        span, permissions, inode = fields[0], fields[1], fields[4]
        name = fields[5].strip() if len(fields) == 6 else ""
        if not permissions.startswith("rw") or permissions[3:4] != "p" or inode != "0":
            continue
        if name not in ("", "[heap]"):
            continue
        low, _, high = span.partition("-")
        start = -(-int(low, 16) // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = int(high, 16) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if end - start >= HUGE_PAGE_BYTES:
            parts.append((start, end))
    return parts


def _anon_huge_bytes() -> int | None:
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def collapse_heap(thp_enabled_path: Path = THP_ENABLED_PATH) -> HugePageReport:
    """Mark the process's heap (`heap_parts`) for huge pages and collapse it into them now."""
    if not sys.platform.startswith("linux"):
        return HugePageReport(skipped="not Linux")
    try:
        mode = thp_mode(thp_enabled_path.read_text())
    except OSError:
        return HugePageReport(skipped=f"{thp_enabled_path} is unreadable: no transparent huge pages")
    if mode is None or mode == "never":
        return HugePageReport(skipped=f"transparent huge pages are `{mode}` on this system")
    started = time.perf_counter()
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    report = HugePageReport()
    parts = heap_parts(Path("/proc/self/maps").read_text())
    for start, end in parts:
        # A mapping freed since the list was read answers ENOMEM and is left; the rest are kept.
        madvise(start, end - start, MADV_HUGEPAGE)
        report.parts += 1
        report.part_bytes += end - start
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            report.collapsed_parts += 1
    report.seconds = time.perf_counter() - started
    report.anon_huge_bytes = _anon_huge_bytes()
    return report


def collapse_heap_in_background() -> threading.Thread:
    """Run `collapse_heap` in a daemon thread and log what it did."""

    def run() -> None:
        try:
            # Named for the kernel too: the CPU it spends shows as its own, not the event loop's.
            ctypes.CDLL(None).prctl(_PR_SET_NAME, THREAD_NAME.encode(), 0, 0, 0)
            report = collapse_heap()
        except Exception as exc:  # never the gateway's failure: it serves as it did
            logger.warning("huge pages: the heap was not collapsed: %s", exc)
            return
        if report.skipped is not None:
            logger.info("huge pages: not used (%s)", report.skipped)
            return
        huge = "unknown" if report.anon_huge_bytes is None else f"{report.anon_huge_bytes >> 20} MiB"
        logger.info(
            "huge pages: %d of %d heap parts (%d MiB) collapsed in %.2f s; %s of the process in huge pages",
            report.collapsed_parts, report.parts, report.part_bytes >> 20, report.seconds, huge,
        )  # fmt: skip

    thread = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    thread.start()
    return thread
