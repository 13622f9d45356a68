"""Mutation fuzzing of a live cache daemon's ZMQ data plane (`cachelayer server`).

    python -m kvgate_testing.fuzz_daemon [--seconds 300] [--seed 1]

Starts `cachelayer server` with a secret, shared memory, a 1 s lease TTL and a 1 MiB frame bound,
and sends it valid requests of every operation (hello, attach, lookup, store with its KV,
retrieve, reserve, commit, lease, release), each mutated at random: bytes set, msgpack markers
inserted, slices cut, frames dropped, duplicated, swapped or added. Most go over an authenticated
connection, which must get an answer to every message within 3 s; some over connections without
the secret, which must get none. Every few hundred messages a good client stores and reads back
KV bit-exact. Fails when the daemon dies, stops answering, corrupts the good client's KV, or
logs a traceback. Run by `make fuzz`; a few seconds of it run in the default suite.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from cachelayer.server import KeySpace, StoreClient, protocol
from cachelayer.server.leases import process_start_time
from cachelayer.server.protocol import Request
from kvgate_testing.daemon import RawClient, running_daemon

CHUNK = 16
SPACE = KeySpace(model="fuzz@rev", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
SECRET = "fuzz-secret-0123456789abcdef"
# msgpack markers worth inserting: nil, bools, ints of every width, str/bin/array/map headers,
# an ext type, the never-used 0xc1, huge lengths.
MARKERS = [
    b"\xc0", b"\xc2", b"\xc3", b"\xcc\xff", b"\xcd\xff\xff", b"\xce\xff\xff\xff\xff", b"\xcf" + b"\xff" * 8,
    b"\xd3" + b"\x80" + b"\x00" * 7, b"\xa0", b"\xd9\xff", b"\xdb\xff\xff\xff\xff", b"\xc4\x00",
    b"\xc6\xff\xff\xff\xff", b"\x90", b"\xdd\xff\xff\xff\xff", b"\x80", b"\xdf\xff\xff\xff\xff",
    b"\xd4\x01\x00", b"\xc1", b"\xa2op", b"\xa5space", b"\xa6tokens", b"\xa5lease",
]  # fmt: skip
MAX_FRAME = 1 << 20


def seed_messages(rand: random.Random) -> list[list[bytes]]:
    """Valid requests of every operation, as frame lists (delimiter, header, payload)."""
    me = {"pid": os.getpid(), "pid_start": process_start_time(os.getpid()) or 0}
    tokens = list(range(rand.randint(1, 4) * CHUNK))
    kv = torch.randn(2, 2, len(tokens), 16).to(torch.bfloat16)
    encoded = protocol.tokens_to_bytes(tokens)
    space = {"space": SPACE, "tokens": encoded, "chunk_size": CHUNK}
    requests = [
        [Request(op="hello")],
        [Request(op="attach", **me)],
        [Request(op="lookup", **space)],
        [Request(op="lookup", cache_salt="s" * rand.randint(0, 40), **space)],
        [Request(op="store", **space), bytes(protocol.kv_to_bytes(kv))],
        [Request(op="retrieve", **space)],
        [Request(op="reserve", **space, **me)],
        [Request(op="lease", **space, **me)],
        [Request(op="commit", lease=rand.randbytes(16), **me)],
        [Request(op="release", lease=rand.randbytes(16), **me)],
    ]
    return [[b"", *(protocol.encode(part) if isinstance(part, Request) else part for part in message)]
            for message in requests]  # fmt: skip


def mutate_bytes(rand: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rand.randint(1, 4)):
        choice = rand.random()
        at = rand.randint(0, len(data))
        if choice < 0.35 and data:
            data[min(at, len(data) - 1)] = rand.randrange(256)
        elif choice < 0.6:
            data[at:at] = rand.choice(MARKERS)
        elif choice < 0.8:
            data[at : at + rand.randint(1, 16)] = b""
        else:
            piece = data[at : at + rand.randint(1, 32)]
            data[at:at] = piece
    return bytes(data[:MAX_FRAME])


def mutate(rand: random.Random, message: list[bytes], seeds: list[list[bytes]]) -> list[bytes]:
    frames = list(message)
    for _ in range(rand.randint(1, 3)):
        choice = rand.random()
        index = rand.randrange(len(frames)) if frames else 0
        if choice < 0.55 and frames:
            frames[index] = mutate_bytes(rand, frames[index])
        elif choice < 0.65 and len(frames) > 1:
            del frames[index]
        elif choice < 0.75 and frames:
            frames.insert(index, frames[index])
        elif choice < 0.85 and len(frames) > 1:
            other = rand.randrange(len(frames))
            frames[index], frames[other] = frames[other], frames[index]
        else:
            frames.append(rand.choice(rand.choice(seeds)))
    return frames or [b""]


def check_good_client(client: StoreClient, rand: random.Random) -> None:
    """A store and a read-back of bit-exact KV; the fuzzer's reservations may hold the pool, so a
    store may hold fewer tokens, but what it reports held must read back exactly."""
    assert client.hello() == CHUNK
    tokens = [rand.randrange(1 << 40) for _ in range(2 * CHUNK)]
    kv = torch.randn(2, 2, len(tokens), 16).to(torch.bfloat16)
    held, _ = client.store(SPACE, tokens, kv)
    hit, loaded = client.retrieve(SPACE, tokens)
    assert hit >= held or held == 0, f"stored {held} tokens, read back {hit}"
    if hit:
        assert torch.equal(loaded.view(torch.int16), kv[:, :, :hit].view(torch.int16)), "KV came back changed"


def fuzz(seconds: float, seed: int) -> dict:
    rand = random.Random(seed)
    flags = ("--auth-secret-env", "FUZZ_DAEMON_SECRET", "--lease-ttl-s", "1", "--max-message-mb", "1")
    with running_daemon(*flags, env={"FUZZ_DAEMON_SECRET": SECRET}, l1_size_gb=0.002) as daemon:
        client = RawClient(daemon.endpoint, SECRET.encode())
        good = StoreClient(daemon.endpoint, chunk_size=CHUNK, timeout_s=10, secret=SECRET.encode())
        counts = {"messages": 0, "answered": 0, "unauthenticated": 0, "good_checks": 0}
        try:
            deadline = time.monotonic() + seconds
            seeds = seed_messages(rand)
            while time.monotonic() < deadline:
                if counts["messages"] % 50 == 0:
                    seeds = seed_messages(rand)
                message = mutate(rand, rand.choice(seeds), seeds)
                counts["messages"] += 1
                if rand.random() < 0.02:  # a connection without the secret: never answered
                    outsider = RawClient(daemon.endpoint, rand.choice([None, b"not-the-secret-0123456789"]))
                    outsider.send_frames(message)
                    assert outsider.receive(0.2) is None, (
                        f"an unauthenticated client was answered: {message!r}"
                    )
                    outsider.close()
                    counts["unauthenticated"] += 1
                    continue
                assert client.send_frames(message), "the daemon stopped taking messages"
                answer = client.receive(3.0)
                assert answer is not None, f"no answer within 3 s to {message!r}"
                assert daemon.process.alive(), daemon.process.output()[-4000:]
                counts["answered"] += 1
                if counts["messages"] % 300 == 0:
                    check_good_client(good, rand)
                    counts["good_checks"] += 1
            check_good_client(good, rand)
            counts["good_checks"] += 1
        finally:
            good.close()
            client.close()
        assert daemon.process.alive(), daemon.process.output()[-4000:]
        output = daemon.process.output()
    assert "Traceback" not in output, output[output.index("Traceback") - 2000 :][:6000]
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"daemon: {fuzz(args.seconds, args.seed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
