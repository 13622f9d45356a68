"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every rendered object validates
against the schemas of a recent Kubernetes release (kubernetes-validate, strict: an unknown field
fails), and what the objects say agrees with kvgate itself: the ConfigMap's proxy.yaml loads with
the gateway's own config loader, the Deployment reads it from where it is mounted, the ports and
probes are the ones the config and the daemon listen on, the dashboard is deploy/grafana's. The
custom resources (the epp overlay's InferencePool and HTTPRoute) validate against their CRDs' own
schemas, vendored in tests/data/crds/ (README there: release, source, license); in the epp
overlay the pool, the picker's Service, probes and discovery agree, and a real `kvgate epp` on the
rendered config finds the pool's pods through the fake Kubernetes API."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate_testing.processes import REPO_ROOT
from router.config import check_admin_exposure, check_epp_exposure, parse_config

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(path.parent.name for path in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
# The schemas of this Kubernetes release (kubernetes-validate ships one set per release).
KUBERNETES_VERSION = "1.33.0"
# Overlays that render nothing yet, and why (each has a README saying so).
WAITING_OVERLAYS: dict[str, str] = {}
# The overlay where kvgate is an InferencePool's endpoint picker; every other one runs the proxy.
EPP_OVERLAY = "epp"
PROXY_OVERLAYS = [overlay for overlay in OVERLAYS if overlay != EPP_OVERLAY]
CRDS = REPO_ROOT / "tests" / "data" / "crds"
# Variables the manifests fill from Secret kvgate-secrets, with values of the right shape.
SECRET_ENV = {"KVGATE_ADMIN_TOKEN": "admin-token-for-the-test", "KVGATE_CLUSTER_SECRET": "c" * 32}
# kustomize `components` need kustomize 3.7 and `labels` 4.1: Debian's own kubernetes-client
# (kubectl 1.20, kustomize 2.0) renders neither.
MIN_KUSTOMIZE = (4, 1)


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail("kubectl is not installed: `bash scripts/install_system_packages.sh` (make test does it)")
    version = subprocess.run([path, "version", "--client"], capture_output=True, text=True, timeout=60)
    found = re.search(r"Kustomize Version: v(\d+)\.(\d+)", version.stdout)
    if found is None or tuple(map(int, found.groups())) < MIN_KUSTOMIZE:
        pytest.fail(
            f"kubectl at {path} is too old for these manifests (needs kustomize >= 4.1): {version.stdout}"
        )
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl(), "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{result.stderr}"
    return [document for document in yaml.safe_load_all(result.stdout) if document]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [obj for obj in objects if obj["kind"] == kind and obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, got {[o['metadata']['name'] for o in objects]}"
    return matches[0]


def config_map_for_volume(objects: list[dict[str, Any]], pod_spec: dict[str, Any], volume: str) -> dict:
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    return find(objects, "ConfigMap", volumes[volume]["configMap"]["name"])


def gateway_proxy_yaml(objects: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The proxy.yaml the gateway container reads: the file its --config names, through its mount."""
    deployment = find(objects, "Deployment", "kvgate-gateway")
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "gateway")
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    config_map = config_map_for_volume(objects, pod, mount["name"])
    return str(config_path), yaml.safe_load(config_map["data"][config_path.name])


def test_every_overlay_directory_renders_or_says_why_it_waits():
    overlay_dirs = sorted(path.name for path in (KUBERNETES / "overlays").iterdir() if path.is_dir())
    assert "standalone" in OVERLAYS
    for name in overlay_dirs:
        if name in OVERLAYS:
            continue
        assert name in WAITING_OVERLAYS, f"overlays/{name} has no kustomization.yaml and no stated reason"
        assert "waits" in (KUBERNETES / "overlays" / name / "README.md").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates_against_the_kubernetes_schemas(overlay):
    objects = render(overlay)
    assert objects
    for obj in objects:
        where = f"overlays/{overlay}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        try:
            # strict: a field the schema does not know (a typo, a misplaced key) fails too.
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} does not validate against Kubernetes {KUBERNETES_VERSION}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            schema = crd_schemas().get((obj["apiVersion"], obj["kind"]))
            if schema is None:
                pytest.fail(f"{where}: no schema for this kind: vendor its CRD in tests/data/crds/")
            check_custom_resource(obj, schema, where)
        # Every namespaced object lands in the overlay's namespace.
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "kvgate", where


@pytest.mark.parametrize("overlay", PROXY_OVERLAYS)
def test_the_gateway_config_in_the_config_map_loads_with_kvgates_loader(overlay, monkeypatch):
    objects = render(overlay)
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    config_path, data = gateway_proxy_yaml(objects)
    config = parse_config(data, f"overlays/{overlay}: {config_path}")
    # What `kvgate serve` checks before it listens on the pod's address.
    check_admin_exposure(config, config.listen.host, config_path, "listen.host")
    assert config.admin.token_env == "KVGATE_ADMIN_TOKEN"

    pod = find(objects, "Deployment", "kvgate-gateway")["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "gateway")
    # Every variable the config names comes from the Secret into the container.
    env_from_secret = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]}
    named = {config.admin.token_env} | ({config.cluster.auth_secret_env} if config.cluster else set())
    assert named <= set(env_from_secret), (named, env_from_secret)
    assert set(env_from_secret.values()) == {"kvgate-secrets"}
    # The probes and the Service reach the port the gateway listens on.
    (port,) = container["ports"]
    assert port["containerPort"] == config.listen.port
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["port"] == port["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    service = find(objects, "Service", "kvgate")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert service["spec"]["selector"].items() <= pod_labels(objects, "Deployment", "kvgate-gateway").items()
    # Replicas above one share their view (docs/gateway.md): a second replica needs `cluster:`.
    replicas = find(objects, "Deployment", "kvgate-gateway")["spec"]["replicas"]
    assert replicas == 1 or config.cluster is not None


def pod_labels(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    return find(objects, kind, name)["spec"]["template"]["metadata"]["labels"]


def test_the_cluster_component_is_the_base_config_plus_cluster_sync(monkeypatch):
    # The component replaces proxy.yaml whole: it must not drift from the base's.
    base = yaml.safe_load((KUBERNETES / "base" / "proxy.yaml").read_text())
    clustered = yaml.safe_load((KUBERNETES / "components" / "redis-cluster" / "proxy.yaml").read_text())
    cluster = clustered.pop("cluster")
    assert clustered == base
    # The Redis it names is the component's Service.
    objects = render("standalone-cluster")
    redis_service = find(objects, "Service", "kvgate-redis")
    assert cluster["url"] == f"redis://kvgate-redis:{redis_service['spec']['ports'][0]['port']}/0"
    assert (
        redis_service["spec"]["selector"].items() <= pod_labels(objects, "Deployment", "kvgate-redis").items()
    )


def test_the_discovery_component_grants_list_and_watch_on_endpointslices_to_the_gateway_only():
    # The component replaces proxy.yaml whole: the base's, with `discovery:` instead of `backends:`.
    base = yaml.safe_load((KUBERNETES / "base" / "proxy.yaml").read_text())
    found = yaml.safe_load((KUBERNETES / "components" / "discovery" / "proxy.yaml").read_text())
    discovery = found.pop("discovery")
    base.pop("backends")
    assert found == base
    assert discovery["kubernetes"].get("api_server") is None  # in-cluster credentials
    objects = render("standalone-discovery")
    _, config = gateway_proxy_yaml(objects)
    assert config["discovery"] == discovery and "backends" not in config
    # One Role: get, list, watch on EndpointSlices, nothing more, in the gateway's namespace
    # (a Role, not a ClusterRole), bound to the account the gateway's pods run as, whose token
    # they mount.
    assert [o["kind"] for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")] == []
    role = find(objects, "Role", "kvgate-discovery")
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = find(objects, "RoleBinding", "kvgate-discovery")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "kvgate-discovery",
    }
    pod = find(objects, "Deployment", "kvgate-gateway")["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "kvgate"}
    ]
    assert pod["automountServiceAccountToken"] is True
    assert find(objects, "ServiceAccount", pod["serviceAccountName"])["automountServiceAccountToken"] is True
    # Without the component, the gateway gets no API token at all.
    plain = render("standalone")
    assert (
        find(plain, "Deployment", "kvgate-gateway")["spec"]["template"]["spec"][
            "automountServiceAccountToken"
        ]
        is False
    )
    assert not [o for o in plain if o["kind"] in ("Role", "RoleBinding")]


def test_the_dashboard_config_map_is_deploy_grafanas_dashboard():
    objects = render("standalone")
    config_map = find(objects, "ConfigMap", "kvgate-grafana-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (REPO_ROOT / "deploy" / "grafana" / "kvgate.json").read_text()
    assert config_map["data"] == {"kvgate.json": shipped}
    json.loads(config_map["data"]["kvgate.json"])


def test_the_cache_daemon_serves_its_probes_and_secret_where_its_arguments_say():
    objects = render("standalone")
    pod = find(objects, "DaemonSet", "kvgate-cache")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = dict(arg.removeprefix("--").split("=", 1) for arg in container["args"])
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthcheck", "port": int(args["http-port"])}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"data": int(args["port"]), "http": int(args["http-port"])}
    # Beyond loopback the daemon needs its secret, from the Secret, in the variable it names.
    assert args["host"] == "0.0.0.0"
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env[args["auth-secret-env"]] == {"name": "kvgate-secrets", "key": "cache-secret"}
    # The shared-memory path needs the engines' network and pid namespaces (docs/deployment.md).
    assert pod["hostNetwork"] is True and pod["hostPID"] is True
    # The memfd pool is charged to the container: its memory limit holds the pool.
    limit = container["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and float(limit[:-2]) > float(args["l1-size-gb"])


# --- Custom resources: validated against their CRDs' openAPIV3Schema (tests/data/crds/) ---


def strict_schema(schema: Any) -> Any:
    """The schema with every object closed to fields it does not declare. The API server prunes
    those silently (a structural schema); here they fail, as kubernetes-validate's strict mode does."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: strict_schema(value) for key, value in schema.items()}
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        closed["additionalProperties"] = False
    return closed


_crd_schemas: dict[tuple[str, str], dict[str, Any]] = {}


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of every version of every vendored CRD."""
    if not _crd_schemas:
        for path in sorted(CRDS.glob("*.yaml")):
            crd = yaml.safe_load(path.read_text())
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                _crd_schemas[key] = strict_schema(version["schema"]["openAPIV3Schema"])
    return _crd_schemas


def check_custom_resource(obj: dict[str, Any], schema: dict[str, Any], where: str) -> None:
    """Fail with every schema violation of obj. The CRDs' CEL rules (x-kubernetes-validations) are
    not evaluated here: the cross-checks below cover the ones the overlay could break."""
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  at {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors]
        pytest.fail(f"{where} does not validate against its CRD:\n" + "\n".join(lines))


def test_the_vendored_crds_hold_the_versions_the_overlays_use():
    schemas = crd_schemas()
    assert ("inference.networking.k8s.io/v1", "InferencePool") in schemas
    assert ("gateway.networking.k8s.io/v1", "HTTPRoute") in schemas
    # Strict: the v1alpha2 spelling of the pool's fields is refused, not pruned.
    pool = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "p"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPortNumber": 8000},
    }
    with pytest.raises(pytest.fail.Exception, match=r"targetPortNumber|targetPorts"):
        check_custom_resource(pool, schemas[("inference.networking.k8s.io/v1", "InferencePool")], "pool")


# --- overlays/epp: kvgate as the endpoint picker of an InferencePool ---


def label_selector_as_labels(selector: str) -> dict[str, str]:
    """An equality selector `k=v,k2=v2` (discovery.kubernetes.label_selector) as matchLabels."""
    pairs = [term.split("=", 1) for term in selector.split(",")]
    assert all(len(pair) == 2 and not pair[0].endswith("!") for pair in pairs), selector
    return {key.strip(): value.strip() for key, value in pairs}


def picker_container(objects: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = find(objects, "Deployment", "kvgate-epp")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def picker_proxy_yaml(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The proxy.yaml the picker reads: the file its --config names, through its mount."""
    pod, container = picker_container(objects)
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    return yaml.safe_load(config_map_for_volume(objects, pod, mount["name"])["data"][config_path.name])


def check_epp_render(objects: list[dict[str, Any]]) -> None:
    """What must agree across the epp overlay's objects for the gateway to reach its picker and
    the picker to see the pool's pods. Raises AssertionError naming the first disagreement."""
    config = picker_proxy_yaml(objects)
    _, container = picker_container(objects)
    pool = find(objects, "InferencePool", "kvgate-pool")["spec"]
    # endpointPickerRef -> a Service of this render, on one of its ports, which reaches the picker's
    # container on the port `epp.port` says it listens on.
    ref = pool["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == "", ref
    services = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == ref["name"]]
    service = services[0] if services else None
    assert service is not None, f"endpointPickerRef names Service {ref['name']}, which the render lacks"
    service_port = next((p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]), None)
    assert service_port is not None, (
        f"endpointPickerRef port {ref['port']['number']} is not a port of Service {ref['name']}: "
        f"{[p['port'] for p in service['spec']['ports']]}"
    )
    assert service["spec"]["selector"].items() <= pod_labels(objects, "Deployment", "kvgate-epp").items()
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    target = service_port["targetPort"]
    assert container_ports.get(target, target) == config["epp"]["port"], (
        f"Service {ref['name']} port {ref['port']['number']} reaches container port {target}, not epp.port"
    )
    assert service_port.get("appProtocol") == "http2"  # gRPC
    # The kubelet's gRPC probes ask grpc.health.v1 on the picker's port, for the services it serves.
    for probe, service_name in (("readinessProbe", "readiness"), ("livenessProbe", "liveness")):
        expected = {"port": config["epp"]["port"], "service": service_name}
        assert container[probe]["grpc"] == expected, f"{probe}: {container[probe]} is not {expected}"

    # The picker discovers the pods the pool selects, on the pool's target port.
    discovery = config["discovery"]
    selector = label_selector_as_labels(discovery["kubernetes"]["label_selector"])
    assert selector == pool["selector"]["matchLabels"], (
        f"discovery selects {selector}, the pool {pool['selector']['matchLabels']}"
    )
    targets = [port["number"] for port in pool["targetPorts"]]
    assert targets == [discovery["ports"]["http"]], (
        f"the pool's target ports {targets} are not discovery.ports.http {discovery['ports']['http']}"
    )
    # The route sends its traffic to this pool.
    route = find(objects, "HTTPRoute", "kvgate-pool")["spec"]
    backends = [ref for rule in route["rules"] for ref in rule["backendRefs"]]
    assert backends == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvgate-pool"}
    ]
    # Only the route's Gateway's pods may open streams on the picker's port.
    policy = find(objects, "NetworkPolicy", "kvgate-epp")["spec"]
    picker_labels = pod_labels(objects, "Deployment", "kvgate-epp")
    assert policy["podSelector"]["matchLabels"].items() <= picker_labels.items()
    grpc_rules = [rule for rule in policy["ingress"] if {"port": config["epp"]["port"]} in rule["ports"]]
    (gateway,) = route["parentRefs"]
    assert [rule["from"] for rule in grpc_rules] == [
        [
            {
                "namespaceSelector": {},
                "podSelector": {"matchLabels": {"gateway.networking.k8s.io/gateway-name": gateway["name"]}},
            }
        ]
    ]


def test_the_epp_overlay_deploys_the_picker_in_place_of_the_proxy():
    objects = render(EPP_OVERLAY)
    check_epp_render(objects)
    kinds_and_names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("Deployment", "kvgate-gateway") not in kinds_and_names
    assert ("Service", "kvgate") not in kinds_and_names
    _, container = picker_container(objects)
    assert container["command"] == ["kvgate", "epp"]


def test_the_picker_config_loads_with_kvgates_loader_and_may_listen_on_the_pods_address(monkeypatch):
    objects = render(EPP_OVERLAY)
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    data = picker_proxy_yaml(objects)
    config = parse_config(data, "overlays/epp: proxy.yaml")
    # What `kvgate epp` checks before it listens (router/epp/cli.py).
    check_admin_exposure(config, config.listen.host, "proxy.yaml", "listen.host")
    check_epp_exposure(config, config.epp.host, "proxy.yaml", "epp.host")
    assert config.discovery is not None and config.listen.workers == 1
    pod, container = picker_container(objects)
    env = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"]}
    assert env == {config.admin.token_env: "kvgate-secrets"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": config.epp.port,
        "http": config.listen.port,
    }
    # Discovery's RBAC (components/discovery) is bound to the account the picker runs as, whose
    # token its pods mount; one replica unless the pickers share their view.
    binding = find(objects, "RoleBinding", "kvgate-discovery")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "kvgate"}
    ]
    assert pod["automountServiceAccountToken"] is True
    assert find(objects, "Deployment", "kvgate-epp")["spec"]["replicas"] == 1 or config.cluster is not None


