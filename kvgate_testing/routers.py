"""The routers a benchmark puts in front of an engine fleet: kvgate with each policy, and the peers.

Each launcher starts one router process on a free loopback port, waits until it forwards a request
(and, for a kvgate gateway with KV events, until every subscriber has caught up with what its engine
still buffers, so that catch-up is not charged to the measured run), and returns a `RunningRouter`.
The peers (sglang-router, vllm-router) come from PyPI into their own virtual environments under
.cache/peers/ (scripts/install_peers.sh), never into the project's.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.proc_stats import thread_names
from kvgate_testing.processes import REPO_ROOT, ManagedProcess
from kvgate_testing.sim_fleet import MODEL, EngineFleet, gateway_backend

PEERS_DIR = REPO_ROOT / ".cache" / "peers"
PEER_DISTRIBUTIONS = ("sglang-router", "vllm-router")
KVGATE_POLICIES = ("round_robin", "least_loaded", "session", "approximate", "kv_aware")
PEER_POLICIES = ("sglang_router_cache_aware", "vllm_router_cache_aware", "vllm_router_kv_aware")
# kv_aware told which engines share a KV tier (the fleet's `shared_tiers`); needs a fleet with one.
SHARED_TIER_POLICY = "kv_aware_shared_tiers"
# Baselines: not cache-aware, so not among the peers kv_aware's TTFT targets compare against.
# vllm-router's consistent_hash puts each x-session-id on a fixed worker (a hash ring, 160 virtual
# nodes a worker); the workloads name the prefix family in the session (cache_pressure: the
# prefix), so it is "hash each prefix family onto a fixed engine".
BASELINE_POLICIES = ("vllm_router_consistent_hash",)
# Behind the real Envoy (routing_bench --via envoy): kv_aware as Envoy's endpoint picker (`kvgate epp`),
# and Envoy alone balancing the engines by its own LEAST_REQUEST (the latency reference).
# `kv_aware_via_envoy` runs deploy/envoy/envoy-epp.yaml's processing modes as they stand (the answer's
# end from Envoy's access log); `..._one_round_trip` the same with the request body STREAMED and sent
# without waiting for the headers' answer (the file's STREAMED variant); `..._streamed_body` the
# earlier design: the request body streamed through the picker and re-emitted, the response headers
# and every answer chunk through it too.
VIA_ENVOY_POLICY = "kv_aware_via_envoy"
VIA_ENVOY_ONE_ROUND_TRIP_POLICY = "kv_aware_via_envoy_one_round_trip"
VIA_ENVOY_STREAMED_BODY_POLICY = "kv_aware_via_envoy_streamed_body"
ENVOY_ALONE_POLICY = "envoy_least_request"
VIA_ENVOY_POLICY_NAMES = (VIA_ENVOY_POLICY, VIA_ENVOY_ONE_ROUND_TRIP_POLICY, VIA_ENVOY_STREAMED_BODY_POLICY)
ENVOY_POLICIES = (*VIA_ENVOY_POLICY_NAMES, ENVOY_ALONE_POLICY)
# The processing modes of `..._streamed_body`.
STREAMED_BODY_MODES = {
    "request_header_mode": "SEND",
    "request_body_mode": "FULL_DUPLEX_STREAMED",
    "request_trailer_mode": "SEND",
    "response_header_mode": "SEND",
    "response_body_mode": "FULL_DUPLEX_STREAMED",
    "response_trailer_mode": "SEND",
}
# Knobs of the via-Envoy routers that set Envoy's ext_proc processing_mode, not the policy.
ENVOY_MODE_KNOBS = frozenset(
    {"request_body_mode", "request_trailer_mode", "response_header_mode", "response_body_mode",
     "response_trailer_mode"}
)  # fmt: skip
ALL_POLICIES = (*KVGATE_POLICIES, SHARED_TIER_POLICY, *PEER_POLICIES, *BASELINE_POLICIES, *ENVOY_POLICIES)
# vllm-router's kv_aware is left out by default: against the simulated engines its debug log shows
# credited_prefix_tokens=0 on every decision (it does not recognise the simulator's block hashes), so
# its numbers would measure that mismatch, not its routing.
# The kvgate policies that fill Choice.candidates, from which the gateway counts missed reuse
# (router/missed_reuse.py; docs/gateway.md, "Missed reuse"). round_robin, least_loaded and session
# see no cache, and the peers publish no such metric.
MISSED_REUSE_POLICIES = ("approximate", "kv_aware", SHARED_TIER_POLICY, *VIA_ENVOY_POLICY_NAMES)
DEFAULT_POLICIES = (
    *KVGATE_POLICIES,
    "sglang_router_cache_aware",
    "vllm_router_cache_aware",
    *BASELINE_POLICIES,
)


@dataclass(slots=True)
class RunningRouter:
    policy: str
    url: str
    process: ManagedProcess
    stop: Callable[[], None]
    # True when responses carry x-kvgate-backend (kvgate), so the client can count load itself.
    names_backend: bool = False
    # The router's Prometheus endpoint: its routing-decision counters go into the results.
    metrics_url: str | None = None
    # True when the router counts missed reuse (kvgate_missed_reuse_tokens_total): a kvgate policy
    # that scores candidates by their cached prefixes (MISSED_REUSE_POLICIES). The others have no
    # such count: their results say "n/a", not 0.
    counts_missed_reuse: bool = False


def start_router(policy: str, fleet: EngineFleet, timeout_s: float = 90.0) -> RunningRouter:
    """`policy` is a name from ALL_POLICIES; a kvgate policy may carry its config knobs after an @,
    e.g. `kv_aware@load_slack=0+max_load_ratio=1.2` (the keys of its section in proxy.yaml)."""
    name, _, knobs = policy.partition("@")
    if name in (*KVGATE_POLICIES, SHARED_TIER_POLICY):
        return _start_kvgate(name, _parse_knobs(knobs), fleet, timeout_s, label=policy)
    if policy in PEER_POLICIES or policy in BASELINE_POLICIES:
        return _start_peer(policy, fleet, timeout_s)
    if name in VIA_ENVOY_POLICY_NAMES:
        return _start_via_envoy(policy, _parse_knobs(knobs), fleet, timeout_s)
    if policy == ENVOY_ALONE_POLICY:
        return _start_envoy_alone(fleet, timeout_s)
    raise ValueError(f"unknown policy {policy!r}; known: {', '.join(ALL_POLICIES)}")


def _parse_knobs(text: str) -> dict:
    knobs = {}
    for item in filter(None, text.split("+")):
        key, separator, value = item.partition("=")
        if not separator:
            raise ValueError(f"policy knob {item!r} must look like key=value")
        knobs[key.strip()] = yaml.safe_load(value)
    return knobs


def kvgate_backends(fleet: EngineFleet, policy: str) -> list[dict]:
    """The `backends:` section of a kvgate config for the fleet's engines under `policy`."""
    backends = []
    for engine in fleet.engines:
        # Only kv_aware reads KV events; the others would pay for nothing.
        if policy in ("kv_aware", SHARED_TIER_POLICY):
            # Real vLLM connects its PUB out to this endpoint (real_fleet.py): bind it here.
            backends.append(gateway_backend(engine, bind=getattr(fleet, "events_bind", False)))
        else:
            backends.append({"name": engine.name, "url": engine.url})
    return backends


