"""``python -m prefill_worker``: one prefill worker process; prints ``READY <address>``."""

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from grpc_plumbing.worker_process import serve_until_signalled
from prefill_worker.launch import prefill_parser, prefill_settings_from_args, start_prefill_worker

if __name__ == "__main__":
    settings = prefill_settings_from_args(prefill_parser().parse_args())
    serve_until_signalled(lambda: start_prefill_worker(settings), settings.server.drain_grace_s)
