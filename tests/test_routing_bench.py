"""The routing benchmark harness, run small: real simulated engines, the real gateway, a real replay."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvgate_testing import routing_report, routing_runs, workloads
from kvgate_testing.proc_stats import process_tree
from kvgate_testing.processes import REPO_ROOT
from kvgate_testing.real_fleet import pin_engines_to_cores
from kvgate_testing.reference_placement import reference_placement
from kvgate_testing.replay import Outcome, replay_one_at_a_time
from kvgate_testing.sim_fleet import EngineFleet


@pytest.fixture(scope="module")
def fleet():
    engines = EngineFleet(count=2, num_gpu_blocks=256, block_size=16)
    engines.start()
    yield engines
    engines.stop()


@pytest.fixture(scope="module")
def chat():
    return workloads.build(
        "chat_sessions", workloads.qwen3_tokenizer(), users=3, turns=3, system_tokens=64,
        user_message_tokens=(20, 40), assistant_reply_tokens=(20, 40), think_time_s=0.2, rate=20.0,
        max_tokens=4,
    )  # fmt: skip


@pytest.mark.slow  # ~70 s on two busy cores: two engines and two gateway processes start
def test_a_policy_run_counts_hits_load_and_token_parity(fleet, chat):
    measured = routing_runs.run_policy(fleet, "session", chat, concurrency=8)
    assert measured["completed"] == measured["requests"] == len(chat.requests)
    assert measured["errors"] == 0
    # The workload's own tokenization is exactly what the engines counted.
    assert measured["prompt_token_mismatches"] == 0
    # Session affinity keeps each conversation on one engine: every later turn reuses the earlier ones.
    assert measured["hit_ratio"] > 0.3
    assert measured["engine_hit_ratio"] == pytest.approx(measured["hit_ratio"], abs=1e-3)
    # Engine-side counts (from /metrics) and the gateway's x-kvgate-backend header agree.
    assert sum(measured["requests_per_engine"]) == len(chat.requests)
    assert measured["max_over_mean_load_by_header"] == measured["max_over_mean_load"]
    for key in ("ttft_p50", "ttft_p90", "ttft_p99"):
        assert measured[key] > 0
    assert measured["ttft_p50"] <= measured["ttft_p90"] <= measured["ttft_p99"]
    assert measured["throughput"] > 0

    # session sees no cache: it counts no missed reuse, and the results say so (None, shown n/a).
    assert measured["missed_reuse_tokens"] is None and measured["missed_reuse_ratio"] is None

    # Caches are emptied before each run: the same run again measures the same hits.
    again = routing_runs.run_policy(fleet, "session", chat, concurrency=8)
    assert again["hit_ratio"] == measured["hit_ratio"]


@pytest.mark.slow  # a gateway with KV events over the two engines
def test_a_cache_aware_run_reports_its_missed_reuse_by_reason(fleet, chat):
    measured = routing_runs.run_policy(fleet, "kv_aware", chat, concurrency=8)
    assert measured["errors"] == 0
    # Scraped from the gateway's kvgate_missed_reuse_tokens_total, split off the decision counters.
    tokens = measured["missed_reuse_tokens"]
    assert set(tokens) == {"load_guard", "stale_index", "tier_unreachable", "contract_mismatch"}
    assert all(count >= 0 for count in tokens.values())
    assert measured["missed_reuse_ratio"] == pytest.approx(
        sum(tokens.values()) / measured["prompt_tokens"], abs=1e-4
    )
    assert not any("missed_reuse" in name for name in measured.get("router_decisions", {}))


def test_missed_reuse_is_a_column_beside_the_hit_ratio_and_n_a_where_not_counted(tmp_path) -> None:
    def run(hit: float, missed: dict | None) -> dict:
        base = {"hit_ratio": hit, "ttft_p50": 1.0, "ttft_p90": 2.0, "ttft_p99": 3.0, "throughput": 1.0,
                "max_over_mean_load": 1.0, "errors": 0}  # fmt: skip
        return base | routing_runs.missed_reuse_fields(missed, 1000)

    results = {
        "meta": {
            "engines": 2,
            "date": "today",
            "command": "c",
            "wall_s": 1.0,
            "scale": 1,
            "rate_scale": 1,
            "num_gpu_blocks": 8,
            "block_size": 16,
            "sim_args": [],
            "concurrency": 1,
            "machine": "m",
        },
        "workloads": {
            "chat": {
                "description": "d",
                "reference_hit_ratio": 0.5,
                "has_reuse": True,
                "workload": {
                    "requests": 1,
                    "mean_prompt_tokens": 1,
                    "arrival_span_s": 1,
                    "unbounded_cache_hit_ratio": 1,
                },
                "policies": {
                    "kv_aware": run(0.5, {"load_guard": 30, "stale_index": 0, "tier_unreachable": 12}),
                    "sglang_router_cache_aware": run(0.4, None),
                    "old_run": {k: v for k, v in run(0.3, None).items() if "missed" not in k},
                },
            },
        },
    }
    path = tmp_path / "r.md"
    routing_report.write_markdown(results, path)
    rows = {
        line.split(" | ")[0]: line.split(" | ")
        for line in path.read_text().splitlines()
        if line.startswith("| ")
    }
    header = rows["| policy"]
    column = header.index("missed reuse")
    assert header[column - 1] == "hit ratio"
    assert rows["| kv_aware"][column] == "0.042"  # 42 of 1000 prompt tokens
    assert rows["| sglang_router_cache_aware"][column] == "n/a"  # a peer: no such metric, never 0
    assert rows["| old_run"][column] == "-"  # not measured then
    assert "- kv_aware: `load_guard` 30, `stale_index` 0, `tier_unreachable` 12" in path.read_text()


def test_the_floor_serves_the_reference_placement_one_request_at_a_time_per_engine(fleet, chat, tmp_path):
    reference = reference_placement(chat, engines=2, num_gpu_blocks=256, block_size=16)
    assert len(set(reference.engine_of_request)) == 2  # both engines, so both lanes, get requests
    before = fleet.counters()
    floor = routing_runs.run_floor(fleet, chat, reference.engine_of_request, tmp_path / "floor.jsonl")
    after = fleet.counters()
    assert floor["errors"] == 0 and floor["completed"] == len(chat.requests)
    # Each request went where the reference put it, and found cached what the reference's block pools say.
    served = [round(a.minus(b).requests) for a, b in zip(after, before, strict=True)]
    assert served == reference.requests_per_engine
    assert floor["hit_ratio"] == pytest.approx(reference.hit_ratio, abs=1e-4)
    # Within an engine's lane, a request leaves only once the one before it has finished.
    records = [json.loads(line) for line in (tmp_path / "floor.jsonl").read_text().splitlines()]
    assert [r["engine"] for r in records] == reference.engine_of_request
    for engine in (0, 1):
        mine = [r for r in records if r["engine"] == engine]
        assert all(later["sent_at"] >= earlier["done_at"] for earlier, later in itertools.pairwise(mine))


def test_a_placement_that_does_not_fit_the_workload_or_the_lanes_is_refused(chat):
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:9"]
    with pytest.raises(ValueError, match="placements for"):
        asyncio.run(replay_one_at_a_time(urls, chat, [0], [[0], [1]], "m"))
    with pytest.raises(ValueError, match=r"engines \[1\] get requests but are in no lane"):
        asyncio.run(replay_one_at_a_time(urls, chat, [1] * len(chat.requests), [[0]], "m"))


def test_targets_are_checked_against_the_measurements_not_assumed():
    def policy(hit: float, p90: float, load: float) -> dict:
        return {"hit_ratio": hit, "ttft_p90": p90, "max_over_mean_load": load}

    results = {
        "workloads": {
            "shared": {
                "has_reuse": True,
                "reference_hit_ratio": 0.8,
                "policies": {
                    "kv_aware": policy(0.78, 50.0, 1.2),
                    "sglang_router_cache_aware": policy(0.6, 40.0, 2.0),
                    "vllm_router_cache_aware": {"failed": "did not start"},
                },
            },
            "control": {
                "has_reuse": False,
                "reference_hit_ratio": 0.0,
                "policies": {"kv_aware": policy(0.0, 90.0, 1.1), "least_loaded": policy(0.0, 100.0, 1.0)},
            },
            "slower_control": {
                "has_reuse": False,
                "reference_hit_ratio": 0.0,
                "policies": {"kv_aware": policy(0.0, 106.0, 1.1), "least_loaded": policy(0.0, 100.0, 1.0)},
            },
        }
    }
    checks = {(c["workload"], c["target"]): c["met"] for c in routing_report.check_targets(results)}
    assert checks[("shared", "hit ratio >= 95% of reference")] is True  # 0.78 / 0.8 = 97.5%
    assert checks[("shared", "TTFT p90 below every peer")] is False  # 50 ms against 40 ms
    assert checks[("shared", "max/mean load <= 1.3")] is True
    assert checks[("control", "no worse than least_loaded (TTFT p90, within 5%)")] is True
    assert checks[("slower_control", "no worse than least_loaded (TTFT p90, within 5%)")] is False  # 6% worse
    assert len(checks) == 5


def test_cache_pressure_is_held_to_ninety_percent_of_the_reference_and_to_beat_the_hash_baseline():
    def policy(hit: float) -> dict:
        return {"hit_ratio": hit, "ttft_p90": 200.0, "max_over_mean_load": 1.1}

    def entry(kv: float, hashed: float) -> dict:
        policies = {"kv_aware": policy(kv), "vllm_router_consistent_hash": policy(hashed)}
        return {"has_reuse": True, "reference_hit_ratio": 0.40, "policies": policies}

    results = {"workloads": {"cache_pressure": entry(0.37, 0.38), "document_qa": entry(0.37, 0.30)}}
    checks = {(c["workload"], c["target"]): c["met"] for c in routing_report.check_targets(results)}
    assert checks[("cache_pressure", "hit ratio >= 90% of reference")] is True  # 92.5%
    assert checks[("cache_pressure", "hit ratio above vllm_router_consistent_hash")] is False
    assert checks[("document_qa", "hit ratio >= 95% of reference")] is False  # the other workloads keep 95%
    assert checks[("document_qa", "hit ratio above vllm_router_consistent_hash")] is True


@pytest.mark.slow  # ~90 s: its own engines, two workloads, two policies
def test_the_command_writes_json_markdown_and_plot_in_the_agreed_shape(tmp_path):
    output = tmp_path / "routing"
    command = [
        sys.executable, "-m", "benchmarks.routing_bench", "--engines", "2", "--num-gpu-blocks", "256",
        "--workloads", "no_reuse,shared_system_prompts", "--policies", "round_robin,least_loaded",
        "--scale", "0.05", "--rate-scale", "4", "--output", str(output),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    results = json.loads(output.with_suffix(".json").read_text())
    assert set(results["workloads"]) == {"no_reuse", "shared_system_prompts"}
    for entry in results["workloads"].values():
        assert 0.0 <= entry["reference_hit_ratio"] <= 1.0
        # The offline figures beside the reference: foresight and the bound never below what is achievable.
        assert entry["reference_hit_ratio"] <= entry["upper_bound_hit_ratio"] + 1e-4
        assert entry["foresight_hit_ratio"] <= entry["upper_bound_hit_ratio"] + 1e-4
        assert set(entry["policies"]) == {"round_robin", "least_loaded"}
        for measured in entry["policies"].values():
            for key in ("hit_ratio", "ttft_p50", "ttft_p90", "ttft_p99", "throughput", "max_over_mean_load"):
                assert isinstance(measured[key], float | int), key
            assert measured["errors"] == 0
        assert entry["floor"]["errors"] == 0
        assert entry["floor"]["hit_ratio"] == pytest.approx(entry["reference_hit_ratio"], abs=1e-4)
    assert results["workloads"]["no_reuse"]["policies"]["round_robin"]["hit_ratio"] == 0.0
    assert next(iter(results)) == "source" and len(results["source"]["commit"]) == 40
    markdown = output.with_suffix(".md").read_text()
    assert "## shared_system_prompts" in markdown and "| least_loaded |" in markdown
    assert "Floor (`run_floor`" in markdown
    assert output.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # installs py-spy from PyPI on first use
def test_profiler_names_the_function_that_burns_the_cpu(tmp_path):
    import subprocess
    import sys
    import time

    from kvgate_testing.profiling import Profiler, summarize

    busy = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "def burn_the_cpu():\n"
        "    end = time.monotonic() + 20\n"
        "    while time.monotonic() < end:\n"
        "        sum(range(1000))\n"
        "burn_the_cpu()\n"
    )])  # fmt: skip
    try:
        time.sleep(0.5)
        profiler = Profiler(busy.pid, tmp_path / "stacks.txt")
        time.sleep(2.0)
        profiler.stop()
    finally:
        busy.kill()
        busy.wait()
    summary = summarize(tmp_path / "stacks.txt")
    assert summary["samples"] > 20
    assert summary["threads"][0][1] > 0.9  # one thread did all the work
    hottest_stacks = [name for name, _share in summary["own"][:3]]
    assert any("burn_the_cpu" in name for name in hottest_stacks), summary["own"]


def test_repeated_runs_pool_every_request_and_keep_each_run() -> None:
    """`--repeats`: percentiles and hit ratio over the requests of all runs, not a mean of the runs';
    the router's decision counters summed over the runs."""

    def outcome(ttft_ms: float, prompt: int, cached: int, ok: bool = True) -> Outcome:
        return Outcome(index=0, ok=ok, sent_at=1.0, first_content_at=1.0 + ttft_ms / 1000, done_at=2.0,
                       prompt_tokens=prompt, cached_tokens=cached)  # fmt: skip

    first = [outcome(ms, 100, 50) for ms in (10, 20, 30, 40)]
    second = [outcome(ms, 100, 100) for ms in (50, 60, 70, 500)] + [outcome(9999, 100, 0, ok=False)]
    runs = [
        {"hit_ratio": 0.5, "ttft_p50": 25.0, "ttft_p90": 37.0, "max_over_mean_load": 1.0, "throughput": 2.0,
         "requests": 4, "completed": 4, "errors": 0, "send_lag_p99_ms": 3.0,
         "router_cpu_ms_per_request": 1.0, "router_decisions": {'reason="cache_hit"': 3, 'reason="cold"': 1}},
        {"hit_ratio": 1.0, "ttft_p50": 65.0, "ttft_p90": 371.0, "max_over_mean_load": 1.5, "throughput": 4.0,
         "requests": 5, "completed": 4, "errors": 1, "send_lag_p99_ms": 9.0,
         "router_cpu_ms_per_request": 3.0, "router_decisions": {'reason="cache_hit"': 4}},
    ]  # fmt: skip
    combined = routing_runs.combine_repeats(runs, first + second)
    everything = [10, 20, 30, 40, 50, 60, 70, 500]
    assert combined["ttft_p90"] == pytest.approx(np.percentile(everything, 90), abs=0.01)
    assert combined["ttft_p50"] == pytest.approx(45.0, abs=0.01)
    assert combined["hit_ratio"] == 0.75  # the failed request's tokens are not counted
    assert (combined["requests"], combined["completed"], combined["errors"]) == (9, 8, 1)
    assert combined["max_over_mean_load"] == 1.25 and combined["throughput"] == 3.0
    assert combined["send_lag_p99_ms"] == 9.0 and combined["router_cpu_ms_per_request"] == 2.0
    assert [run["ttft_p90"] for run in combined["repeats"]] == [37.0, 371.0]
    assert combined["router_decisions"] == {'reason="cache_hit"': 7, 'reason="cold"': 1}  # summed
    # Missed reuse: summed over the runs, over the pooled prompt tokens; n/a if any run had none.
    assert combined["missed_reuse_ratio"] is None
    runs[0].update(routing_runs.missed_reuse_fields({"load_guard": 40, "stale_index": 0}, 400))
    runs[1].update(routing_runs.missed_reuse_fields({"load_guard": 20, "stale_index": 20}, 400))
    combined = routing_runs.combine_repeats(runs, first + second)
    assert combined["missed_reuse_tokens"] == {"load_guard": 60, "stale_index": 20}
    assert combined["missed_reuse_ratio"] == 0.1  # 80 of the 800 tokens of the completed requests
    assert routing_runs.combine_repeats([runs[0], {"failed": "boom"}], first) == {"failed": "boom"}


