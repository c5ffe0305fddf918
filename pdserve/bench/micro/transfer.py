"""`pdserve bench transfer`: KV transfer throughput per transport, against the limit.

All in one process on 127.0.0.1. The limit is raw loopback TCP bandwidth measured in the same
run (a thread writing 4 MiB buffers with ``sendall`` to a thread reading with ``recv_into``).
Each transport then pushes one prompt's KV (every layer: ``send_layer`` per layer, then
``commit``, which waits for the receiver's acknowledgement) from a source cache into a
``KVReceiver``'s cache several times; throughput = payload bytes / seconds, and the ratio to
loopback says how close the transport gets to what the socket can carry. Both figures are the
best of their repeats (a limit is a best case; other processes share these cores). Tighter
limits for the gRPC transports (transfer_limits.py): a bare grpcio client stream of 4 MiB
``bytes`` messages and a bare Arrow Flight stream of 4 MiB batches (no frames, no cache,
nothing but each stack) over the same bytes.

The second limit is a single-thread memcpy of the same bytes (numpy, one thread, best of the
repeats): what a transport that writes into the receiver's memory (nixl) is held against.
``--processes`` puts each receiver in a second process (pdserve/bench/micro/transfer_procs.py),
as between two worker processes, and runs the TTFT cluster's workers as processes too.

Then the transfer's share of TTFT with layer-wise streaming: a local cluster (one prefill and
one decode worker) serves prompts of the same length with ``include_timings``; kv_transfer_s
is the transfer time *not* hidden behind prefill compute, so share = kv_transfer_s / ttft_s.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from engine.config import KV_DTYPES, CacheConfig
from kv_transfer.transports import WORKER_TRANSPORTS, transport_missing
from pdserve.bench.micro.transfer_limits import (
    MiB,
    flight_stack_seconds,
    grpc_stack_seconds,
    loopback_mb_s,
)
from pdserve.bench.micro.transfer_procs import measure_transport_processes, memcpy_mb_s
from pdserve.measure.kv_push import KVShape, TransportResult, measure_transport

# The registry's, less the test-only faults and any whose package is not installed (nixl).
TRANSPORT_NAMES = (*(t for t in WORKER_TRANSPORTS if not transport_missing(t)), "local")


@dataclass
class TTFTShare:
    transport: str
    kv_dtype: str
    prompt_tokens: int
    runs: int
    prefill_s: float  # medians over runs
    kv_transfer_s: float
    ttft_s: float
    kv_bytes: int
    share_of_ttft: float  # median of kv_transfer_s / ttft_s


@dataclass
class TransferReport:
    shape: dict
    loopback_best_mb_s: float
    loopback_median_mb_s: float
    grpc_stack_best_mb_s: float  # a bare grpcio stream of bytes messages, same process
    flight_stack_best_mb_s: float = 0.0  # a bare Arrow Flight stream of the same messages
    memcpy_best_mb_s: float = 0.0  # one thread copying bytes_per_push, same process
    processes: bool = False  # each receiver ran in a second process
    transports: list[TransportResult] = field(default_factory=list)
    ttft: list[TTFTShare] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


# ---- share of TTFT ------------------------------------------------------------------------


def measure_ttft_share(
    model: str,
    transport: str,
    prompt_tokens: int,
    runs: int,
    seed: int = 0,
    kv_dtype="fp32",
    processes: bool = False,
) -> TTFTShare:
    """Prompts of ``prompt_tokens`` random token ids (fresh per request: no prefix-cache hits)
    through a one-prefill, one-decode local cluster whose KV cache is ``kv_dtype``; one
    warm-up request first. ``processes``: the workers run as processes."""
    from engine.loader import load_config
    from pdserve.client import Client
    from pdserve.cluster.local import ClusterSpec, LocalCluster

    block_size = CacheConfig.block_size
    per_request = math.ceil((prompt_tokens + 16) / block_size)
    spec = ClusterSpec(
        model=model,
        kv_transport=transport,
        block_size=block_size,
        num_blocks=4 * per_request,
        max_model_len=per_request * block_size,
        max_num_batched_tokens=max(512, prompt_tokens),
        kv_dtype=kv_dtype,
        separate_processes=processes,
    )
    rng = np.random.default_rng(seed)
    rows = []
    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        vocab = load_config(cluster.model_dir).vocab_size
        low = 3 if vocab < 1000 else 100  # stay clear of special tokens
        for i in range(runs + 1):
            ids = rng.integers(low, vocab, prompt_tokens).tolist()
            t = client.generate(token_ids=ids, max_tokens=2, include_timings=True).timings
            if i > 0 and t is not None:
                rows.append((t.prefill_s, t.kv_transfer_s, t.ttft_s, t.kv_bytes))
    if not rows:
        raise RuntimeError("the cluster returned no timings")
    prefill, kv, ttft, nbytes = (statistics.median(col) for col in zip(*rows))
    share = statistics.median(r[1] / r[2] for r in rows if r[2] > 0)
    return TTFTShare(
        transport, kv_dtype, prompt_tokens, len(rows), prefill, kv, ttft, int(nbytes), share
    )


# ---- report -------------------------------------------------------------------------------


def run_transfer_bench(
    shape: KVShape,
    transports,
    repeats: int,
    loopback_bytes: int,
    ttft_model: str | None,
    ttft_transports=(),
    ttft_runs: int = 3,
    log=print,
    kv_dtypes=("fp32",),
    processes: bool = False,
) -> TransferReport:
    """Every transport, then every TTFT transport, once per KV format in ``kv_dtypes`` (the
    report's shape is ``shape``'s; each result names its format and bytes). ``processes``:
    each receiver in a second process ("local" cannot cross one and is left out)."""
    loop = loopback_mb_s(loopback_bytes, repeats)
    report = TransferReport(
        {
            **asdict(shape),
            "dtype": str(shape.dtype).removeprefix("torch."),
            "bytes_per_push": shape.bytes_per_push,
        },
        max(loop),
        statistics.median(loop),
        loopback_bytes / grpc_stack_seconds(loopback_bytes, calls=repeats) / 1e6,
        loopback_bytes / flight_stack_seconds(loopback_bytes, calls=repeats) / 1e6,
        max(memcpy_mb_s(shape.bytes_per_push, max(repeats, 3))),
        processes,
    )
    log(f"loopback TCP: {report.loopback_best_mb_s:,.0f} MB/s (best of {repeats})")
    log(f"bare gRPC stream: {report.grpc_stack_best_mb_s:,.0f} MB/s")
    log(f"bare Flight stream: {report.flight_stack_best_mb_s:,.0f} MB/s")
    log(f"single-thread memcpy: {report.memcpy_best_mb_s:,.0f} MB/s")
    measure = measure_transport_processes if processes else measure_transport
    for kv_dtype in kv_dtypes:
        dtype_shape = replace(shape, kv_dtype=kv_dtype)
        for name in transports:
            if processes and name == "local":
                continue
            res = measure(name, dtype_shape, repeats, report.loopback_best_mb_s)
            report.transports.append(res)
            log(
                f"{name:>10} {kv_dtype}: {res.best_mb_s:,.0f} MB/s = "
                f"{res.ratio_to_loopback:.2f} x loopback"
            )
    for kv_dtype in kv_dtypes if ttft_model else ():
        for name in ttft_transports:
            share = measure_ttft_share(
                ttft_model, name, shape.tokens, ttft_runs, kv_dtype=kv_dtype, processes=processes
            )
            report.ttft.append(share)
            log(f"{name:>10} {kv_dtype}: kv_transfer_s / ttft_s = {share.share_of_ttft:.1%}")
    return report


# Each gRPC transport against the bare stream of its own stack (the report's field).
OWN_STACK = {"grpc": "grpc_stack_best_mb_s", "flight": "flight_stack_best_mb_s"}


def own_stack_ratio(report: dict, transport: str, best_mb_s: float) -> str:
    """The transport's best / its own stack's bare ceiling, formatted; "-" for the others."""
    stack = report.get(OWN_STACK.get(transport, ""), 0.0)
    return f"{best_mb_s / stack:.2f}" if stack else "-"


def format_report(r: TransferReport) -> str:
    s = r.shape
    kv = (
        f"KV per push: {s['bytes_per_push'] / MiB:.1f} MiB ({s['tokens']} tokens x "
        f"{s['num_layers']} layers, block {s['block_size']}, {s['num_kv_heads']} kv heads x "
        f"{s['head_dim']}, {s['dtype']}; source blocks {s.get('src_blocks', 'shuffled')})"
    )
    limit = (
        f"loopback TCP (limit): best {r.loopback_best_mb_s:,.0f} MB/s, "
        f"median {r.loopback_median_mb_s:,.0f} MB/s\n"
        f"bare grpcio stream of 4 MiB messages (Python gRPC's own ceiling): "
        f"{r.grpc_stack_best_mb_s:,.0f} MB/s = {r.grpc_stack_best_mb_s / r.loopback_best_mb_s:.2f} x loopback\n"
        f"bare Arrow Flight stream of 4 MiB batches (the flight transport's stack): "
        f"{r.flight_stack_best_mb_s:,.0f} MB/s = "
        f"{r.flight_stack_best_mb_s / r.loopback_best_mb_s:.2f} x loopback\n"
        f"single-thread memcpy of the same bytes (limit of a write into memory): "
        f"{r.memcpy_best_mb_s:,.0f} MB/s"
        + ("\nreceivers in a second process" if r.processes else "")
    )
    header = (
        f"{'transport':<12}{'KV':>6}{'MiB':>7}{'best MB/s':>12}{'median MB/s':>13}{'x loopback':>12}"
        f"{'x stack':>9}{'x memcpy':>10}{'frames':>8}{'bytes ok':>10}"
    )
    lines = [f"{' KV Transfer Benchmark ':=^78}", kv, limit, header]
    d = r.to_dict()
    for t in r.transports:
        lines.append(
            f"{t.transport:<12}{t.kv_dtype:>6}{t.bytes_per_push / MiB:>7.1f}{t.best_mb_s:>12,.0f}{t.median_mb_s:>13,.0f}"
            f"{t.ratio_to_loopback:>12.2f}{own_stack_ratio(d, t.transport, t.best_mb_s):>9}"
            f"{t.best_mb_s / max(r.memcpy_best_mb_s, 1e-9):>10.2f}"
            f"{t.frames_per_push:>8}{t.bytes_ok!s:>10}"
        )
    if r.ttft:
        lines.append(
            f"{'transport':<12}{'KV':>6}{'prompt':>8}{'prefill s':>11}{'kv exposed s':>14}"
            f"{'TTFT s':>9}{'KV MiB':>8}{'share':>8}"
        )
    for t in r.ttft:
        lines.append(
            f"{t.transport:<12}{t.kv_dtype:>6}{t.prompt_tokens:>8}{t.prefill_s:>11.3f}"
            f"{t.kv_transfer_s:>14.4f}{t.ttft_s:>9.3f}{t.kv_bytes / MiB:>8.1f}"
            f"{t.share_of_ttft:>8.1%}"
        )
    lines.append("=" * 78)
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("transfer", help="KV transfer MB/s per transport vs loopback bandwidth")
    p.add_argument("--transports", default=",".join(TRANSPORT_NAMES))
    p.add_argument("--tokens", type=int, default=1024, help="prompt tokens whose KV is pushed")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--loopback-mib", type=int, default=256, help="bytes per loopback repeat")
    p.add_argument("--model", default="embedded", help="model for the TTFT share")
    p.add_argument("--ttft-transports", default="grpc", help="comma-separated; '' skips")
    p.add_argument("--ttft-runs", type=int, default=3)
    p.add_argument(
        "--kv-dtypes",
        default="fp32",
        help=f"comma-separated KV cache formats to push and serve, side by side: {KV_DTYPES}",
    )
    p.add_argument(
        "--processes",
        action="store_true",
        help="each receiver (and the TTFT cluster's workers) in a second process",
    )
    p.add_argument(
        "--src-blocks",
        choices=("shuffled", "in-order"),
        default="shuffled",
        help="the sender's blocks per lease position: shuffled (fragmented, no run merges) "
        "or in-order (a fresh prefill's; nixl writes each run of blocks as one)",
    )
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=CacheConfig.num_blocks,
        help="blocks a layer in each side's cache (a worker's default), the prompt's first",
    )
    p.add_argument("--json", dest="json_out", default=None)
    p.set_defaults(func=cmd_transfer)


def _names(csv: str) -> list[str]:
    names = [n.strip() for n in csv.split(",") if n.strip()]
    unknown = set(names) - set(TRANSPORT_NAMES)
    if unknown:
        raise SystemExit(f"unknown transport(s) {sorted(unknown)}; known: {TRANSPORT_NAMES}")
    return names


def _kv_dtypes(csv: str) -> list[str]:
    names = [n.strip() for n in csv.split(",") if n.strip()]
    unknown = sorted(set(names) - set(KV_DTYPES))
    if unknown or not names:
        raise SystemExit(f"--kv-dtypes: unknown or empty {unknown}; known: {KV_DTYPES}")
    return names


def cmd_transfer(args) -> int:
    kv_dtypes = _kv_dtypes(args.kv_dtypes)
    shape = KVShape(
        args.layers, args.block_size, args.kv_heads, args.head_dim, args.tokens,
        src_blocks=args.src_blocks, cache_blocks=args.cache_blocks,
    )  # fmt: skip
    report = run_transfer_bench(
        shape,
        _names(args.transports),
        args.repeats,
        args.loopback_mib * MiB,
        args.model,
        _names(args.ttft_transports),
        args.ttft_runs,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
        kv_dtypes=kv_dtypes,
        processes=args.processes,
    )
    print(format_report(report))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    return 0 if all(t.bytes_ok for t in report.transports) else 1
