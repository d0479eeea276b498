"""Test PKI made on the spot with `cryptography`: a CA, and leaf certificates it signs.

    pki = make_pki(tmp_path)            # ca.pem, server.pem/-key.pem, client.pem/-key.pem, other-ca.pem ...
    pki.server_cert, pki.server_key     # SAN 127.0.0.1 and localhost; serverAuth + clientAuth
    pki.other_ca                        # an unrelated CA: trusting it must fail the handshake

Leaves carry both extended key usages, so one certificate per process serves its gRPC
server and is presented as its client certificate (mutual TLS), as splitserve uses them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    """A CA that signed nothing here."""
    other_client_cert: Path
    """A client certificate signed by other_ca (wrong CA for mutual TLS)."""
    other_client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))  # fmt: skip
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return cert, key


def _make_leaf(common_name: str, ca: x509.Certificate, ca_key) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(san, critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    return cert, key


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _make_ca("splitserve test CA")
    other, other_key = _make_ca("unrelated CA")
    server, server_key = _make_leaf("splitserve server", ca, ca_key)
    client, client_key = _make_leaf("splitserve client", ca, ca_key)
    stranger, stranger_key = _make_leaf("stranger", other, other_key)
    d = directory
    return PKI(
        ca=_write_cert(ca, d / "ca.pem"),
        server_cert=_write_cert(server, d / "server.pem"), server_key=_write_key(server_key, d / "server-key.pem"),
        client_cert=_write_cert(client, d / "client.pem"), client_key=_write_key(client_key, d / "client-key.pem"),
        other_ca=_write_cert(other, d / "other-ca.pem"),
        other_client_cert=_write_cert(stranger, d / "stranger.pem"),
        other_client_key=_write_key(stranger_key, d / "stranger-key.pem"),
    )  # fmt: skip
