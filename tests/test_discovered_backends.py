"""router/discovered_backends.py in-process: the real watcher against the fake Kubernetes API on
loopback (kvgate_testing/fake_kube_api.py, real HTTP) feeding the real BackendRegistry, whose
listeners hear every join and leave. Pods that become ready join, not-ready and terminating ones are
drained, vanished ones removed once their requests are done; a watch restart, 410 Gone and an API
server that is down keep the set; a 403 is reported with the RBAC the gateway needs; a name the file
already uses is left alone. The whole gateway with simulated engines: test_discovery_gateway.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvgate_testing.fake_kube_api import FakeKubeAPI, endpoint_slice
from router.backends import BackendRegistry, BackendState
from router.config import ConfigError, parse_config
from router.discovered_backends import DiscoveredBackends, watcher_for
from router.metrics import GatewayMetrics

NAMESPACE = "llm"
TOKEN = "discovery-test-token"
SERVICE = "vllm"


class Membership:
    """A registry listener: every join and leave, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def backend_added(self, backend: BackendState) -> None:
        self.events.append(("added", backend.name))

    def backend_removed(self, backend: BackendState) -> None:
        self.events.append(("removed", backend.name))


def discovery_section(api: FakeKubeAPI, token_file: Path, **more) -> dict:
    return {
        "kubernetes": {
            "namespace": NAMESPACE,
            "label_selector": f"kubernetes.io/service-name={SERVICE}",
            "api_server": api.url,
            "token_file": str(token_file),
        },
        "ports": {"http": "http", "kv_events": "kv-events", "replay": "kv-replay"},
        **more,
    }


def pod_slice(pod: str, address: str, ready: bool = True, terminating: bool = False, **labels: str) -> dict:
    """One slice per pod (engines on one loopback host differ by port, which a slice shares)."""
    return endpoint_slice(
        f"{SERVICE}-{pod}",
        SERVICE,
        {pod: {"address": address, "ready": ready, "terminating": terminating}},
        8000,
        {"kv-events": 5557, "kv-replay": 5558},
        {key.replace("_", "/"): value for key, value in labels.items()},
    )


async def until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s}s")
        await asyncio.sleep(0.01)


@pytest.fixture
def api():
    server = FakeKubeAPI(NAMESPACE, TOKEN).start()
    yield server
    server.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def run_discovery(
    api: FakeKubeAPI,
    token_file: Path,
    scenario: Callable[[DiscoveredBackends, BackendRegistry, Membership], Awaitable[None]],
    static: list[dict] | None = None,
    **section: object,
) -> None:
    """Run `scenario` beside a started DiscoveredBackends, on one event loop, as the gateway does."""
    config = parse_config(
        {
            "models": [{"name": "m"}],
            "backends": static or [],
            "discovery": discovery_section(api, token_file, **section),
        }
    )

    async def main() -> None:
        registry = BackendRegistry(GatewayMetrics())
        for spec in config.backends:
            registry.add(spec)
        membership = Membership()
        registry.listen(membership)
        assert config.discovery is not None
        discovered = DiscoveredBackends(config.discovery, registry, retry_s=0.05, max_retry_s=0.2)
        discovered.start()
        try:
            await scenario(discovered, registry, membership)
        finally:
            await discovered.stop()

    asyncio.run(main())


def test_a_ready_pod_joins_with_its_kv_events_a_not_ready_one_waits(api, token_file):
    api.apply(pod_slice("vllm-0", "10.0.0.1"))
    api.apply(pod_slice("vllm-1", "10.0.0.2", ready=False))

    async def scenario(discovered, registry, membership):
        await until(lambda: "vllm-0" in registry, "the ready pod in the registry")
        backend = registry["vllm-0"]
        assert backend.url == "http://10.0.0.1:8000" and backend.accepting
        assert backend.kv_events is not None
        assert backend.kv_events.endpoint == "tcp://10.0.0.1:5557"
        assert backend.kv_events.replay_endpoint == "tcp://10.0.0.1:5558"
        assert "vllm-1" not in registry  # not ready: not added yet
        api.apply(pod_slice("vllm-1", "10.0.0.2"))
        await until(lambda: "vllm-1" in registry, "the pod once ready")
        assert membership.events == [("added", "vllm-0"), ("added", "vllm-1")]

    run_discovery(api, token_file, scenario)


def test_a_terminating_pod_is_drained_then_removed_once_its_requests_are_done(api, token_file):
    api.apply(pod_slice("vllm-0", "10.0.0.1"))

    async def scenario(discovered, registry, membership):
        await until(lambda: "vllm-0" in registry, "the pod")
        backend = registry["vllm-0"]
        backend.in_flight = 1  # a request it is still answering
        api.apply(pod_slice("vllm-0", "10.0.0.1", terminating=True))
        await until(lambda: backend.draining, "the terminating pod drained")
        assert registry.candidates("m") == []  # no new request goes there
        api.delete(f"{SERVICE}-vllm-0")  # the pod is gone from the slices
        await asyncio.sleep(0.3)
        assert "vllm-0" in registry, "removed while a request was still in flight"
        backend.in_flight = 0
        await until(lambda: "vllm-0" not in registry, "the drained pod removed")
        assert membership.events == [("added", "vllm-0"), ("removed", "vllm-0")]

    run_discovery(api, token_file, scenario)


