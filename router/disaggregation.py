"""Prefill/decode disaggregation: per request, one cost estimate decides whether it runs colocated
or split; a split runs its prefill leg here, and the decode engine then loads the KV from the
shared tier the prefill engine stored it in.

router/forward.py asks `Disaggregation.plan` before its usual loop over backends. The plan makes
two choices through the routing policy (router/policies/base.py): a decode engine among the
backends of role `decode` or `both`, and, when a split is worth estimating, a prefill engine among
those of role `prefill` or `both` (kv_aware over that pool: cached prefix and load). For each way to
serve the request it estimates, in seconds (router/pd_costs.py measures the per-token costs):

    queue wait + uncached prompt tokens x prefill cost + tier-loadable tokens x load cost
    + transfer (split only: the prompt stored into the shared tier) + stall

where the stall is what the other requests decoding on that engine lose to this one's admission:
per stream, the engine's measured stall per load from a tier, per token computed and per token loaded
(router/pd_costs.py learns them from the inter-token gaps of the streamed answers the gateway
relays, `StreamGaps`; until then, one stream waits the prefill and the loads whole), times the
streams there. A split moves the prefill to an engine where nothing decodes, but its decode leg is
still admitted on the decode engine, which loads the prompt there: on real engines that admission
stalls the streams about as much as a short colocated prefill does, and only the gaps show it.
Each leg also pays its engine's fixed time to a first token (the prefill fit's constant).
The options: `colocated_gpu` (the decode engine computes what its GPU lacks), `colocated_tier`
(it loads the rest from a tier it reads), `split`. The cheapest wins in `mode: conditional`.

For a split, the prompt goes to the prefill engine with `max_tokens: 1`, not streamed, and the plan
waits for its whole answer: a prefill engine answers only once the store holds the prompt (the
simulator's `--kv-role prefill` does so, and so does the cache layer's vLLM connector as
`kv_producer`: docs/vllm.md, "Handoff saves").
The original request then goes to the decode engine through forward.py's usual loop, which
retries another decode engine before the first byte; the prefill is never repeated. A prefill that
fails or times out is retried once on another prefill engine (`prefill_attempts`), then the request
runs colocated. After the answer, `DecodeLeg.finished` learns the costs from what the engines
reported (`kv_transfer_params`, usage) and counts a transfer miss when the decode engine found
fewer tokens cached than the prefill engine had stored.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from router.config import Disaggregation as DisaggregationConfig
from router.errors import KvgateError
from router.pd_costs import CostFigures, CostModel, EngineCosts, OpenPrefill
from router.policies.base import Choice, Policy, RouteRequest
from router.upstream import UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from router.backends import BackendRegistry, BackendState
    from router.upstream import UpstreamPool

log = logging.getLogger("kvgate.disaggregation")

COLOCATED_GPU = "colocated_gpu"
COLOCATED_TIER = "colocated_tier"
SPLIT = "split"
OPTIONS = (COLOCATED_GPU, COLOCATED_TIER, SPLIT)
# The paths a split serves: a prefill leg must be the same prompt with one output token.
SPLIT_PATHS = (b"/v1/completions", b"/v1/chat/completions")
# A prefill leg's answer is one token's JSON; more than this is not an engine's prefill answer.
MAX_PREFILL_ANSWER_BYTES = 1 << 20
# The end of a decode answer the gateway keeps to read its usage and kv_transfer_params from.
USAGE_TAIL_BYTES = 8192
DECISIONS_KEPT = 200
# Admissions kept per engine for StreamGaps: more than one gap's worth at any concurrency.
ADMISSIONS_KEPT = 256
_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_LOADED_TOKENS = re.compile(rb'"loaded_tokens"\s*:\s*(\d+)')
_LOAD_SECONDS = re.compile(rb'"load_seconds"\s*:\s*([0-9.eE+-]+)')


class PrefillFailed(KvgateError):
    """A prefill leg that did not end in a stored prompt (unreachable, an error, a timeout)."""

    def __init__(self, message: str, *, retry_elsewhere: bool = True) -> None:
        super().__init__(message)
        # False when another prefill engine would refuse it too (the engine found the request bad).
        self.retry_elsewhere = retry_elsewhere


@dataclass(frozen=True, slots=True)
class Estimate:
    """What one way to serve a request is expected to cost, in seconds, by term."""

    option: str
    backend: str  # where the request decodes (and, colocated, prefills)
    prefill_backend: str | None
    queue_s: float
    compute_s: float
    load_s: float
    transfer_s: float
    stall_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.compute_s + self.load_s + self.transfer_s + self.stall_s

    def describe(self) -> dict[str, Any]:
        terms = ("queue_s", "compute_s", "load_s", "transfer_s", "stall_s")
        return {
            "backend": self.backend,
            "prefill_backend": self.prefill_backend,
            **{term: round(getattr(self, term), 6) for term in terms},
            "total_s": round(self.total_s, 6),
        }


@dataclass(slots=True)
class _LegLoad:
    """What one engine holds of the prompt, from the policy's scores for it."""

    gpu_tokens: int  # on its GPU (or predicted there)
    tier_tokens: int  # past those, loadable from its CPU, disk or a shared tier

    @classmethod
    def of(cls, choice: Choice, name: str, prompt_tokens: int) -> _LegLoad:
        score = choice.candidates.get(name, {})
        held = min(prompt_tokens, int(score.get("cached", 0)))
        gpu = min(held, max(int(score.get("by_tier", {}).get("gpu", 0)), int(score.get("predicted", 0))))
        return cls(gpu, held - gpu)


