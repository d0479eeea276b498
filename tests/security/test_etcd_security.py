"""etcd credentials against a real etcd: username/password (etcd auth enabled), TLS with client
certificates, both at once; and a whole `splitserve up` cluster whose control plane and workers
reach such an etcd only through --etcd-* options (given as SPLITSERVE_ETCD_* variables)."""

from __future__ import annotations

import shutil

import aetcd
import pytest

from splitserve.control_plane.etcd_client import EtcdOptions, connect
from tests.security.certs import make_pki
from tests.security.secure_etcd import SecureEtcd, enable_auth
from tests.security.up_cluster import UpCluster

if shutil.which("etcd") is None:
    pytest.skip("needs the etcd binary (apt-get install etcd-server)", allow_module_level=True)

USER, PASSWORD = "splitserve", "s3cret-pw"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


async def _round_trip(endpoint: str, options: EtcdOptions) -> bytes:
    async with connect(endpoint, timeout_s=3, options=options) as client:
        await client.put(b"/splitserve-test/k", b"v")
        lease = await client.lease(5)
        await client.put(b"/splitserve-test/leased", b"x", lease=lease)
        await lease.revoke()
        return (await client.get(b"/splitserve-test/k")).value


async def _refused(endpoint: str, options: EtcdOptions) -> bool:
    try:
        await _round_trip(endpoint, options)
    except aetcd.ClientError:
        return True
    return False


async def test_password_auth(tmp_path):
    etcd = SecureEtcd(tmp_path / "etcd", None)
    etcd.start()
    try:
        await enable_auth(etcd.endpoint, USER, PASSWORD)
        assert await _round_trip(etcd.endpoint, EtcdOptions(USER, PASSWORD)) == b"v"
        assert await _refused(etcd.endpoint, EtcdOptions())
        assert await _refused(etcd.endpoint, EtcdOptions(USER, "wrong"))
    finally:
        etcd.stop()


async def test_a_new_token_after_etcd_restarts(tmp_path):
    """etcd forgets its auth tokens when it restarts: one call fails, the next authenticates again."""
    etcd = SecureEtcd(tmp_path / "etcd", None)
    etcd.start()
    try:
        await enable_auth(etcd.endpoint, USER, PASSWORD)
        async with connect(etcd.endpoint, timeout_s=3, options=EtcdOptions(USER, PASSWORD)) as client:
            await client.put(b"/k", b"v")
            lease = await client.lease(30)
            etcd.stop()
            etcd.start()
            with pytest.raises(aetcd.ClientError, match="invalid auth token"):
                await client.get(b"/k")
            assert (await client.get(b"/k")).value == b"v"
            await lease.refresh()  # the lease survived the restart, and the new token may use it
    finally:
        etcd.stop()


async def test_tls_with_client_certificates_and_password(tmp_path, pki):
    etcd = SecureEtcd(tmp_path / "etcd", pki)
    etcd.start()
    try:
        await enable_auth(etcd.endpoint, USER, PASSWORD, pki)
        tls = dict(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        assert await _round_trip(etcd.endpoint, EtcdOptions(USER, PASSWORD, **tls)) == b"v"
        assert await _refused(etcd.endpoint, EtcdOptions(USER, PASSWORD))  # plaintext
        assert await _refused(etcd.endpoint, EtcdOptions(USER, PASSWORD, ca=pki.ca))  # no client certificate
        other = dict(ca=pki.other_ca, cert=pki.client_cert, key=pki.client_key)
        assert await _refused(etcd.endpoint, EtcdOptions(USER, PASSWORD, **other))  # does not trust etcd's CA
        assert await _refused(etcd.endpoint, EtcdOptions(USER, "wrong", **tls))
    finally:
        etcd.stop()


def test_etcd_options_are_validated(pki, tmp_path):
    with pytest.raises(ValueError, match="go together"):
        EtcdOptions(user="u")
    with pytest.raises(ValueError, match="needs --etcd-ca"):
        EtcdOptions(cert=pki.client_cert, key=pki.client_key)
    with pytest.raises(ValueError, match="not a readable file"):
        EtcdOptions(ca=tmp_path / "nope.pem")


async def test_up_against_an_etcd_with_tls_and_auth(tmp_path, pki):
    """Control plane and workers register, elect and watch through TLS + password; READY means every slot
    of the default shard spec was filled through that etcd."""
    etcd = SecureEtcd(tmp_path / "etcd", pki)
    etcd.start()
    try:
        await enable_auth(etcd.endpoint, USER, PASSWORD, pki)
        env = {"SPLITSERVE_ETCD_USER": USER, "SPLITSERVE_ETCD_PASSWORD": PASSWORD, "SPLITSERVE_ETCD_CA": str(pki.ca),
               "SPLITSERVE_ETCD_CERT": str(pki.client_cert), "SPLITSERVE_ETCD_KEY": str(pki.client_key)}  # fmt: skip
        with UpCluster(tmp_path / "up", "--engine", "sim", "--etcd", etcd.endpoint, env=env) as up:
            assert len(up.workers) == 2
            assert PASSWORD not in "".join(up.output)
            assert up.stop() == 0
        async with connect(etcd.endpoint, options=EtcdOptions(USER, PASSWORD, pki.ca, pki.client_cert,
                                                              pki.client_key)) as client:  # fmt: skip
            assert (await client.get_prefix(b"/")).count > 0  # the cluster wrote its keys through TLS + auth
    finally:
        etcd.stop()
