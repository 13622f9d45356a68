"""Sample a running router process with py-spy and say where its CPU goes.

py-spy (PyPI) is installed on first use into .cache/tools/py-spy, outside the project's venv. It
records collapsed stacks ("frame;frame;frame count" lines) from outside the process, so the gateway
runs unmodified; `summarize` turns them into the functions that dominate, by own and by total samples.
Only samples of the thread holding the GIL are kept (--gil): in a Python gateway that is the work
that serializes everything else, and threads blocked in zmq or epoll (idle) drop out.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from kvgate_testing.processes import REPO_ROOT

PY_SPY_DIR = REPO_ROOT / ".cache" / "tools" / "py-spy"
PY_SPY = PY_SPY_DIR / "bin" / "py-spy"


def ensure_py_spy() -> Path:
    if not PY_SPY.exists():
        command = [sys.executable, "-m", "pip", "install", "-q", "--target", str(PY_SPY_DIR), "py-spy"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not PY_SPY.exists():
            raise RuntimeError(f"installing py-spy failed: {result.stderr[-2000:]}")
    return PY_SPY


class Profiler:
    """py-spy record on `pid` (the GIL holder among its threads) into `output`, until stop()."""

    def __init__(self, pid: int, output: Path, rate: int = 100):
        self.output = output
        output.parent.mkdir(parents=True, exist_ok=True)
        self._process = subprocess.Popen(
            [str(ensure_py_spy()), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
             "--output", str(output), "--nonblocking", "--threads", "--gil"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop sampling (SIGINT makes py-spy write its file) and wait for it."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
        try:
            _, errors = self._process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            _, errors = self._process.communicate()
        if not self.output.exists():
            raise RuntimeError(f"py-spy wrote no profile: {errors[-2000:]}")


_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def _short(frame: str) -> tuple[str, bool]:
    """`function (path/to/module.py:12)` -> (`module.py:function`, whether it is kvgate's own code)."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip(), False
    path = match["file"]
    return f"{Path(path).name}:{match['function']}", path.startswith("router/") or "/router/" in path


def summarize(collapsed: Path, top: int = 15) -> dict:
    """Sample shares of the hottest functions in a py-spy collapsed-stack file: `own` (the function
    itself was running) over all code, `total` (on the stack) over kvgate's own functions, and
    `threads` (by thread name: the event loop, tokenizer pool, one KV-event subscriber per engine)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    samples = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # "thread (1234): kv-events-engine-7" -> "kv-events-engine-N": one entry per thread role.
        thread = re.sub(r"\d+", "N", stack.split(";", 1)[0].partition("): ")[2]) or "unnamed thread"
        threads[thread] += count
        frames = [_short(f) for f in stack.split(";") if f and not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        samples += count
        own[frames[-1][0]] += count
        for function in {name for name, ours in frames if ours}:
            total[function] += count

    def shares(counter: Counter[str]) -> list[list]:
        return [[name, round(count / samples, 4)] for name, count in counter.most_common(top)]

    if not samples:
        return {"samples": 0, "own": [], "total": [], "threads": []}
    return {"samples": samples, "own": shares(own), "total": shares(total), "threads": shares(threads)}