def _colocated(backend: BackendState, load: _LegLoad, prompt_tokens: int, costs: CostFigures) -> Estimate:
    computed = max(0, prompt_tokens - load.gpu_tokens - load.tier_tokens)
    load_s = load.tier_tokens * costs.load_s_per_token
    others = max(0, backend.in_flight)
    return Estimate(
        COLOCATED_TIER if load.tier_tokens else COLOCATED_GPU,
        backend.name,
        None,
        queue_s=max(0, backend.in_flight_prefill_tokens) * costs.prefill_s_per_token,
        compute_s=costs.request_s + computed * costs.prefill_s_per_token,
        load_s=load_s,
        transfer_s=0.0,
        # The requests decoding there wait for this prefill (and these loads) to pass.
        stall_s=others * costs.stall_s(computed, load.tier_tokens),
    )


def _split(
    prefill: BackendState,
    prefill_load: _LegLoad,
    prefill_costs: CostFigures,
    decode: BackendState,
    decode_load: _LegLoad,
    decode_costs: CostFigures,
    prompt_tokens: int,
) -> Estimate:
    computed = max(0, prompt_tokens - prefill_load.gpu_tokens - prefill_load.tier_tokens)
    # Each leg pays its engine's fixed time to a first token.
    compute_s = (
        prefill_costs.request_s + computed * prefill_costs.prefill_s_per_token + decode_costs.request_s
    )
    prefill_load_s = prefill_load.tier_tokens * prefill_costs.load_s_per_token
    # The decode engine loads from the shared tier whatever its GPU lacks.
    decode_loaded = max(0, prompt_tokens - decode_load.gpu_tokens)
    decode_load_s = decode_loaded * decode_costs.load_s_per_token
    # Only an engine that also decodes has streams for a prefill to stall.
    prefill_stall = 0 if prefill.role == "prefill" else max(0, prefill.in_flight)
    return Estimate(
        SPLIT,
        decode.name,
        prefill.name,
        queue_s=max(0, prefill.in_flight_prefill_tokens) * prefill_costs.prefill_s_per_token
        + max(0, decode.in_flight_prefill_tokens) * decode_costs.prefill_s_per_token,
        compute_s=compute_s,
        load_s=prefill_load_s + decode_load_s,
        transfer_s=prompt_tokens * prefill_costs.transfer_s_per_token,
        stall_s=prefill_stall * prefill_costs.stall_s(computed, prefill_load.tier_tokens)
        + max(0, decode.in_flight) * decode_costs.stall_s(0, decode_loaded),
    )


