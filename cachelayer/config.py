"""The cache layer's configuration: LMCache's key names, loaded from YAML or a dict, validated.

A user switching from LMCache keeps their file: the keys below are LMCache's, with its units
(sizes in GB). The file is named by CACHELAYER_CONFIG_FILE (or LMCACHE_CONFIG_FILE). msgspec
validates it, so a bad file is refused with the file, the key and what was expected.
"""

from __future__ import annotations

import logging
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from cachelayer.errors import CacheLayerError
from kvgate_common.yaml_errors import with_bad_value, yaml_syntax_error

log = logging.getLogger(__name__)

CONFIG_FILE_ENV_VARS = ("CACHELAYER_CONFIG_FILE", "LMCACHE_CONFIG_FILE")

# LMCache's default instance id: the key its controller answers /lookup under.
DEFAULT_INSTANCE_ID = "lmcache_default_instance"

HashAlgorithm = Literal["sha256_cbor_64bit", "xxhash", "builtin"]
CachePolicy = Literal["LRU", "LFU", "FIFO"]
RemoteSerde = Literal["naive", "cachegen"]

# Schemes of `remote_url` the remote tier speaks (Redis and Valkey speak the same protocol).
REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")

# LMCache's deprecated key names -> the current ones (as LMCache's own alias table maps them).
_DEPRECATED_ALIASES = {"lmcache_worker_port": "lmcache_worker_ports", "controller_url": "controller_pull_url"}


class CacheLayerConfigError(CacheLayerError):
    """A cache-layer configuration that cannot be used; the message says where and how to fix it."""


# A share of a tier: a fraction of its size, above 0 and at most 1.
Share = Annotated[float, msgspec.Meta(gt=0, le=1)]


