"""Every pdserve gRPC server owns its port: a second one on a taken port fails to start rather
than sharing the port (gRPC's default SO_REUSEPORT would split traffic between the two)."""

from __future__ import annotations

import asyncio

import pytest

from grpc_plumbing.server import worker_server
from kv_transfer.transport_grpc import GrpcReceiverServer


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_worker_server_refuses_a_taken_port():
    first, address = worker_server("127.0.0.1", 0, None)
    first.start()
    try:
        with pytest.raises(OSError, match="cannot bind"):
            worker_server("127.0.0.1", _port(address), None)
    finally:
        first.stop(None)


def test_kv_receiver_refuses_a_taken_port():
    first = GrpcReceiverServer(receiver=None, host="127.0.0.1", port=0)
    try:
        with pytest.raises(OSError, match="cannot bind"):
            GrpcReceiverServer(receiver=None, host="127.0.0.1", port=_port(first.endpoint))
    finally:
        first.stop()


def test_router_grpc_server_refuses_a_taken_port(tmp_path):
    from router.core import Router
    from router.grpc_server import start_grpc_server
    from router.settings import RouterSettings
    from tests.conftest import write_word_tokenizer

    write_word_tokenizer(tmp_path, 64)
    router = Router(RouterSettings(model_dir=str(tmp_path)), [], [])

    async def run():
        first, address = await start_grpc_server(router, "127.0.0.1", 0)
        try:
            with pytest.raises(OSError, match="cannot bind"):
                await start_grpc_server(router, "127.0.0.1", _port(address))
        finally:
            await first.stop(None)

    asyncio.run(run())
