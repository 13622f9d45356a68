"""The `usage` an engine reports in its answer (prompt, cached and completion tokens), read from the
response body chunks Envoy shows the picker, without ever holding a chunk back.

A streamed answer (server-sent events) carries it in one `data:` line, usually the last before
`[DONE]` (with `stream_options.include_usage`); only a line split across chunks is kept, up to
MAX_LINE_BYTES. A whole JSON answer carries it at the top level; it is kept up to MAX_JSON_BYTES and
read at its end. Past either bound the usage is not read: the answer passes on all the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from router.epp.metrics import EppMetrics

MAX_LINE_BYTES = 64 * 1024
MAX_JSON_BYTES = 1024 * 1024
_decoder = msgspec.json.Decoder()


class UsageReader:
    __slots__ = ("_given_up", "_metrics", "_pending", "_size", "cached_tokens", "event_stream")

    def __init__(self, event_stream: bool, metrics: EppMetrics) -> None:
        self.event_stream = event_stream
        self._metrics = metrics
        self._pending: list[bytes] = []
        self._size = 0
        self._given_up = False
        # The last `usage.prompt_tokens_details.cached_tokens` read (None: none yet), for stale_index.
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes, end: bool) -> None:
        if self._given_up:
            return
        if self.event_stream:
            self._feed_events(chunk)
        else:
            self._size += len(chunk)
            if self._size > MAX_JSON_BYTES:
                self._give_up()
                return
            self._pending.append(chunk)
            if end:
                self._record(_decode(b"".join(self._pending)))
                self._pending = []

    def _feed_events(self, chunk: bytes) -> None:
        if b"\n" not in chunk:
            self._size += len(chunk)
            if self._size > MAX_LINE_BYTES:
                self._give_up()
            else:
                self._pending.append(chunk)
            return
        if self._pending:
            chunk = b"".join(self._pending) + chunk
            self._pending, self._size = [], 0
        *lines, tail = chunk.split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                self._record(_decode(line[5:].strip()))
        if tail:
            self._pending, self._size = [tail], len(tail)

    def _give_up(self) -> None:
        self._given_up = True
        self._pending = []

    def _record(self, answer: Any) -> None:
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if not isinstance(usage, dict):
            return
        counts = self._metrics.usage_tokens
        for kind, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            value = usage.get(field)
            if isinstance(value, int) and value >= 0:
                counts.labels(kind).inc(value)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int) and cached >= 0:
            counts.labels("cached").inc(cached)
            self.cached_tokens = cached


def _decode(data: bytes) -> Any:
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
