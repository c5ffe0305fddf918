"""``python -m prefill_worker``: one prefill worker process; prints ``READY <address>``."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from engine.args import add_engine_args, engine_from_args
from grpc_plumbing.tls import add_cluster_tls_args, cluster_tls_from_args
from prefill_worker.server import serve_prefill_worker
from prefill_worker.worker import PrefillWorker


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m prefill_worker")
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--worker-id", default=None)
    add_cluster_tls_args(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = PrefillWorker(engine_from_args(args), args.worker_id)
    server, address, senders = serve_prefill_worker(
        worker, args.host, args.port, tls=cluster_tls_from_args(args)
    )
    print(f"READY {address}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    server.stop(grace=2).wait()
    senders.close()
    worker.stop()


if __name__ == "__main__":
    main()
