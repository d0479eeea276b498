"""`splitserve.readiness.free_port`: ports for servers started next come from below the kernel's
ephemeral range, where no `bind(0)` or outgoing connection can take them first."""

from __future__ import annotations

import socket

from splitserve import readiness


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable():
    low = readiness._ephemeral_low()
    assert low is not None  # Linux
    ports = {readiness.free_port() for _ in range(20)}
    assert all(low - readiness._PORT_SPAN <= p < low for p in ports)
    assert len(ports) > 1  # drawn at random, not one fixed port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    low = readiness._ephemeral_low()
    with socket.socket() as held:
        held.bind(("127.0.0.1", low - 1))
        held.listen()
        monkeypatch.setattr(readiness, "_PORT_SPAN", 2)  # only low-2 and low-1 to draw from
        assert {readiness.free_port() for _ in range(10)} == {low - 2}


def test_without_a_known_range_the_kernel_picks(monkeypatch, tmp_path):
    assert readiness._ephemeral_low(str(tmp_path / "missing")) is None
    monkeypatch.setattr(readiness, "_ephemeral_low", lambda: None)
    port = readiness.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