def wait_for_huge_pages(pid: int, appear_s: float = 3.0, timeout_s: float = 60.0) -> None:
    """Return once the gateway's heap collapse (router/huge_pages.py, a thread named THREAD_NAME)
    has ended, or did not show up within `appear_s`: a benchmark counts the router's CPU per
    request from its start, and the collapse's one-off CPU (about 0.6 s) is not the requests'."""
    from router.huge_pages import THREAD_NAME

    seen = False
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        running = THREAD_NAME in thread_names(pid).values()
        seen = seen or running
        if (seen and not running) or (not seen and time.monotonic() - started > appear_s):
            return
        time.sleep(0.02)
    raise TimeoutError(f"the gateway {pid}'s huge-page collapse ran over {timeout_s:g} s")


def _start_kvgate(
    policy: str, knobs: dict, fleet: EngineFleet, timeout_s: float, label: str
) -> RunningRouter:
    config = kvgate_config(policy, knobs, fleet)
    # As users run it: the heap on huge pages (start_gateway leaves them off for tests).
    gateway: GatewayProcess = start_gateway(config, timeout_s=timeout_s, huge_pages=True)
    try:
        _wait_until_forwarding(gateway.url, gateway.process, timeout_s)
        wait_until_synced(gateway.url, timeout_s)
        wait_for_huge_pages(gateway.process.pid)
    except BaseException:
        gateway.stop()
        raise
    return RunningRouter(
        label,
        gateway.url,
        gateway.process,
        gateway.stop,
        names_backend=True,
        metrics_url=f"{gateway.url}/metrics",
        counts_missed_reuse=policy in MISSED_REUSE_POLICIES,
    )


