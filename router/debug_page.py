"""The KV index's HTTP surface and its gateway extension.

- GET /debug/prefix-map: what the gateway knows of every engine's cache, as an HTML page a person
  can read or as JSON (`?format=json`): per backend the event stream's state and the blocks and
  tokens per tier; the top cached prefixes (decoded text, or token counts only when
  `admin.redact_prompts`); the recent routing decisions.
- Routing warnings (`routing_warnings`): the ways kv_aware can go blind without failing: a model
  with no tokenizer (every decision `no_tokens`), a subscribed backend that takes requests but
  whose events never arrive (a topic mismatch looks connected), an event socket that could not
  be bound or connected. Shown on the page and in its JSON, logged (each at most once every
  WARNING_LOG_EVERY_S while it lasts), and counted in kvgate_routing_warnings.
- POST /lookup: LMCache-controller compatible `{"tokens": [...]}` ->
  `{"event_id", "layout_info": {backend: [medium, matched_tokens]}}`, from event-confirmed entries
  only (kv_aware's predictions are not in the index).
Both need the admin token when one is configured.

Stale holders: a backend that is down, or whose event stream is disconnected, may no longer hold
what it announced (and its removals do not arrive). Both endpoints leave it out of the holders
(`layout_info`, a prefix's `backends`) and list it apart, with the reason, under `stale_holders`;
kv_aware does not count a disconnected stream's entries either (KVIndexService.longest_cached_prefix)
and never routes to a down backend.

`create_extension(gateway)` wires the index service (gateway.kv_index), the tokenizer (a request
preparer for policies that need tokens) and these routes into the gateway through its seams.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
import logging
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import msgspec
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from router.config import ApproximatePolicy, KVAwarePolicy
from router.errors import decode_json_body
from router.index.service import KVIndexService
from router.prefix_treemap import sharing_legend, sharing_svg
from router.tokenize import RequestTokenizer

if TYPE_CHECKING:
    from router.app import Gateway
    from router.backends import BackendState

logger = logging.getLogger("kvgate.debug")

_TEMPLATE = Template((Path(__file__).parent / "debug_page.html").read_text())
TOP_PREFIXES = 20
PREVIEW_CHARS = 240
_LOOKUP_MEDIUM = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}
# A subscribed backend is called silent when it took SILENT_MIN_REQUESTS requests with at least a
# block to prefill, routed SILENT_AFTER_S or more after its last event (or its subscription): an
# engine publishes a prefill's blocks within milliseconds, so none arriving means none reach us.
SILENT_MIN_REQUESTS = 3
SILENT_AFTER_S = 5.0
SILENT_MIN_PREFILL_TOKENS = 16
WARNING_LOG_EVERY_S = 300.0
WARNING_CHECK_EVERY_S = 2.0
WARNING_KINDS = ("no_tokenizer", "silent_events", "socket_error")


class _LookupBody(msgspec.Struct):
    tokens: list[int]
    cache_salt: str | None = None
    lora_name: str | None = None


_lookup_decoder = msgspec.json.Decoder(_LookupBody)


class KVIndexExtension:
    """The gateway extension: index service lifecycle, backend changes, tokenizer, routes."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.service = KVIndexService(registry=gateway.metrics.registry)
        self.tokenizer = RequestTokenizer(gateway.config, gateway.backends)
        gateway.kv_index = self.service
        self.needs_tokens = isinstance(gateway.config.policy, (KVAwarePolicy, ApproximatePolicy))
        if self.needs_tokens:
            gateway.request_preparers.append(self.tokenizer.prepare)
        # model -> why its tokenizer failed to load; backend -> when its events were first awaited.
        self.tokenizer_errors: dict[str, str] = {}
        self._subscribed_at: dict[str, float] = {}
        self._logged_at: dict[tuple[str, str], float] = {}
        self._watch_task: asyncio.Task | None = None
        gateway.metrics.registry.register(_WarningsCollector(self))

    # ---- Extension protocol ----

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/debug/prefix-map", self.prefix_map_endpoint, methods=["GET"]),
            Route("/lookup", self.lookup_endpoint, methods=["POST"]),
        ]

    async def start(self) -> None:
        self.service.start()
        if self.needs_tokens:
            # Load tokenizers now, not on the first request (about 2 s for Qwen3).
            for model in self.gateway.config.models:
                try:
                    await asyncio.to_thread(self.tokenizer.tokenizer, model.name)
                except Exception as exc:
                    self.tokenizer_errors[model.name] = str(exc)
            self.tokenizer.start_sandboxes()  # for models that accept client templates, if any
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_warnings())

    async def stop(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        self.service.stop()
        await self.tokenizer.close()

    def backend_added(self, backend: BackendState) -> None:
        self._subscribed_at[backend.name] = time.time()
        self.service.add_backend(backend.name, backend.kv_events)

    def backend_removed(self, backend: BackendState) -> None:
        self._subscribed_at.pop(backend.name, None)
        self.service.remove_backend(backend.name)

    def stale_holders(self) -> dict[str, str]:
        """Backends with KV events whose index entries are not to be trusted now, and why."""
        stale = self.service.disconnected_streams()
        for name in self.service.backends():
            backend = self.gateway.backends.get(name)
            if backend is not None and not backend.healthy:
                down = f"backend down: {backend.down_reason}"
                stale[name] = f"{down}; {stale[name]}" if name in stale else down
        return stale

    # ---- routing warnings ----

    def routing_warnings(self, status: dict[str, dict[str, Any]] | None = None) -> list[dict[str, str]]:
        """Why kv_aware routes (part of) the traffic blind now: [{kind, subject, message}]."""
        if not self.needs_tokens:
            return []
        warnings = []
        for model in self.gateway.config.models:
            if model.name in self.tokenizer_errors:
                problem = f"its tokenizer failed to load ({self.tokenizer_errors[model.name]})"
            elif model.tokenize == "local" and model.tokenizer is None:
                problem = "it has no `tokenizer:`"
            else:
                continue
            warnings.append(
                {
                    "kind": "no_tokenizer",
                    "subject": model.name,
                    "message": f"model {model.name}: {problem}, so the gateway cannot read its prompts' "
                    "tokens and routes every request for it by load alone (decision `no_tokens`); give "
                    "`tokenizer:` a local tokenizer directory (or builtin:qwen3), or set `tokenize: engine`",
                }
            )
        status = self.service.status() if status is None else status
        decisions = list(getattr(self.gateway.policy, "recent_decisions", []))
        for name, stream in status.items():
            if stream["socket_errors"]:
                warnings.append(
                    {
                        "kind": "socket_error",
                        "subject": name,
                        "message": f"backend {name}: its KV-event socket failed "
                        f"({'; '.join(stream['socket_errors'])}), so none of its events can arrive and "
                        "kv_aware treats its cache as empty; free the address or fix kv_events, then "
                        "restart the gateway (or DELETE and POST the backend)",
                    }
                )
                continue
            since = stream["last_message_at"] or self._subscribed_at.get(name, time.time())
            unannounced = [
                decision
                for decision in decisions
                if decision["backend"] == name
                and decision["at"] >= since + SILENT_AFTER_S
                and decision["prompt_tokens"] - decision["cached_tokens"] >= SILENT_MIN_PREFILL_TOKENS
            ]
            if len(unannounced) >= SILENT_MIN_REQUESTS:
                last = "no event yet" if stream["last_message_at"] is None else "no event since"
                waited = time.time() - since
                warnings.append(
                    {
                        "kind": "silent_events",
                        "subject": name,
                        "message": f"backend {name}: took {len(unannounced)} requests with prompts to "
                        f"cache but {last} ({waited:.0f} s), though its stream reads "
                        f"{'connected' if stream['connected'] else 'disconnected'}: check that the engine "
                        "publishes KV events (vLLM --kv-events-config, SGLang --kv-events-config), that "
                        "kv_events.topic equals the engine's topic, and that endpoint and bind match "
                        "who binds (docs/real-engines.md)",
                    }
                )
        return warnings

    def log_warnings(self, warnings: Iterable[dict[str, str]]) -> None:
        """Log each warning when it appears and again every WARNING_LOG_EVERY_S while it lasts."""
        now = time.monotonic()
        for warning in warnings:
            key = (warning["kind"], warning["subject"])
            logged = self._logged_at.get(key)
            if logged is None or now - logged >= WARNING_LOG_EVERY_S:
                self._logged_at[key] = now
                logger.warning("kv_aware routes blind: %s", warning["message"])

    async def _watch_warnings(self) -> None:
        while True:
            try:
                self.log_warnings(await asyncio.to_thread(self.routing_warnings))
            except Exception:  # the watch must outlive a bug in one check
                logger.exception("checking for routing warnings failed")
            await asyncio.sleep(WARNING_CHECK_EVERY_S)

    # ---- /debug/prefix-map ----

    def prefix_map(self) -> dict[str, Any]:
        """The page's data: backends, top prefixes, recent decisions."""
        gateway = self.gateway
        redact = gateway.config.admin.redact_prompts
        status = self.service.status()
        stale = self.stale_holders()
        backends: dict[str, Any] = {}
        for name, backend in gateway.backends.items():
            entry: dict[str, Any] = {
                "url": backend.url,
                "state": backend.describe()["state"],
                "down_reason": None if backend.healthy else backend.down_reason,
                "healthy": backend.healthy,
                "in_flight": backend.in_flight,
                "events": backend.kv_events is not None,
                "stale": stale.get(name),
            }
            stream = status.get(name)
            if stream is None:
                entry.update(connected=None, synced=None, last_seq=None, blocks={}, tokens={})
            else:
                entry.update(stream)
            backends[name] = entry
        decoder = self._decoder()
        prefixes = []
        for top in self.service.index.top_prefixes(TOP_PREFIXES):
            lora_name, salt = top["namespace"]
            holders = {name: tokens for name, tokens in top["backends"].items() if name not in stale}
            item: dict[str, Any] = {
                "tokens": max(holders.values(), default=0),
                "backends": holders,
                "blocks": {name: blocks for name, blocks in top["blocks"].items() if name not in stale},
                "stale_holders": {
                    name: {"tokens": tokens, "reason": stale[name]}
                    for name, tokens in top["backends"].items()
                    if name in stale
                },
                "lora_name": lora_name,
                "salted": salt is not None,
                "preview_tokens": len(top["preview_tokens"]),
            }
            if not redact:
                item["text"] = decoder(top["preview_tokens"]) if decoder else None
                item["token_ids"] = top["preview_tokens"][:32]
            prefixes.append(item)
        decisions = list(getattr(gateway.policy, "recent_decisions", []))[-50:][::-1]
        load_costs = getattr(gateway.policy, "load_costs", None)
        return {
            "warnings": self.routing_warnings(status),
            "backends": backends,
            "prefixes": prefixes,
            "decisions": decisions,
            "index": self.service.index.size(),
            "policy": getattr(gateway.policy, "name", None),
            # kv_aware's measured load weights (router/policies/load_costs.py), when it measures them.
            "load_costs": None if load_costs is None else load_costs.describe(),
            "redacted": redact,
            "generated_at": dt.datetime.now(dt.UTC).isoformat(),
        }

    def _decoder(self) -> Any:
        for model in self.gateway.config.models:
            try:
                tokenizer = self.tokenizer.tokenizer(model.name)
            except Exception:  # a broken tokenizer must not break the debug page
                tokenizer = None
            if tokenizer is not None:
                return tokenizer.decode
        return None

    async def prefix_map_endpoint(self, request: Request) -> Response:
        from router.admin import require_admin

        if (denied := require_admin(self.gateway, request)) is not None:
            return denied
        data = await asyncio.to_thread(self.prefix_map)
        if request.query_params.get("format") == "json":
            return JSONResponse(data)
        refresh = request.query_params.get("refresh", "")
        return HTMLResponse(render_page(data, refresh if refresh.isdigit() and int(refresh) > 0 else None))

    # ---- /lookup ----

    async def lookup_endpoint(self, request: Request) -> Response:
        from router.admin import require_admin, require_json

        if (denied := require_admin(self.gateway, request) or require_json(request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = decode_json_body(_lookup_decoder, raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse(
                {"detail": f'invalid lookup body: {exc}; expected {{"tokens": [int, ...]}}'}, status_code=400
            )
        if any(token < 0 or token >= 2**32 for token in body.tokens):
            return JSONResponse({"detail": "tokens must be integers in 0..2^32-1"}, status_code=400)
        namespace = (body.lora_name, body.cache_salt)
        matches = self.service.longest_cached_prefix(body.tokens, namespace, disconnected=True)
        stale = self.stale_holders()
        layout: dict[str, list[Any]] = {}
        stale_holders: dict[str, dict[str, Any]] = {}
        for name, match in matches.items():
            tier = match.best_tier()
            if tier is None:
                continue
            medium = _LOOKUP_MEDIUM.get(tier, tier.upper())
            if name in stale:
                stale_holders[name] = {"medium": medium, "tokens": match.tokens, "reason": stale[name]}
            else:
                layout[name] = [medium, match.tokens]
        return JSONResponse(
            {"event_id": f"Lookup{uuid.uuid4().hex}", "layout_info": layout, "stale_holders": stale_holders}
        )


def create_extension(gateway: Gateway) -> KVIndexExtension:
    return KVIndexExtension(gateway)


class _WarningsCollector:
    """kvgate_routing_warnings{kind}: how many routing warnings of each kind hold at scrape time."""

    def __init__(self, extension: KVIndexExtension) -> None:
        self._extension = extension

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        gauge = GaugeMetricFamily(
            "kvgate_routing_warnings",
            "Reasons kv_aware routes part of the traffic blind now (see /debug/prefix-map), by kind",
            labels=["kind"],
        )
        counts = dict.fromkeys(WARNING_KINDS, 0)
        for warning in self._extension.routing_warnings():
            counts[warning["kind"]] += 1
        for kind, count in counts.items():
            gauge.add_metric([kind], count)
        yield gauge


# ---- HTML ----


def _tiers(values: dict[str, int]) -> str:
    if not values:
        return '<span class="muted">none</span>'
    return " ".join(f'<span class="pill">{html.escape(t)} {n:,}</span>' for t, n in sorted(values.items()))


def _stream_cell(entry: dict[str, Any], warned: set[str]) -> str:
    if not entry.get("events"):
        return '<span class="muted">no kv_events configured</span>'
    if entry.get("socket_errors"):
        errors = "; ".join(entry["socket_errors"])
        return f'<span class="bad" title="{html.escape(errors)}">socket failed</span>'
    state = (
        '<span class="ok">connected</span>'
        if entry.get("connected")
        else '<span class="bad">disconnected</span>'
    )
    if entry.get("connected") and entry.get("synced") is False:
        state += ' <span class="warn" title="replaying what the engine still buffers">catching up</span>'
    if entry.get("stale"):
        state += f' <span class="warn" title="{html.escape(entry["stale"])}">stale</span>'
    if entry.get("uncertain"):
        reasons = "; ".join(r["uncertain_reason"] or "" for r in entry.get("ranks", []) if r.get("uncertain"))
        state += f' <span class="warn" title="{html.escape(reasons)}">uncertain</span>'
    if "silent_events" in warned:
        state += (
            ' <span class="warn" title="requests served, no events received: see the warnings">silent</span>'
        )
    return state


def _snapshots(entry: dict[str, Any]) -> str:
    """Snapshots taken (kv_events.snapshot), failures after a slash with the last error as a tip."""
    taken, failed = entry.get("snapshots", 0), entry.get("snapshot_failures", 0)
    if not failed:
        return str(taken)
    errors = "; ".join(
        r["last_snapshot_error"] or "" for r in entry.get("ranks", []) if r.get("last_snapshot_error")
    )
    return f'{taken} <span class="warn" title="{html.escape(errors)}">/ {failed} failed</span>'


# The page's legend of decision reasons (kv_aware's and approximate's `reason`).
DECISION_REASONS = {
    "cache_hit": "sent where the longest part of the prompt is cached (or predicted: just routed there)",
    "cache_vs_load": "a backend with part of the prompt cached won on cost over one with more, "
    "whose queue made it dearer",
    "learned_hit": "approximate: sent where the gateway sent this prefix before (no events needed)",
    "load_guard": "the backend holding the prefix is over its in-flight or share line for a hot "
    "prefix; moved to the cheapest one under it (which caches the prefix too)",
    "cold_spread": "nothing of the prompt is cached anywhere: placed where the least has been "
    "placed lately, so new prefixes spread over the engines",
    "least_load": "nothing cached was worth it: the cheapest by load",
    "no_tokens": "the prompt could not be tokenized (no tokenizer, or an unusable prompt): routed by "
    "load alone, blind to the cache",
}


def _health_cell(entry: dict[str, Any]) -> str:
    state = entry.get("state", "healthy" if entry.get("healthy") else "down")
    if state == "healthy":
        return '<span class="ok">healthy</span>'
    if state == "draining":
        return '<span class="warn" title="finishing its requests, taking no new ones">draining</span>'
    reason = html.escape(entry.get("down_reason") or "")
    return f'<span class="bad">down</span><br><span class="muted">{reason}</span>'


def _refresh_links(refresh: str | None) -> str:
    links = []
    for seconds in (2, 5, 30):
        current = refresh == str(seconds)
        label = f"every {seconds} s"
        links.append(f"<b>{label}</b>" if current else f'<a href="?refresh={seconds}">{label}</a>')
    links.append('<a href="?">off</a>' if refresh else "<b>off</b>")
    return "Reload: " + " · ".join(links)


def render_page(data: dict[str, Any], refresh: str | None = None) -> str:
    rows = []
    warned: dict[str, set[str]] = {}
    for warning in data.get("warnings", []):
        warned.setdefault(warning["subject"], set()).add(warning["kind"])
    for name, entry in data["backends"].items():
        last_seq = entry.get("last_seq")
        rows.append(
            "<tr>"
            f'<td><b>{html.escape(name)}</b><br><span class="muted">{html.escape(entry["url"])}</span></td>'
            f"<td>{_health_cell(entry)}</td>"
            f"<td>{_stream_cell(entry, warned.get(name, set()))}</td>"
            f'<td class="num">{"" if last_seq is None else html.escape(str(last_seq))}</td>'
            f'<td class="num">{entry.get("replays", 0)}</td>'
            f'<td class="num">{entry.get("unrecovered_gaps", 0)}</td>'
            f'<td class="num">{entry.get("restarts", 0)}</td>'
            f'<td class="num">{_snapshots(entry)}</td>'
            f'<td class="num">{entry.get("malformed", 0)}</td>'
            f"<td>{_tiers(entry.get('blocks', {}))}</td>"
            f"<td>{_tiers(entry.get('tokens', {}))}</td>"
            f'<td class="num">{entry.get("in_flight", 0)}</td>'
            "</tr>"
        )
    prefix_rows = []
    for prefix in data["prefixes"]:
        holders = " ".join(
            f'<span class="pill">{html.escape(n)} {t:,}</span>' for n, t in sorted(prefix["backends"].items())
        )
        for n, held in sorted(prefix.get("stale_holders", {}).items()):
            holders += (
                f' <span class="pill warn" title="{html.escape(held["reason"])}">'
                f"{html.escape(n)} {held['tokens']:,} stale</span>"
            )
        if data["redacted"]:
            text = f'<span class="muted">redacted ({prefix["preview_tokens"]} tokens shown as a count)</span>'
        elif prefix.get("text") is not None:
            shown = prefix["text"][:PREVIEW_CHARS] + ("…" if len(prefix["text"]) > PREVIEW_CHARS else "")
            text = f'<div class="prefix">{html.escape(shown)}</div>'
        else:
            text = f'<div class="prefix">{html.escape(str(prefix.get("token_ids")))}</div>'
        tags = (" <span class='pill'>salted</span>" if prefix["salted"] else "") + (
            f" <span class='pill'>LoRA {html.escape(prefix['lora_name'])}</span>"
            if prefix["lora_name"]
            else ""
        )
        prefix_rows.append(
            f'<tr><td class="num">{prefix["tokens"]:,}</td><td>{holders}{tags}</td><td>{text}</td></tr>'
        )
    decision_rows = []
    for decision in data["decisions"]:
        when = dt.datetime.fromtimestamp(decision["at"], dt.UTC).strftime("%H:%M:%S.%f")[:-3]
        candidates = " ".join(
            f'<span class="pill">{html.escape(n)} {c.get("cached", 0):,} / {c.get("cost") or 0:,.0f}</span>'
            for n, c in sorted(decision.get("candidates", {}).items())
        )
        decision_rows.append(
            f"<tr><td>{when}</td><td>{html.escape(str(decision['request_id']))}</td>"
            f"<td>{html.escape(str(decision['model']))}</td><td><b>{html.escape(decision['backend'])}</b></td>"
            f"<td>{html.escape(str(decision['reason']))}</td>"
            f'<td class="num">{decision["cached_tokens"]:,} / {decision["prompt_tokens"]:,}</td>'
            f"<td>{candidates}</td></tr>"
        )
    empty = '<tr><td colspan="12" class="muted">{}</td></tr>'
    index = data["index"]
    summary = (
        f"policy <b>{html.escape(str(data['policy']))}</b> · {len(data['backends'])} backends · "
        f"{index['engine_blocks']:,} engine blocks · "
        f"{index['router_keys']:,} cached prefixes (16-token blocks) · "
        f"generated {html.escape(data['generated_at'])}"
    )
    warnings = "".join(
        f'<div class="warning"><b>{html.escape(warning["kind"].replace("_", " "))}</b>: '
        f"{html.escape(warning['message'])}</div>"
        for warning in data.get("warnings", [])
    )
    if warnings:
        warnings = f'<div id="warnings"><h2>Routing blind spots</h2>{warnings}</div>'
    return _TEMPLATE.substitute(
        warnings=warnings,
        refresh=f'<meta http-equiv="refresh" content="{refresh}">' if refresh else "",
        refresh_links=_refresh_links(refresh),
        sharing_map=sharing_svg(data["prefixes"], data["backends"], data["redacted"]),
        sharing_key=sharing_legend(data["prefixes"], data["redacted"]),
        reason_rows="\n".join(
            f"<tr><td><code>{reason}</code></td><td>{html.escape(meaning)}</td></tr>"
            for reason, meaning in DECISION_REASONS.items()
        ),
        summary=summary,
        backend_rows="\n".join(rows) or empty.format("no backends"),
        prefix_rows="\n".join(prefix_rows) or empty.format("nothing cached yet"),
        decision_rows="\n".join(decision_rows)
        or empty.format("no routing decisions yet (kv_aware/approximate)"),
    )