def test_real_engines_are_pinned_one_per_core_with_their_children() -> None:
    """`pin_engines_to_cores`: engine i's processes (the server and what it spawned, every thread)
    run on the i-th allowed core; with more engines than cores, engine i runs on core i mod n."""
    allowed = sorted(os.sched_getaffinity(0))
    spawn_child = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    )
    # One engine more than there are cores: the last shares the first core.
    servers = [subprocess.Popen([sys.executable, "-c", spawn_child]) for _ in range(len(allowed) + 1)]
    try:
        deadline = time.monotonic() + 10
        while any(len(process_tree(s.pid)) < 2 for s in servers) and time.monotonic() < deadline:
            time.sleep(0.05)
        trees = [process_tree(s.pid) for s in servers]
        assert all(len(tree) == 2 for tree in trees), trees
        assert all(os.sched_getaffinity(pid) == set(allowed) for tree in trees for pid in tree)
        cores = pin_engines_to_cores([s.pid for s in servers[:-1]])
        assert cores == allowed
        cores = pin_engines_to_cores([s.pid for s in servers])
        assert cores == [*allowed, allowed[0]]
        for core, tree in zip(cores, trees, strict=True):
            for pid in tree:
                for thread in os.listdir(f"/proc/{pid}/task"):
                    assert os.sched_getaffinity(int(thread)) == {core}, (pid, thread)
    finally:
        for server in servers:
            for pid in reversed(process_tree(server.pid)):
                os.kill(pid, 9)
            server.wait(5)