def kvgate_config(policy: str, knobs: dict, fleet: EngineFleet) -> dict:
    """The proxy.yaml mapping of a kvgate router (`kvgate serve` or `kvgate epp`) over the fleet."""
    shared_tiers: dict = {}
    if policy == SHARED_TIER_POLICY:
        if not getattr(fleet, "shared_tiers", None):
            raise ValueError(f"{policy} needs engines that share a KV tier (routing_bench --shared-tier)")
        shared_tiers = {"shared_tiers": fleet.shared_tiers}
    return {
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, policy),
        "policy": {"name": "kv_aware" if policy == SHARED_TIER_POLICY else policy, **knobs},
        **shared_tiers,
        "log_level": "warning",
        **getattr(fleet, "gateway_settings", {}),  # e.g. slower health checks for real engines
    }


def _start_via_envoy(policy: str, knobs: dict, fleet: EngineFleet, timeout_s: float) -> RunningRouter:
    """Envoy in front of `kvgate epp` (kv_aware): the router's process is the picker's, so the CPU a
    run records is the picker's alone (Envoy's is its own process, `envoy_pid` in the result)."""
    from kvgate_testing.envoy import (
        ResponseBodyMode,
        deploy_buffer_limit,
        ext_proc_settings,
        load_deploy_config,
    )

    # Knobs naming ext_proc processing_mode fields (e.g. response_header_mode=SEND) go to Envoy.
    modes = {key: str(knobs.pop(key)) for key in list(knobs) if key in ENVOY_MODE_KNOBS}
    if policy.partition("@")[0] == VIA_ENVOY_STREAMED_BODY_POLICY:
        base = dict(STREAMED_BODY_MODES)
    else:
        base = {
            key: str(value)
            for key, value in ext_proc_settings(load_deploy_config())["processing_mode"].items()
        }
    config = kvgate_config("kv_aware", knobs, fleet)
    if policy.partition("@")[0] == VIA_ENVOY_ONE_ROUND_TRIP_POLICY:
        base["request_body_mode"] = "STREAMED"
        # Envoy holds a STREAMED body until the pick: the picker's limit stays within Envoy's buffer.
        config["epp"] = {"max_body_bytes": deploy_buffer_limit()}
    modes = {**base, **modes}
    pair = start_envoy_and_picker_with_modes(
        config, ResponseBodyMode(modes["response_body_mode"]), modes, timeout_s
    )
    try:
        _wait_until_forwarding(pair.url, pair.picker.process, timeout_s)
        wait_until_synced(pair.picker.url, timeout_s)
    except BaseException:
        pair.stop()
        raise
    assert pair.picker.process is not None
    return RunningRouter(
        policy,
        pair.url,
        pair.picker.process,
        pair.stop,
        metrics_url=f"{pair.picker.url}/metrics",
        counts_missed_reuse=True,  # the three routing-time reasons; the picker never sees usage
    )


def start_envoy_and_picker_with_modes(
    config: dict, response_body_mode: Any, modes: dict[str, str], timeout_s: float
) -> Any:
    """start_envoy_and_picker, with these ext_proc processing_mode fields set on Envoy's side."""
    from kvgate_testing.envoy import BodyMode, EnvoyProcess, ext_proc_settings, picker_config
    from kvgate_testing.picker import EnvoyWithPicker, PickerProcess

    body_mode = BodyMode(modes.get("request_body_mode", BodyMode.FULL_DUPLEX_STREAMED))
    picker = PickerProcess(config, huge_pages=True).start(timeout_s)
    try:
        assert picker.process is not None
        wait_for_huge_pages(picker.process.pid)
        envoy_config = picker_config(
            free_port(), free_port(), ("127.0.0.1", picker.grpc_port), body_mode,
            response_body_mode=response_body_mode,
        )  # fmt: skip
        ext_proc_settings(envoy_config)["processing_mode"].update(modes)
        envoy = EnvoyProcess(envoy_config).start()
    except BaseException:
        picker.stop()
        raise
    return EnvoyWithPicker(picker, envoy)


