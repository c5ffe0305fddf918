"""``python -m decode_worker``: one decode worker process; prints ``READY <address>``."""

from engine import hugepages

hugepages.request()  # before anything imports torch: its allocator reads it once

from decode_worker.launch import decode_parser, decode_settings_from_args, start_decode_worker
from grpc_plumbing.worker_process import serve_until_signalled

if __name__ == "__main__":
    settings = decode_settings_from_args(decode_parser().parse_args())
    serve_until_signalled(lambda: start_decode_worker(settings), settings.server.drain_grace_s)
