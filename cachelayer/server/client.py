"""Client of the cache daemon's data plane: lookup, store and retrieve over a ZMQ DEALER socket.

One request at a time per client, each with a timeout: a daemon that does not answer makes the
call raise `StoreUnavailable` (the connector then treats it as a miss), and the socket is rebuilt
so a late reply can never be taken for the answer to the next request.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import zmq

from cachelayer.server import protocol
from cachelayer.server.protocol import ChunkEvent, KeySpace, Reply, Request


class StoreUnavailable(RuntimeError):
    """The daemon did not answer in time, or answered with an error."""


class StoreClient:
    def __init__(
        self,
        endpoint: str,
        *,
        chunk_size: int,
        timeout_s: float = 5.0,
        context: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.chunk_size = chunk_size
        self.timeout_ms = int(timeout_s * 1000)
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(self.endpoint)
            self._socket = socket
        return self._socket

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None

    def _call(self, request: Request, payload: memoryview | None = None) -> tuple[Reply, zmq.Frame | None]:
        request.chunk_size = self.chunk_size
        frames: list = [b"", protocol.encode(request)]
        if payload is not None:
            frames.append(payload)
        with self._lock:
            socket = self._connect()
            socket.send_multipart(frames, copy=False)
            if not socket.poll(self.timeout_ms, zmq.POLLIN):
                socket.close(linger=0)
                self._socket = None
                raise StoreUnavailable(
                    f"cache daemon at {self.endpoint} did not answer {request.op} within "
                    f"{self.timeout_ms} ms: is `cachelayer server` running there?"
                )
            reply_frames = socket.recv_multipart(copy=False)
        # [b"", header(, payload)]
        reply = protocol.decode_reply(reply_frames[1].buffer)
        if not reply.ok:
            raise StoreUnavailable(f"cache daemon at {self.endpoint} refused {request.op}: {reply.error}")
        return reply, reply_frames[2] if len(reply_frames) > 2 else None

    def hello(self) -> int:
        """The daemon's chunk size (raises StoreUnavailable when it does not answer)."""
        reply, _ = self._call(Request(op="hello"))
        return reply.chunk_size

    def lookup(
        self, space: KeySpace, tokens: list[int] | np.ndarray, *, cache_salt: str | None = None
    ) -> int:
        request = Request(
            op="lookup", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
        )
        return self._call(request)[0].hit_tokens

    def store(
        self,
        space: KeySpace,
        tokens: list[int] | np.ndarray,
        kv: torch.Tensor,
        *,
        cache_salt: str | None = None,
    ) -> tuple[int, list[ChunkEvent]]:
        """Store the chunks of tokens; returns (leading tokens now held, chunks stored/evicted)."""
        request = Request(
            op="store", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
        )
        reply, _ = self._call(request, protocol.kv_to_bytes(kv))
        return reply.hit_tokens, reply.events

    def retrieve(
        self, space: KeySpace, tokens: list[int] | np.ndarray, *, cache_salt: str | None = None
    ) -> tuple[int, torch.Tensor | None]:
        """(hit_tokens, kv [num_layers, 2, hit_tokens, channels] or None) for the longest held prefix."""
        request = Request(
            op="retrieve", space=space, tokens=protocol.tokens_to_bytes(tokens), cache_salt=cache_salt
        )
        reply, payload = self._call(request)
        if reply.hit_tokens == 0 or payload is None:
            return 0, None
        return reply.hit_tokens, protocol.kv_from_bytes(payload.buffer, space, reply.hit_tokens)