@dataclass(slots=True)
class DecodeLeg:
    """The plan for the request's (decode or whole) answer, handed to router/forward.py's loop."""

    disaggregation: Disaggregation
    request_id: str
    prompt_tokens: int
    option: str
    # The policy's choice of decode engine, for the loop's first attempt.
    first_choice: Choice
    # Split: the engine that ran the prefill, and the prompt tokens it reported the store holds
    # (None: it did not say).
    prefill_backend: str | None = None
    stored_tokens: int | None = None
    # The features the cost model learns the decode engine's prefill cost from, per engine.
    computed_tokens: dict[str, int] = field(default_factory=dict)
    # Of those, the prompt tokens of other requests still to prefill there when it was sent.
    queued_tokens: dict[str, int] = field(default_factory=dict)
    # Counted into the backend's in-flight prefill when the loop sends it (what it still computes).
    expected_prefill_tokens: int | None = None
    # What the decode engine is expected to load from a tier (split: the prompt its GPU lacks).
    loaded_tokens: int = 0
    # Whether the answer streams: only then does its first piece mark the end of its prefill.
    streamed: bool = False
    # A colocated attempt's prefill still in flight on its engine (the cost model's lower bound).
    _open_prefill: tuple[EngineCosts, OpenPrefill | None] | None = None

    @property
    def split(self) -> bool:
        return self.option == SPLIT

    def for_decode(self, choice: Choice) -> Choice:
        """`choice` as the loop sends it: after a split, the engine computes almost nothing."""
        if self.split:
            return msgspec.structs.replace(choice, prefill_tokens=self.expected_prefill_tokens or 0)
        return choice

    def sent(self, backend: BackendState, choice: Choice) -> None:
        """The loop sent the request to `backend` (counted in its in-flight load already)."""
        prefill_tokens = choice.prefill_tokens or 0
        queued = max(0, backend.in_flight_prefill_tokens - prefill_tokens)
        self.computed_tokens[backend.name] = prefill_tokens + queued
        self.queued_tokens[backend.name] = queued
        # A streamed colocated answer's first piece ends its prefill, so until then it bounds the
        # engine's prefill cost (router/pd_costs.py, OpenPrefill). Not a split's decode leg nor a
        # request loading from a tier (their time is mostly the load, which is no prefill), nor an
        # answer sent whole (its first piece comes after every decode step).
        costs = self.disaggregation.costs.engine(backend.name)
        self.prefill_over()
        if self.streamed and not self.split and not self.loaded_tokens:
            self._open_prefill = (costs, costs.open_prefill(prefill_tokens, queued))
        else:
            costs.prefill_sent(prefill_tokens)

    def prefill_over(self) -> None:
        """The attempt's first piece came, or it ended without one: its prefill is no longer open."""
        if self._open_prefill is not None:
            costs, opened = self._open_prefill
            costs.close_prefill(opened)
            self._open_prefill = None

    def stream_gaps(self, backend: BackendState, computed_tokens: int) -> StreamGaps:
        """The timer of this answer's streamed pieces on `backend` (router/forward.py's relay)."""
        return StreamGaps(self.disaggregation, backend.name, computed_tokens, self.loaded_tokens)

    def finished(self, backend: BackendState, status: int, ttft_s: float | None, tail: bytes) -> None:
        """The answer ended: learn from what the engine reported, count a transfer miss."""
        self.prefill_over()
        self.disaggregation.decode_finished(self, backend, status, ttft_s, tail)


