"""L1: one CPU byte pool, allocated once (pinned when CUDA is present), carved by a free-list allocator."""

from __future__ import annotations

import torch

from cachelayer.config import TenantQuotas
from cachelayer.storage.allocator import FreeListAllocator
from cachelayer.storage.quotas import TenantLedger
from cachelayer.storage.tier import Tier, TierEntry


class CpuTier(Tier):
    name = "LocalCPUBackend"
    medium = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        cache_policy: str,
        pool: torch.Tensor | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        """`pool`: bytes to carve (e.g. a shared-memory segment); by default a private allocation.
        `quotas`: per-tenant caps, as shares of the pool (None: one budget for every tenant)."""
        allocator = FreeListAllocator(capacity_bytes if pool is None else pool.numel())
        super().__init__(
            cache_policy, TenantLedger(quotas, allocator.capacity) if quotas is not None else None
        )
        self.allocator = allocator
        # torch.empty only reserves address space; pages are touched as chunks are written.
        self.pool = (
            torch.empty(self.allocator.capacity, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            if pool is None
            else pool
        )

    def _allocate(self, nbytes: int) -> int | None:
        return self.allocator.allocate(nbytes)

    def _release_space(self, entry: TierEntry) -> None:
        self.allocator.free(entry.location)

    def _charged_bytes(self, nbytes: int) -> int:
        return self.allocator.rounded(nbytes)

    def view(self, entry: TierEntry) -> torch.Tensor:
        """The entry's bytes in the pool (a view, no copy)."""
        return self.pool[entry.location : entry.location + entry.nbytes]

    @property
    def usage_ratio(self) -> float:
        return self.allocator.allocated_bytes / max(1, self.allocator.capacity)
