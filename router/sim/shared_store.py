"""The simulated engines' shared KV tier: a second-level block cache several simulated engines read.

It stands for the cache layer's shared stores (its daemon, its Redis tier): KV blocks computed on any
member are written there, and any member whose GPU pool misses a prefix the store holds loads it at
`--shared-load-us-per-token` instead of recomputing it (router/sim/engine.py charges the load). The
members' KV events report the blocks each one wrote with medium "shared", as the cache layer's
daemon reports its store, so a gateway's `shared_tiers` can name them.

Simulated engines run as separate processes (`kvgate sim`, one per engine), so the store lives in a
real `redis-server` that every member reaches over loopback: one key per block (`block_key`), its
value `--shared-block-bytes` of filler standing for the block's KV (the simulator computes nothing),
so a server under `maxmemory` evicts block by block as the cache layer's Redis tier does. Every
call is one round trip and time-boxed; a store that does not answer is a miss (lookups) or a
skipped write, never an error to a request. Emptying it (between benchmark runs) is its owner's
job, not an engine's: `/reset_prefix_cache` leaves a shared store
alone, as it does in vLLM with a KV connector.

Removals (`--shared-tier-removals`, `watch_removals`): the server's keyevent notifications of
evicted, expired and deleted block keys reach the member, which retracts the blocks it announced
(as the cache layer's remote tier does, cachelayer/storage/remote_truth.py); a server that restarted
(its `run_id` changed: a store that lost everything, as a restarted daemon) is a clear of the shared
medium. Pub/sub is fire-and-forget, so after every (re)subscription the member asks which of its
announced blocks are still there. Without it (the default) the members never hear of a loss, and a
router keeps crediting what the store dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Protocol

log = logging.getLogger("kvgate.sim.shared")

# The medium the members' KV events give the blocks they wrote to the shared store.
MEDIUM_SHARED = "shared"
KEY_PREFIX = "kvgate-sim:shared-tier:"
# The keyevent classes a removal needs: E (keyevent channel), x (expired), e (evicted), g (DEL).
NEEDED_KEYEVENT_FLAGS = "Exeg"
# Seconds before subscribing again after the notification connection failed: short at first (a
# restarted store is cleared only once the member is back; until then the router credits what it
# lost), doubling up to the last while the server stays away.
RESUBSCRIBE_AFTER_S = (0.02, 1.0)
# Keys asked about in one round trip of the check after a (re)subscription.
RECHECK_SLICE = 1024


def tier_prefix(tier: str) -> str:
    """The prefix of a tier's block keys (what a benchmark scans or deletes to empty the tier)."""
    return f"{KEY_PREFIX}{tier}:"


def block_key(tier: str, block_hash: int) -> str:
    """The Redis key of one block of a tier."""
    return f"{tier_prefix(tier)}{block_hash}"


class RemovalListener(Protocol):
    """What the store tells a member that watches removals (SimulatedEngine is one)."""

    def removed(self, block_hashes: list[int]) -> None: ...

    def store_restarted(self) -> None: ...

    def announced(self) -> Collection[int]: ...