def _start_envoy_alone(fleet: EngineFleet, timeout_s: float) -> RunningRouter:
    from kvgate_testing.envoy import start_envoy_alone

    envoy = start_envoy_alone([engine.url for engine in fleet.engines])
    try:
        assert envoy.process is not None
        _wait_until_forwarding(envoy.url, envoy.process, timeout_s)
    except BaseException:
        envoy.stop()
        raise
    assert envoy.process is not None
    return RunningRouter(ENVOY_ALONE_POLICY, envoy.url, envoy.process, envoy.stop)


SOCAT_RELAY = "socat_relay"


def start_socat_relay(fleet: EngineFleet, timeout_s: float = 30.0) -> RunningRouter:
    """socat (Debian's) relaying bytes to the fleet's first engine: one more loopback TCP hop and one
    more process to wake, with no HTTP in it. A reference for what any router's hop costs on this
    host, below which no proxy can go; not a router (it parses nothing, balances nothing)."""
    binary = shutil.which("socat")
    if binary is None:
        raise RuntimeError("socat is not installed: `apt-get install -y socat` (the reference hop)")
    engine = fleet.engines[0].url.removeprefix("http://")
    port = free_port()
    # A child per client connection (fork); 64 KiB reads; Nagle off both ways, as the routers have it.
    process = ManagedProcess(
        [binary, "-b", "65536", f"TCP-LISTEN:{port},bind=127.0.0.1,reuseaddr,fork,nodelay",
         f"TCP:{engine},nodelay"]
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_forwarding(url, process, timeout_s)
    except BaseException:
        process.kill()
        raise
    return RunningRouter(SOCAT_RELAY, url, process, process.stop)


def wait_until_synced(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    """Wait until /debug/prefix-map says every backend with KV events is `synced` (its subscribers
    have replayed what the engine still buffers); TimeoutError naming the laggards otherwise."""
    deadline = time.monotonic() + timeout_s
    laggards: dict[str, str] = {}
    last_error = ""
    while True:
        try:
            response = httpx.get(
                f"{url}/debug/prefix-map", params={"format": "json"}, headers=headers, timeout=10.0
            )
            response.raise_for_status()
            backends = response.json()["backends"]
            laggards = {
                name: (
                    f"connected={entry.get('connected')} last_seq={entry.get('last_seq')} "
                    f"replayed_batches={entry.get('replayed_batches')}"
                )
                for name, entry in backends.items()
                if entry.get("events") and entry.get("synced") is not True
            }
            last_error = ""
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            last_error = f"{url}/debug/prefix-map: {exc!r}"
        if not laggards and not last_error:
            return
        if time.monotonic() >= deadline:
            detail = last_error or "; ".join(f"{name} ({state})" for name, state in sorted(laggards.items()))
            raise TimeoutError(
                f"gateway at {url}: KV-event subscribers not synced within {timeout_s}s: {detail}. "
                "Check that the engines' replay endpoints answer (kv_events.replay_endpoint), or "
                "raise the timeout for very long replay buffers."
            )
        time.sleep(0.1)


def peer_versions() -> dict[str, str]:
    """The version of each peer router installed under .cache/peers/, for the reports to record."""
    versions = {}
    for name in PEER_DISTRIBUTIONS:
        site_packages = [str(path) for path in (PEERS_DIR / name).glob("lib/python*/site-packages")]
        installed = next(iter(metadata.distributions(name=name, path=site_packages)), None)
        versions[name] = installed.version if installed is not None else "not installed"
    return versions


def peer_versions_line(versions: dict[str, str], note: str | None = None) -> str:
    """One line of a report: which peer releases were measured (`note`: how they were found, for
    runs that did not record them)."""
    listed = ", ".join(f"{name} {version}" for name, version in versions.items())
    return f"Peer routers: {listed} ({note or 'PyPI, installed by scripts/install_peers.sh'})."


def ensure_peers_installed() -> None:
    """Install the peer routers (scripts/install_peers.sh) unless both are already there."""
    if all(_peer_binary(name).exists() for name in PEER_DISTRIBUTIONS):
        return
    script = REPO_ROOT / "scripts" / "install_peers.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=REPO_ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{script} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


def _peer_binary(name: str) -> Path:
    return PEERS_DIR / name / "bin" / name


def _start_peer(policy: str, fleet: EngineFleet, timeout_s: float) -> RunningRouter:
    ensure_peers_installed()
    port = free_port()
    metrics_port = free_port()  # both peers default to a fixed Prometheus port (29000): never share it
    workers = [engine.url for engine in fleet.engines]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]  # fmt: skip
    if policy == "sglang_router_cache_aware":
        args = [str(_peer_binary("sglang-router")), "launch", *common, "--policy", "cache_aware",
                "--log-level", "warn"]  # fmt: skip
    elif policy == "vllm_router_cache_aware":
        args = [str(_peer_binary("vllm-router")), *common, "--policy", "cache_aware",
                "--log-level", "warning"]  # fmt: skip
    elif policy == "vllm_router_consistent_hash":
        args = [str(_peer_binary("vllm-router")), *common, "--policy", "consistent_hash",
                "--log-level", "warning"]  # fmt: skip
    else:
        # vllm-router's own KV-event-driven policy, fed by the same event streams kvgate reads.
        args = [str(_peer_binary("vllm-router")), *common, "--policy", "kv_aware", "--log-level", "warning",
                "--kv-event-block-size", str(fleet.block_size), "--kv-event-model", MODEL]  # fmt: skip
        for engine in fleet.engines:
            args += ["--kv-event-source", f"{engine.url}={engine.events_endpoint}"]
            args += ["--kv-event-replay-source", f"{engine.url}={engine.replay_endpoint}"]
    process = ManagedProcess(args)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_forwarding(url, process, timeout_s)
    except BaseException:
        process.stop()
        raise
    return RunningRouter(
        policy, url, process, process.stop, metrics_url=f"http://127.0.0.1:{metrics_port}/metrics"
    )


# The routers' counters of how each request was routed, kept per run. vllm-router's cache_aware
# tokenizes every request on every worker over HTTP before it matches prefixes; when those calls time
# out it routes with no prefix at all (outcome="missing_tokens", result="preparation_unavailable").
# kvgate's cache-aware policies count their decisions by reason (cache_hit, cache_vs_load, load_guard,
# cold_spread, ...: docs/index.md): a conversation moved off its engine shows there. kvgate's missed
# reuse (tokens by reason) is scraped with them; `missed_reuse` splits it off.
MISSED_REUSE_COUNTER = "kvgate_missed_reuse_tokens_total"
DECISION_COUNTERS = (
    "vllm_router_prefix_routing_decisions_total",
    "vllm_router_kv_routing_inputs_total",
    "kvgate_route_decisions_total",
    MISSED_REUSE_COUNTER + "{",
)


def decision_counters(router: RunningRouter) -> dict[str, float]:
    """The router's routing-decision counters (DECISION_COUNTERS, by label set); {} where it has none."""
    if router.metrics_url is None:
        return {}
    try:
        text = httpx.get(router.metrics_url, timeout=10.0).text
    except httpx.HTTPError:
        return {}
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(DECISION_COUNTERS):
            name, _, value = line.rpartition(" ")
            counters[name] = counters.get(name, 0.0) + float(value)
    return counters


def missed_reuse(counters: dict[str, float]) -> tuple[dict[str, float], dict[str, int]]:
    """(the other counters, missed reuse tokens by reason) of `decision_counters`' scrape (or of the
    difference of two)."""
    others: dict[str, float] = {}
    missed: dict[str, int] = {}
    for name, value in counters.items():
        if name.startswith(MISSED_REUSE_COUNTER + "{"):
            reason = name.partition('reason="')[2].partition('"')[0]
            missed[reason] = missed.get(reason, 0) + round(value)
        else:
            others[name] = value
    return others, missed


def _wait_until_forwarding(url: str, process: ManagedProcess, timeout_s: float) -> None:
    """Wait until the router answers a tiny chat request with 200 (it has found healthy workers)."""
    deadline = time.monotonic() + timeout_s
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    last = "no attempt"
    while time.monotonic() < deadline:
        if not process.alive():
            code = process.popen.returncode
            raise RuntimeError(f"{process.args[0]} exited with {code}:\n{process.output()[-3000:]}")
        try:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=5.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise TimeoutError(
        f"router at {url} did not forward within {timeout_s}s ({last}):\n{process.output()[-3000:]}"
    )
