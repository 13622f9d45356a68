"""kvgate_testing.ports.free_port: the OS may report one free port to two calls in a row; the
helper never hands out a port it handed out lately (an engine's HTTP, KV-event and replay ports
asked for at once must differ)."""

from __future__ import annotations

import socket

from kvgate_testing import ports


class _RepeatingSocket(socket.socket):
    """A real socket whose reported port comes from a script (the OS repeating itself)."""

    script: list[int] = []

    def getsockname(self):  # type: ignore[override]
        super().getsockname()
        return ("127.0.0.1", self.script.pop(0))


def test_a_port_the_os_reports_twice_is_handed_out_once(monkeypatch):
    first = ports.free_port()  # a real port, now among the recent ones
    other = first + 1 if first < 65535 else first - 1
    _RepeatingSocket.script = [first, first, other]
    monkeypatch.setattr(ports.socket, "socket", _RepeatingSocket)
    second = ports.free_port()
    assert second == other
    assert _RepeatingSocket.script == []  # both repeats were asked for and passed over


def test_many_ports_in_a_row_are_all_distinct():
    handed = [ports.free_port() for _ in range(300)]
    assert len(set(handed)) == len(handed)
