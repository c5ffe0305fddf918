"""Self-signed certificates made in the test: a CA, and leaf certificates it signs for
127.0.0.1 / localhost (servers and clients alike)."""

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
class CertFiles:
    ca: str  # the CA certificate (PEM)
    cert: str  # a leaf signed by it, for 127.0.0.1, localhost and "pdserve-cluster"
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _builder(subject: str, issuer: str, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def make_certs(folder: Path, name: str = "test") -> CertFiles:
    """A CA and one leaf (server and client auth) under ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        _builder(f"{name} CA", f"{name} CA", ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
        x509.DNSName("pdserve-cluster"),
    ]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    leaf = (
        _builder(f"{name} leaf", f"{name} CA", key.public_key())
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = CertFiles(str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem"))
    Path(paths.ca).write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    Path(paths.cert).write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    _write_key(key, Path(paths.key))
    return paths
