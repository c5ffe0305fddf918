"""A throwaway CA and one leaf it signs for every host's address (and "pdserve-cluster"), used
for both the client API's TLS and the cluster's mutual TLS of a namespace cluster. Made with
the ``openssl`` command, so the harness needs no Python package for it."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

CLUSTER_NAME = "pdserve-cluster"
CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: str
    cert: str
    key: str


def _openssl(*args: str) -> None:
    out = subprocess.run(
        ["openssl", *args], check=False, capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {out.stderr.strip()[-1000:]}")


def make_certs(folder: Path, addresses: list[str]) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca-key.pem"
    cert, key, csr = folder / "cert.pem", folder / "key.pem", folder / "leaf.csr"
    _openssl(
        "req",
        "-x509",
        *CURVE,
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-days",
        "2",
        "-subj",
        "/CN=netns CA",
    )
    _openssl(
        "req", "-new", *CURVE, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=netns leaf"
    )
    sans = ",".join([*(f"IP:{a}" for a in addresses), f"DNS:{CLUSTER_NAME}"])
    ext = folder / "leaf.ext"
    ext.write_text(
        f"subjectAltName={sans}\nbasicConstraints=critical,CA:FALSE\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    key.chmod(0o600)
    return Certs(str(ca), str(cert), str(key))