def test_p90_interval_contains_zero_for_one_distribution_and_excludes_it_for_a_shift():
    from kvgate_testing.replay import p90_difference_interval

    generator = np.random.default_rng(3)
    runs = [generator.exponential(50.0, 300) + 40.0 for _ in range(2)]
    same = [generator.exponential(50.0, 300) + 40.0 for _ in range(2)]
    low, high = p90_difference_interval(runs, same)
    assert low < 0.0 < high
    slower = [run + 60.0 for run in same]
    low, high = p90_difference_interval(runs, slower)
    assert high < 0.0 and low > -120.0
    low, high = p90_difference_interval(slower, runs)
    assert low > 0.0


def test_p90_target_verdict_follows_the_interval_not_the_point_estimate():
    generator = np.random.default_rng(5)

    def runs(shift: float) -> list:
        return [generator.exponential(40.0, 200) + 30.0 + shift for _ in range(2)]

    def policy(samples: list) -> dict:
        pooled = np.concatenate(samples)
        return {"hit_ratio": 0.8, "ttft_p90": float(np.percentile(pooled, 90)), "max_over_mean_load": 1.0}

    verdicts = {}
    for name, peer_shift in (("clearly_ahead", 80.0), ("tied", 0.0), ("clearly_behind", -60.0)):
        samples = {"kv_aware": runs(0.0), "sglang_router_cache_aware": runs(peer_shift)}
        results = {"workloads": {name: {
            "has_reuse": True, "reference_hit_ratio": 0.8,
            "policies": {policy_name: policy(s) for policy_name, s in samples.items()},
        }}}  # fmt: skip
        (check,) = [c for c in routing_report.check_targets(results, {name: samples}) if "p90" in c["target"]]
        verdicts[name] = (check["verdict"], check["met"])
        assert "95% interval" in check["measured"]
    assert verdicts == {
        "clearly_ahead": ("met", True),
        "tied": ("within noise", False),
        "clearly_behind": ("not met", False),
    }


