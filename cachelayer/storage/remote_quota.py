"""Per-tenant shares of the remote tier (Redis), enforced by the engines that write it.

Redis is shared by every engine, so a tenant's usage must live in Redis too. For each tenant whose
remote share is below 1, a small index beside the chunks: a sorted set of its chunk keys (scored by
write time) and a hash of their sizes with the total under the field "". Each write batch sends,
behind its SETs and in the same round trip, one EVAL per such tenant (`_ACCOUNT`): it adds the new
keys, and while the total passes the tenant's cap pops the tenant's oldest keys and UNLINKs their
values, never another tenant's; the reply is the total and the keys it removed, which the writer
retracts in its KV events. Tenants with a share of 1 (and engines without quotas) pay nothing.

Why an index and not a count by key prefix: counting a prefix is a SCAN over the whole keyspace,
O(keys) on every check; the index costs O(log n) per chunk written, inside Redis, with no extra
round trip. What it does not see: values Redis itself evicts under maxmemory stay in the index
(counted until popped, so a tenant may be held somewhat below its share, never above it, until its
oldest keys are popped; popping a gone key frees its counted bytes), and a reader does not refresh
a key's place (the order is oldest written first, not least recently read).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cachelayer.config import TenantQuotas
from cachelayer.storage.quotas import SHARED_TENANT, SHARED_TENANT_LABEL
from cachelayer.storage.remote import KEY_PREFIX, RemoteTier, resp_command

log = logging.getLogger(__name__)

# KEYS: the tenant's order (sorted set) and sizes (hash; the total under field "").
# ARGV: cap, then (key, size, score) per chunk written. Returns [total, removed keys...]: at most
# MAX_REMOVED keys a call (a cap lowered by a new configuration is reached over several writes).
_ACCOUNT = b"""
local order, sizes = KEYS[1], KEYS[2]
local cap = tonumber(ARGV[1])
local total = tonumber(redis.call('HGET', sizes, '') or '0')
for i = 2, #ARGV, 3 do
  local key, size = ARGV[i], tonumber(ARGV[i + 1])
  if redis.call('ZADD', order, ARGV[i + 2], key) == 1 then
    redis.call('HSET', sizes, key, size)
    total = total + size
  end