def probe(deployment: dict[str, Any], which: str) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]["containers"][0][which]["grpc"]


def broken(objects: list[dict[str, Any]], kind: str, name: str, edit) -> list[dict[str, Any]]:
    copy = json.loads(json.dumps(objects))
    edit(find(copy, kind, name))
    return copy


@pytest.mark.parametrize(
    ("kind", "name", "edit", "message"),
    [
        pytest.param(
            "InferencePool",
            "kvgate-pool",
            lambda pool: pool["spec"]["endpointPickerRef"]["port"].update(number=9003),
            "port 9003 is not a port of Service kvgate-epp",
            id="the pool points at a port the picker's Service lacks",
        ),
        pytest.param(
            "InferencePool",
            "kvgate-pool",
            lambda pool: pool["spec"]["endpointPickerRef"].update(name="epp"),
            "which the render lacks",
            id="the pool points at a Service that is not rendered",
        ),
        pytest.param(
            "Service",
            "kvgate-epp",
            lambda service: service["spec"]["ports"][0].update(targetPort="http"),
            "reaches container port http",
            id="the Service sends the picker's port to the metrics port",
        ),
        pytest.param(
            "InferencePool",
            "kvgate-pool",
            lambda pool: pool["spec"]["selector"]["matchLabels"].update(app="other"),
            "discovery selects",
            id="the pool selects other pods than the picker discovers",
        ),
        pytest.param(
            "InferencePool",
            "kvgate-pool",
            lambda pool: pool["spec"]["targetPorts"][0].update(number=8001),
            "the pool's target ports [8001]",
            id="the pool targets another port than the picker's discovery",
        ),
        pytest.param(
            "Deployment",
            "kvgate-epp",
            lambda deployment: probe(deployment, "readinessProbe").update(port=9003),
            "readinessProbe",
            id="the readiness probe asks another port",
        ),
    ],
)
def test_a_broken_epp_render_fails_the_check(kind, name, edit, message):
    objects = render(EPP_OVERLAY)
    check_epp_render(objects)  # the shipped render passes
    with pytest.raises(AssertionError, match=re.escape(message)):
        check_epp_render(broken(objects, kind, name, edit))


