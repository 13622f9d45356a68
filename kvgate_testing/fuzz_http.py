"""Mutation fuzzing of a live gateway's HTTP surface over raw sockets.

    python -m kvgate_testing.fuzz_http [--seconds 300] [--seed 1]

Starts `kvgate serve` with two simulated engines (kv_aware, the builtin Qwen3 tokenizer) and sends
it valid requests of every route and shape (generation routes streamed or not, the Responses and
Anthropic Messages APIs among them, chunked bodies,
token-id prompts, content parts, sessions, the debug page, /lookup, /metrics, /backends), each
mutated at random: bytes set, tokens of HTTP and JSON syntax inserted, slices cut, duplicated
(pipelining, repeated headers) or other requests spliced in. Fails on an answer 500, a connection
the gateway neither answers nor closes within 3 s, a /health that stops answering 200, or a line
in the gateway's log that only a bug writes (an unhandled error, an unawaited coroutine, an ASGI
answer left incomplete). Run by `make fuzz`; found what 6d4cb2d fixed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import re
import socket
import sys
import time

from kvgate_testing.gateway import BUG_LOG_LINES, simulated_fleet_config, start_gateway

MODEL = "tiny-qwen3"
# HTTP and JSON syntax worth inserting.
TOKENS = [
    b"\r\n", b"\r\n\r\n", b":", b" ", b"\x00", b"\xff", b"{", b"}", b"[", b"]", b'"', b"\\u0000", b"\\ud800",
    b"chunked", b"-1", b"99999999999999999999", b"0", b"1e309", b"null", b"true", b"Content-Length: 5\r\n",
    b"Transfer-Encoding: chunked\r\n", b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"\xc3\x28",
    b"\xe4\xb8\xad", b"%00", b"/../", b"?x=1", b"HTTP/1.0", b"HTTP/2.0",
]  # fmt: skip


def request(
    method: str, path: str, body: bytes = b"", headers: dict | None = None, chunked: bool = False
) -> bytes:
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", **(headers or {})}
    if chunked:
        fields["Transfer-Encoding"] = "chunked"
        pieces = [body[at : at + 37] for at in range(0, len(body), 37)]
        body = b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    elif body or method == "POST":
        fields["Content-Length"] = str(len(body))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{name}: {value}\r\n" for name, value in fields.items())
    return head.encode() + b"\r\n" + body


def seed_requests(rand: random.Random) -> list[bytes]:
    def chat(**extra) -> bytes:
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi " + "x" * rand.randint(0, 300)},
        ]
        return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 4, **extra}).encode()

    def completion(**extra) -> bytes:
        prompt = "Once upon a time " * rand.randint(1, 30)
        return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4, **extra}).encode()

    def responses(**extra) -> bytes:
        items = [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Say hi " + "x" * rand.randint(0, 300)}],
            }
        ]
        body = {"model": MODEL, "instructions": "You are terse.", "input": items, "max_output_tokens": 4}
        return json.dumps({**body, **extra}).encode()

    def messages(**extra) -> bytes:
        blocks = [{"type": "text", "text": "Say hi " + "x" * rand.randint(0, 300)}]
        body = {"model": MODEL, "system": "You are terse.", "max_tokens": 4,
                "messages": [{"role": "user", "content": blocks}]}  # fmt: skip
        return json.dumps({**body, **extra}).encode()

    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    usage = {"include_usage": True}
    token_ids = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    return [
        request("POST", "/v1/chat/completions", chat()),
        request("POST", "/v1/chat/completions", chat(stream=True)),
        request("POST", "/v1/chat/completions", chat(stream=True, stream_options=usage), chunked=True),
        request("POST", "/v1/chat/completions", chat(), {"x-session-id": "abc"}),
        request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": parts}).encode()),
        request("POST", "/v1/completions", completion()),
        request("POST", "/v1/completions", completion(stream=True)),
        request("POST", "/v1/completions", token_ids),
        request("POST", "/v1/responses", responses()),
        request("POST", "/v1/responses", responses(stream=True)),
        request("POST", "/v1/messages", messages()),
        request("POST", "/v1/messages", messages(stream=True), chunked=True),
        request("GET", "/v1/models"),
        request("GET", f"/v1/models/{MODEL}"),
        request("GET", "/health"),
        request("GET", "/metrics"),
        request("GET", "/debug/prefix-map"),
        request("POST", "/lookup", json.dumps({"model": MODEL, "prompt": "Once upon"}).encode()),
        request("GET", "/backends"),
    ]  # fmt: skip


def mutate(rand: random.Random, data: bytes, seeds: list[bytes]) -> bytes:
    out = bytearray(data)
    for _ in range(rand.randint(1, 3)):
        at = rand.randrange(len(out) + 1)
        operation = rand.randrange(6)
        if operation == 0 and out:
            out[min(at, len(out) - 1)] = rand.randrange(256)
        elif operation == 1:
            out[at:at] = rand.choice(TOKENS)
        elif operation == 2:
            del out[at : at + rand.randint(1, 12)]
        elif operation == 3:
            del out[at:]
        elif operation == 4:  # a slice again: pipelined requests, repeated headers
            start = rand.randrange(len(out) + 1)
            out[at:at] = out[start : start + rand.randint(1, 200)]
        else:
            out[at:at] = rand.choice(seeds)
    return bytes(out)


def exchange(port: int, data: bytes, timeout_s: float = 3.0) -> tuple[bytes, str]:
    """What the gateway sent back for `data` (the client's side then closed for writing) and how
    the connection ended: "closed", or "hung" when it neither answered everything nor closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(data)
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        received = b""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                return received, "hung"
            except ConnectionResetError:
                return received, "reset"
            if not chunk:
                return received, "closed"
            received += chunk
        return received, "hung"


def fuzz(seconds: float, seed: int) -> dict:
    rand = random.Random(seed)
    seeds = seed_requests(rand)
    statuses: collections.Counter[str] = collections.Counter()
    endings: collections.Counter[str] = collections.Counter()
    config = simulated_fleet_config(MODEL, "kv_aware", num_gpu_blocks=1024, prefill_us_per_token=1)
    with start_gateway(config) as gateway:
        port = int(gateway.url.rsplit(":", 1)[1])
        deadline = time.monotonic() + seconds
        sent = 0
        while time.monotonic() < deadline:
            data = mutate(rand, rand.choice(seeds), seeds)
            received, ending = exchange(port, data)
            endings[ending] += 1
            codes = re.findall(rb"HTTP/1\.1 (\d\d\d) ", received)
            statuses.update(code.decode() for code in codes)
            assert b"500" not in codes, f"500 for {data!r}: {received[:600]!r}"
            assert ending != "hung", f"neither answered nor closed in 3 s: {data!r}"
            sent += 1
            if sent % 200 == 0:
                health, _ = exchange(port, request("GET", "/health"))
                assert health.startswith(b"HTTP/1.1 200 "), health[:300]
        time.sleep(0.5)
        log = gateway.process.output()
    bugs = [line for line in log.splitlines() if any(mark in line for mark in BUG_LOG_LINES)]
    assert not bugs, "\n".join(bugs[:20])
    return {"requests": sent, "statuses": dict(statuses), "endings": dict(endings)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print(f"http: {fuzz(args.seconds, args.seed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
