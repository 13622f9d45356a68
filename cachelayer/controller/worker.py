"""The cache engine's side of the controller: register, heartbeat, and serve the controller's commands.

The engine does not start it: whoever owns an engine attaches one (`attach_controller_worker`, when
the config's `enable_controller` is true): the daemon's StoreServer for the engines it makes when
asked to (the vLLM connector's in-process store asks; the shared daemon does not), or a program that
builds a CacheEngine itself. The worker then closes with the engine.

Two threads per engine, one socket each: a PUSH to the controller's monitor socket for reports
(register, a heartbeat every interval, deregister), and a REP bound on `p2p_host` (default
127.0.0.1) at `lmcache_worker_ports[worker_id]` (or a port the OS picks) for commands. Heartbeats
have their own thread so that a long command never makes the controller drop the worker. Commands
run on the engine exactly like a local call. With `controller_auth_secret_env` every message is
signed (cachelayer/controller/auth.py); an unsigned command is answered with a refusal, never run.

A third thread, at start, warms the codecs up (cachelayer.compress.warm_up): CacheGen's CPU kernels
are compiled by numba on their first call in a process, a second or two from numba's cache and half a
minute on a busy machine without one, which a first `/compress` paid inside the controller's command
timeout ("worker 0 did not answer in 5.0s"). A compress or decompress that comes before the warm-up
is done waits up to CODEC_WARM_UP_WAIT_S for it, then is refused with `retry_after_s` and a message
that says what is going on and what to do.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq

from cachelayer.config import CacheLayerConfig
from cachelayer.controller.auth import (
    COMMAND,
    REPLY,
    REPORT,
    AuthError,
    MessageAuth,
    refuse_open_socket_beyond_loopback,
    secret_from_env,
)
from cachelayer.controller.protocol import (
    MAX_BYTES_PER_TOKEN,
    Command,
    Reply,
    WorkerReport,
    encode,
    normalize_url,
)

if TYPE_CHECKING:
    from cachelayer.engine import CacheEngine

log = logging.getLogger(__name__)

# How long a compress or decompress that comes during the codecs' warm-up waits for it before it is
# refused for now (under the controller's COMMAND_TIMEOUT_S, so that the refusal reaches it).
CODEC_WARM_UP_WAIT_S = 3.0
# What the refusal suggests waiting before the next try.
CODEC_WARM_UP_RETRY_S = 10.0
# How long close() waits for a warm-up still compiling (a cold numba cache on a busy machine).
CODEC_WARM_UP_CLOSE_WAIT_S = 60.0


class ControllerWorker:
    def __init__(self, engine: CacheEngine, config: CacheLayerConfig) -> None:
        if not config.controller_pull_url:
            raise ValueError(
                "enable_controller is true but controller_pull_url is not set (e.g. localhost:9001)"
            )
        self._engine = engine
        self._config = config
        self.ip = config.p2p_host or "127.0.0.1"
        secret = secret_from_env(config.controller_auth_secret_env, "controller_auth_secret_env")
        refuse_open_socket_beyond_loopback(
            self.ip,
            secret,
            config.controller_allow_unauthenticated,
            "the controller worker's command socket (p2p_host)",
            "Set controller_auth_secret_env (and the controller's --auth-secret-env), or set "
            "controller_allow_unauthenticated: true if the network is trusted.",
        )
        self._auth = MessageAuth(secret)
        self._context = zmq.Context.instance()
        self._push = self._context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.setsockopt(zmq.SNDHWM, 100)
        self._push.connect(normalize_url(config.controller_pull_url))
        self._commands = self._context.socket(zmq.REP)
        self._commands.setsockopt(zmq.LINGER, 0)
        # The largest legitimate command: its tokens, plus a chunk (import_chunk) of at most twice
        # the raw size (an encoded chunk's worst case) and its headers. A larger message is dropped
        # by ZMQ before it is buffered.
        raw_chunk = engine.layout.raw_nbytes(engine.chunk_size)
        self._commands.setsockopt(
            zmq.MAXMSGSIZE, MAX_BYTES_PER_TOKEN * config.controller_max_tokens + 2 * raw_chunk + (1 << 20)
        )
        ports = config.lmcache_worker_ports or []
        wanted_port = ports[engine.worker_id] if engine.worker_id < len(ports) else 0
        if wanted_port:
            self._commands.bind(f"tcp://{self.ip}:{wanted_port}")
            self.port = wanted_port
        else:
            self.port = self._commands.bind_to_random_port(f"tcp://{self.ip}")
        self._closed = threading.Event()
        # Set once every codec has run once in this process (or its warm-up failed: a real call
        # then reports the failure itself).
        self.codecs_warm = threading.Event()
        self.codec_warm_up_s: float | None = None
        self._warm_up_thread = threading.Thread(
            target=self._warm_up_codecs, name="cachelayer-codec-warm-up", daemon=True
        )
        self._warm_up_thread.start()
        self._threads = [
            threading.Thread(target=self._serve_commands, name="cachelayer-controller-worker", daemon=True),
            threading.Thread(
                target=self._send_heartbeats, name="cachelayer-controller-heartbeat", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()

    def _report(self, kind: str) -> WorkerReport:
        return WorkerReport(
            kind=kind,  # type: ignore[arg-type]
            instance_id=self._config.lmcache_instance_id,
            worker_id=self._engine.worker_id,
            world_size=self._engine.world_size,
            ip=self.ip,
            port=self.port,
            heartbeat_interval_s=self._config.lmcache_worker_heartbeat_time,
            chunk_size=self._engine.chunk_size,
            kv_bytes_per_token=self._engine.layout.bytes_per_token,
        )

    def _send_report(self, kind: str) -> None:
        frames, _ = self._auth.seal(REPORT, [encode(self._report(kind))])
        try:
            self._push.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning(
                "cachelayer worker: controller at %s is not reachable yet", self._config.controller_pull_url
            )

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=5)
        # A compile cut short by the interpreter's exit can crash it in numba's LLVM: let it end.
        self._warm_up_thread.join(timeout=CODEC_WARM_UP_CLOSE_WAIT_S)
        self._send_report("deregister")  # the heartbeat thread has ended: the PUSH socket is ours now
        self._push.close(linger=500)
        self._commands.close(linger=0)

    def _warm_up_codecs(self) -> None:
        from cachelayer.compress import warm_up

        try:
            self.codec_warm_up_s = warm_up(self._engine.dtype)
            log.info("cachelayer worker: codecs ready in %.1f s", self.codec_warm_up_s)
        except Exception:
            log.exception("cachelayer worker: warming the codecs up failed; their first call pays it")
        finally:
            self.codecs_warm.set()

    def _send_heartbeats(self) -> None:
        self._send_report("register")
        while not self._closed.wait(self._config.lmcache_worker_heartbeat_time):
            self._send_report("heartbeat")

    def _serve_commands(self) -> None:
        decoder = msgspec.msgpack.Decoder(Command)
        last_refusal_logged = 0.0
        while not self._closed.is_set():
            if not self._commands.poll(100):
                continue
            frames = self._commands.recv_multipart(copy=True)
            chunk_bytes: bytes | None = None
            nonce = b""
            try:
                frames, nonce = self._auth.open(COMMAND, frames)
                reply, chunk_bytes = self._execute(self._checked(decoder.decode(frames[0])), frames[1:])
            except AuthError as exc:
                if time.monotonic() - last_refusal_logged > 10:  # at most one line per 10 s of attack
                    last_refusal_logged = time.monotonic()
                    log.warning("cachelayer worker: unauthenticated command refused: %s", exc)
                reply = Reply(ok=False, error=f"command refused: {exc}")
            except (msgspec.DecodeError, IndexError) as exc:
                reply = Reply(ok=False, error=f"malformed command: {exc}")
            except ValueError as exc:  # _checked's refusals
                reply = Reply(ok=False, error=str(exc))
            answer = [encode(reply)] if chunk_bytes is None else [encode(reply), chunk_bytes]
            self._commands.send_multipart(
                self._auth.seal(REPLY, answer, answering=nonce)[0] if nonce else answer
            )

    def _checked(self, command: Command) -> Command:
        limit = self._config.controller_max_tokens
        if len(command.tokens) > limit:
            raise ValueError(
                f"{command.op} carries {len(command.tokens)} tokens; this worker accepts at most "
                f"{limit} per command (controller_max_tokens)"
            )
        return command

    def _execute(self, command: Command, extra_frames: list[bytes]) -> tuple[Reply, bytes | None]:
        """The reply, and the chunk bytes that follow it as a raw frame (export_chunk only)."""
        engine = self._engine
        try:
            if command.op == "export_chunk":
                exported = engine.export_chunk(command.tokens, command.chunk_index, command.location or "")
                if exported is None:
                    return Reply(num_tokens=0), None
                span, chunk_format, data = exported
                return Reply(num_tokens=span.end, chunk_format=chunk_format), data
            if command.op == "import_chunk":
                if len(extra_frames) != 1:
                    return Reply(ok=False, error="import_chunk needs the chunk's bytes as one frame"), None
                stored_end = engine.import_chunk(
                    command.tokens,
                    command.chunk_index,
                    command.location or "",
                    command.chunk_format or "raw",
                    extra_frames[0],
                )
                return Reply(num_tokens=stored_end), None
        except ValueError as exc:
            return Reply(ok=False, error=str(exc)), None
        except Exception as exc:
            log.exception("cachelayer worker: %s failed", command.op)
            return Reply(ok=False, error=f"{command.op} failed on worker {engine.worker_id}: {exc!r}"), None
        return self._execute_command(command), None

    def _execute_command(self, command: Command) -> Reply:
        engine = self._engine
        try:
            if command.op == "lookup":
                location, matched = engine.lookup_location(
                    command.tokens, cache_salt=command.cache_salt, lora=command.lora
                )
                return Reply(num_tokens=matched, location=location)
            if command.op == "clear":
                return Reply(num_tokens=engine.clear(command.location))
            if command.op == "pin":
                return Reply(num_tokens=engine.pin(command.tokens, command.location))
            if command.op in ("compress", "decompress"):
                if not self.codecs_warm.wait(CODEC_WARM_UP_WAIT_S):
                    return Reply(
                        ok=False,
                        retry_after_s=CODEC_WARM_UP_RETRY_S,
                        error=(
                            f"{command.op} not run on worker {engine.worker_id}: its codecs are still "
                            "being compiled (CacheGen's numba kernels on their first use on this machine: "
                            "up to a minute, then kept in numba's cache, NUMBA_CACHE_DIR, for later starts); "
                            f"send the {command.op} again in {CODEC_WARM_UP_RETRY_S:.0f} s"
                        ),
                    )
                operation = engine.compress if command.op == "compress" else engine.decompress
                return Reply(
                    num_tokens=operation(command.tokens, command.method or "", command.location or "cpu")
                )
            if command.op == "move":
                moved = engine.move(
                    command.tokens, command.location or "", command.destination or "", copy=command.copy
                )
                return Reply(num_tokens=moved)
            if command.op == "health":
                return Reply()
            if command.op == "info":
                return Reply(info=engine.stats())
            if command.op == "identity":
                if command.location is not None:  # refuse a move to or from a missing tier up front
                    engine.check_location(command.location)
                return Reply(info=engine.transfer_identity())
            if command.op == "drop":
                return Reply(num_tokens=engine.drop(command.tokens, command.location or ""))
        except ValueError as exc:  # the engine's refusals: bad location, method, tokens
            return Reply(ok=False, error=str(exc))
        except Exception as exc:  # never let one bad command stop the worker's thread
            log.exception("cachelayer worker: %s failed", command.op)
            return Reply(ok=False, error=f"{command.op} failed on worker {engine.worker_id}: {exc!r}")
        return Reply(ok=False, error=f"unknown operation {command.op!r}")


def attach_controller_worker(engine: CacheEngine, config: CacheLayerConfig) -> ControllerWorker | None:
    """Register `engine` with the controller and serve its commands when `config.enable_controller`
    is true (None when it is not); the worker closes with the engine (`CacheEngine.on_close`).

    A worker that cannot start (e.g. a refused secret or address) closes the engine before the error
    goes on: a caller that gets the error has nothing left running."""
    if not config.enable_controller:
        return None
    try:
        worker = ControllerWorker(engine, config)
    except BaseException:
        engine.close()
        raise
    engine.on_close(worker.close)
    return worker