def test_no_reuse_verdict_reads_the_interval_against_a_five_percent_margin():
    generator = np.random.default_rng(7)

    def runs(shift: float) -> list:
        return [generator.exponential(40.0, 200) + 60.0 + shift for _ in range(2)]

    def policy(samples: list) -> dict:
        return {"ttft_p90": float(np.percentile(np.concatenate(samples), 90))}

    verdicts = {}
    for name, kv_shift in (("clearly_faster", -60.0), ("tied", 0.0), ("clearly_slower", 80.0)):
        samples = {"kv_aware": runs(kv_shift), "least_loaded": runs(0.0)}
        results = {"workloads": {name: {
            "has_reuse": False, "policies": {p: policy(s) for p, s in samples.items()},
        }}}  # fmt: skip
        (check,) = routing_report.check_targets(results, {name: samples})
        assert "95% interval" in check["measured"]
        verdicts[name] = (check["verdict"], check["met"])
    # "No worse within 5%" is met only when the whole interval lies under the margin.
    assert verdicts == {
        "clearly_faster": ("met", True),
        "tied": ("within noise", False),
        "clearly_slower": ("not met", False),
    }


def test_a_real_model_of_no_layers_is_refused_before_anything_starts() -> None:
    command = [
        sys.executable, "-m", "benchmarks.routing_bench", "--real-engines", "2", "--real-model-layers", "0"
    ]  # fmt: skip
    exited = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert exited.returncode == 2
    assert "--real-model-layers must be at least 1, got 0" in exited.stderr


