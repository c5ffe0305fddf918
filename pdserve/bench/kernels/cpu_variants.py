"""The decode matmuls per CPU kernel variant: the skinny kernel's AVX-512 and AVX2 builds
beside oneDNN's packed kernel and torch's F.linear (MKL), on SmolLM2-135M's projections.

A decode step is a weight stream: every layer's weights are read once per step, from memory.
So the weights of all 30 layers are distinct tensors (~425 MB, beyond the caches) and one
"step" runs every projection of every layer on the same few rows, as the engine does. Each
result is a fraction of the read bandwidth measured in the same run (MBU); the variants are
timed in turn within each repetition, so a shared machine's slow spells fall on all alike.

    pdserve bench cpu-variants [--threads 2] [--rows 1,8,32] [--json out.json]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from kernels import cpu_extension
from pdserve.bench.micro.limits import read_bandwidth

HIDDEN, INTER, LAYERS = 576, 1536, 30
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [N, K]


def make_weights(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]


def implementations(weights) -> dict:
    """name -> step(x_by_k): every projection once on the rows of x of its input width."""
    impls = {}
    tiles = None
    for name in cpu_extension.runnable_variants():
        ext = cpu_extension.load(name)
        if ext is None:
            continue
        tiles = tiles or [ext.pack_skinny_weight(w) for w in weights]  # same layout in all
        impls[f"skinny-{name}"] = _skinny_step(ext, weights, tiles)
    if torch.backends.mkldnn.is_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        impls["onednn"] = lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(weights, packed)
        ]
    impls["torch-F.linear"] = lambda xs: [F.linear(xs[w.shape[1]], w) for w in weights]
    return impls


def _skinny_step(ext, weights, tiles):
    return lambda xs: [
        ext.skinny_linear(xs[w.shape[1]], t, w.shape[0]) for w, t in zip(weights, tiles)
    ]


def measure(impls, weights, rows: int, reps: int) -> dict[str, float]:
    """Best seconds per step of each implementation, interleaved repetition by repetition."""
    g = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=g) for k in {w.shape[1] for w in weights}}
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(reps + 1):  # the first round warms up
        for name, step in impls.items():
            t = time.perf_counter()
            step(xs)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def add_parser(sub) -> None:
    doc = __doc__.splitlines()[0]
    p = sub.add_parser("cpu-variants", help="decode matmuls per CPU kernel build vs oneDNN, MKL",
                       description=doc)  # fmt: skip
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = make_weights()
    nbytes = sum(w.numel() for w in weights) * 4
    impls = implementations(weights)
    bandwidth = read_bandwidth()
    info = {**cpu_extension.describe(), "threads": torch.get_num_threads()}
    info["read_bandwidth_gbs"] = bandwidth / 1e9
    print(f"CPU {info['cpu_model']}  instruction sets {info['cpu_isa']}  threads "
          f"{info['threads']}  read bandwidth {bandwidth / 1e9:.1f} GB/s  weights "
          f"{nbytes / 1e6:.0f} MB")  # fmt: skip
    print(f"{'rows':>5}{'implementation':>18}{'ms/step':>10}{'GB/s':>8}{'MBU':>7}{'GFLOP/s':>9}")
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, t in measure(impls, weights, rows, args.reps).items():
                flops = 2 * rows * nbytes / 4
                results.append({"rows": rows, "impl": name, "seconds": t,
                                "mbu": nbytes / t / bandwidth, "gflops": flops / t / 1e9})  # fmt: skip
                print(f"{rows:>5}{name:>18}{t * 1e3:>10.2f}{nbytes / t / 1e9:>8.1f}"
                      f"{nbytes / t / bandwidth:>7.2f}{flops / t / 1e9:>9.1f}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "results": results}, indent=2) + "\n")
    return 0
