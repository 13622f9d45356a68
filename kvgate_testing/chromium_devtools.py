"""A real headless Chromium driven over the DevTools protocol (CDP): load a page at a set viewport,
evaluate JavaScript in it, take a screenshot, visit it again in the same profile.

The `--dump-dom` and `--screenshot` flags answer one question per browser start; a layout question
(where is this element at 1400x1000?) or a second visit that reads what the first stored
(localStorage) needs a live page, so this speaks CDP over its websocket (the `websockets` package,
which uvicorn[standard] already installs).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import websockets

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
_DEVTOOLS_LINE = re.compile(r"DevTools listening on (ws://127\.0\.0\.1:(\d+)/\S+)")


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class BrowserPage:
    """One Chromium process with one page, for use in `async with`; every wait is bounded."""

    def __init__(self, profile: Path, width: int, height: int, timeout_s: float = 60.0) -> None:
        self.profile, self.width, self.height, self.timeout_s = profile, width, height, timeout_s
        self._ids = itertools.count(1)
        self._process: subprocess.Popen[str] | None = None
        self._socket: Any = None

    async def __aenter__(self) -> BrowserPage:
        path = chromium_path()
        if path is None:
            raise RuntimeError(
                "chromium is not installed: `apt-get install --no-install-recommends chromium`"
            )
        self._process = subprocess.Popen(
            [path, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
             "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        port = await asyncio.wait_for(asyncio.to_thread(self._devtools_port), self.timeout_s)
        async with httpx.AsyncClient(timeout=10) as client:
            targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        self._socket = await websockets.connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20)
        await self.call("Page.enable")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width, height=self.height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        return self

    def _devtools_port(self) -> int:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:  # Chromium names its DevTools endpoint on stderr first
            if match := _DEVTOOLS_LINE.search(line):
                return int(match.group(2))
        raise RuntimeError(f"chromium exited ({self._process.wait()}) before naming its DevTools port")

    async def __aexit__(self, *exc: object) -> None:
        if self._socket is not None:
            await self._socket.close()
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one CDP command, return its result (events arriving meanwhile are dropped)."""
        return (await self._call_then(method, params, until_event=None))[0]

    async def _call_then(
        self, method: str, params: dict[str, Any], until_event: str | None
    ) -> tuple[dict[str, Any], bool]:
        """Send a command; read until its answer came and, when named, `until_event` arrived too."""
        message_id = next(self._ids)
        await self._socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        result: dict[str, Any] | None = None
        event_seen = until_event is None
        async with asyncio.timeout(self.timeout_s):
            while result is None or not event_seen:
                message = json.loads(await self._socket.recv())
                if message.get("id") == message_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    result = message["result"]
                elif message.get("method") == until_event:
                    event_seen = True
        return result, event_seen

    async def visit(self, url: str) -> None:
        """Navigate and wait for the page's load event (its inline scripts have run by then)."""
        result, _ = await self._call_then("Page.navigate", {"url": url}, until_event="Page.loadEventFired")
        if result.get("errorText"):
            raise RuntimeError(f"{url}: {result['errorText']}")

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        """The viewport as a PNG: what a person sees without scrolling."""
        result = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(result["data"]))
