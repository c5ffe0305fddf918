"""gRPC plumbing shared by the router, the workers and kv_transfer, torch-free.

``server``: binding a port exclusively (with TLS when configured) and the message-size options;
``tls``: certificate files as gRPC credentials; ``auth``: the cluster token and the loopback
rule; ``health``: a worker's standard gRPC health service; ``worker_process``: what every
worker process shares (its server settings and flags, serving until a signal). The router may
import this package but never ``kv_transfer`` (DESIGN.md), so what both need lives here, below
both. It imports grpc and the standard library only.
"""