def test_a_misspelled_field_of_the_pool_fails_its_crd_schema():
    objects = render(EPP_OVERLAY)
    schema = crd_schemas()[("inference.networking.k8s.io/v1", "InferencePool")]
    check_custom_resource(find(objects, "InferencePool", "kvgate-pool"), schema, "pool")
    # v1alpha2's name of endpointPickerRef, and a port number out of range: both refused.
    misnamed = broken(
        objects,
        "InferencePool",
        "kvgate-pool",
        lambda pool: pool["spec"].update(extensionRef=pool["spec"].pop("endpointPickerRef")),
    )
    with pytest.raises(pytest.fail.Exception, match="extensionRef"):
        check_custom_resource(find(misnamed, "InferencePool", "kvgate-pool"), schema, "pool")
    out_of_range = broken(
        objects,
        "InferencePool",
        "kvgate-pool",
        lambda pool: pool["spec"]["targetPorts"][0].update(number=70000),
    )
    with pytest.raises(pytest.fail.Exception, match="70000"):
        check_custom_resource(find(out_of_range, "InferencePool", "kvgate-pool"), schema, "pool")
    route_schema = crd_schemas()[("gateway.networking.k8s.io/v1", "HTTPRoute")]
    check_custom_resource(find(objects, "HTTPRoute", "kvgate-pool"), route_schema, "route")
    bad_route = broken(
        objects, "HTTPRoute", "kvgate-pool", lambda route: route["spec"]["rules"][0].update(backendRef=[])
    )
    with pytest.raises(pytest.fail.Exception, match="backendRef"):
        check_custom_resource(find(bad_route, "HTTPRoute", "kvgate-pool"), route_schema, "route")