def test_a_pod_that_stops_being_ready_is_drained_and_takes_traffic_again_when_ready(api, token_file):
    api.apply(pod_slice("vllm-0", "10.0.0.1"))

    async def scenario(discovered, registry, membership):
        await until(lambda: "vllm-0" in registry, "the pod")
        api.apply(pod_slice("vllm-0", "10.0.0.1", ready=False))
        await until(lambda: registry["vllm-0"].draining, "the not-ready pod drained")
        api.apply(pod_slice("vllm-0", "10.0.0.1"))
        await until(lambda: not registry["vllm-0"].draining, "the pod ready again")
        assert membership.events == [("added", "vllm-0")]  # never removed and re-added

    run_discovery(api, token_file, scenario)


def test_watch_restarts_410_and_an_api_server_down_keep_the_backends(api, token_file, caplog):
    api.apply(pod_slice("vllm-0", "10.0.0.1"))
    caplog.set_level(logging.WARNING, logger="kvgate.discovery")

    async def scenario(discovered, registry, membership):
        await until(lambda: "vllm-0" in registry, "the pod")
        watcher = discovered.watcher
        api.drop_watches()  # a watch the server ends
        await until(lambda: watcher.counts["watches"] >= 2, "the watch resumed")
        # Down while a pod joins, and the history compacted away: the watch gets 410, the watcher lists.
        api.stop()
        api.apply(pod_slice("vllm-1", "10.0.0.2"))
        api.compact()
        api.start()
        await until(lambda: "vllm-1" in registry, "the pod the re-list found")
        assert watcher.counts["gone"] >= 1 and watcher.counts["lists"] == 2
        # Down for good: the set stays, with a warning, until the API is back.
        api.stop()
        failures = watcher.counts["failures"]
        await until(lambda: watcher.counts["failures"] >= failures + 2, "failures while the API is down")
        assert {"vllm-0", "vllm-1"} <= set(registry) and registry["vllm-0"].accepting
        assert discovered.describe()["api"] == "failing"
        assert discovered.describe()["backends"] == ["vllm-0", "vllm-1"]
        api.start()
        api.apply(pod_slice("vllm-2", "10.0.0.3"))
        await until(lambda: "vllm-2" in registry, "a change after the outage")
        assert discovered.describe()["api"] == "ok" and discovered.describe()["error"] is None
        # Through all of it, the pod was never removed nor added twice.
        assert membership.events == [("added", "vllm-0"), ("added", "vllm-1"), ("added", "vllm-2")]

    run_discovery(api, token_file, scenario)
    assert any("keeping the last 2 endpoints" in r.getMessage() for r in caplog.records)


def test_a_403_says_which_rbac_the_service_account_needs(api, token_file, caplog):
    api.forbidden_tokens.add(TOKEN)
    api.token = "another-accounts-token"
    api.apply(pod_slice("vllm-0", "10.0.0.1"))
    caplog.set_level(logging.WARNING, logger="kvgate.discovery")

    async def scenario(discovered, registry, membership):
        await until(lambda: discovered.describe()["api"] == "failing", "the refusal")
        assert "forbidden" in api.requests
        error = discovered.describe()["error"]
        assert "403" in error and "is forbidden" in error
        assert "get, list and watch on endpointslices (discovery.k8s.io)" in error
        assert len(registry) == 0

    run_discovery(api, token_file, scenario)


def test_a_backend_from_the_file_is_never_touched_and_a_pod_of_its_name_is_skipped(api, token_file):
    api.apply(pod_slice("engine-a", "10.0.0.1"))
    api.apply(pod_slice("vllm-1", "10.0.0.2"))
    static = [{"name": "engine-a", "url": "http://127.0.0.1:9000"}]

    async def scenario(discovered, registry, membership):
        await until(lambda: "vllm-1" in registry, "the other pod")
        assert registry["engine-a"].url == "http://127.0.0.1:9000"
        assert "exists already" in discovered.skipped["engine-a"]
        api.delete(f"{SERVICE}-engine-a")
        api.delete(f"{SERVICE}-vllm-1")
        await until(lambda: "vllm-1" not in registry, "the discovered pod removed")
        assert "engine-a" in registry  # the file's backend stays
        assert discovered.skipped == {}

    run_discovery(api, token_file, scenario, static=static)


