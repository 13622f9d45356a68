"""Shared test helpers: free ports, managed subprocesses, a scriptable OpenAI backend, the real gateway.

Every process started through these helpers is killed by its owner (a context manager or a pytest
fixture finalizer), even when the test fails.
"""

from tests.support.backend import BackendProcess, running_backends, start_backend
from tests.support.gateway import GatewayProcess, start_gateway
from tests.support.ports import free_port
from tests.support.processes import ManagedProcess, start_process, wait_for_http

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