# One simulated engine, the fake Kubernetes API and a real `kvgate epp`: about 5 s.
def test_the_picker_with_the_overlays_config_finds_the_pools_pods_and_answers_its_probes(
    tmp_path: Path, monkeypatch
):
    """The rendered proxy.yaml drives a real picker. Replaced for a run outside a pod: the API's
    address and token (a pod uses its service account's), the namespace, the listeners (loopback
    ports) and the engine's port and model (a simulated engine on a free port)."""
    from kvgate_testing.fake_kube_api import FakeKubeAPI, endpoint_slice
    from kvgate_testing.picker import PickerProcess, grpc_health
    from kvgate_testing.sim_fleet import MODEL, EngineFleet
    from kvgate_testing.waiting import wait_for

    objects = render(EPP_OVERLAY)
    config = picker_proxy_yaml(objects)
    pool = find(objects, "InferencePool", "kvgate-pool")["spec"]
    _, container = picker_container(objects)
    for name, value in SECRET_ENV.items():
        monkeypatch.setenv(name, value)
    token_file = tmp_path / "token"
    token_file.write_text("picker-token")
    api = FakeKubeAPI("kvgate", "picker-token").start()
    fleet = EngineFleet(1, num_gpu_blocks=256)
    picker = None
    try:
        fleet.start()
        (engine,) = fleet.engines
        port = int(engine.url.rsplit(":", 1)[1])
        pod = {"address": "127.0.0.1"}
        # A Service carrying the pool's labels (its slices copy them), and one that does not.
        api.apply(
            endpoint_slice("vllm-x", "vllm", {"vllm-0": pod}, port, labels=pool["selector"]["matchLabels"])
        )
        api.apply(endpoint_slice("other-x", "other", {"other-0": pod}, port, labels={"app": "other"}))
        config["models"] = [{"name": MODEL}]
        config["discovery"]["kubernetes"] |= {
            "api_server": api.url,
            "token_file": str(token_file),
            "namespace": "kvgate",
        }
        config["discovery"]["ports"] = {"http": port}
        picker = PickerProcess(config).start(timeout_s=120)  # returns once `readiness` is SERVING
        wait_for(
            lambda: (
                httpx.get(f"{picker.url}/health", timeout=10).json()["discovery"]["backends"] == ["vllm-0"]
            ),
            30,
            "the pool's pod, and only it, as a backend",
        )
        health = httpx.get(f"{picker.url}/health", timeout=10).json()
        assert health["backends"] == {"vllm-0": "healthy"}
        # The kubelet's probes: the services the Deployment names answer SERVING.
        for probe in ("readinessProbe", "livenessProbe"):
            assert grpc_health(picker.grpc_address, container[probe]["grpc"]["service"]) == "SERVING"
    finally:
        if picker is not None:
            picker.stop()
        fleet.stop()
        api.stop()
