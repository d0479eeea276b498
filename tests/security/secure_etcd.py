"""A real etcd with TLS (server certificate, client certificates required) and/or authentication.

    etcd = SecureEtcd(tmp_path, pki)                 # https, --client-cert-auth, certificates from `pki`
    etcd.start()
    await enable_auth(etcd.endpoint, "splitserve", "s3cret", tls=...)   # root + a read-write user, auth on
"""

from __future__ import annotations

import ssl
import urllib.request

import grpc
from aetcd import rpc

from tests.fixtures.etcd import EtcdServer
from tests.security.certs import PKI


class SecureEtcd(EtcdServer):
    """EtcdServer whose client URL is https, with certificates from a test PKI (None: plain http)."""

    def __init__(self, workdir, pki: PKI | None) -> None:
        super().__init__(workdir, name="splitserve-secure")
        self.pki = pki

    def _args(self) -> list[str]:
        args = super()._args()
        if self.pki is None:
            return args
        client = f"https://127.0.0.1:{self.client_port}"
        args = [a for a in args if not a.startswith(("--listen-client-urls", "--advertise-client-urls"))]
        return [*args, f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
                f"--cert-file={self.pki.server_cert}", f"--key-file={self.pki.server_key}",
                f"--trusted-ca-file={self.pki.ca}", "--client-cert-auth"]  # fmt: skip

    def is_healthy(self) -> bool:
        if self.pki is None:
            return super().is_healthy()
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.client_cert), str(self.pki.client_key))
        try:
            with urllib.request.urlopen(f"https://{self.endpoint}/health", timeout=1, context=context) as response:
                return b'"true"' in response.read()
        except (OSError, ValueError):
            return False


async def enable_auth(endpoint: str, user: str, password: str, pki: PKI | None = None) -> None:
    """Adds root and `user` (read-write on every key) and turns etcd's authentication on."""
    if pki is None:
        channel = grpc.aio.insecure_channel(endpoint)
    else:
        credentials = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                                   pki.client_cert.read_bytes())  # fmt: skip
        channel = grpc.aio.secure_channel(endpoint, credentials)
    async with channel:
        auth = rpc.AuthStub(channel)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-" + password))
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.UserAdd(rpc.AuthUserAddRequest(name=user, password=password))
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="readwrite-all"))
        everything = rpc.Permission(permType=rpc.Permission.READWRITE, key=b"\0", range_end=b"\0")
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="readwrite-all", perm=everything))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=user, role="readwrite-all"))
        await auth.AuthEnable(rpc.AuthEnableRequest())