def test_sse_chunks_yields_the_data_lines_json_and_skips_the_rest() -> None:
    from kvgate_testing.replay import sse_chunks

    usage = 'data: {"usage": {"prompt_tokens": 3}}'
    lines = ['data: {"choices": []}', "", ": keep-alive", "event: ping", usage]
    assert list(sse_chunks([*lines, "data: [DONE]"])) == [{"choices": []}, {"usage": {"prompt_tokens": 3}}]


def test_report_names_how_real_engines_were_pinned() -> None:
    """The report says whether each engine had a core of its own or engines shared cores."""
    remark = routing_report.engine_cores_remark
    assert remark({}) == ""
    own = remark({"engine_cores": [0, 1]})
    assert own == ", each engine's processes pinned to a core of their own (0, 1)"
    shared = remark({"engine_cores": [0, 1, 0, 1]})
    assert shared == ", each engine's processes pinned to one core, 2 cores shared evenly (0, 1, 0, 1)"


def test_sigterm_stops_the_benchmark_with_its_engines_and_router(tmp_path) -> None:
    """SIGTERM (a job scheduler's stop, `timeout`, `kill`) ends the benchmark and everything it
    started: the engines and the router run in sessions of their own, so nothing else would."""
    log = tmp_path / "bench.log"
    command = [
        sys.executable, "-m", "benchmarks.routing_bench", "--engines", "2", "--workloads", "no_reuse",
        "--policies", "round_robin", "--repeats", "50", "--no-floor", "--scale", "0.2",
        "--output", str(tmp_path / "routing"),
    ]  # fmt: skip
    with log.open("w") as output:
        bench = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while "no_reuse: round_robin" not in log.read_text() and time.monotonic() < deadline:
            assert bench.poll() is None, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)  # the router started, the replay running
        started = process_tree(bench.pid)
        assert len(started) >= 4, (started, log.read_text())  # the benchmark, 2 engines, a router
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while (alive := [pid for pid in started if _running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, (alive, log.read_text())
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait(10)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing
