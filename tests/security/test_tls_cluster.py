"""`splitserve up --tls-* --tls-client-auth`: every gRPC hop of a real cluster runs mutual TLS.

Every server (control plane, workers, router) requires a client certificate of the test CA, so
the cluster only comes up — workers register, the router follows the topology, a completion goes
gateway → router → prefill → handoff → decode — if every hop between them uses TLS with a
certificate. A plaintext client, a client without a certificate and one of another CA are refused
by every server; the SDK with the client certificate gets through."""

from __future__ import annotations

import shutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client import Client, ClientOptions, SamplingParams, TLSConfig
from splitserve.client.errors import UnavailableError
from tests.gateway.http_helpers import post
from tests.security.certs import make_pki
from tests.security.up_cluster import UpCluster

if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.slow  # a whole cluster on the model (~20 s); test_grpc_tls.py covers the mechanism in the default stage
def test_every_grpc_hop_runs_mutual_tls(tmp_path):
    pki = make_pki(tmp_path / "pki")
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
             "--tls-ca", str(pki.ca), "--tls-client-auth"]  # fmt: skip
    with UpCluster(tmp_path / "up", *flags) as up:
        status, body, _ = post(up.url, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 6})
        assert status == 200 and body["usage"]["completion_tokens"] == 6, body

        good = TLSConfig(pki.ca, pki.client_key, pki.client_cert)
        with Client(up.router, options=ClientOptions(tls=good, max_attempts=1, timeout_s=30)) as sdk:
            [result] = sdk.generate([[5, 6, 7, 8]], SamplingParams(num_tokens_to_generate=4))
            assert len(result.generated_tokens) == 4
        for bad in (None, TLSConfig(pki.ca), TLSConfig(pki.ca, pki.other_client_key, pki.other_client_cert),
                    TLSConfig(pki.other_ca, pki.client_key, pki.client_cert)):  # fmt: skip
            with Client(up.router, options=ClientOptions(tls=bad, max_attempts=1, timeout_s=10)) as sdk:
                with pytest.raises(UnavailableError):
                    sdk.generate([[5, 6, 7, 8]], SamplingParams(num_tokens_to_generate=4))

        ca, key, cert = pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        assert len(up.workers) == 2
        for address in (up.router, up.control_plane, *up.workers):
            assert _health(address, grpc.ssl_channel_credentials(ca, key, cert)) == grpc.StatusCode.OK, address
            assert _health(address, None) == grpc.StatusCode.UNAVAILABLE, address
            assert _health(address, grpc.ssl_channel_credentials(ca)) == grpc.StatusCode.UNAVAILABLE, address
            stranger = grpc.ssl_channel_credentials(ca, pki.other_client_key.read_bytes(), pki.other_client_cert.read_bytes())
            assert _health(address, stranger) == grpc.StatusCode.UNAVAILABLE, address
        # The cluster's own processes never failed a handshake with each other (only our bad clients did,
        # and those are logged by the servers as handshake failures, not by clients as call failures).
        for name in ("router", "gateway", "decode-worker-g1-dp0", "prefill-worker-g0-dp0"):
            assert "release of" not in up.log(name) and "Traceback" not in up.log(name), up.log(name)[-2000:]
        assert up.stop() == 0
