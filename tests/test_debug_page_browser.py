"""/debug/prefix-map rendered by a real headless Chromium: the DOM shows the backends' health and
stream state, the legend of decision reasons and costs, the reload links, the picture of prefix
sharing across engines, the cached prefixes as decoded text and the routing decisions; at 1400x1000
the map and the decisions are in view once the legend, open on the first visit only, is collapsed."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate_testing.chromium_devtools import CHROMIUM_FLAGS, BrowserPage, chromium_path
from kvgate_testing.kv_fleet import DOCS, Fleet, chat_body
from router.config import builtin_tokenizer_dir
from router.debug_page import DECISION_REASONS
from router.tokenize import PromptTokenizer

pytestmark = pytest.mark.browser


def chromium() -> str:
    path = chromium_path()
    if path is None:
        pytest.fail("chromium is not installed: `apt-get install -y chromium` (.ci/run does it)")
    return path


def run_chromium(args: list[str], profile: Path) -> str:
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    qwen3 = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    fleet = Fleet()
    try:
        for n, (name, doc) in enumerate(DOCS.items()):
            fleet.cache(name, qwen3.tokens_for(chat_body(doc, "What is this about?")), 100 * (n + 1))
        fleet.wait_for(lambda m: len(m["prefixes"]) == 2)
        # More cached prefixes for the sharing picture: three of b0's own, and one (a shared
        # system prompt) cached on b0 and b2 alike.
        for n, topic in enumerate(["glacier mapping", "sourdough starters", "tram timetables"]):
            prompt = f"Notes on {topic}: " + f"the {topic} chapter goes on and on. " * (12 * (n + 1))
            fleet.cache("b0", qwen3.tokens_for({"prompt": prompt}), 5000 + 1000 * n)
        shared = qwen3.tokens_for(chat_body("You are a patient assistant for a railway museum. " * 10, "Hi"))
        fleet.cache("b0", shared, 9000)
        fleet.cache("b2", shared, 9000)
        fleet.wait_for(lambda m: len(m["prefixes"]) == 6)
        for name, doc in DOCS.items():
            response = fleet.client.post("/v1/chat/completions", json=chat_body(doc, "Next?"))
            assert response.headers["x-kvgate-backend"] == name
        yield fleet
    finally:
        fleet.close()


def test_the_page_renders_in_chromium(fleet: Fleet, tmp_path: Path) -> None:
    dom = run_chromium(["--dump-dom", f"{fleet.gateway.url}/debug/prefix-map"], tmp_path / "profile")
    assert "<h1>kvgate prefix map</h1>" in dom
    backends = dom.split('id="backends"')[1].split("</table>")[0]
    for name in ("b0", "b1", "b2"):
        assert f"<b>{name}</b>" in backends
    assert backends.count(">connected<") == 3
    prefixes = dom.split('id="prefixes"')[1].split("</table>")[0]
    assert "tidal energy in northern fjords" in prefixes
    assert "medieval bookbinding" in prefixes
    decisions = dom.split('id="decisions"')[1].split("</table>")[0]
    assert "cache_hit" in decisions and "<b>b1</b>" in decisions and "<b>b2</b>" in decisions


def test_the_page_explains_itself(fleet: Fleet, tmp_path: Path) -> None:
    dom = run_chromium(["--dump-dom", f"{fleet.gateway.url}/debug/prefix-map"], tmp_path / "profile")
    legend = dom.split('id="legend"')[1].split("</details>")[0]
    for reason in DECISION_REASONS:
        assert f"<code>{reason}</code>" in legend
    assert "<b>Cost</b>" in legend and "request_load_weight" in legend
    backends = dom.split('id="backends"')[1].split("</table>")[0]
    assert "<th>Health</th>" in backends and backends.count('class="ok">healthy<') == 3
    assert 'href="?refresh=5"' in dom.split('id="refresh"')[1]
    reloading = run_chromium(
        ["--dump-dom", f"{fleet.gateway.url}/debug/prefix-map?refresh=5"], tmp_path / "p2"
    )
    assert '<meta http-equiv="refresh" content="5">' in reloading
    assert "<b>every 5 s</b>" in reloading


def test_the_page_draws_prefix_sharing_across_engines(fleet: Fleet, tmp_path: Path) -> None:
    dom = run_chromium(["--dump-dom", f"{fleet.gateway.url}/debug/prefix-map"], tmp_path / "profile")
    picture = dom.split('<svg id="sharing-map"')[1].split("</svg>")[0]
    # One column per engine, each labelled, each holding the prefixes its engine caches.
    columns = re.findall(r'class="map-engine">([^<]+)<', picture)
    assert columns == ["b0", "b1", "b2"]
    cells = re.findall(
        r'<g class="map-cell"><title>#(\d+): ([^<]*)</title><rect [^>]*fill="([^"]+)"', picture
    )
    ranks = [int(rank) for rank, _, _ in cells]
    assert sorted(set(ranks)) == [1, 2, 3, 4, 5, 6]
    # The prefix cached on two engines: drawn in two columns, in one colour, said to be shared.
    shared = [rank for rank in set(ranks) if ranks.count(rank) == 2]
    assert len(shared) == 1 and len(cells) == 7
    drawn = [(tip, fill) for rank, tip, fill in cells if int(rank) == shared[0]]
    assert drawn[0][1] == drawn[1][1] and all("cached on 2 engines" in tip for tip, _ in drawn)
    assert "patient assistant for a railway museum" in dom.split('class="map-key"')[1]


def test_a_screenshot_of_the_page(fleet: Fleet, tmp_path: Path) -> None:
    # Kept where a person can look at it (KVGATE_SCREENSHOT_DIR), else in the test's temp dir.
    out_dir = Path(os.environ.get("KVGATE_SCREENSHOT_DIR", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "prefix-map.png"
    run_chromium(
        [f"--screenshot={shot}", "--window-size=1400,1900", f"{fleet.gateway.url}/debug/prefix-map"],
        tmp_path / "profile",
    )
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank image


def test_the_map_is_in_view_once_the_legend_collapses_after_the_first_visit(
    fleet: Fleet, tmp_path: Path
) -> None:
    out_dir = Path(os.environ.get("KVGATE_SCREENSHOT_DIR", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    url = f"{fleet.gateway.url}/debug/prefix-map"
    layout = """JSON.stringify({
        viewport: innerHeight,
        legend_open: document.getElementById("legend").open,
        map: document.getElementById("sharing-map").getBoundingClientRect(),
        decisions: document.getElementById("decisions").getBoundingClientRect(),
    })"""

    async def visits() -> list[dict]:
        chromium()  # a clear failure when it is not installed
        seen = []
        async with BrowserPage(tmp_path / "profile", width=1400, height=1000) as page:
            for visit in ("first", "second"):
                await page.visit(url)
                seen.append(json.loads(await page.evaluate(layout)))
                await page.screenshot(out_dir / f"prefix-map-1400x1000-{visit}-visit.png")
            # The reader opens the legend: it stays open on the next visit, as they left it.
            await page.evaluate('document.querySelector("#legend summary").click()')
            await page.visit(url)
            seen.append(json.loads(await page.evaluate(layout)))
        return seen

    first, second, reopened = asyncio.run(visits())
    assert first["legend_open"], "a first visit shows how to read the page"
    assert not second["legend_open"], "the legend is collapsed from the second visit on"
    assert reopened["legend_open"], "a legend the reader opened stays open"
    # Second visit, nothing scrolled: the whole prefix map is in the 1000-pixel viewport, and the
    # decisions table starts in it (its rows follow the map: they are the next thing to read).
    viewport = second["viewport"]
    assert viewport == 1000
    assert second["map"]["top"] >= 0 and second["map"]["bottom"] <= viewport, second
    assert second["decisions"]["top"] < viewport, second
    assert first["map"]["top"] > second["map"]["top"], "collapsing the legend moved the map up"
    for visit in ("first", "second"):
        assert (out_dir / f"prefix-map-1400x1000-{visit}-visit.png").stat().st_size > 10_000
