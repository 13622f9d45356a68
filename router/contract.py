"""The contract check: the gateway and each engine must key cached KV alike, or every lookup misses
silently (LMCache #1767, #1842; llm-d-router #2873 on mixed block sizes). This module finds out.

At a backend's subscription and every `contract_check.interval_s`, a round probes every backend of
a model with one prompt (a fresh nonce first, so no engine holds it yet, then `probe_words` words;
sent with the salt PROBE_SALT, as a 1-token completion straight to each engine), then compares:
- `tokens`: the gateway's tokens for the probe against the engine's own `/tokenize`;
- `kv_events`: the probe's blocks reach the gateway's index under the gateway's tokens and namespace
  (none arriving means the engine tokenized, salted or published differently);
- from the engine's own KV events for the probe (read back from its replay endpoint):
  `block_size` (its GPU blocks), `chunk_size` (the cache layer's chunks: events of another medium),
  `block_hash` (the first block's hash, which the hash algorithm and seed decide: engines of one
  model and block size announce the same hash for the same tokens), and `cache_salt` (the salt
  comes back in the first block's extra keys, or the engine ignores salts).
- `model`: the engine's own /v1/models lists the model under the name the gateway sends (its
  `served_name`), as a base model or as a LoRA adapter (an entry with a `parent`);
- with a `cache_controller` on the backend: `cache_lookup`, the cache layer's controller /lookup
  finds the probe's whole chunks for the backend's instance, under the gateway's tokens and the
  probe's namespace (its salt, its LoRA), and `chunk_size` from the chunk size its workers
  registered with (/query_worker_info) when no events of the cache layer's gave one.
What a field is expected to be: `contract_check.block_size` / `chunk_size` when configured, else
what the model's reference backend (its first backend in the configuration) reported in the same
round. A mismatch names the backend, the field and both values; it is a routing warning
(`contract_mismatch`: the log, /health, /debug/prefix-map, kvgate_routing_warnings), and the
backend's cached prefixes get no credit (KVIndexService.set_uncredited: it is routed by load only)
until a later round finds it agreeing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from kvwire import BlockStored, cache_salt_of, decode_batch, tier_of
from kvwire.replay import END_SEQ, decode_seq, encode_seq
from router.tokenize.messages import TokenizeError, as_tokens

if TYPE_CHECKING:
    from router.backends import BackendRegistry, BackendState
    from router.config import Config
    from router.index.service import KVIndexService
    from router.tokenize.request import RequestTokenizer
    from router.upstream import UpstreamPool

logger = logging.getLogger("kvgate.contract")

PROBE_SALT = "kvgate-contract-probe"
# The probe's words: plain ASCII every tokenizer reads, in an order no real prompt shares.
_WORDS = [
    "amber", "bridge", "copper", "delta", "ember", "fable", "garnet", "harbor", "island", "jasper",
    "kettle", "lantern", "meadow", "nickel", "orchard", "pepper", "quartz", "ribbon", "saddle", "timber",
    "umber", "velvet", "willow", "yonder", "zephyr", "anchor", "basil", "cedar", "dune", "fern", "grove",
    "heron", "ivory", "juniper", "kelp", "lichen", "maple", "nutmeg", "olive", "pine",
]  # fmt: skip
# Batches read back from a replay at most, and the bytes of one (what an engine can make us read).
_MAX_REPLAYED_BATCHES = 4096
_MAX_REPLAYED_BYTES = 64 << 20
_JSON_HEADERS = [(b"content-type", b"application/json")]
_MAX_ANSWER_BYTES = 4 << 20
FIELDS = (
    "model",
    "tokens",
    "kv_events",
    "block_size",
    "chunk_size",
    "block_hash",
    "cache_salt",
    "cache_lookup",
)
# The cache layer's chunk size when neither the configuration nor a worker names one (LMCache's).
_DEFAULT_CHUNK = 256


def probe_text(nonce: str, words: int) -> str:
    """The probe prompt of one round: its nonce first, so that no engine holds any of its blocks."""
    body = " ".join(_WORDS[(index * 7 + 3) % len(_WORDS)] for index in range(words))
    return f"kvgate contract probe {nonce}: {body}"


@dataclass(frozen=True, slots=True)
class Mismatch:
    backend: str
    field: str
    expected: str
    reported: str

    def message(self) -> str:
        return (
            f"backend {self.backend}: contract mismatch on {self.field}: the gateway expects "
            f"{self.expected}, the backend reports {self.reported}; its cached prefixes get no credit "
            "(routed by load only) until a check finds them agreeing (docs/gateway.md, 'Contract check')"
        )


@dataclass(slots=True)
class ProbeReport:
    """What one backend reported for one probe."""

    engine_tokens: np.ndarray | None = None
    indexed_tokens: int = 0
    block_size: int | None = None
    chunk_size: int | None = None
    first_block_hash: Any = None
    cache_salt: str | None = None
    events_read: bool = False
    probe_tokens: int = 0
    # The engine took the probe (a 2xx answer); without it nothing can be compared.
    answered: bool = False
    # The engine's /v1/models: each id and its `parent` (a LoRA adapter's base model; None for a
    # base model); None when it did not answer.
    served_models: dict[str, str | None] | None = None
    # From the backend's cache_controller: the probe's tokens its /lookup found for the instance
    # (None: no controller, or it did not answer), where, and the chunk size its workers registered.
    controller_tokens: int | None = None
    controller_layout: dict[str, Any] | None = None
    controller_chunk_size: int | None = None


class ContractChecker:
    """Runs the rounds in the background and keeps the last round's mismatches per backend. A
    BackendListener: a backend that joins gets a round of its model soon after."""

    def __init__(
        self,
        config: Config,
        backends: BackendRegistry,
        index: KVIndexService,
        tokenizer: RequestTokenizer,
        pool: UpstreamPool,
    ) -> None:
        self.settings = config.contract_check
        self._config = config
        self._backends = backends
        self._index = index
        self._tokenizer = tokenizer
        self._pool = pool
        # Per backend, per model: the last round's mismatches (a round checks one model).
        self.mismatches: dict[str, dict[str, list[Mismatch]]] = {}
        self.checked_at: dict[str, float] = {}
        self._due: set[str] = set()  # models with a backend that joined since their last round
        self._wake = asyncio.Event() if self.settings.enabled else None
        self._task: asyncio.Task | None = None
        self._rounds = 0

    # ---- BackendListener ----
    def backend_added(self, backend: BackendState) -> None:
        if self._wake is None or backend.kv_events is None:
            return
        self._due.update(backend.models or [model.name for model in self._config.models])
        with contextlib.suppress(RuntimeError):  # no running loop yet: start() checks every model
            asyncio.get_running_loop().call_soon_threadsafe(self._wake.set)

    def backend_removed(self, backend: BackendState) -> None:
        self.mismatches.pop(backend.name, None)
        self._index.set_uncredited(backend.name, None)

    # ---- what the warnings show ----
    def warnings(self) -> list[dict[str, str]]:
        return [
            {
                "kind": "contract_mismatch",
                "subject": f"{mismatch.backend}/{mismatch.field}",
                "message": mismatch.message(),
            }
            for by_model in self.mismatches.values()
            for found in by_model.values()
            for mismatch in found
        ]

    # ---- the rounds ----
    def start(self) -> None:
        if self._wake is None:
            return
        self._due.update(model.name for model in self._config.models)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        assert self._wake is not None
        next_all = time.monotonic() + self.settings.interval_s
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_all - time.monotonic()))
            self._wake.clear()
            if time.monotonic() >= next_all:
                self._due.update(model.name for model in self._config.models)
                next_all = time.monotonic() + self.settings.interval_s
            due, self._due = self._due, set()
            for model in sorted(due):
                try:
                    await self.check_model(model)
                except Exception:  # a bug in one round must not end the checks
                    logger.exception("contract check of model %s failed", model)

    async def check_model(self, model: str) -> dict[str, list[Mismatch]]:
        """One round over the backends of `model` with KV events: probe each, compare, apply."""
        members = [b for b in self._backends.values() if b.serves(model) and b.kv_events is not None]
        if not members:
            return {}
        self._rounds += 1
        await self._streams_connected([backend.name for backend in members])
        text = probe_text(f"{os.getpid():x}-{self._rounds}-{time.time_ns():x}", self.settings.probe_words)
        gateway_tokens = await self._gateway_tokens(model, text)
        reports = {}
        for backend in members:  # one at a time: each engine's events are read back on their own
            reports[backend.name] = await self._probe(backend, model, text, gateway_tokens)
        reference = reports[members[0].name]
        found: dict[str, list[Mismatch]] = {}
        served = self._served_name(model)
        for backend in members:
            report = reports[backend.name]
            if not report.answered:
                # An engine that does not serve the model refuses its probe: that much is known.
                missing = _model_mismatch(backend.name, model, served, report.served_models)
                if missing is not None:
                    found[backend.name] = [missing]
                continue
            found[backend.name] = self._compare(
                backend.name, report, reference, is_reference=backend is members[0],
                gateway_tokens=gateway_tokens, model=model,
            )  # fmt: skip
        for name, mismatches in found.items():  # an unanswered probe changes nothing
            by_model = self.mismatches.setdefault(name, {})
            by_model[model] = mismatches
            self.checked_at[name] = time.time()
            fields = dict.fromkeys(m.field for found_now in by_model.values() for m in found_now)
            reason = "; ".join(f"contract mismatch on {field}" for field in fields) or None
            self._index.set_uncredited(name, reason)
            for mismatch in mismatches:
                logger.warning("%s", mismatch.message())
        return found

    def _compare(
        self,
        name: str,
        report: ProbeReport,
        reference: ProbeReport,
        *,
        is_reference: bool,
        gateway_tokens: np.ndarray | None,
        model: str | None = None,
    ) -> list[Mismatch]:
        settings = self.settings
        found: list[Mismatch] = []
        if model is not None:
            missing = _model_mismatch(name, model, self._served_name(model), report.served_models)
            if missing is not None:
                found.append(missing)

        def differ(field: str, expected: Any, reported: Any, describe: Callable[[Any], str] = str) -> None:
            if expected is not None and reported is not None and expected != reported:
                found.append(Mismatch(name, field, describe(expected), describe(reported)))

        engine_tokens = report.engine_tokens
        tokens_known = gateway_tokens is not None and engine_tokens is not None
        if tokens_known and not np.array_equal(gateway_tokens, engine_tokens):
            expected, reported = _describe_tokens(gateway_tokens), _describe_tokens(engine_tokens)
            found.append(Mismatch(name, "tokens", expected, reported))
        if gateway_tokens is not None and report.indexed_tokens == 0:
            found.append(
                Mismatch(
                    name,
                    "kv_events",
                    f"the probe's {len(gateway_tokens)} tokens in its KV events "
                    f"(namespace of salt {PROBE_SALT!r})",
                    "none of them reached the index under the gateway's tokens within "
                    f"{settings.timeout_s:g} s (events missing, or tokenized or salted otherwise)",
                )
            )
        tokens = "{} tokens".format
        differ("block_size", settings.block_size or (None if is_reference else reference.block_size),
               report.block_size, tokens)  # fmt: skip
        expected_chunk = settings.chunk_size or (None if is_reference else reference.chunk_size)
        # A probe shorter than a chunk shows only its tail chunk: no chunk size to compare.
        if (
            expected_chunk is None
            or report.probe_tokens >= expected_chunk
            or (report.chunk_size or 0) > expected_chunk
        ):
            differ("chunk_size", expected_chunk, report.chunk_size, tokens)
        if report.chunk_size is None and report.controller_chunk_size is not None:
            # The cache layer published no events for the probe: its workers' registered chunk size.
            differ("chunk_size", expected_chunk, report.controller_chunk_size, tokens)
        if report.controller_tokens is not None and gateway_tokens is not None:
            chunk = report.controller_chunk_size or expected_chunk or _DEFAULT_CHUNK
            whole = len(gateway_tokens) // chunk * chunk
            if report.controller_tokens < whole:
                found.append(
                    Mismatch(
                        name,
                        "cache_lookup",
                        f"the cache layer's controller to find the probe's {whole} tokens (whole "
                        f"{chunk}-token chunks) under the gateway's tokens and the salt {PROBE_SALT!r}",
                        f"{report.controller_tokens} tokens within {settings.timeout_s:g} s "
                        f"(its /lookup answered {report.controller_layout}: chunks keyed otherwise, "
                        "another instance_id, or the engine does not store into this cache layer)",
                    )
                )
        if not is_reference and report.block_size == reference.block_size:
            differ("block_hash", reference.first_block_hash, report.first_block_hash, _describe_hash)
        if report.events_read and report.first_block_hash is not None and report.cache_salt != PROBE_SALT:
            expected_salt = f"the salt {PROBE_SALT!r} in the first block's extra keys"
            found.append(Mismatch(name, "cache_salt", expected_salt, repr(report.cache_salt)))
        return found

    async def _gateway_tokens(self, model: str, text: str) -> np.ndarray | None:
        try:
            return await self._tokenizer.tokens_for(model, {"model": model, "prompt": text})
        except (TokenizeError, ValueError) as exc:
            logger.warning("contract check of %s: the gateway cannot tokenize its probe (%s)", model, exc)
            return None

    async def _probe(
        self, backend: BackendState, model: str, text: str, gateway_tokens: np.ndarray | None
    ) -> ProbeReport:
        report = ProbeReport()
        served = self._served_name(model)
        timeout_s = self.settings.timeout_s
        with contextlib.suppress(Exception):
            status, answer = await self._request(backend.origin, b"GET", b"/v1/models", None, timeout_s)
            if status == 200:
                listed = _json(answer)["data"]
                report.served_models = {str(entry["id"]): entry.get("parent") for entry in listed}
        with contextlib.suppress(Exception):
            request = {"model": served, "prompt": text}
            status, answer = await self._post(backend, b"/tokenize", request, timeout_s)
            if status == 200:
                report.engine_tokens = as_tokens(_json(answer)["tokens"])
        start_seq = self._last_seq(backend.name)
        body = {"model": served, "prompt": text, "max_tokens": 1, "temperature": 0, "cache_salt": PROBE_SALT}
        try:
            status, _ = await self._post(backend, b"/v1/completions", body, timeout_s)
        except Exception as exc:
            logger.warning("contract check: backend %s did not answer the probe (%s)", backend.name, exc)
            return report
        if not 200 <= status < 300:  # e.g. an engine with --api-key: the check cannot run there
            logger.warning("contract check: backend %s answered the probe with HTTP %d", backend.name, status)
            return report
        report.answered = True
        if gateway_tokens is not None:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                # Asked each time: a LoRA adapter's namespace is known once its events announce it.
                namespace = self._index.namespace_for(model, PROBE_SALT)
                match = self._index.longest_cached_prefix(
                    gateway_tokens, namespace, [backend.name], disconnected=True
                )[backend.name]
                if match.tokens:
                    report.indexed_tokens = match.tokens
                    break
                await asyncio.sleep(0.05)
        probe_tokens = report.engine_tokens if report.engine_tokens is not None else gateway_tokens
        replay = backend.kv_events.replay_endpoint if backend.kv_events is not None else None
        if replay is not None and probe_tokens is not None:
            events = await asyncio.to_thread(_replayed_events, replay, (start_seq or -1) + 1, timeout_s)
            if events is not None:
                report.events_read = True
                report.probe_tokens = len(probe_tokens)
                _read_probe_events(report, events, probe_tokens)
        if backend.cache_controller is not None and gateway_tokens is not None:
            await self._ask_controller(backend, model, gateway_tokens, report)
        return report

    def _served_name(self, model: str) -> str:
        spec = self._config.model(model)
        return (spec.served_name if spec is not None else None) or model

    async def _ask_controller(
        self, backend: BackendState, model: str, tokens: np.ndarray, report: ProbeReport
    ) -> None:
        """Fill the controller's part of `report`: its workers' chunk size, and the probe's tokens
        its /lookup finds for the instance (asked until whole chunks show or timeout_s passes: the
        store writes after the answer)."""
        controller = backend.cache_controller
        assert controller is not None
        origin = _origin(controller.url)
        headers = list(_JSON_HEADERS)
        if controller.auth_secret_env:
            secret = os.environ.get(controller.auth_secret_env, "")
            headers.append((b"authorization", b"Bearer " + secret.encode()))
        timeout_s = self.settings.timeout_s
        try:
            body = {"instance_id": controller.instance_id}
            status, answer = await self._request(
                origin, b"POST", b"/query_worker_info", body, timeout_s, headers
            )
            if status == 200:
                sizes = {info.get("chunk_size") for info in _json(answer)["worker_infos"]} - {None}
                if len(sizes) == 1:
                    report.controller_chunk_size = int(sizes.pop())
            # A LoRA adapter's chunks are keyed by its name: the engine's /v1/models says which
            # models are adapters (they have a parent), as do the events the index has read.
            served = self._served_name(model)
            is_adapter = (report.served_models or {}).get(served) is not None
            lora = served if is_adapter else self._index.namespace_for(model, PROBE_SALT).lora_name
            lookup = {"tokens": tokens.tolist(), "cache_salt": PROBE_SALT, "lora": lora}
            chunk = report.controller_chunk_size or self.settings.chunk_size or _DEFAULT_CHUNK
            whole = len(tokens) // chunk * chunk
            deadline = time.monotonic() + timeout_s
            while True:
                status, answer = await self._request(origin, b"POST", b"/lookup", lookup, timeout_s, headers)
                if status != 200:
                    logger.warning(
                        "contract check: the cache controller of %s answered /lookup with HTTP %d: %s",
                        backend.name, status, answer[:200],
                    )  # fmt: skip
                    return
                layout = _json(answer)["layout_info"]
                held = layout.get(controller.instance_id)
                report.controller_layout = layout
                report.controller_tokens = int(held[1]) if held else 0
                if report.controller_tokens >= whole or time.monotonic() >= deadline:
                    return
                await asyncio.sleep(0.1)
        except Exception as exc:  # an unreachable controller: nothing to compare, as an unanswered probe
            logger.warning(
                "contract check: the cache controller of %s did not answer (%s)", backend.name, exc
            )

    async def _streams_connected(self, names: list[str]) -> None:
        """Wait (up to timeout_s) until every backend's event stream is connected: a probe's events
        published before the subscription lands would never reach the index."""
        deadline = time.monotonic() + self.settings.timeout_s
        while time.monotonic() < deadline:
            status = self._index.status()
            ranks = [rank for name in names for rank in (status.get(name) or {}).get("ranks", [])]
            if all(name in status for name in names) and all(rank["connected"] for rank in ranks):
                return
            await asyncio.sleep(0.1)

    def _last_seq(self, name: str) -> int | None:
        status = self._index.status().get(name)
        if not status:
            return None
        seqs = [rank["last_seq"] for rank in status["ranks"] if rank["last_seq"] is not None]
        return min(seqs) if seqs else None

    async def _post(
        self, backend: BackendState, path: bytes, body: dict[str, Any], timeout_s: float
    ) -> tuple[int, bytes]:
        return await self._request(backend.origin, b"POST", path, body, timeout_s)

    async def _request(
        self,
        origin: tuple[str, int],
        method: bytes,
        path: bytes,
        body: dict[str, Any] | None,
        timeout_s: float,
        headers: list[tuple[bytes, bytes]] = _JSON_HEADERS,
    ) -> tuple[int, bytes]:
        import json

        encoded = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        response = await self._pool.request(origin, method, path, headers, encoded, timeout_s)
        try:
            pieces: list[bytes] = []
            size = 0
            async for piece in response.pieces(timeout_s):
                size += len(piece)
                if size > _MAX_ANSWER_BYTES:
                    raise ValueError(f"an answer over {_MAX_ANSWER_BYTES} bytes")
                pieces.append(piece)
        finally:
            response.close()
        return response.status, b"".join(pieces)


def _origin(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def _model_mismatch(
    name: str, model: str, served: str, served_models: dict[str, str | None] | None
) -> Mismatch | None:
    """A `model` mismatch when the engine's /v1/models does not list the name it is sent."""
    if served_models is None or served in served_models:
        return None
    listed = ", ".join(
        repr(id_) if parent is None else f"{id_!r} (LoRA adapter of {parent!r})"
        for id_, parent in served_models.items()
    )
    configured = "" if served == model else f" (the configured model {model!r})"
    return Mismatch(
        name, "model", f"it to serve {served!r}{configured}", f"its /v1/models lists {listed or 'nothing'}"
    )