class StreamGaps:
    """Times one streamed answer's pieces on an engine and teaches the engine's stall fit.

    Its first piece is its own admission there (the step that computed or loaded its prompt ended),
    logged with its computed and loaded tokens. Each later gap is resolved one piece late, once the
    admissions around its end have been relayed too: the admissions whose first piece came within
    it (from halfway through the gap before it to halfway through the gap after it) stalled it; a
    gap with none is a usual one."""

    __slots__ = ("_admissions", "_computed", "_costs", "_from", "_last", "_loaded", "_pending")

    def __init__(self, disaggregation: Disaggregation, backend: str, computed: int, loaded: int) -> None:
        self._admissions = disaggregation.admissions(backend)
        self._costs = disaggregation.costs.engine(backend).stall
        self._computed, self._loaded = max(0, computed), max(0, loaded)
        self._last: float | None = None
        self._from = 0.0
        self._pending: tuple[float, float] | None = None

    def piece(self, now: float) -> None:
        last = self._last
        self._last = now
        if last is None:
            self._admissions.append((now, self._computed, self._loaded))
            self._from = now  # its own admission is not a stall of its gaps
            return
        if self._pending is not None:
            start, end = self._pending
            until = end + (now - end) / 2
            self._resolve(end - start, self._from, until)
            self._from = until
        self._pending = (last, now)

    def _resolve(self, gap: float, since: float, until: float) -> None:
        admitted = loads = computed = loaded = 0
        for at, tokens, from_tier in reversed(self._admissions):
            if at <= since:
                break
            if at <= until:
                admitted += 1
                loads += from_tier > 0
                computed += tokens
                loaded += from_tier
        if admitted:
            self._costs.observe_stall(gap, loads, computed, loaded)
        else:
            self._costs.observe_gap(gap)