class TenantShare(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The most one tenant may hold: a share of L1 (the CPU or shared-memory pool) and of the remote tier."""

    l1_share: Share = 1.0
    remote_share: Share = 1.0


class TenantQuotas(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Per-tenant caps (docs/cachelayer.md, "Tenant quotas"). A chunk's tenant is the part of its
    cache_salt before the first ':'; chunks stored without a salt belong to the shared tenant."""

    # Tenant name -> its share; a tenant not listed gets `default` (each on its own).
    tenants: dict[str, TenantShare] = {}
    default: TenantShare = TenantShare()
    # Chunks stored without a cache_salt (what every tenant may reuse).
    shared: TenantShare = TenantShare()
    # The remote tier's size in GB that remote shares are fractions of; None: the server's maxmemory.
    remote_size_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def __post_init__(self) -> None:
        for name in self.tenants:
            if not name or ":" in name:
                raise ValueError(
                    f"tenant name {name!r}: a tenant is the part of a cache_salt before the first ':', "
                    "so its name must be non-empty and hold no ':'"
                )
            if name in ("_shared", "_other"):
                raise ValueError(
                    f"tenant name {name!r} is reserved: usage reports name the shared tenant "
                    "'_shared' and the tenants not listed '_other'; rename the tenant"
                )

    def share_of(self, tenant: str) -> TenantShare:
        """The share that applies to `tenant` ("" is the shared tenant)."""
        if not tenant:
            return self.shared
        return self.tenants.get(tenant, self.default)

    @property
    def limits_remote(self) -> bool:
        """Whether any share of the remote tier is below 1 (else the remote tier keeps no index)."""
        shares = [self.default, self.shared, *self.tenants.values()]
        return any(share.remote_share < 1 for share in shares)


class CacheLayerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 256
    local_cpu: bool = True
    # GB, as in LMCache. The L1 pool is allocated once at this size.
    max_local_cpu_size: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # A directory ("/path" or "file:///path"), or None for no disk tier.
    local_disk: str | None = None
    max_local_disk_size: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # Store the last, shorter chunk too (LMCache's documented 12-token example relies on it).
    save_unfull_chunk: bool = True
    enable_kv_events: bool = False
    # "builtin" is LMCache's default name; here it means the fast deterministic xxhash, because
    # Python's hash() differs between processes and would make keys useless across restarts.
    pre_caching_hash_algorithm: HashAlgorithm = "sha256_cbor_64bit"
    cache_policy: CachePolicy = "LRU"
    enable_controller: bool = False
    lmcache_instance_id: Annotated[str, msgspec.Meta(min_length=1)] = DEFAULT_INSTANCE_ID
    # host:port (or tcp://host:port) of the controller's monitor (registration + heartbeat) socket.
    controller_pull_url: str | None = None
    # Ports the workers' command sockets bind, indexed by worker id; None or 0 lets the OS choose.
    lmcache_worker_ports: list[Annotated[int, msgspec.Meta(ge=0, le=65535)]] | None = None
    # Seconds between heartbeats; the controller drops a worker silent for three intervals.
    # LMCache defaults to no heartbeat, which silently empties its index; here it is on.
    lmcache_worker_heartbeat_time: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    # Name of the environment variable holding the secret shared with the controller (its
    # --auth-secret-env): every report, command and reply is signed with it. Never the secret itself.
    controller_auth_secret_env: str | None = None
    # Without a secret, a command socket bound beyond loopback (p2p_host) is refused unless this is true.
    controller_allow_unauthenticated: bool = False
    # Most tokens one controller command may carry (the controller's --max-tokens); more is refused.
    controller_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 1 << 20
    # Name of the environment variable holding the shared cache daemon's secret (its
    # --auth-secret-env): the vLLM connector presents it to `cachelayer server`. Never the secret.
    server_auth_secret_env: str | None = None
    # The address the workers' command sockets bind (default 127.0.0.1). Peer-to-peer transfer is
    # not implemented (see docs/cachelayer.md).
    p2p_host: str | None = None
    p2p_init_ports: list[int] | None = None
    # The shared remote tier below L1/L2 (docs/cachelayer.md, "Remote tier"): redis://HOST:PORT,
    # rediss://HOST:PORT, redis://:PASSWORD@HOST:PORT/DB or unix:///path; None for no remote tier.
    remote_url: str | None = None
    # How chunks travel to the remote tier: "naive" (the KV bytes as stored) or "cachegen" (encoded).
    remote_serde: RemoteSerde = "naive"
    # LMCache's bound on a blocking remote read (seconds); here the ceiling of remote_timeout_s.
    blocking_timeout_secs: Annotated[int, msgspec.Meta(ge=1)] = 10
    # Not LMCache's: the total deadline of every remote call, from its first byte sent to its last
    # byte read (connecting included), however slowly the server answers.
    remote_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    # Not LMCache's: a call moving many bytes gets one more second per this many MB moved (a
    # 512 MiB prompt is not cut off for being large; a server slower than this still is).
    remote_min_transfer_mb_per_s: Annotated[float, msgspec.Meta(gt=0)] = 64.0
    # Not LMCache's: name of the environment variable holding a secret the engines sharing the
    # remote tier all have (never the secret itself). With it, values carry an HMAC tag and only
    # tagged values are loaded (docs/cachelayer.md, Security).
    remote_auth_secret_env: str | None = None
    # Not LMCache's: tag and check values when a secret is configured (false: checksum only, e.g.
    # while the secret is being rolled out to every engine).
    remote_authenticate_values: bool = True
    # Not LMCache's: without a secret, a remote_url beyond loopback is refused unless this is true
    # (whoever can write to that Redis could then feed KV of their choosing to every engine).
    remote_allow_unauthenticated: bool = False
    # Not LMCache's: consecutive remote failures that open the circuit breaker, and the seconds
    # it stays open before one probe call may close it again.
    remote_failure_threshold: Annotated[int, msgspec.Meta(ge=1)] = 3
    remote_retry_after_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    # Not LMCache's: store batches waiting for the remote writer; a store finding it full is not
    # written through (counted as dropped), so a slow remote never delays the engine.
    remote_write_queue_batches: Annotated[int, msgspec.Meta(ge=1)] = 64
    # Not LMCache's: how the engine learns which of the chunks it announced in the remote tier
    # Redis has since lost, so that its KV events retract them (docs/cachelayer.md, "Remote tier
    # truth"): every remote_reconcile_interval_s it asks Redis which still exist (0: never), and
    # with remote_eviction_notifications it also listens to Redis's keyspace notifications of
    # evicted, expired and deleted keys (needs the server's notify-keyspace-events to include them).
    remote_reconcile_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    remote_eviction_notifications: bool = False
    # Not LMCache's: most announced remote chunks an engine remembers; past it the oldest is
    # retracted (announced removed) rather than left credited unchecked.
    remote_max_announced_chunks: Annotated[int, msgspec.Meta(ge=1)] = 1 << 18
    # The cache layer's own KV-event publisher (vLLM's protocol), used when enable_kv_events is
    # true and the engine does not forward the events itself.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # Not LMCache's: per-tenant caps on L1 and the remote tier; None: none (one shared budget).
    tenant_quotas: TenantQuotas | None = None
    extra_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.local_cpu:
            raise ValueError("local_cpu: false is not supported: the CPU pool is the cache's first tier")
        if self.local_disk is not None and self.max_local_disk_size <= 0:
            raise ValueError(
                "local_disk is set but max_local_disk_size is 0: give the disk tier a size in GB"
            )
        for field, value in (
            ("kv_events_endpoint", self.kv_events_endpoint),
            ("kv_events_replay_endpoint", self.kv_events_replay_endpoint),
        ):
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{field} {value!r} must start with tcp://, ipc:// or inproc://")
        if self.remote_url is not None:
            scheme = self.remote_url.partition("://")[0] if "://" in self.remote_url else ""
            if scheme not in REMOTE_URL_SCHEMES:
                raise ValueError(
                    f"remote_url {self.remote_url!r}: the remote tier speaks Redis (and Valkey): "
                    "use redis://HOST:PORT, rediss://HOST:PORT or unix:///path (LMCache's lm://, "
                    "mooncakestore://, infinistore:// and s3:// backends are not implemented)"
                )
            # Checked here, so that every entry point (a YAML file, the daemon's flags) refuses at
            # startup: an unset secret variable, or an unauthenticated Redis beyond loopback.
            from cachelayer.shared_secret import remote_tier_secret

            remote_tier_secret(
                self.remote_url,
                self.remote_auth_secret_env,
                self.remote_authenticate_values,
                self.remote_allow_unauthenticated,
            )

    @property
    def remote_call_timeout_s(self) -> float:
        """Every remote call's total deadline: remote_timeout_s, never above blocking_timeout_secs."""
        return min(self.remote_timeout_s, float(self.blocking_timeout_secs))

    @property
    def local_disk_path(self) -> Path | None:
        if self.local_disk is None:
            return None
        return Path(self.local_disk.removeprefix("file://"))

    @property
    def max_local_cpu_bytes(self) -> int:
        return int(self.max_local_cpu_size * (1 << 30))

    @property
    def max_local_disk_bytes(self) -> int:
        return int(self.max_local_disk_size * (1 << 30))


def _format_error(source: str, exc: Exception, data: Any = None) -> str:
    text = str(exc)
    message, where = text, ""
    if " - at `$" in text:
        message, _, where = text.rpartition(" - at `$")
        message = with_bad_value(message, data, "$" + where.rstrip("`"))
        where = where.rstrip("`").lstrip(".")
    if message.startswith("Object contains unknown field"):
        message += f" (accepted keys: {', '.join(CacheLayerConfig.__struct_fields__)})"
    elif message.startswith("Invalid enum value") and where in _CHOICES:
        message += f" (choose one of {', '.join(_CHOICES[where])})"
    if where:
        return f"{source}: invalid cache-layer configuration at `{where}`: {message}"
    return f"{source}: invalid cache-layer configuration: {message}"


_CHOICES = {
    "pre_caching_hash_algorithm": typing.get_args(HashAlgorithm),
    "cache_policy": typing.get_args(CachePolicy),
    "remote_serde": typing.get_args(RemoteSerde),
}


def _resolve_deprecated_keys(data: dict[str, Any], source: str) -> dict[str, Any]:
    """LMCache's deprecated names under their current ones (`lmcache_worker_port: 9001` is read as
    `lmcache_worker_ports: [9001]`); both spellings at once are refused rather than one ignored."""
    resolved = dict(data)
    for old, new in _DEPRECATED_ALIASES.items():
        if old not in resolved:
            continue
        if new in resolved:
            raise CacheLayerConfigError(
                f"{source}: invalid cache-layer configuration at `{old}`: it is LMCache's deprecated "
                f"name of `{new}`, which is set too; keep only `{new}`"
            )
        value = resolved.pop(old)
        if new == "lmcache_worker_ports" and isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        resolved[new] = value
        log.warning("%s: `%s` is deprecated (LMCache's old name), read as `%s`", source, old, new)
    return resolved


def parse_config(data: dict[str, Any] | None, source: str = "<config>") -> CacheLayerConfig:
    """Validate a mapping of LMCache-style keys into a CacheLayerConfig."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise CacheLayerConfigError(
            f"{source}: the configuration must be a mapping, got {type(data).__name__}"
        )
    data = _resolve_deprecated_keys(data, source)
    try:
        return msgspec.convert(data, CacheLayerConfig)
    except msgspec.ValidationError as exc:
        raise CacheLayerConfigError(_format_error(source, exc, data)) from None


def load_config(path: str | os.PathLike[str] | None = None) -> CacheLayerConfig:
    """Read a YAML file (by default the one named by CACHELAYER_CONFIG_FILE / LMCACHE_CONFIG_FILE).

    With no path and no variable set, the defaults apply.
    """
    if path is None:
        path = next((os.environ[name] for name in CONFIG_FILE_ENV_VARS if os.environ.get(name)), None)
        if path is None:
            return CacheLayerConfig()
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise CacheLayerConfigError(
            f"{file}: cannot read cache-layer configuration: {exc.strerror}"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise CacheLayerConfigError(yaml_syntax_error(file, exc)) from None
    return parse_config(data, str(file))


def as_config(config: CacheLayerConfig | dict[str, Any] | str | os.PathLike[str] | None) -> CacheLayerConfig:
    """Accept a config object, a dict of keys, a YAML path, or None (environment or defaults)."""
    if isinstance(config, CacheLayerConfig):
        return config
    if isinstance(config, dict):
        return parse_config(config)
    return load_config(config)
