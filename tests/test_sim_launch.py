"""`kvgate serve` with a `launch:` section starts simulated engines, routes to them and stops them;
`kvgate demo` runs end to end on a tiny setting."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvgate_testing.gateway import simulated_fleet_config, start_gateway
from kvgate_testing.processes import REPO_ROOT, python_command
from router.launch import _pick_ports

MODEL = "tiny-qwen3"


def _children(pid: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                children.append(int(entry.name))
    return children


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_taken_ports_are_replaced_and_no_port_is_picked_twice():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picked = _pick_ports("127.0.0.1", [busy, busy, busy + 1])
    assert busy not in picked
    assert len(set(picked)) == 3


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_serve_launches_simulated_engines_forwards_to_them_and_stops_them(stop_signal):
    config = simulated_fleet_config(MODEL, "round_robin", num_gpu_blocks=256, prefill_us_per_token=10)
    gateway = start_gateway(config, timeout_s=180)
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{gateway.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "launched engines never became healthy in the gateway"
            time.sleep(0.2)
        engines = [pid for pid in _children(gateway.process.pid) if _alive(pid)]
        assert len(engines) == 2
        assert all(b"router.sim" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in engines)

        prompt = " ".join(f"shared words number {i}" for i in range(30))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        answers = [
            httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30).json() for _ in range(4)
        ]
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        # Round robin over two engines: each engine's first sight of the prompt misses, its second hits.
        assert cached[:2] == [0, 0]
        assert cached[2] > 0 and cached[3] > 0

        os.kill(gateway.process.pid, stop_signal)  # the gateway alone: it must stop its engines
        status = gateway.process.popen.wait(timeout=30)
        if stop_signal == signal.SIGINT:  # Ctrl-C: a quiet exit saying it was interrupted
            assert status == 130
            assert "Traceback" not in gateway.process.output()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in engines), "simulated engines outlived the gateway"
    finally:
        gateway.stop()


def test_demo_runs_on_a_tiny_setting(tmp_path):
    results_path = tmp_path / "demo.json"
    command = python_command(
        "-m", "router.cli", "demo", "--engines", "2", "--requests", "12", "--system-prompts", "3",
        "--prefix-words", "200", "--num-gpu-blocks", "256", "--concurrency", "4",
        "--policies", "round_robin,least_loaded", "--json", str(results_path),
    )  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    # start_new_session + killpg on timeout: nothing the demo started may outlive the test.
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text
    assert "SIMULATED" in text and "cache hits" in text
    results = {r["policy"]: r for r in json.loads(results_path.read_text())["results"]}
    assert set(results) == {"round_robin", "least_loaded"}
    for result in results.values():
        assert result["error"] is None
        assert result["requests"] == 12
        assert 0 < result["hit_ratio"] < 1  # three prompts over twelve requests: repeats hit
        assert result["ttft_p90_ms"] >= result["ttft_p50_ms"] > 0
    _assert_table_explains_itself(text, results)


def _assert_table_explains_itself(text: str, results: dict[str, dict]) -> None:
    """The printed table says its TTFTs are simulated and what max/mean load is, beside its rows."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "policy" in line and "max/mean load" in line)
    title = lines[header - 1]
    assert "SIMULATED" in title and "TTFT" in title, title
    assert "sim TTFT p50" in lines[header] and "sim TTFT p90" in lines[header], lines[header]
    legend = "\n".join(lines[header + 1 :])
    assert "sim TTFT:      SIMULATED time to the first streamed chunk" in legend, legend
    assert "not a real engine's TTFT" in legend, legend
    load_legend = next(line for line in lines[header + 1 :] if line.startswith("max/mean load:"))
    assert "busiest engine" in load_legend and "mean per engine" in load_legend, load_legend
    assert "2.00 = all on one engine" in legend, legend  # two engines in this run
    for policy, result in results.items():  # the rows carry the numbers the JSON holds
        row = next(line for line in lines[header + 1 :] if line.split()[:1] == [policy])
        assert f"{result['hit_ratio']:.1%}" in row and f"{result['max_over_mean_load']:.2f}" in row, row
