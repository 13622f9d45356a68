"""kvgate_testing.ports.free_port: never hands out a port it handed out lately (an engine's HTTP,
KV-event and replay ports asked for at once must differ), never one taken, and none from the OS's
ephemeral range (where outgoing connections take ports unannounced)."""

from __future__ import annotations

import socket

from kvgate_testing import ports
from router.launch import port_is_free


class _ScriptedDraw:
    """Stands in for the random draw: the ports to try, in order."""

    def __init__(self, script: list[int]):
        self.script = script

    def randrange(self, low: int, high: int) -> int:
        port = self.script.pop(0)
        assert low <= port < high
        return port


def _a_port_not_handed_out() -> int:
    high = ports._ephemeral_low()
    return next(
        port for port in range(ports._LOWEST, high)
        if port not in ports._recent_set and port_is_free("127.0.0.1", port)
    )  # fmt: skip


def test_a_port_drawn_twice_is_handed_out_once(monkeypatch):
    first = ports.free_port()  # now among the recent ones
    other = _a_port_not_handed_out()
    draw = _ScriptedDraw([first, first, other])
    monkeypatch.setattr(ports, "_draw", draw)
    assert ports.free_port() == other
    assert draw.script == []  # both repeats were drawn and passed over


def test_a_port_something_else_holds_is_passed_over(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", _a_port_not_handed_out()))
        taken.listen()
        held = taken.getsockname()[1]
        other = next(
            port for port in range(held + 1, ports._ephemeral_low())
            if port not in ports._recent_set and port_is_free("127.0.0.1", port)
        )  # fmt: skip
        draw = _ScriptedDraw([held, other])
        monkeypatch.setattr(ports, "_draw", draw)
        assert ports.free_port() == other


def test_ports_come_from_below_the_ephemeral_range():
    high = ports._ephemeral_low()
    handed = [ports.free_port() for _ in range(50)]
    assert all(ports._LOWEST <= port < high for port in handed)


def test_many_ports_in_a_row_are_all_distinct():
    handed = [ports.free_port() for _ in range(300)]
    assert len(set(handed)) == len(handed)
