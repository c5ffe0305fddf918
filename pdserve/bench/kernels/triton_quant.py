"""Micro-benchmark of the weight-only matmuls on CUDA: the Triton int8 / q4 kernels
(kernels/triton_quant.py) against cuBLAS (``F.linear``) on the dequantized weight in the
activations' dtype, and torch's own ``_weight_int8pack_mm`` (int8, bf16/fp16 activations where
this torch has it). Decode shapes (few rows) of SmolLM2-135M and a Llama-7B-sized layer.

As the design asks, each kernel is reported against a limit measured here in the same run:
the bytes it must read (codes + scales, or the dequantized weight for cuBLAS) over its time,
as a fraction of the device's copy bandwidth (MBU).

    pdserve bench triton-quant [--dtypes bfloat16,float32] [--rows 1,8,32,64]
        [--json out.json]
    python -m pdserve.bench.kernels.triton_quant ...  # the same, importing no other benchmark

``--device cpu`` (with TRITON_INTERPRET=1) runs one tiny shape under the interpreter: a check
that the script runs, not a timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import quant
from pdserve.measure.timing import timed

SHAPES = {  # name: (K, N)
    "smollm2.qkv": (576, 1728),
    "smollm2.gate_up": (576, 3072),
    "smollm2.down": (1536, 576),
    "smollm2.lm_head": (576, 49152),
    "llama7b.qkv": (4096, 12288),
    "llama7b.gate_up": (4096, 22016),
    "llama7b.down": (11008, 4096),
}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a 1 GiB device copy (read + write): the practical bandwidth ceiling."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10, best=True, device=device)


def torch_int8pack(x: torch.Tensor, qw: quant.QuantizedWeight):
    """torch's weight-only int8 matmul as a callable, or None where this build lacks it for
    these activations (its CUDA kernel takes bf16 / fp16)."""
    scale = qw.scale.to(x.dtype)
    try:
        torch.ops.aten._weight_int8pack_mm(x, qw.q, scale)
    except (RuntimeError, NotImplementedError):
        return None
    return lambda: torch.ops.aten._weight_int8pack_mm(x, qw.q, scale)


def bench_shape(name, k, n, rows, dtype, device, reps, bandwidth) -> list[dict]:
    from kernels import triton_quant  # needs Triton: imported when a benchmark runs, not at --help

    w = torch.randn(n, k, device=device)
    x = torch.randn(rows, k, device=device, dtype=dtype)
    results = []

    def row(kernel, fn, nbytes):
        seconds = timed(fn, reps, device=device)
        results.append(
            {
                "shape": name,
                "k": k,
                "n": n,
                "rows": rows,
                "dtype": str(dtype).split(".")[-1],
                "kernel": kernel,
                "ms": seconds * 1e3,
                "bytes": nbytes,
                "mbu": nbytes / seconds / bandwidth,
            }
        )

    for fmt in ("int8", "q4"):
        qw = quant.quantize(w, fmt, 32)
        packed = triton_quant.pack(qw)
        row(f"triton {fmt}", lambda p=packed: triton_quant.quant_linear(x, p), qw.nbytes)
        dense = quant.dequantize(qw).to(dtype)
        row(f"cublas dequantized ({fmt})", lambda d=dense: F.linear(x, d), dense.nbytes)
        if fmt == "int8":
            fn = torch_int8pack(x, qw)
            if fn is not None:
                row("torch _weight_int8pack_mm", fn, qw.nbytes)
    return results


def add_parser(sub) -> None:
    doc = __doc__.splitlines()[0]
    p = sub.add_parser("triton-quant", help="the Triton int8 / q4 matmuls vs cuBLAS (CUDA)",
                       description=doc)  # fmt: skip
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--rows", default="1,8,32,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", type=Path)
    p.set_defaults(func=run)


def run(a) -> int:
    if a.device == "cpu":  # the interpreter: one tiny shape
        shapes, rows_list, reps, bandwidth = {"tiny": (64, 32)}, [1], 1, 1.0
    else:
        shapes = {s: SHAPES[s] for s in a.shapes.split(",")}
        rows_list, reps = [int(r) for r in a.rows.split(",")], a.reps
        bandwidth = copy_bandwidth(a.device)
        print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:,.0f} GB/s")
    results = []
    print(f"{'shape':<17}{'dtype':>9}{'rows':>5}  {'kernel':<28}{'ms':>9}{'MBU':>7}", flush=True)
    for dtype in (getattr(torch, d) for d in a.dtypes.split(",")):
        for name, (k, n) in shapes.items():
            for rows in rows_list:
                rows_out = bench_shape(name, k, n, rows, dtype, a.device, reps, bandwidth)
                for r in rows_out:  # as measured: a run cut short still shows its rows
                    print(
                        f"{r['shape']:<17}{r['dtype']:>9}{r['rows']:>5}  {r['kernel']:<28}"
                        f"{r['ms']:>9.4f}{r['mbu']:>7.2f}",
                        flush=True,
                    )
                results += rows_out
    if a.json:
        a.json.write_text(json.dumps({"bandwidth": bandwidth, "results": results}, indent=1))
    return 0


if __name__ == "__main__":  # alone, for GPU images without the serving dependencies
    from pdserve.bench import run_alone

    raise SystemExit(run_alone(add_parser))
