"""A small, fast, scriptable OpenAI-compatible backend for tests and benchmarks (raw ASGI on uvicorn).

Run it as `python -m kvgate_testing.openai_backend --port P --name NAME [--models m1,m2]`.

The generation paths (/v1/completions, /v1/chat/completions, /v1/responses, /v1/messages) all answer
the same made-up completion, whole or streamed: the gateway's forwarding is what these tests check.
Behaviour per request, chosen by headers the gateway forwards unchanged:
- `x-test-status: 503` answers that status (OpenAI error shape);
- `x-test-delay-ms: N` waits before the response headers (upstream timeouts);
- `x-test-chunks: N` and `x-test-chunk-delay-ms: N` shape a streamed (`"stream": true`) answer;
  `x-test-first-chunk-delay-ms: N` waits between its head and its first chunk (an engine's prefill);
- `x-test-die-after-head: NAME`: the backend named NAME sends a whole answer's head, then its
  process exits before the body (a crash between the two).
Behaviour for every request, set with POST /_test/mode {"status": 503, "health_status": 503}
(and "health_delay_ms": N, a /health that takes N ms to answer).
GET /_test/received lists what it received (request id, path, body) unless started with --no-record;
POST /_test/reset clears that list and the mode.

Answers are deterministic bytes with deliberately unusual JSON spacing and non-ASCII text, so any
re-serialization on the way shows up in a byte comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os

import uvicorn

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


class OpenAIBackend:
    """The ASGI app; all state lives on the instance."""

    def __init__(self, name: str, models: list[str], record: bool = True):
        self.name = name
        self.models = models
        self.record = record
        self.received: list[dict] = []
        self.mode: dict = {}
        self._name_header = [(b"x-test-backend", name.encode())]
        self._models_body = json.dumps(
            {"object": "list", "data": [{"id": m, "object": "model", "owned_by": name} for m in models]}
        ).encode()

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if path == "/health":
            status = int(self.mode.get("health_status", 200))
            health_delay_ms = float(self.mode.get("health_delay_ms", 0))
            if health_delay_ms:
                await asyncio.sleep(health_delay_ms / 1000)
            await self._send(send, status, b'{"status":"ok"}' if status == 200 else b'{"status":"down"}')
        elif path == "/v1/models":
            await self._send(send, 200, self._models_body)
        elif path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
            client_port = scope["client"][1] if scope.get("client") else None
            await self._generate(path, headers, body, send, receive, client_port)
        elif path == "/_test/received":
            await self._send(send, 200, json.dumps(self.received).encode())
        elif path == "/_test/reset":
            self.received.clear()
            self.mode = {}
            await self._send(send, 200, b"{}")
        elif path == "/_test/mode":
            self.mode = json.loads(body or b"{}")
            await self._send(send, 200, b"{}")
        else:
            await self._send(send, 404, b'{"error":{"message":"not found","type":"not_found","code":404}}')

    async def _generate(
        self, path: str, headers: dict[str, str], body: bytes, send, receive, client_port: int | None
    ) -> None:
        request = json.loads(body)
        record = {
            "request_id": headers.get("x-request-id"),
            "path": path,
            "body": body.decode(),
            "headers": headers,
            # The caller's TCP port: tells whether a client reused its connection.
            "client_port": client_port,
        }
        if self.record:
            self.received.append(record)
        delay_ms = float(headers.get("x-test-delay-ms", 0))
        if delay_ms:
            await asyncio.sleep(delay_ms / 1000)
        status = int(headers.get("x-test-status", self.mode.get("status", 200)))
        if status != 200:
            error = {"error": {"message": f"{self.name} answers {status}", "type": "test", "code": status}}
            await self._send(send, status, json.dumps(error).encode())
            return
        digest = hashlib.sha1(body).hexdigest()[:12]
        if request.get("stream"):
            await self._stream(headers, digest, send, receive, record)
            return
        # Unusual spacing and raw non-ASCII: a re-serializing proxy would change these bytes.
        request_id = headers.get("x-request-id", "")
        answer = (
            f'{{"id" :  "cmpl-{digest}", "object":"text_completion",  "backend": "{self.name}", '
            f'"request_id": "{request_id}", '
            '"choices":[{"index":0,"text":"héllo ✓ wörld","finish_reason":"stop"}]}'
        )
        if headers.get("x-test-die-after-head") == self.name:
            encoded = answer.encode()
            length = str(len(encoded)).encode()
            start = [*_JSON_HEADERS, *self._name_header, (b"content-length", length)]
            await send({"type": "http.response.start", "status": 200, "headers": start})
            await asyncio.sleep(0.05)  # the head leaves (uvicorn writes it at once)
            os._exit(1)
        await self._send(send, 200, answer.encode())

    async def _stream(self, headers: dict[str, str], digest: str, send, receive, record: dict) -> None:
        """Stream the chunks; record in `record` whether the client stayed to the end ("stream_end")."""
        chunks = int(headers.get("x-test-chunks", 5))
        chunk_delay_s = float(headers.get("x-test-chunk-delay-ms", 0)) / 1000
        start = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + self._name_header}
        await send(start)
        first_chunk_delay_s = float(headers.get("x-test-first-chunk-delay-ms", 0)) / 1000
        if first_chunk_delay_s:
            await asyncio.sleep(first_chunk_delay_s)
        disconnected = asyncio.Event()
        watcher = None
        if chunk_delay_s:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                disconnected.set()

            watcher = asyncio.get_running_loop().create_task(watch())
        record["stream_end"] = "completed"
        for index in range(chunks):
            if chunk_delay_s and index:
                await asyncio.sleep(chunk_delay_s)
            if disconnected.is_set():
                record["stream_end"] = "client_disconnected"
                record["chunks_sent"] = index
                return
            event = (
                f'data: {{"id":"cmpl-{digest}","backend":"{self.name}","index":{index},'
                f'"choices":[{{"text":"tök{index} "}}]}}\n\n'
            )
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        record["chunks_sent"] = chunks
        if watcher is not None:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _send(self, send, status: int, body: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [*_JSON_HEADERS, *self._name_header, (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--models", default="test-model", help="comma-separated model ids it reports")
    parser.add_argument("--no-record", action="store_true", help="do not keep received requests")
    args = parser.parse_args()
    app = OpenAIBackend(args.name, args.models.split(","), record=not args.no_record)
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools", log_level="warning")


if __name__ == "__main__":
    main()
