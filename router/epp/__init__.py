"""`kvgate epp`: the endpoint picker that Envoy-based gateways call over ext_proc, as the Gateway API
Inference Extension specifies; the same core as `kvgate serve` (router/wiring.py), another face.

protocol (the ext_proc messages), picker (the routing call and its accounting), stream (the ext_proc
servicer), access_log (the answers' ends from Envoy's log), usage (token usage from response bodies),
metrics, grpc_server and http2 (gRPC over HTTP/2 on the gateway's loop), health (gRPC health),
server (the services on one listener), cli. Everything but cli needs the `epp` extra (hpack and the
message types: xds-protos, grpcio-health-checking).
"""
