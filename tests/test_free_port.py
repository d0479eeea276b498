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
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as our servers bind
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


def test_a_stopped_servers_time_wait_connections_leave_its_port_free():
    """`splitserve up` checks its --port before starting: run again right after a stop, the
    closed server's connections sit in TIME_WAIT for a minute, which servers binding with
    SO_REUSEADDR (all of ours) ignore, so the check must too; a listener still counts."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert not readiness.port_is_free("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    client.close()
    server.close()
    with socket.socket() as plain:  # the connection holds the port against a bind without the option
        try:
            plain.bind(("127.0.0.1", port))
            held = False
        except OSError:
            held = True
    assert held
    assert readiness.port_is_free("127.0.0.1", port)
