"""The security flags every serving subcommand shares, and how they reach the process and its children.

    --tls-cert / --tls-key / --tls-ca / --tls-client-auth     every gRPC server and channel (grpc_security)
    --grpc-max-message-bytes                                  largest gRPC message either way
    --etcd-user / --etcd-password / --etcd-ca / --etcd-cert / --etcd-key   processes that talk to etcd

Like every option they also come from SPLITSERVE_<OPTION> variables and --config files
(config_sources.py). `splitserve up` hands them to its children as SPLITSERVE_* variables,
so a password never appears on a command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve import grpc_security
from splitserve.control_plane import etcd_client

TLS_COMMANDS = frozenset({"control-plane", "router", "prefill-worker", "decode-worker", "gateway", "up"})
ETCD_COMMANDS = frozenset({"control-plane", "prefill-worker", "decode-worker", "up"})
_TLS_DESTS = ("tls_cert", "tls_key", "tls_ca", "tls_client_auth", "grpc_max_message_bytes")
_ETCD_DESTS = ("etcd_user", "etcd_password", "etcd_ca", "etcd_cert", "etcd_key")
_PATH_DESTS = frozenset({"tls_cert", "tls_key", "tls_ca", "etcd_ca", "etcd_cert", "etcd_key"})


def add_security_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    """Adds the flags that apply to `command` (none for offline tools)."""
    if command in TLS_COMMANDS:
        tls = parser.add_argument_group("gRPC transport security (every gRPC server and channel of the process)")
        tls.add_argument("--tls-cert", default=None, metavar="PEM",
                         help="this process's certificate chain: served by its gRPC servers, presented as client "
                         "certificate with --tls-client-auth (default: plaintext gRPC)")
        tls.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
        tls.add_argument("--tls-ca", default=None, metavar="PEM",
                         help="CA bundle that verifies the servers this process calls (and, with "
                         "--tls-client-auth, its clients); setting it alone makes channels use TLS")
        tls.add_argument("--tls-client-auth", action="store_true",
                         help="mutual TLS: servers refuse clients without a certificate signed by --tls-ca")
        tls.add_argument("--grpc-max-message-bytes", type=int, default=grpc_security.DEFAULT_MAX_MESSAGE_BYTES,
                         metavar="N", help="largest gRPC message sent or received (default %(default)s)")
    if command in ETCD_COMMANDS:
        etcd = parser.add_argument_group("etcd credentials")
        etcd.add_argument("--etcd-user", default=None, metavar="USER", help="etcd user (etcd auth enabled)")
        etcd.add_argument("--etcd-password", default=None, metavar="PASSWORD",
                          help="password of --etcd-user; prefer SPLITSERVE_ETCD_PASSWORD (flags show in `ps`)")
        etcd.add_argument("--etcd-ca", default=None, metavar="PEM", help="CA bundle of etcd's server certificate: TLS to etcd")
        etcd.add_argument("--etcd-cert", default=None, metavar="PEM", help="client certificate for etcd's --client-cert-auth")
        etcd.add_argument("--etcd-key", default=None, metavar="PEM", help="private key of --etcd-cert")  # fmt: skip


def security_from_args(args: argparse.Namespace) -> grpc_security.GrpcSecurity:
    if not hasattr(args, "tls_cert"):
        return grpc_security.GrpcSecurity()
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca or args.tls_client_auth:
        tls = grpc_security.TLSFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    return grpc_security.GrpcSecurity(tls=tls, max_message_bytes=args.grpc_max_message_bytes)


def etcd_options_from_args(args: argparse.Namespace) -> etcd_client.EtcdOptions:
    if not hasattr(args, "etcd_user"):
        return etcd_client.EtcdOptions()
    return etcd_client.EtcdOptions(args.etcd_user, args.etcd_password, args.etcd_ca, args.etcd_cert, args.etcd_key)


def configure_process(args: argparse.Namespace) -> None:
    """Sets the process-wide gRPC security and etcd credentials; ValueError quotes a bad option."""
    grpc_security.configure(security_from_args(args))
    etcd_client.configure(etcd_options_from_args(args))


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """SPLITSERVE_* variables that give a child process the same security options."""
    env = {}
    for dest in (*_TLS_DESTS, *_ETCD_DESTS):
        value = getattr(args, dest, None)
        if value is None or value is False:
            continue
        if dest in _PATH_DESTS:
            value = Path(value).resolve()  # children may run elsewhere
        env[f"SPLITSERVE_{dest.upper()}"] = "1" if value is True else str(value)
    return env
