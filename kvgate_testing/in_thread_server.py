"""An ASGI app served by a real uvicorn on a free loopback port, in a thread of the test process:
for apps a test builds itself (a stand-in engine endpoint, the gateway app with test extensions)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from kvgate_testing.ports import free_port


@contextlib.contextmanager
def serving_in_thread(
    app: Any, *, log_level: str = "warning", start_timeout_s: float = 30.0
) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL (`http://127.0.0.1:PORT`)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, f"uvicorn did not start within {start_timeout_s} s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
