"""The shared daemon's remote-tier feed (cachelayer/server/remote_feed.py): what it costs and how
fast the daemon's Redis writes and losses reach the engine that stored.

Setup: a real redis-server (keyspace notifications on), an in-process `StoreServer` with a remote
tier (reconciliation every 5 s, notifications on), two TCP `StoreClient`s, one without a feed and
one with (`remote_feed=True`, polled every 0.25 s as the connector does). Alternating rounds of
`--prompts` fresh 4-chunk prompts (256-token chunks) measure the store round trip of each client;
for the feed client, the time from the store's start until every chunk it stored is announced
`stored`. Then `--deletes` of its chunks are DEL'd in Redis, each timed until its `removed`
arrives. Last, `--polls` empty `feed` polls are timed (the serving thread's cost per poll).

    python -m benchmarks.daemon_remote_feed [--prompts 30] [--output benchmarks/results/daemon_remote_feed]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from cachelayer.config import parse_config
from cachelayer.server import KeySpace, StoreClient, StoreServer
from kvgate_testing.provenance import with_source
from kvgate_testing.redis_server import running_redis

CHUNK = 256
SPACE = KeySpace(model="bench@r", dtype="bfloat16", num_layers=4, num_kv_heads=2, head_dim=64)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(len(ordered) * 0.9)] * 1e3,
    }


def run(prompts: int, deletes: int, polls: int) -> dict:
    with running_redis("--notify-keyspace-events", "Exeg") as redis_server:
        config = parse_config(
            {"chunk_size": CHUNK, "max_local_cpu_size": 0.5, "remote_url": redis_server.url,
             "remote_reconcile_interval_s": 5.0, "remote_eviction_notifications": True,
             "save_unfull_chunk": True}
        )  # fmt: skip
        server = StoreServer(config, "tcp://127.0.0.1:0").start()
        plain = StoreClient(server.endpoint, chunk_size=CHUNK, transport="tcp")
        fed = StoreClient(server.endpoint, chunk_size=CHUNK, transport="tcp", remote_feed=True)
        rtts: dict[str, list[float]] = {"no_feed": [], "feed": []}
        lags: list[float] = []
        mine: set[int] = set()
        base = 0
        try:
            for _ in range(2):
                for name, client in (("no_feed", plain), ("feed", fed)):
                    for index in range(prompts):
                        tokens = list(range(base, base + 4 * CHUNK))
                        base += 4 * CHUNK
                        generator = torch.Generator().manual_seed(index)
                        kv = torch.randn(4, 2, len(tokens), 128, generator=generator).to(torch.bfloat16)
                        started = time.perf_counter()
                        _, events = client.store(SPACE, tokens, kv)
                        rtts[name].append(time.perf_counter() - started)
                        if client is fed:
                            wanted, got = {event.key for event in events}, set()
                            mine |= wanted
                            while not wanted <= got:
                                got |= {e.key for e in fed.take_remote_feed() if e.kind == "stored"}
                                time.sleep(0.001)
                            lags.append(time.perf_counter() - started)
            fed.take_remote_feed()
            with redis_server.client() as redis_client:
                keys = [key for key in redis_client.keys("*") if b":" in key]
                keys = [key for key in keys if int(key.rsplit(b":", 1)[1], 16) in mine][:deletes]
                retract: list[float] = []
                for key in keys:
                    chunk = int(key.rsplit(b":", 1)[1], 16)
                    started = time.perf_counter()
                    redis_client.delete(key)
                    while not any(e.kind == "removed" and e.key == chunk for e in fed.take_remote_feed()):
                        time.sleep(0.001)
                    retract.append(time.perf_counter() - started)
            poll_times = []
            for _ in range(polls):
                started = time.perf_counter()
                fed.poll_feed()
                poll_times.append(time.perf_counter() - started)
        finally:
            fed.close()
            plain.close()
            server.close()
    return {
        "store_rtt_no_feed": summary(rtts["no_feed"]),
        "store_rtt_feed": summary(rtts["feed"]),
        "store_to_announced": summary(lags),
        "delete_to_retracted_by_notification": summary(retract),
        "feed_poll": summary(poll_times),
        "feed_poll_s": 0.25,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--deletes", type=int, default=20)
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--output", default="benchmarks/results/daemon_remote_feed")
    args = parser.parse_args()
    result = run(args.prompts, args.deletes, args.polls)
    result["command"] = f"python -m benchmarks.daemon_remote_feed --prompts {args.prompts}"
    Path(f"{args.output}.json").write_text(json.dumps(with_source(result), indent=2) + "\n")
    lines = ["| measure | n | median ms | p90 ms |", "|---|---|---|---|"]
    for name, row in result.items():
        if isinstance(row, dict) and "median_ms" in row:
            lines.append(f"| {name} | {row['n']} | {row['median_ms']:.2f} | {row['p90_ms']:.2f} |")
    text = "# The shared daemon's remote-tier feed\n\n" + "\n".join(lines) + f"\n\n`{result['command']}`\n"
    Path(f"{args.output}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
