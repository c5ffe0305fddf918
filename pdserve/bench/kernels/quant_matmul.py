"""Milliseconds per matmul of the quantized skinny kernels (and the fp32 one) on SmolLM2-135M's
decode shapes, per build, per thread count: best of ``--repeats`` calls each, and the sum a
decode step would spend in them (30 layers x qkv, o, gate_up, down + the LM head; with q4 the
LM head is int8, as the engine runs it). A format ending in ``a8`` (``int8a8``, ``q4a8``) is
the same weights with int8 activations (kernels/csrc/quant_dot_cpu.cpp).

    pdserve bench quant-matmul --cpu-kernels avx512,avx2 --rows 1,8,32 --threads 1,2
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kernels import cpu_extension, quant
from pdserve.measure.timing import timed

LAYERS = 30
SHAPES = {  # name: (N, K); SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, vocab 49152
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
FORMATS = ("fp32", "int8", "q4", "int8a8", "q4a8")


def packed_weight(module, fmt: str, name: str, weight: torch.Tensor) -> torch.Tensor:
    if fmt == "fp32":
        return module.pack_skinny_weight(weight)
    activations = "int8" if fmt.endswith("a8") else "fp32"
    fmt = fmt.removesuffix("a8")
    if fmt == "q4" and name == "lm_head":  # the tied embedding stays at 8 bits (as the file)
        fmt = "int8"
    return quant.pack(quant.quantize(weight, fmt, 32), activations)


def time_matmuls(linear, pack, formats, rows, threads, repeats) -> list[dict]:
    """One record per (format, threads, rows): ms per shape and the decode step's sum.
    ``linear(x, packed, n)`` is the kernel; ``pack(fmt, name, weight)`` its packing."""
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k) * 0.05 for name, (n, k) in SHAPES.items()}
    out = []
    for fmt in formats:
        packed = {name: pack(fmt, name, w) for name, w in weights.items()}
        for t in threads:
            torch.set_num_threads(t)
            for m in rows:
                ms = {}
                for name, (n, k) in SHAPES.items():
                    x = torch.randn(m, k)
                    reps = max(3, repeats // 10) if name == "lm_head" else repeats
                    call = lambda x=x, w=packed[name], n=n: linear(x, w, n)
                    ms[name] = timed(call, reps, best=True) * 1e3
                step = LAYERS * sum(ms[s] for s in ("qkv", "o", "gate_up", "down")) + ms["lm_head"]
                out.append({"format": fmt, "threads": t, "rows": m, "ms": ms, "step_ms": step})
    return out


def report(records: list[dict], label: str) -> str:
    lines = [f"{label}: ms per matmul (best of N) and a decode step's matmuls (step)"]
    lines.append(
        f"{'fmt':<6}{'thr':>4}{'rows':>5}" + "".join(f"{s:>10}" for s in SHAPES) + "      step"
    )
    for r in records:
        cells = "".join(f"{r['ms'][s]:>10.4f}" for s in SHAPES)
        lines.append(f"{r['format']:<6}{r['threads']:>4}{r['rows']:>5}{cells}{r['step_ms']:>10.3f}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def add_parser(sub) -> None:
    doc = __doc__.splitlines()[0]
    p = sub.add_parser("quant-matmul", help="ms per quantized skinny matmul, per build and threads",
                       description=doc)  # fmt: skip
    p.add_argument("--cpu-kernels", default="", help="builds, e.g. avx512,avx2 (default: chosen)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    variants = [v for v in args.cpu_kernels.split(",") if v] or [cpu_extension.selected_variant()]
    load_before = os.getloadavg()
    results = {}
    for v in variants:
        module = cpu_extension.load(v)
        if module is None:
            print(f"{v}: no build on this CPU")
            continue
        results[v] = time_matmuls(
            module.skinny_linear,
            lambda fmt, name, w, module=module: packed_weight(module, fmt, name, w),
            args.formats.split(","), _ints(args.rows), _ints(args.threads), args.repeats,
        )  # fmt: skip
        print(report(results[v], f"{v} build"))
    meta = {
        **cpu_extension.describe(),
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    print(f"CPU {meta['cpu_model']}  load average before {meta['load_before']}  "
          f"after {meta['load_after']}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0
