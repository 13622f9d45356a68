"""A shared-memory client that stops in the middle of a transfer, to be killed there.

`python -m kvgate_testing.lease_holder ENDPOINT CHUNK_SIZE`: stores one chunk, then opens a write
reservation for a second chunk (half written) and a read lease on the first, prints "holding"
and sleeps until it is killed.
"""

from __future__ import annotations

import sys
import time

import torch

from cachelayer.server import KeySpace, StoreClient

SPACE = KeySpace(model="lease-holder", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)


def main() -> int:
    endpoint, chunk_size = sys.argv[1], int(sys.argv[2])
    client = StoreClient(endpoint, chunk_size=chunk_size, timeout_s=10, transport="shm")
    first = list(range(chunk_size))
    client.store(SPACE, first, torch.ones(2, 2, chunk_size, 16, dtype=torch.bfloat16))
    with (
        client.reserved(SPACE, first + [7] * chunk_size) as reservation,
        client.leased(SPACE, first) as lease,
    ):
        assert len(reservation.chunks) == 1 and lease.hit_tokens == chunk_size
        reservation.chunks[0].kv[0].fill_(3)  # half of the chunk: killed mid-transfer
        print("holding", flush=True)
        time.sleep(3600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
