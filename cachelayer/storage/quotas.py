"""Per-tenant quotas of one tier: which tenant a chunk belongs to, what each holds, and its cap.

A chunk's tenant is the part of its cache_salt before the first ':' (the gateway sets the salt to
`<tenant>` or `<tenant>:<client salt>`); a chunk stored without a salt belongs to the shared
tenant, "". A `TenantLedger` counts the bytes and chunks each tenant has allocated in one tier,
from the reservation to the moment the space goes back (so the sum over tenants is the tier's
allocated bytes), and answers each tenant's cap. The tier (cachelayer.storage.tier) enforces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachelayer.config import TenantQuotas

SHARED_TENANT = ""
# How per-tenant figures are reported: configured tenants by name, the rest summed under this one
# (a client inventing salts must not grow a metric's label set).
OTHER_TENANTS = "_other"
SHARED_TENANT_LABEL = "_shared"


def tenant_of(cache_salt: str | None) -> str:
    """The tenant of a chunk stored under `cache_salt` ("" for the shared tenant)."""
    if not cache_salt:
        return SHARED_TENANT
    return cache_salt.partition(":")[0]


@dataclass(slots=True)
class TenantUsage:
    bytes: int = 0
    chunks: int = 0


class TenantLedger:
    """Bytes and chunks per tenant in one tier of `capacity_bytes`, and each tenant's cap in bytes.

    Only tenants holding something have an entry: the ledger is bounded by the tier's chunks."""

    __slots__ = ("_caps", "_counts", "_default_cap", "capacity_bytes", "quotas", "refused_chunks", "usage")

    def __init__(self, quotas: TenantQuotas, capacity_bytes: int, *, tier: str = "l1") -> None:
        self.quotas = quotas
        self.capacity_bytes = capacity_bytes

        def cap(tenant: str) -> int:
            share = quotas.share_of(tenant)
            return int((share.l1_share if tier == "l1" else share.remote_share) * capacity_bytes)

        self._caps = {tenant: cap(tenant) for tenant in [SHARED_TENANT, *quotas.tenants]}
        self._default_cap = int(
            (quotas.default.l1_share if tier == "l1" else quotas.default.remote_share) * capacity_bytes
        )
        self.usage: dict[str, TenantUsage] = {}
        # Chunks refused because their tenant's own chunks could not make room (pinned or in use).
        self.refused_chunks = 0
        # Per report label: chunks evicted to keep their tenant within its cap, and chunks refused.
        self._counts: dict[str, dict[str, int]] = {}

    def label(self, tenant: str) -> str:
        """The name `tenant` is reported under: its own when configured, else `_shared` / `_other`."""
        if tenant == SHARED_TENANT:
            return SHARED_TENANT_LABEL
        return tenant if tenant in self.quotas.tenants else OTHER_TENANTS

    def note(self, tenant: str, *, evicted: int = 0, refused: int = 0) -> None:
        counts = self._counts.setdefault(self.label(tenant), {"evicted_for_cap": 0, "refused": 0})
        counts["evicted_for_cap"] += evicted
        counts["refused"] += refused
        self.refused_chunks += refused

    def cap(self, tenant: str) -> int:
        return self._caps.get(tenant, self._default_cap)

    def used(self, tenant: str) -> int:
        usage = self.usage.get(tenant)
        return usage.bytes if usage is not None else 0

    def add(self, tenant: str, nbytes: int) -> None:
        usage = self.usage.get(tenant)
        if usage is None:
            usage = self.usage[tenant] = TenantUsage()
        usage.bytes += nbytes
        usage.chunks += 1

    def subtract(self, tenant: str, nbytes: int) -> None:
        usage = self.usage[tenant]
        usage.bytes -= nbytes
        usage.chunks -= 1
        if usage.chunks == 0:
            del self.usage[tenant]

    def report(self) -> dict[str, dict[str, int]]:
        """{tenant label: {bytes, chunks, cap_bytes, evicted_for_cap, refused}} for the shared tenant,
        every configured tenant (held or not) and the unlisted ones summed (`cap_bytes` is then each
        one's): a bounded set of labels."""
        caps = {SHARED_TENANT_LABEL: self.cap(SHARED_TENANT), OTHER_TENANTS: self._default_cap}
        caps |= {tenant: self.cap(tenant) for tenant in self.quotas.tenants}
        report = {
            label: {"bytes": 0, "chunks": 0, "cap_bytes": cap, "evicted_for_cap": 0, "refused": 0}
            for label, cap in caps.items()
        }
        for label, counts in self._counts.items():
            report[label].update(counts)
        for tenant, usage in self.usage.items():
            row = report[self.label(tenant)]
            row["bytes"] += usage.bytes
            row["chunks"] += usage.chunks
        return report