def test_the_role_comes_from_the_slice_label_and_a_bad_value_or_port_skips_the_pod(api, token_file):
    api.apply(pod_slice("prefill-0", "10.0.0.1", kvgate_role="prefill"))
    api.apply(pod_slice("any-0", "10.0.0.2"))
    api.apply(pod_slice("odd-0", "10.0.0.3", kvgate_role="fast"))
    no_events = endpoint_slice("vllm-bare-0", SERVICE, {"bare-0": {"address": "10.0.0.4"}}, 8000)
    api.apply(no_events)

    async def scenario(discovered, registry, membership):
        await until(lambda: {"prefill-0", "any-0"} <= set(registry), "the two good pods")
        await until(lambda: {"odd-0", "bare-0"} <= set(discovered.skipped), "the two skipped pods")
        assert registry["prefill-0"].role == "prefill" and registry["any-0"].role == "decode"
        assert "kvgate/role='fast' is not a role" in discovered.skipped["odd-0"]
        assert "no port named 'kv-events'" in discovered.skipped["bare-0"]
        assert set(registry) == {"prefill-0", "any-0"}
        # A backend whose slice stops naming its ports is drained, not left taking traffic.
        api.apply(endpoint_slice("vllm-any-0", SERVICE, {"any-0": {"address": "10.0.0.2"}}, 8000))
        await until(lambda: registry["any-0"].draining, "the pod without its ports drained")
        assert "no port named 'kv-events'" in discovered.skipped["any-0"]

    run_discovery(api, token_file, scenario, role_label="kvgate/role", default_role="decode")


# ---- the `discovery:` section ----


def config_with(discovery: dict, backends: list | None = None) -> dict:
    return {"models": [{"name": "m"}], "backends": backends or [], "discovery": discovery}


def test_discovery_alone_is_a_valid_configuration_without_backends(token_file):
    section = {
        "kubernetes": {"namespace": "llm", "label_selector": "app=vllm", "api_server": "http://127.0.0.1:1",
                       "token_file": str(token_file)},
        "ports": {"http": 8000, "kv_events": "kv-events"},
        "models": ["m"],
    }  # fmt: skip
    config = parse_config(config_with(section))
    assert config.discovery is not None and config.discovery.ports.http == 8000
    with pytest.raises(ConfigError, match="no backends; list at least one, add `discovery:`"):
        parse_config({"models": [{"name": "m"}]})
    # A shared tier may name pods discovery will find (a StatefulSet's names are known in advance).
    static = [{"name": "static-0", "url": "http://127.0.0.1:9000"}]
    tiers = [{"name": "cpu", "backends": ["static-0", "vllm-0"]}]
    parse_config({**config_with(section, static), "shared_tiers": tiers})
    with pytest.raises(ConfigError, match="unknown backend 'vllm-0'"):
        parse_config({"models": [{"name": "m"}], "backends": static, "shared_tiers": tiers})


@pytest.mark.parametrize(
    ("change", "where", "says"),
    [
        ({"ports": {"replay": "kv-replay"}}, "discovery", "ports.replay needs ports.kv_events"),
        ({"ports": {"http": "HTTP_Port"}}, "discovery.ports.http", "Expected"),
        ({"models": ["other"]}, "discovery.models", "unknown model 'other'"),
        ({"default_role": "fast"}, "discovery.default_role", "expected one of both, decode, prefill"),
        ({"kubernetes": {"label_selector": "a=b", "api_server": "http://10.1.2.3:6443",
                         "token_file": "TOKEN"}},
         "discovery.kubernetes.api_server", "plain http beyond loopback"),
        ({"kubernetes": {"label_selector": "a=b", "api_server": "https://k:6443",
                         "token_file": "/nonexistent"}},
         "discovery.kubernetes.token_file", "cannot read '/nonexistent'"),
        ({"kubernetes": {"label_selector": "a=b", "api_server": "https://k:6443"}},
         "discovery", "api_server needs kubernetes.token_file"),
        ({"kubernetes": {"label_selector": "a=b", "token_file": "TOKEN"}},
         "discovery", "token_file and ca_file go with kubernetes.api_server"),
    ],
)  # fmt: skip
def test_a_bad_discovery_section_is_refused_with_where_and_how(token_file, change, where, says):
    section = {"kubernetes": {"namespace": "llm", "label_selector": "app=vllm"}, **change}
    if "kubernetes" in change:
        section["kubernetes"] = {
            key: (str(token_file) if value == "TOKEN" else value)
            for key, value in change["kubernetes"].items()
        }
    with pytest.raises(ConfigError) as raised:
        parse_config(config_with(section))
    assert f"invalid configuration at `{where}`" in str(raised.value)
    assert says in str(raised.value)


def test_in_cluster_credentials_come_from_the_service_account_and_their_absence_is_explained(
    tmp_path, monkeypatch
):
    config = parse_config(config_with({"kubernetes": {"label_selector": "app=vllm"}}))
    assert config.discovery is not None
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(
        ConfigError, match=r"no in-cluster credentials .* or set discovery\.kubernetes\.api_server"
    ):
        watcher_for(config.discovery, lambda endpoints: None, service_account_dir=tmp_path)
    (tmp_path / "token").write_text("in-cluster-token\n")
    (tmp_path / "namespace").write_text("inference\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    watcher = watcher_for(config.discovery, lambda endpoints: None, service_account_dir=tmp_path)
    # The pod's own namespace, the API's address and the service account's token and CA.
    assert (
        watcher._url == "https://10.96.0.1:443/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
    )
    assert watcher._headers == {"Authorization": "Bearer in-cluster-token"}
    assert watcher._verify == str(tmp_path / "ca.crt")