class Disaggregation:
    """The split decision and the prefill leg (see the module docstring)."""

    def __init__(
        self,
        config: DisaggregationConfig,
        backends: BackendRegistry,
        pool: UpstreamPool,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.backends = backends
        self.pool = pool
        self.costs = CostModel(config)
        self._decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)
        # Per backend: (time, computed, loaded tokens) of the streamed answers admitted there lately.
        self._admissions: dict[str, deque[tuple[float, int, int]]] = {}
        self.decisions = Counter(
            "kvgate_pd_decisions",
            "Requests by how the disaggregation served them (colocated_gpu, colocated_tier, split), "
            "and those that fell back to colocated after their prefill leg failed",
            ["option"],
            registry=registry,
        )
        self.prefill_failures = Counter(
            "kvgate_pd_prefill_failures",
            "Prefill legs that failed, by backend and why (error: unreachable or broke off; status; timeout)",
            ["backend", "reason"],
            registry=registry,
        )
        self.transfer_misses = Counter(
            "kvgate_pd_transfer_misses",
            "Split requests whose decode engine found fewer tokens cached than the prefill engine "
            "stored (the store lost them): the decode engine recomputed them",
            registry=registry,
        )
        if registry is not None:
            registry.register(_CostCollector(self.costs))

    def admissions(self, backend: str) -> deque[tuple[float, int, int]]:
        log_ = self._admissions.get(backend)
        if log_ is None:
            log_ = self._admissions[backend] = deque(maxlen=ADMISSIONS_KEPT)
        return log_

    # ---- the decision ----

    async def plan(
        self,
        policy: Policy,
        request: RouteRequest,
        data: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        path: bytes,
        model_name: str,
    ) -> DecodeLeg | None:
        """Decide and, for a split, run the prefill leg; None: nothing can take the decode (the loop
        answers its usual 503)."""
        decode_pool = self.backends.candidates(request.model, leg="decode")
        if not decode_pool:
            return None
        prompt_tokens = 0 if request.tokens is None else len(request.tokens)
        decode_choice = policy.choose(request, decode_pool)
        decode = decode_choice.backend
        decode_load = _LegLoad.of(decode_choice, decode.name, prompt_tokens)
        decode_costs = self.costs.figures(decode.name)
        colocated = _colocated(decode, decode_load, prompt_tokens, decode_costs)
        estimates = {colocated.option: colocated}
        prefill_pool = [
            backend
            for backend in self.backends.candidates(request.model, leg="prefill")
            if backend is not decode
        ]
        prefill_choice = None
        if prompt_tokens and prefill_pool and self.config.mode != "never":
            prefill_choice = policy.choose(request, prefill_pool)
            prefill = prefill_choice.backend
            estimates[SPLIT] = _split(
                prefill,
                _LegLoad.of(prefill_choice, prefill.name, prompt_tokens),
                self.costs.figures(prefill.name),
                decode,
                decode_load,
                decode_costs,
                prompt_tokens,
            )
        option = colocated.option
        if SPLIT in estimates and (
            self.config.mode == "always" or estimates[SPLIT].total_s < colocated.total_s
        ):
            option = SPLIT
        leg = DecodeLeg(self, request.request_id, prompt_tokens, option, decode_choice)
        leg.loaded_tokens = decode_load.tier_tokens
        leg.streamed = data.get("stream") is True
        fallback = None
        if option == SPLIT and prefill_choice is not None:
            try:
                leg.prefill_backend, leg.stored_tokens = await self._prefill(
                    policy, request, data, headers, path, model_name, prefill_choice, prefill_pool
                )
                leg.expected_prefill_tokens = max(0, prompt_tokens - (leg.stored_tokens or 0))
                leg.loaded_tokens = max(
                    0, prompt_tokens - decode_load.gpu_tokens - leg.expected_prefill_tokens
                )
            except PrefillFailed as exc:
                fallback = str(exc)
                leg.option = colocated.option
                self.decisions.labels("prefill_failed").inc()
        self.decisions.labels(leg.option).inc()
        self._record(request, leg, estimates, fallback)
        return leg

    def _record(
        self, request: RouteRequest, leg: DecodeLeg, estimates: dict[str, Estimate], fallback: str | None
    ) -> None:
        chosen = estimates.get(leg.option) or next(iter(estimates.values()))
        entry = {
            "at": time.time(),
            "request_id": request.request_id,
            "model": request.model,
            "mode": self.config.mode,
            "option": leg.option,
            "backend": chosen.backend if leg.option != SPLIT else estimates[SPLIT].backend,
            "prefill_backend": leg.prefill_backend,
            "prompt_tokens": leg.prompt_tokens,
            "estimate_s": round(chosen.total_s, 6),
            "estimates": {option: estimate.describe() for option, estimate in estimates.items()},
            "prefill_failed": fallback,
        }
        self._decisions.append(entry)
        log.info(
            "pd %s: %s (estimate %.4f s) of %s; %s",
            request.request_id,
            leg.option,
            chosen.total_s,
            {option: round(estimate.total_s, 4) for option, estimate in estimates.items()},
            f"prefill failed ({fallback}), colocated" if fallback else "as estimated",
        )

    # ---- the prefill leg ----

    async def _prefill(
        self,
        policy: Policy,
        request: RouteRequest,
        data: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        path: bytes,
        model_name: str,
        choice: Choice,
        pool: Sequence[BackendState],
    ) -> tuple[str, int | None]:
        """Run the prefill leg on `choice`, and on one other prefill engine if it fails; return the
        engine that ran it and the prompt tokens the store holds as it reported them (None: it did
        not say)."""
        body = _prefill_body(data, model_name)
        tried: list[BackendState] = []
        errors: list[str] = []
        for attempt in range(self.config.prefill_attempts):
            if attempt:
                rest = [backend for backend in pool if backend not in tried and backend.accepting]
                if not rest:
                    break
                choice = policy.choose(request, rest)
            tried.append(choice.backend)
            try:
                stored = await self._prefill_once(policy, choice, request, headers, path, body)
                return choice.backend.name, stored
            except PrefillFailed as exc:
                errors.append(str(exc))
                if not exc.retry_elsewhere:
                    break
        raise PrefillFailed("; ".join(errors))

    async def _prefill_once(
        self,
        policy: Policy,
        choice: Choice,
        request: RouteRequest,
        headers: list[tuple[bytes, bytes]],
        path: bytes,
        body: bytes,
    ) -> int | None:
        backend = choice.backend
        prefill_tokens = choice.prefill_tokens or 0
        queued = max(0, backend.in_flight_prefill_tokens)
        costs = self.costs.engine(backend.name)
        prompt_tokens = 0 if request.tokens is None else len(request.tokens)
        # Until it answers, the leg bounds the engine's prefill cost (router/pd_costs.py,
        # OpenPrefill); not one that loads part of the prompt from a tier (the load is no prefill).
        # The engine stores the prompt before it answers: that time, at its transfer cost, is not
        # prefill either.
        opened = None
        if not _LegLoad.of(choice, backend.name, prompt_tokens).tier_tokens:
            store_s = prompt_tokens * self.costs.figures(backend.name).transfer_s_per_token
            opened = costs.open_prefill(prefill_tokens, queued, store_s)
        else:
            costs.prefill_sent(prefill_tokens)
        backend.in_flight += 1
        backend.in_flight_prefill_tokens += prefill_tokens
        policy.on_routed(choice)
        status = 502
        started = perf_counter()
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                response = await self.pool.request(
                    backend.origin, b"POST", path, headers, body, self.config.prefill_timeout_s
                )
                try:
                    status = response.status
                    answer = await _read_bounded(response, self.config.prefill_timeout_s)
                finally:
                    response.close()
        except (TimeoutError, UpstreamTimeout):
            self.prefill_failures.labels(backend.name, "timeout").inc()
            status = 504
            raise PrefillFailed(
                f"prefill backend {backend.name} did not answer within {self.config.prefill_timeout_s:g} s"
            ) from None
        except UpstreamError as exc:
            self.prefill_failures.labels(backend.name, "error").inc()
            self.backends.mark_down(backend, str(exc))
            raise PrefillFailed(f"prefill backend {backend.name} failed: {exc}") from None
        finally:
            costs.close_prefill(opened)
            backend.in_flight -= 1
            backend.in_flight_prefill_tokens -= prefill_tokens
            backend.requests_total += 1
            policy.on_finished(choice, status, None)
        elapsed = perf_counter() - started
        if status != 200:
            self.prefill_failures.labels(backend.name, "status").inc()
            if status >= 500:
                self.backends.mark_down(backend, f"answered HTTP {status} to a prefill")
            # A 4xx is the request's: the decode engine, colocated, answers the client the same.
            raise PrefillFailed(
                f"prefill backend {backend.name} answered HTTP {status}", retry_elsewhere=status >= 500
            )
        transfer = _transfer_params(answer)
        stored = _int(transfer.get("stored_tokens"))
        store_s = _float(transfer.get("store_seconds")) or 0.0
        load_s = _float(transfer.get("load_seconds")) or 0.0
        costs.prefill.observe(prefill_tokens + queued, max(0.0, elapsed - store_s - load_s))
        if stored:
            costs.transfer.observe(store_s, stored)
        loaded = _int(transfer.get("loaded_tokens"))
        if loaded:
            costs.load.observe(load_s, loaded)
        return stored

    # ---- after the answer ----

    def decode_finished(
        self, leg: DecodeLeg, backend: BackendState, status: int, ttft_s: float | None, tail: bytes
    ) -> None:
        if status != 200:
            return
        cached = _last_int(_CACHED_TOKENS, tail)
        loaded = _last_int(_LOADED_TOKENS, tail)
        load_match = _LOAD_SECONDS.findall(tail)
        load_s = _float(load_match[-1].decode()) if load_match else None
        costs = self.costs.engine(backend.name)
        if loaded and load_s is not None:
            costs.load.observe(load_s, loaded)
        computed = leg.computed_tokens.get(backend.name)
        if ttft_s is not None and computed is not None and (load_s is not None or not leg.split):
            costs.prefill.observe(computed, max(0.0, ttft_s - (load_s or 0.0)))
        elif (
            ttft_s is not None
            and computed is not None
            and leg.split
            and loaded is None
            and not leg.queued_tokens.get(backend.name)
        ):
            # A streamed decode leg reports no load time: its time to the first token, less the
            # prefill of what it computed, is its load; only when nothing was queued before it (a
            # queue's wait is not the load's, and the fit cannot tell them apart).
            prefill_s = computed * self.costs.figures(backend.name).prefill_s_per_token
            costs.load_from_ttft.observe(leg.loaded_tokens, max(0.0, ttft_s - prefill_s))
        if leg.split and leg.stored_tokens and cached is not None and cached < leg.stored_tokens:
            self.transfer_misses.inc()
            log.warning(
                "pd %s: decode backend %s found %d prompt tokens cached of the %d the prefill stored; "
                "it recomputed the rest",
                leg.request_id,
                backend.name,
                cached,
                leg.stored_tokens,
            )

    # ---- what the debug page shows ----

    def recent_decisions(self) -> list[dict[str, Any]]:
        return list(self._decisions)

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.config.mode,
            "roles": {name: backend.role for name, backend in self.backends.items()},
            "costs": self.costs.describe(),
            "priors_us_per_token": {
                "prefill": self.config.prior_prefill_us_per_token,
                "load": self.config.prior_load_us_per_token,
                "transfer": self.config.prior_transfer_us_per_token,
            },
            "decisions": self.recent_decisions()[-50:][::-1],
        }


