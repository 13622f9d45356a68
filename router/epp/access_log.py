"""The answer's end told by Envoy's gRPC access log (`envoy.service.accesslog.v3.AccessLogService`):
Envoy writes one entry per HTTP request when its stream ends (the answer's last byte sent, or the
stream reset) and streams the entries, batched, to the picker over one long-lived stream per worker.

Why: Envoy does not always keep the ext_proc stream open for the answer. With `response_body_mode:
NONE`, a request body sent FULL_DUPLEX_STREAMED (or not at all) and the response headers sent, Envoy
1.40 half-closes it right after the picker answers the response headers, long before a streamed
answer ends; with a BUFFERED request body it kept it open to the HTTP stream's end. Sending the body
through ext_proc instead costs a round trip per answer chunk. The entry, whatever the modes, comes
when the request ends and carries its `x-request-id`, the response code, the upstream that served it
and the time to its first byte: the picker closes the pick's accounting (router/epp/picker.py,
`Pick.finish`) on it.

Envoy opens the stream with its first entry only. With `epp.envoy_access_log` (Envoy is configured
to log here) a pick waits for its entry before any stream has connected too; without it, a pick
closes at its ext_proc stream's end while none is connected. When the last stream closes, the picks
made before that close no longer wait (`EndpointPicker.access_log_closed`). An entry for a request
id with no open pick (an immediate response, a request Envoy routed without the picker, a pick
closed already) is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

from router.epp.picker import format_endpoint

if TYPE_CHECKING:
    from router.epp.picker import EndpointPicker

log = logging.getLogger("kvgate.epp")


def _seconds(common: accesslog_pb2.AccessLogCommon, field: str) -> float | None:
    """A Duration field of the entry in seconds; None when Envoy left it unset (no upstream byte)."""
    if not common.HasField(field):
        return None
    duration = getattr(common, field)
    return duration.seconds + duration.nanos / 1e9


def served_address(common: accesslog_pb2.AccessLogCommon) -> str | None:
    """The upstream Envoy connected to, as `ip:port` (None: it reached none)."""
    if not common.HasField("upstream_remote_address"):
        return None
    address = common.upstream_remote_address.socket_address
    if not address.address:
        return None
    return format_endpoint(address.address, address.port_value)


def time_to_first_byte(common: accesslog_pb2.AccessLogCommon) -> float | None:
    """From the request's last byte sent upstream to the answer's first byte back (a streamed answer's
    time to its first token, as the gateway sees it)."""
    sent = _seconds(common, "time_to_last_upstream_tx_byte")
    first = _seconds(common, "time_to_first_upstream_rx_byte")
    if sent is None or first is None:
        return None
    return max(first - sent, 0.0)


class AccessLogServicer:
    """Reads Envoy's HTTP access-log entries and ends the picks they name."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def StreamAccessLogs(
        self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: object
    ) -> als_pb2.StreamAccessLogsResponse:
        picker = self.picker
        picker.access_log_streams += 1
        try:
            async for message in requests:
                if not message.HasField("http_logs"):
                    continue
                for entry in message.http_logs.log_entry:
                    request_id = entry.request.request_id
                    if not request_id:
                        continue
                    common = entry.common_properties
                    content_type = entry.response.response_headers.get("content-type", "")
                    await picker.answer_ended(
                        request_id.encode(),
                        entry.response.response_code.value if entry.response.HasField("response_code") else 0,
                        served_address(common),
                        time_to_first_byte(common) if content_type.startswith("text/event-stream") else None,
                    )
        finally:
            picker.access_log_streams -= 1
            if picker.access_log_streams == 0:
                picker.access_log_closed()
        return als_pb2.StreamAccessLogsResponse()
