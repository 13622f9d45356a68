"""Where a hop's time goes on a shared core: the scheduler's own record of who ran when.

`perf sched record` logs every context switch and wake-up; `perf sched timehist -w` prints them, one
line each: a wake-up ("TIME [CPU] WAKER[TID] awakened: WAKEE[TID]") or a switch away from a task
with how long it ran ("TIME [CPU] TASK[TID] WAIT SCH_DELAY RUN", in ms); a thread other than its
process's main one is TASK[TID/PID]. From those, for a client C
sending through a router R to an engine E, the router's stints on one request's path:

- request side: from C's first wake-up of R (the request's head arriving) to R waking E (the request
  sent on); unknown, and left out, where E was awake and nothing woke it;
- response side: from E waking R (the answer arriving) to R waking C (the answer written to it);
- after the write: from R waking C to R switching away (work the client, sharing R's core, waits
  for);
- R's run time: what R ran in all, per response-side cycle.

These are the scheduler's numbers, not a sampler's: a stint's length is what it is, whatever the
task did in it (a system call, Python, a wait for the core).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

_LINE = re.compile(r"\s*([\d.]+)\s+\[(\d+)\]\s+(\S+)\s+(.*)")
# A task is COMM[TID], or COMM[TID/PID] for a thread that is not its process's main one.
_TID = re.compile(r"\[(\d+)(?:/\d+)?\]$")
_AWAKENED = re.compile(r"awakened: \S+?\[(\d+)(?:/\d+)?\]")


@dataclass(frozen=True)
class Wake:
    at_us: float
    waker: int | None
    wakee: int


@dataclass(frozen=True)
class SwitchOut:
    at_us: float
    task: int | None
    ran_us: float


def parse_timehist(text: str) -> list[Wake | SwitchOut]:
    """The wake-ups and switches of `perf sched timehist -w` output (headers and idle lines skipped;
    the idle task's switches are kept with task None)."""
    events: list[Wake | SwitchOut] = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        at_us = float(match[1]) * 1e6
        tid_match = _TID.search(match[3])
        tid = int(tid_match[1]) if tid_match else None
        rest = match[4]
        awakened = _AWAKENED.search(rest)
        if awakened is not None:
            events.append(Wake(at_us, tid, int(awakened[1])))
            continue
        numbers = rest.split()
        if len(numbers) >= 3:
            try:
                events.append(SwitchOut(at_us, tid, float(numbers[2]) * 1e3))
            except ValueError:
                continue
    return events


@dataclass
class HopStints:
    request_side_us: list[float] = field(default_factory=list)
    response_side_us: list[float] = field(default_factory=list)
    after_write_us: list[float] = field(default_factory=list)
    router_run_us: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, dict[str, float] | None]:
        return {name: _quartiles(values) for name, values in vars(self).items()}


def hop_stints(events: list[Wake | SwitchOut], client: int, router: int, engine: int) -> HopStints:
    """The router's stints on each request's path (module docstring), in µs."""
    stints = HopStints()
    request_started: float | None = None
    answer_arrived: float | None = None
    written: float | None = None
    ran = 0.0
    for event in events:
        if isinstance(event, Wake):
            if event.waker == client and event.wakee == router and request_started is None:
                request_started = event.at_us
            elif event.waker == router and event.wakee == engine and request_started is not None:
                stints.request_side_us.append(event.at_us - request_started)
                request_started = None
            elif event.waker == engine and event.wakee == router:
                answer_arrived = event.at_us
                # The request went on unseen (the engine was awake, so nothing woke it): that
                # request side is unknown, not the time to the next one's.
                request_started = None
            elif event.waker == router and event.wakee == client and answer_arrived is not None:
                stints.response_side_us.append(event.at_us - answer_arrived)
                written, answer_arrived = event.at_us, None
        elif event.task == router:
            ran += event.ran_us
            if written is not None:
                stints.after_write_us.append(event.at_us - written)
                stints.router_run_us.append(ran)
                written, ran = None, 0.0
    return stints


def _quartiles(values: list[float]) -> dict[str, float] | None:
    if len(values) < 4:
        return None
    low, median, high = statistics.quantiles(values, n=4)
    return {"count": len(values), "p25": low, "median": median, "p75": high}
