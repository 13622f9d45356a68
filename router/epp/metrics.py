"""The endpoint picker's own Prometheus metrics (kvgate_epp_*), on the gateway's registry beside the
index's and the policies' (GET /metrics on the HTTP listener)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# A pick is tens of microseconds to a few milliseconds (a long prompt's tokenization).
_PICK_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1.6e-3, 3.2e-3, 6.4e-3, 12.8e-3, 0.1, 1.0)


class EppMetrics:
    def __init__(self, registry: CollectorRegistry, in_flight: Callable[[], int]) -> None:
        self.picks = Counter(
            "kvgate_epp_picks",
            "Requests the picker chose an endpoint for, by why (the policy's reason; `load` for paths "
            "routed by load alone)",
            ["reason"],
            registry=registry,
        )
        self.immediate = Counter(
            "kvgate_epp_immediate_responses",
            "Requests the picker answered itself (Envoy's immediate response), by reason and status",
            ["reason", "status"],
            registry=registry,
        )
        self.finished = Counter(
            "kvgate_epp_finished",
            "Picked requests whose accounting closed, by how: response_end (the answer ended), "
            "stream_closed (Envoy closed the stream first), response_timeout (no response headers in time), "
            "access_log (Envoy's access-log entry told the end), access_log_timeout / access_log_closed "
            "(the entry did not come within epp.stream_timeout_s / the access-log stream closed)",
            ["how"],
            registry=registry,
        )
        self.served_elsewhere = Counter(
            "kvgate_epp_served_elsewhere",
            "Responses Envoy reports served by another endpoint than the one picked (its retries)",
            registry=registry,
        )
        self.usage_tokens = Counter(
            "kvgate_epp_usage_tokens",
            "Tokens the engines reported in the `usage` of answers the picker saw, by kind "
            "(prompt, cached: prompt tokens served from the engine's cache, completion)",
            ["kind"],
            registry=registry,
        )
        self.pick_seconds = Histogram(
            "kvgate_epp_pick_seconds",
            "Time from the complete request body to the pick (parse, tokenize, choose)",
            buckets=_PICK_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "kvgate_epp_in_flight", "Picked requests whose answer has not ended", registry=registry
        )
        self.in_flight.set_function(in_flight)
