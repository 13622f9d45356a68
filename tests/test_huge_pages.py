"""router/huge_pages.py: which mappings are moved onto huge pages, when nothing is done, and a real
`kvgate serve` process whose heap the kernel reports on huge pages once it has started (and not with
`listen.huge_pages: false`)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvgate_testing.gateway import gateway_config, start_gateway
from router.huge_pages import HUGE_PAGE_BYTES, THP_ENABLED_PATH, collapse_heap, heap_parts, thp_mode

MIB = 1 << 20


def test_thp_mode_reads_the_selected_word() -> None:
    assert thp_mode("always [madvise] never\n") == "madvise"
    assert thp_mode("[always] madvise never") == "always"
    assert thp_mode("always madvise [never]") == "never"
    assert thp_mode("") is None


def test_heap_parts_are_the_aligned_private_anonymous_writable_mappings() -> None:
    base = 0x7F0000000000  # 2 MiB-aligned
    maps = "\n".join(
        [
            # anonymous, private, writable: its aligned inner part (one huge page past each edge trimmed)
            f"{base + 4096:x}-{base + 3 * HUGE_PAGE_BYTES + 4096:x} rw-p 00000000 00:00 0 ",
            f"{0x55D000000000:x}-{0x55D000000000 + 4 * HUGE_PAGE_BYTES:x} rw-p 00000000 00:00 0    [heap]",
            # too small once aligned
            f"{base + 8 * HUGE_PAGE_BYTES + 4096:x}-{base + 9 * HUGE_PAGE_BYTES + 8192:x} rw-p 0 00:00 0",
            # a file's data, the stack, shared memory, read-only or executable memory: never
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} rw-p 00001000 fd:01 1234   /usr/lib/libpython3.11.so",
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} rw-p 00000000 00:00 0      [stack]",
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} rw-s 00000000 00:05 77     /dev/zero (deleted)",
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} rw-s 00000000 00:00 0",
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} r--p 00000000 00:00 0",
            f"{base:x}-{base + 4 * HUGE_PAGE_BYTES:x} r-xp 00000000 00:00 0",
            "garbage",
        ]
    )
    assert heap_parts(maps) == [
        (base + HUGE_PAGE_BYTES, base + 3 * HUGE_PAGE_BYTES),
        (0x55D000000000, 0x55D000000000 + 4 * HUGE_PAGE_BYTES),
    ]


def test_nothing_is_done_where_the_system_turned_huge_pages_off(tmp_path: Path) -> None:
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    report = collapse_heap(never)
    assert report.parts == 0 and report.skipped is not None and "never" in report.skipped
    report = collapse_heap(tmp_path / "missing")
    assert report.parts == 0 and report.skipped is not None and "unreadable" in report.skipped


def _system_mode() -> str | None:
    try:
        return thp_mode(THP_ENABLED_PATH.read_text())
    except OSError:
        return None


def _anon_huge_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no AnonHugePages in /proc/{pid}/smaps_rollup")


def _gateway(huge_pages: bool):
    # No backend answers: the gateway starts and serves its health and metrics all the same.
    config = gateway_config([], listen={"huge_pages": huge_pages})
    config["backends"] = [{"name": "nobody", "url": "http://127.0.0.1:9"}]
    return start_gateway(config, huge_pages=huge_pages)


@pytest.mark.skipif(
    _system_mode() in (None, "never"),
    reason=f"transparent huge pages are off on this system ({THP_ENABLED_PATH}): nothing to collapse",
)
def test_a_started_gateway_has_its_heap_on_huge_pages_and_not_when_told_not_to() -> None:
    with _gateway(huge_pages=True) as gateway:
        deadline = time.monotonic() + 30
        while (huge := _anon_huge_bytes(gateway.process.pid)) < 8 * MIB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert huge >= 8 * MIB, gateway.process.output()[-2000:]
        deadline = time.monotonic() + 10
        while "huge pages:" not in gateway.process.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "collapsed" in gateway.process.output()
    if _system_mode() != "madvise":
        return  # with `always` the kernel backs the heap with huge pages by itself
    with _gateway(huge_pages=False) as gateway:
        time.sleep(3)  # as long as a collapse takes here, had one started
        assert _anon_huge_bytes(gateway.process.pid) == 0
        assert "huge pages:" not in gateway.process.output()
