"""`cachelayer server`: command-line entry of the shared cache daemon (LMCache `lmcache server` flags)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from cachelayer.config import CacheLayerConfigError, parse_config
from cachelayer.server.daemon import StoreServer, start_http

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface of the ZMQ data plane and HTTP side")
    # 5555: the ZMQ port of LMCache's multiprocess server (MPServerConfig.port), so connectors
    # configured for LMCache's daemon find this one where they look.
    parser.add_argument("--port", type=int, default=5555, help="ZMQ data-plane port (0: any free port)")
    parser.add_argument("--http-port", type=int, default=7000, help="HTTP port for /healthcheck and /metrics")
    parser.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk; clients must agree")
    parser.add_argument(
        "--l1-size-gb", type=float, default=8.0, help="CPU store size in GB, shared by every key space"
    )
    parser.add_argument(
        "--eviction-policy", default="LRU", choices=["LRU", "LFU", "FIFO"], help="what a full store drops"
    )
    parser.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="keep the L1 pool private: every client's KV travels over the socket",
    )
    parser.add_argument(
        "--lease-ttl-s",
        type=float,
        default=30.0,
        help="how long a same-host client may hold chunks between two messages (shared memory)",
    )
    parser.add_argument(
        "--remote-url", default=None, help="shared remote tier below L1 (redis://HOST:PORT); none by default"
    )
    parser.add_argument("--remote-serde", default="naive", choices=["naive", "cachegen"])


def run(args: argparse.Namespace, server_class: type[StoreServer] = StoreServer) -> int:
    try:
        config = parse_config(
            {
                "chunk_size": args.chunk_size,
                "max_local_cpu_size": args.l1_size_gb,
                "cache_policy": args.eviction_policy,
                # Only full chunks are shared between engines (a tail chunk differs per prompt).
                "save_unfull_chunk": False,
                "remote_url": args.remote_url,
                "remote_serde": args.remote_serde,
            },
            source="cachelayer server flags",
        )
    except CacheLayerConfigError as exc:
        print(f"cachelayer server: {exc}")
        return 2
    if args.lease_ttl_s <= 0:
        print(f"cachelayer server: --lease-ttl-s must be > 0, got {args.lease_ttl_s}")
        return 2
    server = server_class(
        config,
        f"tcp://{args.host}:{args.port}",
        shared_memory=not args.no_shared_memory,
        lease_ttl_s=args.lease_ttl_s,
    )
    http = start_http(server, args.host, args.http_port)
    server.start()
    # One line a supervisor (or a test) can wait for, with the ports actually bound.
    print(
        f"cachelayer server ready: data plane {server.endpoint}"
        f"{' (+ shared memory)' if server.shared_pool is not None else ''}, "
        f"http http://{args.host}:{http.server_address[1]}",
        flush=True,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    http.shutdown()
    server.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="cachelayer server", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
