"""The standard gRPC health service (``grpc.health.v1.Health``) on a worker's server (both
roles; the router has its own, on its asyncio server, in router/).

What Kubernetes' gRPC probes and ``grpc-health-probe`` speak. A worker's server starts only
after its warm-up, so it answers SERVING from the first call it can take; it turns NOT_SERVING
while draining (no new work: routing and probes stop sending), and on shutdown. Probes carry
no cluster token, so the token check lets these two methods through (auth.py).
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def add_worker_health(server, worker, service_name: str) -> health.HealthServicer:
    """Register the health service for ``worker`` (an EngineWorker) on ``server``; the
    overall status ("") and ``service_name`` follow the worker's draining flag."""
    servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)

    def follow(draining: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if draining
            else (health_pb2.HealthCheckResponse.SERVING)
        )
        for name in ("", service_name):
            servicer.set(name, status)

    follow(worker.draining)
    worker.on_draining_change.append(follow)
    return servicer
