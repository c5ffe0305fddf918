"""``python -m decode_worker``: one decode worker process; prints ``READY <address>``."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from decode_worker.server import serve_decode_worker
from decode_worker.worker import DecodeWorker
from engine.args import add_engine_args, engine_from_args
from grpc_plumbing.tls import add_cluster_tls_args, cluster_tls_from_args
from kv_transfer.transports import WORKER_TRANSPORTS


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m decode_worker")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kv-transport", default="grpc", choices=WORKER_TRANSPORTS)
    parser.add_argument("--lease-ttl", type=float, default=30.0)
    parser.add_argument("--worker-id", default=None)
    add_cluster_tls_args(parser)
    parser.add_argument(
        "--kv-private-network",
        action="store_true",
        help="let torch_dist KV listen off loopback (its data path is not authenticated: only "
        "on a network no one but the cluster reaches); the cluster token comes from "
        "$PDSERVE_CLUSTER_TOKEN",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = DecodeWorker(engine_from_args(args), args.worker_id, args.lease_ttl)
    server, address, kv_server = serve_decode_worker(
        worker,
        args.host,
        args.port,
        args.kv_transport,
        kv_private_network=args.kv_private_network,
        tls=cluster_tls_from_args(args),
    )
    print(f"READY {address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop(grace=2).wait()
    if kv_server is not None:
        kv_server.stop()
    worker.stop()


if __name__ == "__main__":
    main()
