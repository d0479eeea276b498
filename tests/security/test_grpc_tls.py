"""grpc_security on a real gRPC server in this process: TLS, mutual TLS, refusals, message limits,
and the flags / SPLITSERVE_TLS_* variables / --config that set them on every serving subcommand."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve import grpc_security
from splitserve.config_sources import add_config_option, apply_config_sources
from splitserve.grpc_security import GrpcSecurity, TLSFiles
from splitserve.security_flags import (
    TLS_COMMANDS,
    add_security_arguments,
    child_environment,
    security_from_args,
)
from tests.security.certs import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _serve(security: GrpcSecurity) -> tuple[grpc.aio.Server, str]:
    server = grpc_security.aio_server(security=security)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = grpc_security.add_port(server, "127.0.0.1:0", security)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _check(address: str, security: GrpcSecurity, service: str = "") -> grpc.StatusCode:
    async with grpc_security.aio_channel(address, security) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_admits_only_clients_of_its_ca(pki):
    server, address = await _serve(GrpcSecurity(TLSFiles(pki.server_cert, pki.server_key, pki.ca, client_auth=True)))
    try:
        assert await _check(address, GrpcSecurity(TLSFiles(pki.client_cert, pki.client_key, pki.ca))) == grpc.StatusCode.OK
        assert await _check(address, GrpcSecurity()) == grpc.StatusCode.UNAVAILABLE  # plaintext
        assert await _check(address, GrpcSecurity(TLSFiles(ca=pki.ca))) == grpc.StatusCode.UNAVAILABLE  # no client cert
        stranger = TLSFiles(pki.other_client_cert, pki.other_client_key, pki.ca)  # right CA to trust, wrong CA signed it
        assert await _check(address, GrpcSecurity(stranger)) == grpc.StatusCode.UNAVAILABLE
        wrong_trust = TLSFiles(pki.client_cert, pki.client_key, pki.other_ca)  # does not trust the server's CA
        assert await _check(address, GrpcSecurity(wrong_trust)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_server_tls_without_client_auth(pki):
    server, address = await _serve(GrpcSecurity(TLSFiles(pki.server_cert, pki.server_key)))
    try:
        assert await _check(address, GrpcSecurity(TLSFiles(ca=pki.ca))) == grpc.StatusCode.OK
        assert await _check(address, GrpcSecurity()) == grpc.StatusCode.UNAVAILABLE
        assert await _check(address, GrpcSecurity(TLSFiles(ca=pki.other_ca))) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)


async def test_messages_past_the_limit_are_refused():
    server, address = await _serve(GrpcSecurity(max_message_bytes=64 << 10))
    try:
        big_sender = GrpcSecurity(max_message_bytes=1 << 20)
        assert await _check(address, big_sender, "x" * (100 << 10)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await _check(address, GrpcSecurity(max_message_bytes=64 << 10), "x" * (100 << 10)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED  # fmt: skip
        assert await _check(address, big_sender, "unknown") == grpc.StatusCode.NOT_FOUND  # small ones still work
    finally:
        await server.stop(None)


def test_tls_files_are_validated(pki, tmp_path):
    with pytest.raises(ValueError, match="go together"):
        TLSFiles(cert=pki.server_cert)
    with pytest.raises(ValueError, match="needs --tls-ca"):
        TLSFiles(pki.server_cert, pki.server_key, client_auth=True)
    with pytest.raises(ValueError, match="not a readable file"):
        TLSFiles(ca=tmp_path / "missing.pem")
    with pytest.raises(ValueError, match="max_message_bytes"):
        GrpcSecurity(max_message_bytes=10)


REQUIRED = {"control-plane": ["--inference-shards", "tp=1,role=prefill", "--etcd", "127.0.0.1:2379"]}


def _parser(command: str) -> argparse.ArgumentParser:
    from splitserve.cli import SUBCOMMANDS

    parser = argparse.ArgumentParser(prog=command)
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    add_security_arguments(parser, command)
    add_config_option(parser)
    return parser


@pytest.mark.parametrize("command", sorted(TLS_COMMANDS))
def test_every_serving_subcommand_takes_tls_from_flags_env_and_config(command, pki, tmp_path, monkeypatch):
    parser = _parser(command)
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-ca", str(pki.ca),
             "--tls-client-auth", "--grpc-max-message-bytes", "2048"]  # fmt: skip
    security = security_from_args(parser.parse_args([*REQUIRED.get(command, []), *flags]))
    assert security.tls == TLSFiles(pki.server_cert, pki.server_key, pki.ca, True) and security.max_message_bytes == 2048
    config = tmp_path / "c.yaml"
    config.write_text(f"tls-cert: {pki.server_cert}\ntls-key: {pki.server_key}\n")
    monkeypatch.setenv("SPLITSERVE_TLS_CA", str(pki.ca))
    monkeypatch.setenv("SPLITSERVE_TLS_CLIENT_AUTH", "true")
    parser = _parser(command)
    argv = [*REQUIRED.get(command, []), "--config", str(config)]
    apply_config_sources(parser, argv)
    args = parser.parse_args(argv)
    assert security_from_args(args).tls == TLSFiles(pki.server_cert, pki.server_key, pki.ca, True)
    env = child_environment(args)
    assert env["SPLITSERVE_TLS_CERT"] == str(pki.server_cert.resolve()) and env["SPLITSERVE_TLS_CLIENT_AUTH"] == "1"


def test_every_server_and_channel_goes_through_grpc_security():
    """A server or channel made elsewhere would skip --tls-* and the message limits."""
    root = Path(__file__).resolve().parents[2]
    # The SDK has its own TLSConfig; the etcd client its own credentials (--etcd-*).
    allowed = {"splitserve/grpc_security.py", "client/options.py", "control_plane/etcd_secure_client.py"}
    banned = ("insecure_channel(", "secure_channel(", "add_insecure_port(", "grpc.aio.server(", "grpc.server(")
    found = []
    for package in ("splitserve", "router", "control_plane", "gateway", "engine", "prefill_worker", "decode_worker"):
        for file in sorted((root / package).rglob("*.py")):
            rel = str(file.relative_to(root))
            if rel in allowed or file.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            text = file.read_text()
            found += [f"{rel}: {b}" for b in banned if b in text]
    assert found == []
