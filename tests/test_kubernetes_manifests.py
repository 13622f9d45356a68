"""deploy/kubernetes: every overlay renders with `kubectl kustomize`, every rendered object validates
against the schemas of a recent Kubernetes release (kubernetes-validate, strict: an unknown field
fails), and what the objects say agrees with kvgate itself: the ConfigMap's proxy.yaml loads with
the gateway's own config loader, the Deployment reads it from where it is mounted, the ports and
probes are the ones the config and the daemon listen on, the dashboard is deploy/grafana's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvgate_testing.processes import REPO_ROOT
from router.config import check_admin_exposure, parse_config

KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(path.parent.name for path in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))
# The schemas of this Kubernetes release (kubernetes-validate ships one set per release).
KUBERNETES_VERSION = "1.33.0"
# Overlays that render nothing yet, and why (each has a README saying so).
WAITING_OVERLAYS = {"epp": "waits for `kvgate epp` (the endpoint-picker issue)"}
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
            pytest.fail(f"{where}: no schema for this kind (a CRD?): validate it or list it as not validated")
        # Every namespaced object lands in the overlay's namespace.
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "kvgate", where


@pytest.mark.parametrize("overlay", OVERLAYS)
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
