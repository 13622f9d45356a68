"""Chat templates sent by clients, rendered in a child process with a time and memory budget.

A chat template is code. jinja2's sandbox (transformers renders every template in an
ImmutableSandboxedEnvironment) keeps a template away from Python's internals, but not from the
CPU: two nested `range(8000)` loops cost seconds, three cost hours, and a Python thread cannot be
stopped. So the gateway renders a request's own template (only for a model with
`trust_request_chat_template`) in a child process that runs the same code as the engine
(`router.tokenize.render.render_chat`, transformers' apply_chat_template) and is killed when a render
runs past RENDER_TIMEOUT_S; its address space is capped (MEMORY_HEADROOM_BYTES over what the
loaded tokenizer takes) and so is the text it sends back. A request whose template fails any of
these is routed without tokens, as any request that cannot be tokenized.

Protocol on the child's stdin/stdout: frames of a 4-byte big-endian length and a msgpack map.
The child sends {"ready": true} once its tokenizer is loaded; then, per request
{"body": {...}, "max_chars": N}, it answers {"text": "..."} or {"error": "..."}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import struct
import sys
from typing import Any, BinaryIO

import msgspec

from router.errors import KvgateError

logger = logging.getLogger("kvgate.template_sandbox")

# Wall-clock budget of one render, from the moment the request waits for the child.
RENDER_TIMEOUT_S = 2.0
# How long a child may take to import transformers and load its tokenizer.
STARTUP_TIMEOUT_S = 60.0
# Address space a render may use beyond what the child holds once its tokenizer is loaded.
MEMORY_HEADROOM_BYTES = 1 << 30
# The body fields a chat template reads (what vLLM passes to apply_chat_template).
CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
)

_LENGTH = struct.Struct(">I")


class TemplateSandboxError(KvgateError):
    """The request's template was not rendered: it failed, ran past its budget, or the child is not ready."""


class TemplateSandbox:
    """One child process rendering client-supplied templates with one model's tokenizer, one at a time."""

    def __init__(self, tokenizer_dir: str, *, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.timeout_s = timeout_s
        self.killed = 0  # renders stopped for running past the budget
        self._process: asyncio.subprocess.Process | None = None
        self._starting: asyncio.Task[asyncio.subprocess.Process] | None = None
        self._lock = asyncio.Lock()
        self._reaping: set[asyncio.Task] = set()

    def start(self) -> None:
        """Start the child now, in the background, if it is not running or starting."""
        if self._process is None and self._starting is None:
            self._starting = asyncio.get_running_loop().create_task(self._spawn())

    async def render(self, body: dict[str, Any], max_chars: int) -> str:
        """The prompt text of a chat request whose body carries its own template."""
        fields = {key: body[key] for key in CHAT_FIELDS if key in body}
        try:
            request = _frame({"body": fields, "max_chars": max_chars})
        except (TypeError, ValueError, OverflowError) as exc:  # e.g. an integer over 64 bits
            raise TemplateSandboxError(
                f"the request's chat fields cannot be passed to the sandbox: {exc}"
            ) from None
        sent = False
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._lock:
                    process = self._ready()
                    assert process.stdin is not None and process.stdout is not None
                    sent = True
                    process.stdin.write(request)
                    await process.stdin.drain()
                    reply = await _read_frame(process.stdout)
        except TimeoutError:
            if sent:
                # The child is stuck in this render: only killing it stops the work.
                self.killed += 1
                self._kill()
                raise TemplateSandboxError(
                    f"the request's chat template ran past its {self.timeout_s:g} s budget; its render was "
                    "stopped"
                ) from None
            raise TemplateSandboxError(
                "the template sandbox is busy with other requests' templates"
            ) from None
        except (OSError, asyncio.IncompleteReadError, msgspec.DecodeError) as exc:
            self._kill()
            raise TemplateSandboxError(f"the template sandbox died during the render: {exc!r}") from None
        if "error" in reply:
            raise TemplateSandboxError(str(reply["error"]))
        return reply["text"]

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
            with contextlib.suppress(BaseException):
                await self._starting
        if self._process is None:
            self._process = self._started_child()
        self._kill(restart=False)

    def _ready(self) -> asyncio.subprocess.Process:
        """The running child; while there is none, one starts and the request is not held up for it
        (a start takes seconds: transformers' import)."""
        if self._process is None:
            self._process = self._started_child()
        if self._process is not None and self._process.returncode is None:
            return self._process
        self._process = None
        self.start()
        raise TemplateSandboxError("the template sandbox is starting")

    def _started_child(self) -> asyncio.subprocess.Process | None:
        """The child the start task brought up, once it is done (None while it runs, or if it failed)."""
        starting = self._starting
        if starting is None or not starting.done():
            return None
        self._starting = None
        if starting.cancelled():
            return None
        if starting.exception() is not None:
            logger.warning(
                "template sandbox for %s failed to start: %r", self.tokenizer_dir, starting.exception()
            )
            return None
        return starting.result()

    async def _spawn(self) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "router.template_sandbox",
            self.tokenizer_dir,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert process.stdout is not None
            async with asyncio.timeout(STARTUP_TIMEOUT_S):
                hello = await _read_frame(process.stdout)
            if not hello.get("ready"):
                raise TemplateSandboxError(f"unexpected first message {hello!r}")
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            raise
        logger.info("template sandbox for %s started (pid %d)", self.tokenizer_dir, process.pid)
        return process

    def _kill(self, *, restart: bool = True) -> None:
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            # Reaped in the background; a fresh child starts at once, for the next render.
            reaping = asyncio.get_running_loop().create_task(process.wait())
            self._reaping.add(reaping)
            reaping.add_done_callback(self._reaping.discard)
        if restart:
            self.start()


def _frame(message: dict[str, Any]) -> bytes:
    payload = msgspec.msgpack.encode(message)
    return _LENGTH.pack(len(payload)) + payload


async def _read_frame(stream: asyncio.StreamReader) -> dict[str, Any]:
    (size,) = _LENGTH.unpack(await stream.readexactly(_LENGTH.size))
    return msgspec.msgpack.decode(await stream.readexactly(size))


# ---- the child ----


def _limit_address_space(headroom: int) -> None:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    in_use = pages * resource.getpagesize()
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = in_use + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _write_frame(out: BinaryIO, message: dict[str, Any]) -> None:
    out.write(_frame(message))
    out.flush()


def main(tokenizer_dir: str) -> None:
    out, source = sys.stdout.buffer, sys.stdin.buffer
    sys.stdout = sys.stderr  # the protocol owns stdout; a stray print must not corrupt it
    from transformers import AutoTokenizer

    from router.tokenize.render import TokenizeError, render_chat

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    _limit_address_space(MEMORY_HEADROOM_BYTES)
    _write_frame(out, {"ready": True})
    while True:
        header = source.read(_LENGTH.size)
        if len(header) < _LENGTH.size:
            return  # the gateway closed the pipe: it stopped or gave this child up
        (size,) = _LENGTH.unpack(header)
        request = msgspec.msgpack.decode(source.read(size))
        try:
            text = render_chat(tokenizer, request["body"])
            if len(text) > request["max_chars"]:
                reply = {"error": f"the rendered prompt is over {request['max_chars']} characters"}
            else:
                reply = {"text": text}
        except TokenizeError as exc:
            reply = {"error": str(exc)}
        except MemoryError:
            reply = {"error": "the chat template needs more memory than the sandbox allows"}
        _write_frame(out, reply)


if __name__ == "__main__":
    main(sys.argv[1])
