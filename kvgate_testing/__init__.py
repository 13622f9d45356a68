"""Helpers shared by the tests and the benchmarks: free ports, managed subprocesses, a scriptable
OpenAI backend, the real gateway, redis-server, real vLLM engines.

A top-level package rather than `tests/support`: the benchmarks use these helpers too, and a
benchmark importing from the test tree (a pytest collection root, with its conftest) ties the two
together. It is not shipped in the wheel (pyproject.toml's `packages.find` lists router and
cachelayer only): it starts test backends, redis-server and vLLM environments, which a user of the
gateway never needs. Tests and benchmarks import it from the repository root (pytest's rootdir,
`python -m benchmarks.NAME`); the processes it starts get the same root on PYTHONPATH.

Every process started through these helpers is killed by its owner (a context manager or a pytest
fixture finalizer), even when the test fails.
"""

from kvgate_testing.backend import BackendProcess, running_backends, start_backend
from kvgate_testing.gateway import GatewayProcess, start_gateway
from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, start_process, wait_for_http

__all__ = [
    "BackendProcess",
    "GatewayProcess",
    "ManagedProcess",
    "free_port",
    "running_backends",
    "start_backend",
    "start_gateway",
    "start_process",
    "wait_for_http",
]
