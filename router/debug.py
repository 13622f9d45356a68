"""The KV index's HTTP surface and its gateway extension.

- GET /debug/prefix-map: what the gateway knows of every engine's cache, as an HTML page a person
  can read or as JSON (`?format=json`): per backend the event stream's state and the blocks and
  tokens per tier; the top cached prefixes (decoded text, or token counts only when
  `admin.redact_prompts`); the recent routing decisions.
- POST /lookup: LMCache-controller compatible `{"tokens": [...]}` ->
  `{"event_id", "layout_info": {backend: [medium, matched_tokens]}}`, from event-confirmed entries
  only (kv_aware's predictions are not in the index).
Both need the admin token when one is configured.

`create_extension(gateway)` wires the index service (gateway.kv_index), the tokenizer (a request
preparer for policies that need tokens) and these routes into the gateway through its seams.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
import logging
import uuid
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from router.config import ApproximatePolicy, KVAwarePolicy
from router.index.service import KVIndexService
from router.tokenize import RequestTokenizer

if TYPE_CHECKING:
    from router.app import Gateway
    from router.backends import BackendState

logger = logging.getLogger("kvgate.debug")

_TEMPLATE = Template((Path(__file__).parent / "debug_page.html").read_text())
TOP_PREFIXES = 20
PREVIEW_CHARS = 240
_LOOKUP_MEDIUM = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}


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

    # ---- Extension protocol ----

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/debug/prefix-map", self.prefix_map_endpoint, methods=["GET"]),
            Route("/lookup", self.lookup_endpoint, methods=["POST"]),
        ]

    async def start(self) -> None:
        self.service.start()
        if not self.needs_tokens:
            return  # the debug page loads a tokenizer when it first shows prefixes
        try:  # load tokenizers now, not on the first request (about 2 s for Qwen3)
            await asyncio.to_thread(self.tokenizer.preload)
        except Exception as exc:
            logger.error("tokenizer failed to load: %s; kv-aware routing will use load only", exc)

    async def stop(self) -> None:
        self.service.stop()
        await self.tokenizer.close()

    def backend_added(self, backend: BackendState) -> None:
        self.service.add_backend(backend.name, backend.kv_events)

    def backend_removed(self, backend: BackendState) -> None:
        self.service.remove_backend(backend.name)

    # ---- /debug/prefix-map ----

    def prefix_map(self) -> dict[str, Any]:
        """The page's data: backends, top prefixes, recent decisions."""
        gateway = self.gateway
        redact = gateway.config.admin.redact_prompts
        status = self.service.status()
        backends: dict[str, Any] = {}
        for name, backend in gateway.backends.items():
            entry: dict[str, Any] = {
                "url": backend.url,
                "healthy": backend.healthy,
                "in_flight": backend.in_flight,
                "events": backend.kv_events is not None,
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
            item: dict[str, Any] = {
                "tokens": top["tokens"],
                "backends": top["backends"],
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
        return HTMLResponse(render_page(data, refresh if refresh.isdigit() else None))

    # ---- /lookup ----

    async def lookup_endpoint(self, request: Request) -> Response:
        from router.admin import require_admin

        if (denied := require_admin(self.gateway, request)) is not None:
            return denied
        raw = await request.body()
        try:
            body = _lookup_decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return JSONResponse(
                {"detail": f'invalid lookup body: {exc}; expected {{"tokens": [int, ...]}}'}, status_code=400
            )
        if any(token < 0 or token >= 2**32 for token in body.tokens):
            return JSONResponse({"detail": "tokens must be integers in 0..2^32-1"}, status_code=400)
        matches = self.service.longest_cached_prefix(body.tokens, (body.lora_name, body.cache_salt))
        layout = {}
        for name, match in matches.items():
            tier = match.best_tier()
            if tier is not None:
                layout[name] = [_LOOKUP_MEDIUM.get(tier, tier.upper()), match.tokens]
        return JSONResponse({"event_id": f"Lookup{uuid.uuid4().hex}", "layout_info": layout})


def create_extension(gateway: Gateway) -> KVIndexExtension:
    return KVIndexExtension(gateway)


# ---- HTML ----


def _tiers(values: dict[str, int]) -> str:
    if not values:
        return '<span class="muted">none</span>'
    return " ".join(f'<span class="pill">{html.escape(t)} {n:,}</span>' for t, n in sorted(values.items()))


def _stream_cell(entry: dict[str, Any]) -> str:
    if not entry.get("events"):
        return '<span class="muted">no kv_events configured</span>'
    state = (
        '<span class="ok">connected</span>'
        if entry.get("connected")
        else '<span class="bad">disconnected</span>'
    )
    if entry.get("connected") and entry.get("synced") is False:
        state += ' <span class="warn" title="replaying what the engine still buffers">catching up</span>'
    if entry.get("uncertain"):
        reasons = "; ".join(r["uncertain_reason"] or "" for r in entry.get("ranks", []) if r.get("uncertain"))
        state += f' <span class="warn" title="{html.escape(reasons)}">uncertain</span>'
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


def render_page(data: dict[str, Any], refresh: str | None = None) -> str:
    rows = []
    for name, entry in data["backends"].items():
        last_seq = entry.get("last_seq")
        rows.append(
            "<tr>"
            f'<td><b>{html.escape(name)}</b><br><span class="muted">{html.escape(entry["url"])}</span></td>'
            f"<td>{_stream_cell(entry)}</td>"
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
    empty = '<tr><td colspan="10" class="muted">{}</td></tr>'
    index = data["index"]
    summary = (
        f"policy <b>{html.escape(str(data['policy']))}</b> · {len(data['backends'])} backends · "
        f"{index['engine_blocks']:,} engine blocks · "
        f"{index['router_keys']:,} cached prefixes (16-token blocks) · "
        f"generated {html.escape(data['generated_at'])}"
    )
    return _TEMPLATE.substitute(
        refresh=f'<meta http-equiv="refresh" content="{refresh}">' if refresh else "",
        summary=summary,
        backend_rows="\n".join(rows) or empty.format("no backends"),
        prefix_rows="\n".join(prefix_rows) or empty.format("nothing cached yet"),
        decision_rows="\n".join(decision_rows)
        or empty.format("no routing decisions yet (kv_aware/approximate)"),
    )
