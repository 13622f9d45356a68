"""What a routing policy is given in its unit tests: random prompts, candidate backends, route
requests, and a prefix index told that a backend holds a prompt's blocks."""

from __future__ import annotations

import numpy as np

from kvgate_testing.index_oracle import WritableIndex
from kvwire import BlockStored
from router.backends import BackendState
from router.index.keys import Namespace
from router.policies.base import RouteRequest

_rng = np.random.default_rng(11)
PROMPTS = [_rng.integers(0, 150_000, size=512).astype(np.uint32) for _ in range(16)]


def backends(n: int = 4) -> list[BackendState]:
    return [BackendState(name=f"b{i}", url=f"http://127.0.0.1:{9000 + i}") for i in range(n)]


def request(tokens: np.ndarray | None, salt: str | None = None, rid: str = "r") -> RouteRequest:
    return RouteRequest(
        request_id=rid, model="m", body={}, tokens=tokens, namespace=Namespace(cache_salt=salt)
    )


def store(
    index: WritableIndex,
    backend: str,
    tokens: np.ndarray,
    *,
    medium: str = "GPU",
    salt: str | None = None,
    start: int = 0,
):
    """`backend` announces `tokens`' 16-token blocks in `medium`; with `start` (a multiple of 16),
    only the blocks from that token on, chained to the block before it as an engine announces a
    tail it offloaded without the head."""
    first = start // 16
    index.apply(
        backend,
        [
            BlockStored(
                block_hashes=list(range(first + 1, len(tokens) // 16 + 1)),
                parent_block_hash=first or None,
                token_ids=tokens[start:].tolist(),
                block_size=16,
                medium=medium,
                extra_keys=[[salt]] if salt and not start else None,
            )
        ],
    )