def _json(answer: bytes) -> Any:
    import json

    return json.loads(answer)


def _replayed_events(endpoint: str, start_seq: int, timeout_s: float) -> list[Any] | None:
    """The events of every batch the publisher at `endpoint` still buffers from `start_seq` on (a
    replay over a DEALER, bounded in batches, bytes and time); None when it did not answer."""
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLAYED_BYTES)
    events: list[Any] = []
    try:
        socket.connect(endpoint)
        socket.send_multipart([b"", encode_seq(max(0, start_seq))])
        deadline = time.monotonic() + timeout_s
        for _ in range(_MAX_REPLAYED_BATCHES):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not socket.poll(left_ms):
                return events or None
            frames = socket.recv_multipart()
            # [b"", topic, seq, payload], or without the topic (some vLLM versions)
            seq_frame, payload = (frames[-2], frames[-1]) if len(frames) >= 3 else (b"", b"")
            if len(seq_frame) != 8 or decode_seq(seq_frame) == END_SEQ:
                return events
            with contextlib.suppress(ValueError):
                events.extend(decode_batch(payload).events)
        return events
    finally:
        socket.close(linger=0)


def _read_probe_events(report: ProbeReport, events: Sequence[Any], tokens: np.ndarray) -> None:
    """Fill `report` from the engine's events that store blocks of the probe's `tokens`."""
    sequence = tokens.tolist()
    starts: dict[tuple[int, ...], list[int]] = {}
    for position in range(len(sequence) - 7):
        starts.setdefault(tuple(sequence[position : position + 8]), []).append(position)
    for event in events:
        if not isinstance(event, BlockStored) or len(event.token_ids) < 8 or not event.block_hashes:
            continue
        token_ids = list(event.token_ids)
        positions = [
            p for p in starts.get(tuple(token_ids[:8]), []) if sequence[p : p + len(token_ids)] == token_ids
        ]
        if not positions:
            continue
        size = event.block_size or len(token_ids) // len(event.block_hashes)
        if tier_of(event.medium) == "gpu":
            report.block_size = max(report.block_size or 0, size)
            if positions[0] == 0 and event.parent_block_hash is None:
                report.first_block_hash = event.block_hashes[0]
                report.cache_salt = cache_salt_of(event)
        else:
            report.chunk_size = max(report.chunk_size or 0, size)


def _describe_tokens(tokens: np.ndarray) -> str:
    return f"{len(tokens)} tokens starting {tokens[:6].tolist()}"


def _describe_hash(value: Any) -> str:
    if isinstance(value, int):
        return f"first-block hash {value:#018x} (hash algorithm and seed)"
    return f"first-block hash {value!r} (hash algorithm and seed)"