end
local removed = {tostring(total)}
while total > cap and #removed <= 256 do
  local oldest = redis.call('ZPOPMIN', order)
  if #oldest == 0 then total = 0 break end
  total = total - tonumber(redis.call('HGET', sizes, oldest[1]) or '0')
  redis.call('HDEL', sizes, oldest[1])
  redis.call('UNLINK', oldest[1])
  removed[#removed + 1] = oldest[1]
end
removed[1] = tostring(total)
redis.call('HSET', sizes, '', total)
return removed
"""
MAX_REMOVED = 256
# Scores: write time in ms, times this, plus the chunk's position from the end of its batch, so a
# chain's tail chunks leave before its head (a chunk whose parent is gone is no prefix hit).
_POSITIONS = 1024


class RemoteQuota:
    """The caps of `quotas` over `remote`, whose size is `remote_size_gb` or the server's maxmemory."""

    def __init__(self, remote: RemoteTier, quotas: TenantQuotas) -> None:
        self.remote = remote
        self.quotas = quotas
        self._capacity: int | None = (
            int(quotas.remote_size_gb * (1 << 30)) if quotas.remote_size_gb is not None else None
        )
        self._capacity_warned = False
        # The totals Redis answered at this engine's last write of each configured tenant (every
        # engine's chunks of it); unlisted tenants are not remembered (clients may invent them).
        self.last_totals: dict[str, int] = {}
        self._listed = {SHARED_TENANT, *quotas.tenants}
        self.removed_chunks = 0
        self.refused_chunks = 0
        self._last_ms = 0

    def limits(self, tenant: str) -> bool:
        return self.quotas.share_of(tenant).remote_share < 1

    def capacity_bytes(self) -> int | None:
        """The tier's size (learnt once from maxmemory when not configured); None while unknown."""
        if self._capacity is None:
            setting = self.remote.config_value("maxmemory")
            if setting is not None and setting.isdigit() and int(setting) > 0:
                self._capacity = int(setting)
            elif not self._capacity_warned:
                self._capacity_warned = True
                log.error(
                    "cachelayer: tenant_quotas limit the remote tier, but its size is unknown (the "
                    "server's maxmemory is %s): chunks of limited tenants are not written through; "
                    "set tenant_quotas.remote_size_gb, or maxmemory on the server",
                    "0 (no limit)" if setting == "0" else "unreadable",
                )
        return self._capacity

    def cap(self, tenant: str) -> int | None:
        """Most bytes `tenant` may hold in the remote tier; None while the tier's size is unknown."""
        capacity = self.capacity_bytes()
        if capacity is None:
            return None
        return int(self.quotas.share_of(tenant).remote_share * capacity)

    def commands(self, batch: list[tuple[str, int, int]]) -> tuple[list[bytes], list[str], set[int]]:
        """For chunks (tenant, chunk key, value bytes) about to be written: the EVALs that account
        for them, the tenant of each EVAL, and the chunk keys not to write (their tenant's cap is
        unknown, or smaller than the chunk)."""
        by_tenant: dict[str, list[tuple[int, int]]] = {}
        refused: set[int] = set()
        for tenant, key, nbytes in batch:
            if not self.limits(tenant):
                continue
            cap = self.cap(tenant)
            if cap is None or nbytes > cap:
                refused.add(key)
                continue
            by_tenant.setdefault(tenant, []).append((key, nbytes))
        self.refused_chunks += len(refused)
        # Never the same millisecond twice from one engine: its batches keep their order.
        now_ms = self._last_ms = max(int(time.time() * 1000), self._last_ms + 1)
        commands, tenants = [], []
        for tenant, chunks in by_tenant.items():
            cap = self.cap(tenant)
            arguments: list[bytes] = [str(cap).encode()]
            for position, (key, nbytes) in enumerate(chunks):
                score = now_ms * _POSITIONS + (_POSITIONS - 1 - min(position, _POSITIONS - 1))
                arguments += [self.remote.redis_key(key).encode(), str(nbytes).encode(), str(score).encode()]
            order, sizes = index_keys(tenant)
            commands.append(resp_command(b"EVAL", _ACCOUNT, b"2", order, sizes, *arguments))
            tenants.append(tenant)
        return commands, tenants, refused

    def removed(self, tenants: list[str], replies: list[list[Any]]) -> list[int]:
        """The chunk keys (of this engine's layout) the EVALs removed; notes each tenant's total."""
        removed: list[int] = []
        for tenant, reply in zip(tenants, replies, strict=True):
            if reply and isinstance(reply[0], (bytes, bytearray)) and tenant in self._listed:
                self.last_totals[tenant] = int(reply[0])
            for redis_key in reply[1:]:
                key = self.remote.chunk_key_of(bytes(redis_key))
                if key is not None:
                    removed.append(key)
            self.removed_chunks += max(0, len(reply) - 1)
        return removed

    def report(self) -> dict[str, dict[str, int]]:
        """{tenant label: {bytes, cap_bytes}} for the configured tenants and the shared one, as
        Redis answered at this engine's last write of each (0 before one; a bounded set of labels).
        Unlisted tenants each have an index of their own: summing them would need a scan."""
        capacity = self._capacity or 0
        rows: dict[str, dict[str, int]] = {}
        for tenant in [SHARED_TENANT, *self.quotas.tenants]:
            label = SHARED_TENANT_LABEL if tenant == SHARED_TENANT else tenant
            share = self.quotas.share_of(tenant).remote_share
            rows[label] = {"bytes": self.last_totals.get(tenant, 0), "cap_bytes": int(share * capacity)}
        return rows


def index_keys(tenant: str) -> tuple[bytes, bytes]:
    """The Redis keys of `tenant`'s index: its order (sorted set) and its sizes (hash)."""
    base = f"{KEY_PREFIX}:tenant:{tenant}".encode()
    return base + b":order", base + b":sizes"
