"""TLS from certificate files for pdserve's gRPC servers and channels (grpcio and Arrow Flight).

Two uses share these helpers. The client API (the router's gRPC port) presents a certificate and,
with ``client_ca``, asks clients for one signed by it (mutual TLS). The cluster's worker services
(worker gRPC, KV over gRPC and Flight) use one cluster certificate authority: every server
presents ``cert``/``key``, every client verifies it against ``ca`` and presents the same
``cert``/``key``, and servers require a client certificate signed by ``ca``, so only holders of a
cluster key pair get a connection at all (the cluster token is checked on top). ``server_name``
is the name the certificate was issued for when it does not list every node's IP address.

torch_dist (gloo, NCCL) has no TLS: see kv_transfer/torch_dist/pair.py's security note.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; ValueError naming the setting when it cannot be read."""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror}") from None


@dataclass(frozen=True)
class TlsFiles:
    """A server's certificate chain and key (PEM paths); ``client_ca``: mutual TLS."""

    cert: str
    key: str
    client_ca: str | None = None

    def server_credentials(self):
        import grpc

        ca = read_pem(self.client_ca, "client_ca") if self.client_ca else None
        pair = (read_pem(self.key, "key"), read_pem(self.cert, "cert"))
        return grpc.ssl_server_credentials(
            [pair], root_certificates=ca, require_client_auth=ca is not None
        )


@dataclass(frozen=True)
class ClusterTls:
    """Mutual TLS between the router and workers and between workers (see the module doc)."""

    cert: str
    key: str
    ca: str
    server_name: str | None = None  # override the expected name (default: the host dialled)

    def server_files(self) -> TlsFiles:
        return TlsFiles(self.cert, self.key, client_ca=self.ca)

    def server_credentials(self):
        return self.server_files().server_credentials()

    def channel_credentials(self):
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "ca"),
            private_key=read_pem(self.key, "key"),
            certificate_chain=read_pem(self.cert, "cert"),
        )

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_cluster_tls_args(parser) -> None:
    """``--cluster-tls-cert/-key/-ca/-server-name`` on a process's argparse parser."""
    add = parser.add_argument
    add("--cluster-tls-cert", help="the cluster's PEM certificate (mutual TLS between processes)")
    add("--cluster-tls-key", help="its private key")
    add("--cluster-tls-ca", help="the cluster CA every peer's certificate is signed by")
    add("--cluster-tls-server-name", help="the name in the peers' certificate")


def cluster_tls_from_args(args) -> ClusterTls | None:
    if not args.cluster_tls_cert:
        return None
    if not (args.cluster_tls_key and args.cluster_tls_ca):
        raise SystemExit("--cluster-tls-cert needs --cluster-tls-key and --cluster-tls-ca")
    return ClusterTls(
        args.cluster_tls_cert,
        args.cluster_tls_key,
        args.cluster_tls_ca,
        args.cluster_tls_server_name,
    )
