"""/debug/prefix-map rendered by a real headless Chromium: the DOM shows the backends' stream state,
the cached prefixes as decoded text and the routing decisions."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer
from tests.test_kv_aware_gateway import DOCS, Fleet, chat_body

pytestmark = pytest.mark.browser

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
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


def test_a_screenshot_of_the_page(fleet: Fleet, tmp_path: Path) -> None:
    # Kept where a person can look at it (KVGATE_SCREENSHOT_DIR), else in the test's temp dir.
    out_dir = Path(os.environ.get("KVGATE_SCREENSHOT_DIR", tmp_path))
    out_dir.mkdir(parents=True, exist_ok=True)
    shot = out_dir / "prefix-map.png"
    run_chromium(
        [f"--screenshot={shot}", "--window-size=1400,1000", f"{fleet.gateway.url}/debug/prefix-map"],
        tmp_path / "profile",
    )
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank image
