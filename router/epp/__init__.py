"""`kvgate epp`: the endpoint picker that Envoy-based gateways call over ext_proc, as the Gateway API
Inference Extension specifies; the same core as `kvgate serve` (router/wiring.py), another face.

protocol (the ext_proc messages), picker (the routing call and its accounting), stream (the ext_proc
servicer), usage (token usage from response bodies), metrics, server (gRPC server and health), cli.
Everything but cli needs the `epp` extra (grpcio, grpcio-health-checking, xds-protos).
"""
