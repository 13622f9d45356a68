"""A simulated engine's block pool (router/sim/blocks.py) whose KV events reach a prefix index the way
they would over ZMQ: encoded as the simulator publishes them, decoded as the gateway's subscriber does."""

from __future__ import annotations

import numpy as np

from router.index.events import decode_batch
from router.index.prefix_index import PrefixIndex
from router.sim.blocks import BlockPool
from router.sim.events import encode_batch


class PoolEngine:
    def __init__(self, index: PrefixIndex, name: str, num_blocks: int, block_size: int = 16) -> None:
        self.index, self.name = index, name
        self.pool = BlockPool(num_blocks, block_size)
        self.served = 0
        index.add_backend(name)

    def publish(self, events: list) -> None:
        if events:
            self.index.apply(self.name, decode_batch(encode_batch(events, "vllm", 0.0)).events)

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
