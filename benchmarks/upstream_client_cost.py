"""CPU per request of the gateway's upstream client (router/upstream.py) against httpx, side by side.

Both clients send the same JSON request to the same fast test backend (kvgate_testing/openai_backend.py)
over 10 keep-alive connections, closed loop, and read the whole answer; the figure is this process's
CPU time (time.process_time) divided by the requests.

    .venv/bin/python -m benchmarks.upstream_client_cost  # writes benchmarks/results/upstream_client_cost.json
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import httpx
import uvloop

from kvgate_testing.backend import BackendProcess
from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.provenance import with_source
from router.upstream import UpstreamPool

BODY = b'{"model": "test-model", "prompt": "hello"}'
CONNECTIONS = 10
REQUESTS = 3000


async def httpx_cpu_us(url: str) -> float:
    limits = httpx.Limits(max_connections=CONNECTIONS, max_keepalive_connections=CONNECTIONS)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker(count: int) -> None:
            for _ in range(count):
                response = await client.post(url, content=BODY, headers={"content-type": "application/json"})
                assert response.status_code == 200

        await worker(100)
        started = time.process_time()
        await asyncio.gather(*(worker(REQUESTS // CONNECTIONS) for _ in range(CONNECTIONS)))
        return (time.process_time() - started) / REQUESTS * 1e6


async def upstream_pool_cpu_us(port: int) -> float:
    pool = UpstreamPool(connect_timeout_s=2, max_connections=CONNECTIONS)
    headers = [(b"content-type", b"application/json")]

    async def worker(count: int) -> None:
        for _ in range(count):
            response = await pool.request(("127.0.0.1", port), b"POST", b"/v1/completions", headers, BODY, 10)
            await response.read(10)
            response.close()
            assert response.status == 200

    await worker(100)
    started = time.process_time()
    await asyncio.gather(*(worker(REQUESTS // CONNECTIONS) for _ in range(CONNECTIONS)))
    cpu = (time.process_time() - started) / REQUESTS * 1e6
    pool.close()
    return cpu


def main() -> None:
    backend = BackendProcess("fast", ["test-model"], record=False).start()
    try:
        results = {
            "httpx_cpu_us_per_request": uvloop.run(httpx_cpu_us(f"{backend.url}/v1/completions")),
            "upstream_pool_cpu_us_per_request": uvloop.run(upstream_pool_cpu_us(backend.port)),
            "requests": REQUESTS,
            "connections": CONNECTIONS,
            "command": "python -m benchmarks.upstream_client_cost",
            # httpcore imports sniffio on every request when it is missing (it is, in this venv),
            # which costs httpx extra CPU; run with sniffio on PYTHONPATH to see the difference.
            "sniffio_available": importlib.util.find_spec("sniffio") is not None,
            "httpx_version": httpx.__version__,
        }
    finally:
        backend.stop()
    out = REPO_ROOT / "benchmarks" / "results" / "upstream_client_cost.json"
    out.write_text(json.dumps(with_source(results), indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
