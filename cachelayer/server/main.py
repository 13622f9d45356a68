"""`cachelayer server`: command-line entry of the shared cache daemon (LMCache `lmcache server` flags).

Secrets come from environment variables the flags name (`--auth-secret-env`, `--tenant-secret-env`),
never from the command line itself, which other users of the host can read in /proc.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import yaml

from cachelayer.config import CacheLayerConfigError, parse_config
from cachelayer.controller.auth import AuthConfigError, refuse_open_socket_beyond_loopback, secret_from_env
from cachelayer.server.access import Credential
from cachelayer.server.daemon import (
    DEFAULT_MAX_KEY_SPACES_PER_CLIENT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MAX_TOKENS,
    StoreServer,
    start_http,
)
from kvgate_common.yaml_errors import yaml_syntax_error

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
    parser.add_argument(
        "--remote-reconcile-interval-s",
        type=float,
        default=5.0,
        help="seconds between checks of which announced remote chunks Redis still holds (0: never); "
        "the lost ones are retracted to the engines they were announced to",
    )
    parser.add_argument(
        "--remote-eviction-notifications",
        action="store_true",
        help="also learn Redis's evictions, expiries and deletions from its keyspace notifications "
        "(the server's notify-keyspace-events must include Exeg)",
    )
    parser.add_argument(
        "--remote-auth-secret-env",
        default=None,
        metavar="NAME",
        help="environment variable holding the secret the engines share for the remote tier's values "
        "(HMAC-tagged); needed for a --remote-url beyond loopback",
    )
    parser.add_argument(
        "--remote-allow-unauthenticated",
        action="store_true",
        help="accept a --remote-url beyond loopback without --remote-auth-secret-env (only trusted "
        "hosts reach that Redis)",
    )
    parser.add_argument(
        "--auth-secret-env",
        default=None,
        metavar="NAME",
        help="environment variable holding the secret every client must present (16+ characters); "
        "clients set server_auth_secret_env to a variable with the same value",
    )
    parser.add_argument(
        "--tenant-secret-env",
        action="append",
        default=[],
        metavar="NAME=MODEL[,MODEL...]",
        help="another credential, limited to these model names (repeatable); it cannot map the "
        "shared pool (TCP only)",
    )
    parser.add_argument(
        "--tenant-quotas",
        default=None,
        metavar="FILE",
        help="YAML file of per-tenant shares of the L1 pool and the remote tier (the cache config's "
        "tenant_quotas mapping: tenants, default, shared, remote_size_gb); none by default",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="listen beyond loopback without a secret (only on a network you trust)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens one request may carry"
    )
    parser.add_argument(
        "--max-message-mb",
        type=float,
        default=DEFAULT_MAX_MESSAGE_BYTES / (1 << 20),
        help="largest frame a client may send, in MiB (a TCP store's KV); a larger one disconnects it",
    )
    parser.add_argument(
        "--max-key-spaces-per-client",
        type=int,
        default=DEFAULT_MAX_KEY_SPACES_PER_CLIENT,
        help="key spaces one credential may have open; a new one past it retires its least recently used",
    )


def credentials_from_args(args: argparse.Namespace) -> list[Credential]:
    """The credentials the flags name, their secrets read from the environment (AuthConfigError
    naming the flag and the fix when one cannot be used)."""
    credentials: list[Credential] = []
    secret = secret_from_env(args.auth_secret_env, "--auth-secret-env")
    if secret is not None:
        credentials.append(Credential(args.auth_secret_env, secret))
    for tenant in args.tenant_secret_env:
        variable, _, models = tenant.partition("=")
        names = frozenset(name.strip() for name in models.split(",") if name.strip())
        if not variable or not names:
            raise AuthConfigError(
                f"--tenant-secret-env {tenant!r}: expected NAME=MODEL[,MODEL...], e.g. "
                "TENANT_A_SECRET=Qwen/Qwen3-0.6B"
            )
        tenant_secret = secret_from_env(variable, "--tenant-secret-env")
        assert tenant_secret is not None
        credentials.append(Credential(variable, tenant_secret, names))
    if len({credential.secret for credential in credentials}) < len(credentials):
        raise AuthConfigError("two credentials have the same secret: give each its own")
    return credentials


PR_SET_DUMPABLE = 4


def make_non_dumpable() -> bool:
    """prctl(PR_SET_DUMPABLE, 0): /proc/<this pid>/fd and /proc/<this pid>/mem become root's, so
    other processes of this user cannot open the pool's memfd (or read the daemon's memory)
    without asking the daemon; its pool handout is the only way in. False (logged) if refused."""
    try:
        refused = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError) as exc:
        log.warning("cachelayer server: cannot make the daemon non-dumpable (%s)", exc)
        return False
    if refused:
        log.warning("cachelayer server: prctl(PR_SET_DUMPABLE, 0) failed (errno %d)", ctypes.get_errno())
    return not refused


def tenant_quotas_from_file(path: str | None) -> Any:
    """The mapping in the --tenant-quotas file (None without one); CacheLayerConfigError naming
    the file when it cannot be read or parsed."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CacheLayerConfigError(f"--tenant-quotas {path}: cannot read it: {exc.strerror}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CacheLayerConfigError(f"--tenant-quotas {yaml_syntax_error(Path(path), exc)}") from None


