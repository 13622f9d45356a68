"""The controller: LMCache's controller HTTP API over the cache engines that register with it.

HTTP (Starlette), all POST with JSON, every error (401, 404, 405, 413, 500 included) in LMCache's
`{"detail": ...}` shape (`protocol.lmcache_error_body`): /lookup, /clear, /pin, /compress,
/decompress, /move, /health, /query_worker_info (schemas in docs/cachelayer.md, "Controller"), and
/check_finish {event_id} -> {status: "finished"} for clients that poll (every operation here
completes before it answers).
Workers report on a ZMQ PULL socket (the monitor port): register, heartbeat, deregister. A
worker silent for `MISSED_HEARTBEATS` of its own intervals is dropped. Each operation on an
instance fans out to all its (tensor-parallel) workers in parallel; they must all report the
same token count, or the answer is a 500 naming the counts.
With a shared secret (auth.py) the HTTP API needs `Authorization: Bearer <secret>` and every worker
message is signed; unsigned reports are dropped. A request carries at most `max_tokens` tokens (413).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cachelayer.controller.auth import (
    COMMAND,
    REPLY,
    REPORT,
    AuthConfigError,
    AuthError,
    MessageAuth,
    bearer_token_matches,
    refuse_open_socket_beyond_loopback,
    secret_from_env,
)
from cachelayer.controller.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_BYTES_PER_TOKEN,
    Command,
    Reply,
    WorkerReport,
    encode,
    lmcache_error_body,
)
from cachelayer.errors import CacheLayerError

log = logging.getLogger(__name__)

MISSED_HEARTBEATS = 3
COMMAND_TIMEOUT_S = 5.0
# Operations whose work grows with the KV of the tokens they carry get longer: this many seconds per
# byte of it, 10 MB/s, a quarter of what CacheGen's CPU encoder did on a busy 2-core machine (38 MB/s:
# 3 ms a token of a 28-layer model, 112 KiB a token). A compress of 100k such tokens gets 20 minutes.
COMMAND_SECONDS_PER_KV_BYTE = 1e-7
# A worker that does not report its bytes per token is taken to hold this many (an 8B model in bf16).
DEFAULT_KV_BYTES_PER_TOKEN = 128 * 1024
KV_SIZED_OPERATIONS = frozenset({"compress", "decompress", "move", "export_chunk", "import_chunk", "drop"})


def command_timeout_s(command: Command, kv_bytes_per_token: int = 0) -> float:
    """How long the controller waits for a worker's answer to `command`: COMMAND_TIMEOUT_S, plus, for
    the operations whose work follows the tokens' KV, COMMAND_SECONDS_PER_KV_BYTE per byte of it
    (`kv_bytes_per_token` as the worker reported it, DEFAULT_KV_BYTES_PER_TOKEN when it did not)."""
    if command.op not in KV_SIZED_OPERATIONS:
        return COMMAND_TIMEOUT_S
    kv_bytes = len(command.tokens) * (kv_bytes_per_token or DEFAULT_KV_BYTES_PER_TOKEN)
    return COMMAND_TIMEOUT_S + COMMAND_SECONDS_PER_KV_BYTE * kv_bytes


_MAX_REPORT_BYTES = 64 * 1024  # a WorkerReport is ~200 bytes; ZMQ drops larger messages unread


class ApiError(CacheLayerError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# ---- request bodies (LMCache's schemas) ----


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    pass


class LookupBody(_Body):
    tokens: list[int]
    # Not LMCache's: the namespace the chunks were stored under (a request's cache_salt, its LoRA
    # adapter); without them, the unsalted base model's (all LMCache's lookup can ask for).
    cache_salt: str | None = None
    lora: str | None = None


class ClearBody(_Body):
    instance_id: str
    location: str | None = None


class PinBody(_Body):
    instance_id: str
    tokens: list[int]
    location: str | None = None


class CompressBody(_Body):
    instance_id: str
    method: str
    location: str
    tokens: list[int]


class MoveBody(_Body):
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int]
    copy: bool = False


class HealthBody(_Body):
    instance_id: str


class TenantUsageBody(_Body):
    instance_id: str


class CheckFinishBody(_Body):
    event_id: str


class QueryWorkerInfoBody(_Body):
    instance_id: str
    worker_ids: list[int] | None = None


@dataclass
class WorkerRecord:
    report: WorkerReport
    registration_time: float
    last_heartbeat_time: float

    @property
    def url(self) -> str:
        return f"tcp://{self.report.ip}:{self.report.port}"

    def info(self) -> dict[str, Any]:
        return {
            "instance_id": self.report.instance_id,
            "worker_id": self.report.worker_id,
            "ip": self.report.ip,
            "port": self.report.port,
            "world_size": self.report.world_size,
            # Not LMCache's: the worker's chunk size (tokens), as it registered (the contract check).
            "chunk_size": self.report.chunk_size,
            "registration_time": self.registration_time,
            "last_heartbeat_time": self.last_heartbeat_time,
        }


class Controller:
    """The worker registry and the fan-out of operations; the HTTP layer is `build_app`."""

    def __init__(
        self,
        monitor_endpoint: str,
        *,
        secret: bytes | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._context = context or zmq.asyncio.Context()
        self.secret = secret
        self._auth = MessageAuth(secret)
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, _MAX_REPORT_BYTES)
        self._pull.bind(monitor_endpoint)
        self.monitor_endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.instances: dict[str, dict[int, WorkerRecord]] = {}
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle (inside the event loop) ----
    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_reports()), asyncio.create_task(self._reap())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pull.close(linger=0)

    # ---- registry ----
    def apply_report(self, report: WorkerReport, now: float | None = None) -> None:
        now = time.time() if now is None else now
        workers = self.instances.setdefault(report.instance_id, {})
        if report.kind == "deregister":
            workers.pop(report.worker_id, None)
            if not workers:
                self.instances.pop(report.instance_id, None)
            log.info("controller: worker %s/%d left", report.instance_id, report.worker_id)
            return
        record = workers.get(report.worker_id)
        if record is None or record.report.port != report.port or record.report.ip != report.ip:
            workers[report.worker_id] = WorkerRecord(report, now, now)
            log.info(
                "controller: worker %s/%d registered at %s:%d",
                report.instance_id,
                report.worker_id,
                report.ip,
                report.port,
            )
        else:
            record.report = report
            record.last_heartbeat_time = now

    def drop_silent_workers(self, now: float | None = None) -> list[tuple[str, int]]:
        now = time.time() if now is None else now
        dropped = []
        for instance_id, workers in list(self.instances.items()):
            for worker_id, record in list(workers.items()):
                if now - record.last_heartbeat_time > MISSED_HEARTBEATS * record.report.heartbeat_interval_s:
                    del workers[worker_id]
                    dropped.append((instance_id, worker_id))
                    log.warning(
                        "controller: worker %s/%d stopped heartbeating; dropped", instance_id, worker_id
                    )
            if not workers:
                del self.instances[instance_id]
        return dropped

    async def _receive_reports(self) -> None:
        decoder = msgspec.msgpack.Decoder(WorkerReport)
        last_refusal_logged = 0.0
        while True:
            frames = await self._pull.recv_multipart()
            try:
                payload, _ = self._auth.open(REPORT, frames)
                self.apply_report(decoder.decode(payload[0]))
            except AuthError as exc:
                if time.monotonic() - last_refusal_logged > 10:  # one line per 10 s of attack at most
                    last_refusal_logged = time.monotonic()
                    log.warning("controller: unauthenticated worker report dropped: %s", exc)
            except (msgspec.DecodeError, IndexError) as exc:
                log.warning("controller: malformed worker report ignored: %s", exc)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            self.drop_silent_workers()

    # ---- fan-out ----
    def workers_of(self, instance_id: str) -> dict[int, WorkerRecord]:
        workers = self.instances.get(instance_id)
        if not workers:
            known = ", ".join(sorted(self.instances)) or "none registered"
            raise ApiError(404, f"unknown instance_id {instance_id!r} (known: {known})")
        return workers

    async def _ask(self, record: WorkerRecord, command: Command) -> Reply:
        reply, _ = await self._exchange(record, command)
        return reply

    async def _exchange(
        self, record: WorkerRecord, command: Command, chunk_bytes: bytes | None = None
    ) -> tuple[Reply, bytes | None]:
        """Send a command (and chunk bytes as a raw second frame); the reply and any bytes after it."""
        socket = self._context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(record.url)
        try:
            frames = [encode(command)] if chunk_bytes is None else [encode(command), chunk_bytes]
            frames, nonce = self._auth.seal(COMMAND, frames)
            await socket.send_multipart(frames, copy=False)
            timeout_s = command_timeout_s(command, record.report.kv_bytes_per_token)
            if not await socket.poll(int(timeout_s * 1000)):
                error = (
                    f"worker {record.report.worker_id} did not answer in {timeout_s:.1f}s (the allowance "
                    f"for {command.op} of {len(command.tokens)} tokens): it may still be running it, or be "
                    "stopped; check its log, and send the command again once /health answers for it"
                )
                return Reply(ok=False, error=error), None
            answer = await socket.recv_multipart()
            try:
                answer, _ = self._auth.open(REPLY, answer, answering=nonce)
                reply = msgspec.msgpack.decode(answer[0], type=Reply)
            except (AuthError, msgspec.DecodeError, IndexError) as exc:
                error = f"worker {record.report.worker_id} at {record.url} gave an unusable answer: {exc}"
                return Reply(ok=False, error=error), None
            return reply, (answer[1] if len(answer) > 1 else None)
        finally:
            socket.close(linger=0)

    async def fan_out(self, instance_id: str, command: Command) -> dict[int, Reply]:
        # A copy: the reaper and new reports change the registry while the replies are awaited.
        workers = dict(self.workers_of(instance_id))
        replies = await asyncio.gather(*(self._ask(record, command) for record in workers.values()))
        return dict(zip(workers, replies, strict=True))

    async def same_count(self, instance_id: str, command: Command) -> int:
        replies = await self.fan_out(instance_id, command)
        self._raise_failures(command.op, instance_id, replies)
        counts = {worker: reply.num_tokens for worker, reply in replies.items()}
        if len(set(counts.values())) > 1:
            raise ApiError(
                500, f"{command.op} on {instance_id}: workers disagree on the token count {counts}"
            )
        return next(iter(counts.values()))

    @staticmethod
    def _raise_failures(operation: str, instance_id: str, replies: dict[int, Reply]) -> None:
        failures = {worker: reply.error for worker, reply in replies.items() if not reply.ok}
        if failures:
            # 503 where trying again later can succeed: a worker that did not answer, or one that
            # said it is not ready yet (retry_after_s); 400 for a refusal of the command itself.
            later = any(
                not reply.ok and (reply.retry_after_s is not None or "did not answer" in str(reply.error))
                for reply in replies.values()
            )
            status = 503 if later else 400
            raise ApiError(status, f"{operation} failed on {instance_id}: {failures}")

    async def move_between_instances(
        self, tokens: list[int], source: tuple[str, str], destination: tuple[str, str], *, copy: bool
    ) -> int:
        """Relay the held prefix of `tokens` from one instance's location to another's, chunk by chunk.

        Worker r of the source sends to worker r of the destination; both must build the same keys
        (`transfer_identity`), or nothing moves. A chunk moves only when every source worker holds it
        and every destination worker stored it, so both sides keep a prefix. Unless `copy`, the
        source then drops what moved. Returns the tokens now held at the destination.
        """
        (source_instance, source_location), (destination_instance, destination_location) = source, destination
        # Copies: the registry may change while the chunks move; the move keeps the workers it began with.
        senders = dict(self.workers_of(source_instance))
        receivers = dict(self.workers_of(destination_instance))
        if sorted(senders) != sorted(receivers):
            raise ApiError(
                400,
                f"cannot move from {source_instance!r} (workers {sorted(senders)}) to "
                f"{destination_instance!r} (workers {sorted(receivers)}): each tensor-parallel worker "
                "sends to the destination worker of the same rank, so both need the same workers",
            )
        ranks = sorted(senders)
        identities = await asyncio.gather(
            *(
                self._ask(workers[rank], Command(op="identity", location=location))
                for workers, location in ((senders, source_location), (receivers, destination_location))
                for rank in ranks
            )
        )
        self._raise_failures(
            "identity", f"{source_instance}/{destination_instance}", dict(enumerate(identities))
        )
        for position, rank in enumerate(ranks):
            sender_identity = identities[position].info or {}
            receiver_identity = identities[len(ranks) + position].info or {}
            differing = {
                name: [sender_identity.get(name), receiver_identity.get(name)]
                for name in sorted(set(sender_identity) | set(receiver_identity))
                if sender_identity.get(name) != receiver_identity.get(name)
            }
            if differing:
                raise ApiError(
                    409,
                    f"cannot move from {source_instance!r} to {destination_instance!r}: worker {rank} "
                    f"keys its chunks differently ({_describe_differences(differing)}); "
                    "KV moves only between instances of the same model, dtype, world size and chunking",
                )
        moved_end = 0
        chunk_index = 0
        while True:
            export = Command(
                op="export_chunk", tokens=tokens, location=source_location, chunk_index=chunk_index
            )
            exported = await asyncio.gather(*(self._exchange(senders[rank], export) for rank in ranks))
            self._raise_failures(
                "export_chunk",
                source_instance,
                {rank: reply for rank, (reply, _) in zip(ranks, exported, strict=True)},
            )
            ends = {reply.num_tokens for reply, _ in exported}
            if 0 in ends or any(data is None for _, data in exported):
                break  # some worker does not hold this chunk: what moves is the prefix before it
            if len(ends) > 1:
                raise ApiError(
                    500,
                    f"export_chunk on {source_instance}: workers disagree on where chunk "
                    f"{chunk_index} ends {sorted(ends)}",
                )
            exchanges = await asyncio.gather(
                *(
                    self._exchange(
                        receivers[rank],
                        Command(
                            op="import_chunk",
                            tokens=tokens,
                            location=destination_location,
                            chunk_index=chunk_index,
                            chunk_format=reply.chunk_format,
                        ),
                        data,
                    )
                    for rank, (reply, data) in zip(ranks, exported, strict=True)
                )
            )
            imported = [reply for reply, _ in exchanges]
            self._raise_failures(
                "import_chunk", destination_instance, dict(zip(ranks, imported, strict=True))
            )
            if any(reply.num_tokens != next(iter(ends)) for reply in imported):
                break  # no room at the destination on some worker: stop, the destination keeps a prefix
            moved_end = next(iter(ends))
            chunk_index += 1
        if not copy and moved_end:
            drop = Command(op="drop", tokens=tokens[:moved_end], location=source_location)
            await self.same_count(source_instance, drop)
        return moved_end

    async def lookup(
        self, tokens: list[int], cache_salt: str | None = None, lora: str | None = None
    ) -> dict[str, list[Any]]:
        """Per instance, [location, matched tokens]; an instance holding nothing is left out.

        Tensor-parallel workers each hold their shard: the instance holds what all of them hold (the minimum).
        """
        layout: dict[str, list[Any]] = {}
        instance_ids = list(self.instances)
        answers = await asyncio.gather(
            *(
                self.fan_out(
                    instance_id, Command(op="lookup", tokens=tokens, cache_salt=cache_salt, lora=lora)
                )
                for instance_id in instance_ids
            ),
            return_exceptions=True,
        )
        for instance_id, replies in zip(instance_ids, answers, strict=True):
            if isinstance(replies, BaseException):
                continue
            good = [reply for reply in replies.values() if reply.ok]
            if len(good) != len(replies):
                continue
            weakest = min(good, key=lambda reply: reply.num_tokens)
            if weakest.num_tokens > 0:
                layout[instance_id] = [weakest.location, weakest.num_tokens]
        return layout


def _describe_differences(differing: dict[str, list[Any]]) -> str:
    return ", ".join(
        f"{name}: {source!r} vs {destination!r}" for name, (source, destination) in differing.items()
    )


def _event_id(operation: str) -> str:
    return f"{operation}{uuid.uuid4().hex}"


_REMEMBERED_EVENTS = 10_000


def _error(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    return Response(lmcache_error_body(detail), status, headers, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, _too_large(int(declared), limit))
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, _too_large(len(body), limit))
    return bytes(body)


def _too_large(size: int, limit: int) -> str:
    return (
        f"request body of {size} bytes or more; at most {limit} are accepted "
        "(a bound that follows the controller's --max-tokens)"
    )


def build_app(controller: Controller, *, max_tokens: int = DEFAULT_MAX_TOKENS) -> Starlette:
    """The HTTP API; with `controller.secret` set every call needs `Authorization: Bearer <secret>`."""
    # Every operation completes before its answer, so an event id is finished as soon as it is issued;
    # /check_finish serves LMCache clients that poll for it.
    finished_events: OrderedDict[str, None] = OrderedDict()
    body_limit = MAX_BYTES_PER_TOKEN * max_tokens + 64 * 1024

    def endpoint(body_type: type[_Body], operation: str, handler: Any) -> Any:
        async def handle(request: Request) -> Response:
            if controller.secret is not None and not bearer_token_matches(
                request.headers.get("authorization", ""), controller.secret
            ):
                return _error(
                    401,
                    "this controller needs `Authorization: Bearer <secret>`, the secret of its "
                    "--auth-secret-env variable",
                    {"WWW-Authenticate": "Bearer"},
                )
            try:
                body = msgspec.json.decode(await _read_body(request, body_limit), type=body_type)
                tokens = getattr(body, "tokens", ())
                if len(tokens) > max_tokens:
                    raise ApiError(
                        413,
                        f"{len(tokens)} tokens in one request; this controller accepts at most {max_tokens} "
                        "(--max-tokens): split the request",
                    )
            except ApiError as exc:
                return _error(exc.status, exc.detail)
            except msgspec.ValidationError as exc:
                return _error(422, f"malformed {request.url.path} body: {exc}")
            except msgspec.DecodeError as exc:
                return _error(400, f"{request.url.path} body is not valid JSON: {exc}")
            try:
                result = await handler(body)
            except ApiError as exc:
                return _error(exc.status, exc.detail)
            except Exception as exc:  # a bug here must still answer in the API's error shape
                log.exception("controller: %s failed", request.url.path)
                return _error(500, f"{request.url.path} failed inside the controller: {exc!r}")
            event_id = _event_id(operation)
            finished_events[event_id] = None
            while len(finished_events) > _REMEMBERED_EVENTS:
                finished_events.popitem(last=False)
            return JSONResponse({"event_id": event_id, **result})

        return handle

    async def lookup(body: LookupBody) -> dict[str, Any]:
        return {"layout_info": await controller.lookup(body.tokens, body.cache_salt, body.lora)}

    async def clear(body: ClearBody) -> dict[str, Any]:
        command = Command(op="clear", location=body.location)
        return {"num_tokens": await controller.same_count(body.instance_id, command)}

    async def pin(body: PinBody) -> dict[str, Any]:
        command = Command(op="pin", tokens=body.tokens, location=body.location)
        return {"num_tokens": await controller.same_count(body.instance_id, command)}

    def recode(operation: str) -> Any:
        async def handler(body: CompressBody) -> dict[str, Any]:
            command = Command(op=operation, tokens=body.tokens, location=body.location, method=body.method)  # type: ignore[arg-type]
            return {"num_tokens": await controller.same_count(body.instance_id, command)}

        return handler

    async def move(body: MoveBody) -> dict[str, Any]:
        (source_instance, source), (destination_instance, destination) = body.old_position, body.new_position
        if source_instance != destination_instance:
            moved = await controller.move_between_instances(
                body.tokens, body.old_position, body.new_position, copy=body.copy
            )
            return {"num_tokens": moved}
        command = Command(
            op="move", tokens=body.tokens, location=source, destination=destination, copy=body.copy
        )
        return {"num_tokens": await controller.same_count(source_instance, command)}

    async def health(body: HealthBody) -> dict[str, Any]:
        replies = await controller.fan_out(body.instance_id, Command(op="health"))
        return {"error_codes": {str(worker): 0 if reply.ok else -1 for worker, reply in replies.items()}}

    async def query_worker_info(body: QueryWorkerInfoBody) -> dict[str, Any]:
        workers = controller.workers_of(body.instance_id)
        wanted = body.worker_ids if body.worker_ids else sorted(workers)
        missing = [worker for worker in wanted if worker not in workers]
        if missing:
            raise ApiError(
                404, f"instance {body.instance_id!r} has no worker(s) {missing}; it has {sorted(workers)}"
            )
        return {"worker_infos": [workers[worker].info() for worker in wanted]}

    async def tenant_usage(body: TenantUsageBody) -> dict[str, Any]:
        replies = await controller.fan_out(body.instance_id, Command(op="info"))
        controller._raise_failures("tenant_usage", body.instance_id, replies)
        # Per worker: its L1 and remote-tier usage by tenant label (configured tenants, `_shared`,
        # `_other`: bounded whatever salts clients send); null without tenant_quotas.
        return {
            "tenant_usage": {
                str(worker): {
                    "l1": (reply.info or {}).get("cpu_tenant_usage"),
                    "remote": (reply.info or {}).get("remote_tenant_usage"),
                }
                for worker, reply in replies.items()
            }
        }

    async def check_finish(body: CheckFinishBody) -> dict[str, Any]:
        if body.event_id not in finished_events:
            raise ApiError(
                404, f"unknown event_id {body.event_id!r} (or older than the last {_REMEMBERED_EVENTS})"
            )
        return {"status": "finished"}

    routes = [
        Route("/lookup", endpoint(LookupBody, "Lookup", lookup), methods=["POST"]),
        Route("/clear", endpoint(ClearBody, "Clear", clear), methods=["POST"]),
        Route("/pin", endpoint(PinBody, "Pin", pin), methods=["POST"]),
        Route("/compress", endpoint(CompressBody, "Compress", recode("compress")), methods=["POST"]),
        Route("/decompress", endpoint(CompressBody, "Decompress", recode("decompress")), methods=["POST"]),
        Route("/move", endpoint(MoveBody, "Move", move), methods=["POST"]),
        Route("/health", endpoint(HealthBody, "Health", health), methods=["POST"]),
        Route("/check_finish", endpoint(CheckFinishBody, "CheckFinish", check_finish), methods=["POST"]),
        Route("/tenant_usage", endpoint(TenantUsageBody, "TenantUsage", tenant_usage), methods=["POST"]),
        Route(
            "/query_worker_info",
            endpoint(QueryWorkerInfoBody, "QueryWorkerInfo", query_worker_info),
            methods=["POST"],
        ),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await controller.start()
        try:
            yield
        finally:
            await controller.stop()

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 405:
            detail = f"{request.method} {request.url.path}: every controller route takes POST with JSON"
        elif exc.status_code == 404:
            detail = (
                f"no route {request.url.path}; the routes are {', '.join(route.path for route in routes)}"
            )
        else:
            detail = str(exc.detail)
        return _error(exc.status_code, detail, exc.headers)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def serve(
    host: str,
    port: int,
    monitor_port: int,
    *,
    auth_secret_env: str | None = None,
    allow_unauthenticated: bool = False,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> None:
    """Run the controller until interrupted (the `cachelayer controller` command)."""
    import uvicorn

    try:
        secret = secret_from_env(auth_secret_env, "--auth-secret-env")
        refuse_open_socket_beyond_loopback(
            host,
            secret,
            allow_unauthenticated,
            "the controller (HTTP API and worker monitor socket)",
            "Pass --auth-secret-env NAME (and set controller_auth_secret_env: NAME on the engines), or "
            "--allow-unauthenticated if the network is trusted.",
        )
    except AuthConfigError as exc:
        raise SystemExit(f"cachelayer controller: {exc}") from None
    controller = Controller(f"tcp://{host}:{monitor_port}", secret=secret)
    log.info(
        "controller: HTTP on %s:%d, worker monitor on %s, %s",
        host,
        port,
        controller.monitor_endpoint,
        "authenticated (shared secret)" if secret else "unauthenticated",
    )
    uvicorn.run(build_app(controller, max_tokens=max_tokens), host=host, port=port, log_level="info")