class SharedBlockStore:
    """The blocks of one shared tier, one Redis key each, in a server every member reaches."""

    def __init__(self, url: str, tier: str, timeout_s: float = 0.2, block_bytes: int = 1):
        """`block_bytes`: the size of each block's value, standing for its KV bytes (what a server
        under `maxmemory` counts)."""
        if not tier:
            raise ValueError("the shared tier needs a name (--shared-tier)")
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--shared-tier-url {url!r} must start with redis://, rediss:// or unix://")
        if block_bytes < 1:
            raise ValueError(f"--shared-block-bytes must be at least 1, got {block_bytes}")
        self.tier = tier
        self.url = url
        self._value = b"k" * block_bytes
        self.timeout_s = timeout_s
        self._prefix = tier_prefix(tier)
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

        self._redis = redis
        self._errors = (RedisError, OSError, TimeoutError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False
        )
        self.errors = 0
        # What the removal watch did (exported for tests and benchmarks through the engine).
        self.removals_heard = 0
        self.restarts_heard = 0
        self.subscriptions = 0
        # The server process the watch last subscribed to (INFO's run_id): another one lost everything.
        self._run_id: str | None = None

    def _key(self, block_hash: int) -> str:
        return f"{self._prefix}{block_hash}"

    async def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the store holds (0 when it cannot be reached)."""
        if not hashes:
            return 0
        try:
            # MGET, not EXISTS: a read refreshes the keys' LRU clocks, as a load from the tier does.
            held = await asyncio.wait_for(self._client.mget([self._key(h) for h in hashes]), self.timeout_s)
        except self._errors as exc:
            self._note_error("lookup", exc)
            return 0
        for index, present in enumerate(held):
            if present is None:
                return index
        return len(hashes)

    async def written(self, hashes: list[int]) -> bool:
        """Write the blocks; False when the store could not be reached (the write is skipped)."""
        if not hashes:
            return True
        try:
            await asyncio.wait_for(
                self._client.mset({self._key(h): self._value for h in hashes}), self.timeout_s
            )
        except self._errors as exc:
            self._note_error("write", exc)
            return False
        return True

    async def watch_removals(self, listener: RemovalListener) -> None:
        """Tell `listener` of every block key the server evicts, expires or deletes, and of a server
        restart; runs until cancelled, subscribing again whenever the connection drops."""
        first, most = RESUBSCRIBE_AFTER_S
        delay = first
        while True:
            subscriptions = self.subscriptions
            try:
                await self._watch_once(listener)
            except asyncio.CancelledError:
                raise
            except self._errors as exc:
                self._note_error("removal watch", exc)
            delay = first if self.subscriptions > subscriptions else min(delay * 2, most)
            await asyncio.sleep(delay)

    async def _watch_once(self, listener: RemovalListener) -> None:
        # Its own connection without a read timeout: a quiet tier sends nothing for long stretches.
        client = self._redis.Redis.from_url(
            self.url, socket_connect_timeout=self.timeout_s, decode_responses=False
        )
        try:
            server = await asyncio.wait_for(client.info("server"), self.timeout_s)
            flags = await asyncio.wait_for(client.config_get("notify-keyspace-events"), self.timeout_s)
            enabled = str(flags.get("notify-keyspace-events", ""))
            if not _notifications_cover(enabled):
                log.warning(
                    "shared tier %r: the server's notify-keyspace-events is %r; its evictions reach no "
                    "member (set it to include %r: redis-server --notify-keyspace-events %s)",
                    self.tier, enabled, NEEDED_KEYEVENT_FLAGS, NEEDED_KEYEVENT_FLAGS,
                )  # fmt: skip
            database = client.connection_pool.connection_kwargs.get("db", 0)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            await pubsub.subscribe(
                *(f"__keyevent@{database}__:{event}" for event in ("evicted", "expired", "del"))
            )
            self.subscriptions += 1
            current = str(server.get("run_id"))
            if self._run_id is not None and current != self._run_id:
                # Another server process: everything the old one held is gone.
                self.restarts_heard += 1
                listener.store_restarted()
            else:
                await self._recheck(listener)  # what was lost while nobody listened
            self._run_id = current
            async for message in pubsub.listen():
                gone = self._block_of(message.get("data"))
                if gone is None:
                    continue
                batch = [gone]
                # Whatever else has already arrived goes out in the same event.
                while (more := await pubsub.get_message(timeout=0)) is not None:
                    if (block := self._block_of(more.get("data"))) is not None:
                        batch.append(block)
                self.removals_heard += len(batch)
                listener.removed(batch)
        finally:
            await client.aclose()

    async def _recheck(self, listener: RemovalListener) -> None:
        announced = list(listener.announced())
        for start in range(0, len(announced), RECHECK_SLICE):
            part = announced[start : start + RECHECK_SLICE]
            held = await asyncio.wait_for(self._client.mget([self._key(h) for h in part]), self.timeout_s)
            gone = [block for block, value in zip(part, held, strict=True) if value is None]
            if gone:
                listener.removed(gone)

    def _block_of(self, key: object) -> int | None:
        """The block hash of one of this tier's keys, None for any other key."""
        if not isinstance(key, bytes):
            return None
        text = key.decode("utf-8", "replace")
        if not text.startswith(self._prefix):
            return None
        try:
            return int(text[len(self._prefix) :])
        except ValueError:
            return None

    def _note_error(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        if self.errors == 1 or self.errors % 1000 == 0:
            log.warning("shared tier %r: %s failed (%d so far): %r", self.tier, what, self.errors, exc)

    async def close(self) -> None:
        await self._client.aclose()


def _notifications_cover(flags: str) -> bool:
    """Whether notify-keyspace-events `flags` sends the keyevent messages a removal needs."""
    if "E" not in flags:
        return False
    return "A" in flags or all(flag in flags for flag in "xeg")
