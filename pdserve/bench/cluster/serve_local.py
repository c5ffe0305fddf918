"""Serve a local (Ray-less) cluster's OpenAI HTTP API until killed; for scripts/benchmarks.sh
and scripts/bench_compare.sh.

Prints ``URL http://127.0.0.1:PORT`` once ready, or exits with status 3 when this checkout's
router has no HTTP API (the serve benchmarks are then skipped).

    python -m pdserve.bench cluster --model embedded --transport grpc            # 1P + 1D
    python -m pdserve.bench cluster --num-prefill 0 --threads 2                  # colocated
    python -m pdserve.bench cluster --weights q4 --prefill-gemm auto             # quantized
    python -m pdserve.bench cluster --num-decode 2 --decode-policy most_free_blocks  # by load
    python -m pdserve.bench cluster --share-cores 2 --transport shm              # one node, 1P1D
"""

from __future__ import annotations

import signal
import sys
import threading

from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.settings import RouterSettings
from router.warmup import warm_up_router


def add_parser(sub) -> None:
    p = sub.add_parser(
        "cluster",
        help="serve a local cluster's HTTP API until killed (for the shell drivers)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--model", default="embedded")
    p.add_argument("--transport", default="grpc")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--local-prefill-max-tokens", type=int, default=0)
    p.add_argument(
        "--prefill-chunk-size",
        type=int,
        default=0,
        help="most prompt tokens of one request per step (0: the whole budget)",
    )
    p.add_argument("--weights", default="fp32", help="fp32 | bf16 | int8 | q4 (engine.config)")
    p.add_argument(
        "--prefill-gemm",
        default="auto",
        help="prefill matmuls: fp32 | bf16 | int8 | auto (engine.config)",
    )
    p.add_argument(
        "--kv-dtype", default="fp32", help="the KV cache: fp32 | int8 | fp8 (engine.config)"
    )
    # The router's own defaults, so a benchmarked cluster routes as `pdserve serve` does.
    p.add_argument(
        "--prefill-policy", default=RouterSettings.prefill_policy, help="router.policies"
    )
    p.add_argument("--decode-policy", default=RouterSettings.decode_policy, help="router.policies")
    p.add_argument(
        "--share-cores",
        type=int,
        default=0,
        metavar="N",
        help="prefill and decode worker i lend each other N cores step by step (share_cores; "
        "0: off, each worker keeps --threads)",
    )
    p.add_argument("--in-process", action="store_true", help="workers as threads of this process")
    p.set_defaults(func=run)


def _share_cores(node_cores: int) -> dict:
    if node_cores == 0:
        return {}
    return {"share_cores": {"enabled": True, "node_cores": node_cores}}


def run(args) -> int:
    spec = ClusterSpec(
        model=args.model,
        kv_transport=args.transport,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        http_port=0,
        threads_per_worker=args.threads,
        separate_processes=not args.in_process,
        max_num_batched_tokens=args.max_num_batched_tokens,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        prefill_chunk_size=args.prefill_chunk_size,
        weights=args.weights,
        prefill_gemm=args.prefill_gemm,
        kv_dtype=args.kv_dtype,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        **_share_cores(args.share_cores),
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with LocalCluster(spec) as cluster:
        address = getattr(cluster, "http_address", "")
        if not address:
            print("no HTTP API in this checkout's router", file=sys.stderr)
            return 3
        url = address if address.startswith("http") else f"http://{address}"
        cluster.run(warm_up_router(cluster.servers), timeout=300)  # as `pdserve serve` does
        print(f"URL {url}", flush=True)
        stop.wait()
    return 0
