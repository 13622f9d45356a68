"""`kvgate serve`: start-up checks that fail at once, before anything is launched, and its exit status."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvgate_testing.ports import free_port
from kvgate_testing.processes import REPO_ROOT, python_command

FAILING_EXTENSION = "kvgate_testing.sample_extension:create_failing_at_start"


def one_backend_config(tmp_path, **sections) -> Path:
    """A proxy.yaml on free ports with one backend nobody answers on (port 9), and `sections`."""
    config = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "models": [{"name": "tiny-qwen3"}],
        "backends": [{"name": "a", "url": "http://127.0.0.1:9"}],
        "policy": {"name": "least_loaded"},
        "log_level": "warning",
        **sections,
    }
    config_path = tmp_path / "proxy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    return config_path


def test_a_taken_listen_port_fails_at_once_with_one_line_before_any_engine_starts(tmp_path):
    engine_port = free_port()
    config = {
        "models": [{"name": "tiny-qwen3", "tokenizer": "builtin:qwen3"}],
        # Four simulated engines take tens of seconds to start on a busy machine: the port check
        # must come first.
        "launch": {
            "simulated_engines": {"count": 4, "base_port": engine_port, "events_base_port": free_port()}
        },
        "policy": {"name": "kv_aware"},
    }
    config_path = tmp_path / "proxy.yaml"
    config_path.write_text(yaml.safe_dump(config))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            python_command("-m", "router.cli", "serve", "--config", str(config_path), "--port", str(taken)),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        )
        elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{taken}" in lines[0]
    assert "Address already in use" in lines[0]
    assert "--port" in lines[0]  # how to fix it
    # Nothing was launched: the first engine's port was never taken, and the answer came quickly.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        assert probe.connect_ex(("127.0.0.1", engine_port)) != 0
    # A bound on a hang (it would launch the engines and wait for them), not a timing.
    assert elapsed < 20, f"the taken port was reported after {elapsed:.1f} s"


def test_the_check_refuses_a_listening_port_and_leaves_a_free_one_free():
    from router.startup import check_listen_address

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(OSError) as refused:
            check_listen_address("127.0.0.1", holder.getsockname()[1])
        assert refused.value.errno == errno.EADDRINUSE
    port = free_port()
    check_listen_address("127.0.0.1", port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:  # the server binds it next
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))


def test_ctrl_c_that_ends_the_loop_without_an_interrupt_still_exits_130(tmp_path, monkeypatch):
    """uvicorn re-raises a SIGINT after its graceful shutdown; asyncio's handler can turn that into
    a cancellation of a task about to finish, and `server.run` then returns normally. The exit
    status must say the gateway was interrupted all the same (the race, made certain here)."""
    import argparse

    from router import serve

    config_path = one_backend_config(tmp_path)
    interrupted_server = serve._server_class()

    class RacedServer(interrupted_server):
        def run(self, sockets=None):
            self.handle_exit(signal.SIGINT, None)  # Ctrl-C, then the loop ends without raising

    class StoppedServer(interrupted_server):
        def run(self, sockets=None):
            self.started = True  # it served, then SIGTERM stopped it
            self.handle_exit(signal.SIGTERM, None)

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--config", str(config_path)])
    monkeypatch.setattr(serve, "_server_class", lambda: RacedServer)
    assert serve.run(args) == 130
    monkeypatch.setattr(serve, "_server_class", lambda: StoppedServer)
    assert serve.run(args) == 0


@pytest.mark.parametrize("command", ["serve", "epp"])
def test_a_start_up_that_fails_exits_1_with_a_line_saying_the_gateway_did_not_start(tmp_path, command):
    """A part of the gateway that raises in the app's startup (uvicorn's lifespan): the command says
    it did not start and exits 1, as a service manager must see it (not 0, nor uvicorn's own 3)."""
    config_path = one_backend_config(tmp_path, epp={"port": free_port()})
    result = subprocess.run(
        python_command(
            "-m", "kvgate_testing.gateway_with_extensions", FAILING_EXTENSION, command,
            "--config", str(config_path),
        ),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "the sample extension refuses to start" in result.stderr  # uvicorn logged the error
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"kvgate: {config_path}: the gateway did not start: its start-up failed (the error is logged "
        "above); nothing is listening"
    ), result.stderr


def test_a_server_that_returns_without_having_started_exits_1(tmp_path, monkeypatch, capsys):
    """uvicorn releases before its exit-status rework return from run() where the start-up failed,
    instead of exiting 3: never started is exit 1 all the same."""
    import argparse

    from router import serve

    config_path = one_backend_config(tmp_path)

    class NeverStartedServer(serve._server_class()):
        def run(self, sockets=None):
            return  # the lifespan failed: uvicorn logged it and returned, self.started still False

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    monkeypatch.setattr(serve, "_server_class", lambda: NeverStartedServer)
    assert serve.run(parser.parse_args(["--config", str(config_path)])) == 1
    assert "the gateway did not start" in capsys.readouterr().err
