"""The test etcd picks new ports when a port that was free is taken before etcd binds it
(another test's socket), but a restart keeps its ports."""

import socket

from tests.fixtures.etcd import EtcdServer


def test_a_first_start_that_loses_its_port_picks_new_ones(tmp_path):
    server = EtcdServer(tmp_path)
    taken = server.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
    try:
        assert server.client_port != taken and server.is_healthy()
        port = server.client_port
        server.stop()
        server.start()  # a restart: same ports (clients hold the endpoint)
        assert server.client_port == port and server.is_healthy()
    finally:
        server.stop()
