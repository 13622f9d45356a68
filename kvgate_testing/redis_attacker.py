"""A hostile Redis client for the security tests: a separate process that can write to the Redis the
engines and gateways share, but holds none of their secrets.

    python -m kvgate_testing.redis_attacker junk URL KEY MIB
        SET KEY to MIB MiB of junk (a value far larger than any chunk).
    python -m kvgate_testing.redis_attacker forge URL KEY
        Flip the payload of the value at KEY and recompute its xxh3 checksum (the tag, if any, is
        kept as it was: the attacker cannot compute a new one).
    python -m kvgate_testing.redis_attacker refoot URL SOURCE_KEY TARGET_KEY TARGET_CHUNK_HEX
        Copy another model's value to the victim's key, its footer rewritten to name the victim's
        chunk key, its checksum recomputed.
    python -m kvgate_testing.redis_attacker publish URL CHANNEL KIND COUNT [ARG]
        Publish COUNT forged replica-sync messages (router/cluster.py) on CHANNEL. KIND:
        fake-peers (each from a new replica id, with a load on backend ARG), pin (pin session ARG,
        "session=backend"; every other one with a made-up signature), huge (ARG MiB of junk each).

It prints one line saying what it did and exits 0.
"""

from __future__ import annotations

import struct
import sys
import time

import msgspec
import redis
import xxhash

# The value format is public (cachelayer/storage/remote.py's docstring): the attacker needs no code of it.
_FOOTER_FIELDS = struct.Struct("<QIIIQBBBB")
_FOOTER = struct.Struct("<QIIIQBBBBQ4s")
TAG_BYTES = 32


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=30)


def _rewrite(value: bytes, *, new_key: int | None = None, flip_payload: bool = False) -> bytes:
    """The value with its footer's chunk key changed and/or its payload flipped, checksum recomputed."""
    footer_start = len(value) - _FOOTER.size
    fields = list(_FOOTER.unpack_from(value, footer_start))
    if new_key is not None:
        fields[0] = new_key
    body = bytearray(value[:footer_start])
    if flip_payload:
        for position in range(0, fields[4], 7):
            body[position] ^= 0x5A
    field_bytes = _FOOTER_FIELDS.pack(*fields[:9])
    checksum = xxhash.xxh3_64(bytes(body) + field_bytes).intdigest()
    return bytes(body) + field_bytes + struct.pack("<Q4s", checksum, fields[10])


def _publish(url: str, channel: str, kind: str, count: int, arg: str) -> None:
    encode = msgspec.msgpack.encode
    with _client(url) as client, client.pipeline(transaction=False) as pipeline:
        for n in range(count):
            if kind == "fake-peers":
                # [replica, loads [[backend, in_flight, prefill]], routed, leaving]
                data = encode([f"forged-{n}", [[arg, 50, 100_000]], [], False])
            elif kind == "pin":
                session, _, backend = arg.partition("=")
                message = encode(
                    [f"forged-{n % 4}", [], [[backend, 0, [], 0.0, None, False, session]], False]
                )
                if n % 2:  # every other one in a signed-looking envelope with a made-up signature
                    message = b"KVC1" + bytes(TAG_BYTES) + struct.pack("<Q", time.time_ns()) + message
                data = message
            elif kind == "huge":
                data = b"\x00" * int(float(arg) * (1 << 20))
            else:
                raise SystemExit(f"unknown kind {kind!r}")
            pipeline.publish(channel, data)
            if kind != "huge" or n == count - 1:  # huge ones all at once: Redis buffers them together
                pipeline.execute()
    print(f"published {count} {kind} messages on {channel}")


def main(argv: list[str]) -> None:
    action, url, *rest = argv
    if action == "junk":
        key, mib = rest
        with _client(url) as client:
            client.set(key, b"\xee" * (int(mib) << 20))
        print(f"set {key} to {mib} MiB of junk")
    elif action == "forge":
        (key,) = rest
        with _client(url) as client:
            client.set(key, _rewrite(client.get(key), flip_payload=True))
        print(f"forged {key}")
    elif action == "refoot":
        source, target, chunk_hex = rest
        with _client(url) as client:
            client.set(target, _rewrite(client.get(source), new_key=int(chunk_hex, 16)))
        print(f"copied {source} to {target}")
    elif action == "publish":
        channel, kind, count, *arg = rest
        _publish(url, channel, kind, int(count), arg[0] if arg else "")
    else:
        raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