class _CostCollector:
    """kvgate_pd_*_seconds_per_token{backend}: the cost model's figures at scrape time."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def collect(self):
        families = {
            "prefill": GaugeMetricFamily(
                "kvgate_pd_prefill_seconds_per_token",
                "Measured (else prior) prefill cost of one uncached prompt token, per backend; at least "
                "what its prefills still in flight bound it to",
                labels=["backend"],
            ),
            "load": GaugeMetricFamily(
                "kvgate_pd_load_seconds_per_token",
                "Measured (else prior) cost of loading one prompt token's KV from a tier, per backend",
                labels=["backend"],
            ),
            "transfer": GaugeMetricFamily(
                "kvgate_pd_transfer_seconds_per_token",
                "Measured (else prior) cost of storing one prompt token's KV into the shared tier, "
                "per backend",
                labels=["backend"],
            ),
        }
        for name in self.costs.names():
            figures = self.costs.figures(name)
            families["prefill"].add_metric([name], figures.prefill_s_per_token)
            families["load"].add_metric([name], figures.load_s_per_token)
            families["transfer"].add_metric([name], figures.transfer_s_per_token)
        yield from families.values()


def _prefill_body(data: dict[str, Any], model_name: str) -> bytes:
    """The prefill leg's request: the same prompt, one output token, answered whole (what would
    contradict one token, `min_tokens`, or ask for several answers, `n`, is left out)."""
    dropped = ("stream", "stream_options", "n", "min_tokens")
    body = {key: value for key, value in data.items() if key not in dropped}
    body["model"] = model_name
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    # vLLM's prefill/decode request field: a remote decode follows, so the engine hands the KV over
    # before it answers (an engine of role `both` would otherwise store it in the background).
    body["kv_transfer_params"] = {"do_remote_decode": True}
    return _encoder.encode(body)


async def _read_bounded(response, timeout_s: float) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for piece in response.pieces(timeout_s):
        size += len(piece)
        if size > MAX_PREFILL_ANSWER_BYTES:
            raise PrefillFailed(f"the prefill answer is over {MAX_PREFILL_ANSWER_BYTES} bytes")
        parts.append(piece)
    return b"".join(parts)


def _transfer_params(answer: bytes) -> dict[str, Any]:
    try:
        parsed = _decoder.decode(answer)
    except msgspec.DecodeError:
        return {}
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _last_int(pattern: re.Pattern[bytes], tail: bytes) -> int | None:
    found = pattern.findall(tail)
    return int(found[-1]) if found else None