def run(args: argparse.Namespace, server_class: type[StoreServer] = StoreServer) -> int:
    try:
        quotas = tenant_quotas_from_file(args.tenant_quotas)
        config = parse_config(
            {
                "chunk_size": args.chunk_size,
                "max_local_cpu_size": args.l1_size_gb,
                "cache_policy": args.eviction_policy,
                # Engines store whole chunks, except a handoff (a prefill engine's prompt for another
                # engine to decode), whose tail chunk is kept for the decode engine's lookup of the
                # same prefix (cachelayer/connectors/planning.py).
                "save_unfull_chunk": True,
                "remote_url": args.remote_url,
                "remote_serde": args.remote_serde,
                "remote_reconcile_interval_s": args.remote_reconcile_interval_s,
                "remote_eviction_notifications": args.remote_eviction_notifications,
                "remote_auth_secret_env": args.remote_auth_secret_env,
                "remote_allow_unauthenticated": args.remote_allow_unauthenticated,
                "tenant_quotas": quotas,
            },
            source=f"cachelayer server flags (--tenant-quotas {args.tenant_quotas})"
            if args.tenant_quotas
            else "cachelayer server flags",
        )
    except CacheLayerConfigError as exc:
        # The config's keys are this command's flags: remote_auth_secret_env is --remote-auth-secret-env.
        flags = " (here: --remote-auth-secret-env NAME, --remote-allow-unauthenticated)"
        print(f"cachelayer server: {exc}{flags if 'remote_' in str(exc) else ''}")
        return 2
    for flag, value in (
        ("--lease-ttl-s", args.lease_ttl_s),
        ("--max-tokens", args.max_tokens),
        ("--max-message-mb", args.max_message_mb),
        ("--max-key-spaces-per-client", args.max_key_spaces_per_client),
    ):
        if value <= 0:
            print(f"cachelayer server: {flag} must be > 0, got {value}")
            return 2
    try:
        credentials = credentials_from_args(args)
        refuse_open_socket_beyond_loopback(
            args.host,
            credentials[0].secret if credentials else None,
            args.allow_unauthenticated,
            "the cache daemon (data plane)",
            "Pass --auth-secret-env NAME (and set server_auth_secret_env: NAME in the engines' cache "
            "config), or --allow-unauthenticated if the network is trusted.",
        )
    except AuthConfigError as exc:
        print(f"cachelayer server: {exc}")
        return 2
    if not args.no_shared_memory:
        make_non_dumpable()
    server = server_class(
        config,
        f"tcp://{args.host}:{args.port}",
        shared_memory=not args.no_shared_memory,
        lease_ttl_s=args.lease_ttl_s,
        credentials=credentials or None,
        max_tokens=args.max_tokens,
        max_message_bytes=int(args.max_message_mb * (1 << 20)),
        max_key_spaces_per_client=args.max_key_spaces_per_client,
    )
    http = start_http(server, args.host, args.http_port)
    server.start()
    # One line a supervisor (or a test) can wait for, with the ports actually bound.
    print(
        f"cachelayer server ready: data plane {server.endpoint}"
        f"{' (+ shared memory)' if server.shared_pool is not None else ''}, "
        f"{f'authenticated ({len(credentials)} credentials)' if credentials else 'unauthenticated'}, "
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
