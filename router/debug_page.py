"""GET /debug/prefix-map: what the gateway knows of every engine's cache, as an HTML page a person
can read or as JSON (`?format=json`).

Per backend: its health and the state of its KV-event stream, the blocks and tokens it holds per
tier; the top cached prefixes (decoded text, or token counts only when `admin.redact_prompts`) and
which backends hold them (stale holders apart, see router/lookup.py); the recent routing decisions
of the cache-aware policies; the routing warnings (router/routing_warnings.py). Needs the admin
token when one is configured.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
from collections.abc import Callable, Mapping
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from router.admin import require_admin
from router.lookup import stale_holders
from router.prefix_treemap import sharing_legend, sharing_svg

if TYPE_CHECKING:
    from router.backends import BackendState
    from router.config import Config
    from router.disaggregation import Disaggregation
    from router.index.service import KVIndexService
    from router.missed_reuse import MissedReuse
    from router.policies.base import Policy
    from router.routing_warnings import RoutingWarnings
    from router.tokenize import RequestTokenizer

_TEMPLATE = Template((Path(__file__).parent / "debug_page.html").read_text())
TOP_PREFIXES = 20
PREVIEW_CHARS = 240


class DebugPage:
    """The page's data (`prefix_map`) and its endpoint."""

    def __init__(
        self,
        config: Config,
        backends: Mapping[str, BackendState],
        index: KVIndexService,
        policy: Policy,
        tokenizer: RequestTokenizer,
        warnings: RoutingWarnings,
        admin_token: str | None,
        disaggregation: Disaggregation | None = None,
        missed_reuse: MissedReuse | None = None,
    ) -> None:
        self.config = config
        self.missed_reuse = missed_reuse
        self.backends = backends
        self.index = index
        self.policy = policy
        self.tokenizer = tokenizer
        self.warnings = warnings
        self.admin_token = admin_token
        self.disaggregation = disaggregation

    def routes(self) -> list[BaseRoute]:
        return [Route("/debug/prefix-map", self.endpoint, methods=["GET"])]

    def prefix_map(self) -> dict[str, Any]:
        """The page's data: backends, top prefixes, recent decisions."""
        redact = self.config.admin.redact_prompts
        status = self.index.status()
        stale = stale_holders(self.index, self.backends)
        backends: dict[str, Any] = {}
        for name, backend in self.backends.items():
            entry: dict[str, Any] = {
                "url": backend.url,
                "state": backend.describe()["state"],
                "down_reason": None if backend.healthy else backend.down_reason,
                "healthy": backend.healthy,
                "in_flight": backend.in_flight,
                "events": backend.kv_events is not None,
                "role": backend.role,
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
        for top in self.index.index.top_prefixes(TOP_PREFIXES):
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
        policy = self.policy
        decisions = list(policy.recent_decisions())[-50:][::-1]
        return {
            "warnings": self.warnings.current(status),
            "backends": backends,
            "prefixes": prefixes,
            "decisions": decisions,
            "index": self.index.index.size(),
            "policy": policy.name,
            # kv_aware's measured load weights (router/policies/load_costs.py), when it measures them.
            "load_costs": policy.measured_load_costs(),
            # Prompt tokens cached in the fleet but computed anyway, by reason (router/missed_reuse.py).
            "missed_reuse": None if self.missed_reuse is None else self.missed_reuse.describe(),
            # Prefill/decode disaggregation: roles, measured costs, recent decisions with estimates.
            "disaggregation": None if self.disaggregation is None else self.disaggregation.describe(),
            "redacted": redact,
            "generated_at": dt.datetime.now(dt.UTC).isoformat(),
        }

    def _decoder(self) -> Callable[[list[int]], str] | None:
        for model in self.config.models:
            try:
                tokenizer = self.tokenizer.tokenizer(model.name)
            except Exception:  # a broken tokenizer must not break the debug page
                tokenizer = None
            if tokenizer is not None:
                return tokenizer.decode
        return None

    async def endpoint(self, request: Request) -> Response:
        if (denied := require_admin(self.admin_token, request)) is not None:
            return denied
        data = await asyncio.to_thread(self.prefix_map)
        if request.query_params.get("format") == "json":
            return JSONResponse(data)
        refresh = request.query_params.get("refresh", "")
        return HTMLResponse(render_page(data, refresh if refresh.isdigit() and int(refresh) > 0 else None))


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


def _disaggregation_section(pd: dict[str, Any] | None) -> str:
    """Prefill/decode decisions: each one's option, engines and every option's estimate (seconds)."""
    if pd is None:
        return ""
    rows = []
    for decision in pd["decisions"]:
        when = dt.datetime.fromtimestamp(decision["at"], dt.UTC).strftime("%H:%M:%S.%f")[:-3]
        estimates = " ".join(
            f'<span class="pill">{html.escape(option)} {estimate["total_s"] * 1000:,.1f} ms</span>'
            for option, estimate in decision["estimates"].items()
        )
        engines = html.escape(decision["backend"])
        if decision["prefill_backend"]:
            engines = f"{html.escape(decision['prefill_backend'])} → {engines}"
        failed = decision.get("prefill_failed")
        note = f'<br><span class="warn">prefill failed: {html.escape(failed)}</span>' if failed else ""
        rows.append(
            f"<tr><td>{when}</td><td>{html.escape(str(decision['request_id']))}</td>"
            f"<td><b>{html.escape(decision['option'])}</b>{note}</td><td>{engines}</td>"
            f'<td class="num">{decision["prompt_tokens"]:,}</td><td>{estimates}</td></tr>'
        )
    costs = " ".join(
        f'<span class="pill">{html.escape(name)} ({html.escape(pd["roles"].get(name, "?"))}): prefill '
        f"{cost['prefill_us_per_token']:g}, load {cost['load_us_per_token']:g}, transfer "
        f"{cost['transfer_us_per_token']:g} us/token{_prefill_bound(cost)}</span>"
        for name, cost in pd["costs"].items()
    )
    body = "\n".join(rows) or '<tr><td colspan="6" class="muted">no requests yet</td></tr>'
    return (
        f"<h2>Prefill/decode decisions (mode {html.escape(pd['mode'])})</h2>"
        f'<div class="sub">measured costs (priors until measured): {costs or "none yet"}</div>'
        "<table><tr><th>at</th><th>request</th><th>option</th><th>engines</th><th>prompt tokens</th>"
        f"<th>estimates</th></tr>{body}</table>"
    )


def _prefill_bound(cost: dict[str, Any]) -> str:
    """The lower bound the engine's prefills still in flight put on its prefill cost, if any."""
    bound = cost.get("prefill_bound_us_per_token") or 0
    if not bound:
        return ""
    return f"; prefill at least {bound:g} us/token, prefills running: {cost['open_prefills']}"


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
        disaggregation=_disaggregation_section(data.get("disaggregation")),
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
