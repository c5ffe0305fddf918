"""Micro-benchmark of one attention layer: prefill and decode, Triton vs the torch path.

On CUDA it times the Triton kernels and the torch path (SDPA over gathered KV) at serving
shapes; on CPU only the torch path (the production CPU path), at smaller shapes. As the
design asks, each result is reported against a limit measured here in the same run:
decode against copy bandwidth (MBU), prefill against matmul throughput (MFU).

    pdserve bench attention [--dtype bfloat16] [--block-size 16]
    python -m pdserve.bench.kernels.attention ...     # the same, importing no other benchmark
"""

from __future__ import annotations

import functools

import torch

from engine.block_manager import blocks_for
from kernels import ops
from kernels.metadata import AttentionMetadata
from pdserve.measure.timing import timed

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def copy_bandwidth(device: str, dtype: torch.dtype) -> float:
    """Bytes/s of a large device copy (read + write): the practical bandwidth ceiling."""
    src = torch.empty(2**30 if device == "cuda" else 2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10, best=True, device=device)


def matmul_flops(device: str, dtype: torch.dtype) -> float:
    n = 4096 if device == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ a, 10, best=True, device=device)


def make_batch(query_lens, seq_lens, block_size, device, dtype):
    needed = [blocks_for(s, block_size) for s in seq_lens]
    order = torch.randperm(sum(needed)).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(order[at : at + n])
        at += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    shape = (sum(needed), block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
    return query, k_cache, v_cache, meta


DEFAULT_MIN_ROWS = ops.CPU_PREFILL_KERNEL_MIN_ROWS


def _prefill_variants(device, dtype, backends):
    """(label, backend, C++ kernel threshold): on CPU fp32 the torch path runs the C++ causal
    kernel, shown beside torch's own flash attention (SDPA) on the same inputs."""
    variants = [(b, b, DEFAULT_MIN_ROWS) for b in backends]
    if device == "cpu" and dtype == torch.float32 and ops.cpu_extension.load() is not None:
        variants = [("cpp", "torch", DEFAULT_MIN_ROWS), ("sdpa", "torch", 1 << 62)]
    return variants


def bench_prefill(device, dtype, block_size, backends, peak_flops, reps):
    prompt = 2048 if device == "cuda" else 512
    for name, q_lens, s_lens in [
        ("prompt", [prompt] * 4, [prompt] * 4),
        ("chunk", [prompt // 2] * 4, [prompt] * 4),  # second half of each prompt
    ]:
        q, kc, vc, meta = make_batch(q_lens, s_lens, block_size, device, dtype)
        # Causal: query j attends to (context + j + 1) keys; 4 = two matmuls x multiply-add.
        pairs = sum(
            q_len * (s - q_len) + q_len * (q_len + 1) / 2 for q_len, s in zip(q_lens, s_lens)
        )
        flops = 4 * pairs * NUM_HEADS * HEAD_DIM
        for label, backend, min_rows in _prefill_variants(device, dtype, backends):
            ops.CPU_PREFILL_KERNEL_MIN_ROWS = min_rows
            secs = timed(
                functools.partial(
                    ops.prefill_attention, q, kc, vc, meta, HEAD_DIM**-0.5, backend=backend
                ),
                reps,
                device=device,
            )
            ops.CPU_PREFILL_KERNEL_MIN_ROWS = DEFAULT_MIN_ROWS
            print(
                f"prefill {name:7s} {label:6s} {secs * 1e3:8.3f} ms "
                f"{flops / secs / 1e12:7.2f} TFLOP/s  MFU {flops / secs / peak_flops:6.1%}"
            )


def bench_decode(device, dtype, block_size, backends, bandwidth, reps):
    batch, context = (64, 2048) if device == "cuda" else (16, 512)
    q, kc, vc, meta = make_batch([1] * batch, [context] * batch, block_size, device, dtype)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kc.element_size()
    for backend in backends:
        secs = timed(
            functools.partial(
                ops.decode_attention, q, kc, vc, meta, HEAD_DIM**-0.5, backend=backend
            ),
            reps,
            device=device,
        )
        print(
            f"decode  b{batch}x{context} {backend:6s} {secs * 1e3:8.3f} ms "
            f"{kv_bytes / secs / 1e9:8.1f} GB/s  MBU {kv_bytes / secs / bandwidth:6.1%}"
        )


def add_parser(sub) -> None:
    p = sub.add_parser(
        "attention", help=__doc__.splitlines()[0], description=__doc__.splitlines()[0]
    )
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device == "cuda" else "float32"))
    backends = ["triton", "torch"] if device == "cuda" and ops.TRITON_AVAILABLE else ["torch"]
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device, dtype)
    peak = matmul_flops(device, dtype)
    print(
        f"device={device} dtype={dtype} block_size={args.block_size} heads={NUM_HEADS}/"
        f"{NUM_KV_HEADS} head_dim={HEAD_DIM} threads={torch.get_num_threads()}"
    )
    print(f"measured limits: copy {bandwidth / 1e9:.1f} GB/s, matmul {peak / 1e12:.2f} TFLOP/s")
    bench_prefill(device, dtype, args.block_size, backends, peak, args.reps)
    bench_decode(device, dtype, args.block_size, backends, bandwidth, args.reps)
    return 0


if __name__ == "__main__":  # alone, for GPU images without the serving dependencies
    from pdserve.bench import run_alone

    raise SystemExit(run_alone(add_parser))
