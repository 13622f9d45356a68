"""A simulated engine's block pool (router/sim/blocks.py) whose KV events reach a prefix index the way
they would over ZMQ: encoded as the simulator publishes them, decoded as the gateway's subscriber does."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvwire import decode_batch, encode_batch
from router.index.ingest import IndexWriter
from router.sim.blocks import BlockPool


class PoolEngine:
    def __init__(
        self,
        index: Any,
        name: str,
        num_blocks: int,
        block_size: int = 16,
        *,
        writer: IndexWriter | None = None,
    ) -> None:
        """`index`: a `PrefixIndex` whose `writer` is given, or a `WritableIndex` (its own writer)."""
        self.index, self.name = index, name
        self.writer: Any = writer if writer is not None else index
        self.pool = BlockPool(num_blocks, block_size)
        self.served = 0
        index.add_backend(name)

    def publish(self, events: list) -> None:
        if events:
            payload = encode_batch(events, ts=0.0, data_parallel_rank=0)
            self.writer.apply(self.name, decode_batch(payload).events)

    def serve(self, tokens: np.ndarray) -> int:
        """Run one request (no generated tokens) to completion; return its cached prompt tokens."""
        request_id = f"{self.name}-{self.served}"
        self.served += 1
        allocated = self.pool.allocate(request_id, tokens, 0, 0.0)
        if allocated is None:
            raise RuntimeError(f"{self.name}: a prompt of {len(tokens)} tokens does not fit the pool")
        sequence, events = allocated
        self.publish(events)
        self.pool.free(request_id)
        return sequence.cached_tokens

    def reset(self) -> None:
        self.publish(self.pool.reset())
