"""The simulated engines' shared KV tier: a second-level block cache several simulated engines read.

It stands for the cache layer's shared stores (its daemon, its Redis tier): KV blocks computed on any
member are written there, and any member whose GPU pool misses a prefix the store holds loads it at
`--shared-load-us-per-token` instead of recomputing it (router/sim/engine.py charges the load). The
members' KV events report the blocks each one wrote with medium "shared", as the cache layer's
daemon reports its store, so a gateway's `shared_tiers` can name them.

Simulated engines run as separate processes (`kvgate sim`, one per engine), so the store lives in a
real `redis-server` that every member reaches over loopback: one Redis set of block hashes per tier
name (no KV bytes: the simulator computes nothing). Every call is one round trip and time-boxed; a
store that does not answer is a miss (lookups) or a skipped write, never an error to a request. The
set never evicts: it stands for a store sized to hold the working set. Emptying it (between benchmark
runs) is its owner's job, not an engine's: `/reset_prefix_cache` leaves a shared store alone, as it
does in vLLM with a KV connector.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvgate.sim.shared")

# The medium the members' KV events give the blocks they wrote to the shared store.
MEDIUM_SHARED = "shared"
KEY_PREFIX = "kvgate-sim:shared-tier:"


def tier_key(tier: str) -> str:
    """The Redis key of a tier's block set (what a benchmark deletes to empty the tier)."""
    return KEY_PREFIX + tier


class SharedBlockStore:
    """The block hashes of one shared tier, in a Redis set every member reaches."""

    def __init__(self, url: str, tier: str, timeout_s: float = 0.2):
        if not tier:
            raise ValueError("the shared tier needs a name (--shared-tier)")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--shared-tier-url {url!r} must start with redis://, rediss:// or unix://")
        self.tier = tier
        self.timeout_s = timeout_s
        self._key = tier_key(tier)
        # Imported here: the redis client comes with the `cluster` extra, and only a simulated engine
        # of a shared tier needs it.
        try:
            import redis.asyncio as redis
            from redis.exceptions import RedisError
        except ImportError:
            raise ValueError(
                "a shared tier lives in Redis and the redis client is not installed: "
                "pip install 'kvgate[cluster]'"
            ) from None

        self._errors = (RedisError, OSError, TimeoutError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False
        )
        self.errors = 0

    async def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the store holds (0 when it cannot be reached)."""
        if not hashes:
            return 0
        try:
            held = await asyncio.wait_for(
                self._client.smismember(self._key, [str(h) for h in hashes]), self.timeout_s
            )
        except self._errors as exc:
            self._note_error("lookup", exc)
            return 0
        for index, present in enumerate(held):
            if not present:
                return index
        return len(hashes)

    async def written(self, hashes: list[int]) -> bool:
        """Write the blocks; False when the store could not be reached (the write is skipped)."""
        if not hashes:
            return True
        try:
            await asyncio.wait_for(self._client.sadd(self._key, *[str(h) for h in hashes]), self.timeout_s)
        except self._errors as exc:
            self._note_error("write", exc)
            return False
        return True

    def _note_error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("shared tier %r: %s failed (%d so far): %r", self.tier, what, self.errors, exc)

    async def close(self) -> None:
        await self._client.aclose()
