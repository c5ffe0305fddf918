"""Decode tokens/s of pdserve with fp32 / int8 / q4 weights beside llama.cpp on the same Q4_1
GGUF file at the same thread count, in one run, with ratios.

llama.cpp is a baseline only (not a dependency): build its ``llama-batched-bench`` from the
llama-cpp-python sdist's vendored sources (docs/results/quantized.md says how) and pass the
folder of its binaries. Both sides decode ``--gen`` tokens per sequence after a ``--context``
token prompt, ``--batches`` sequences at once; pdserve's figure is the mean step time over
``--gen`` steps at that context (each step: the forward and the LM head, as llama.cpp's
decode); rounds alternate between the two so a shared machine's slow spells fall on both.

    pdserve bench quant --threads 2 --cpu-kernels avx512,avx2 \\
        --llama-bin avx512=/work/llama-build/cbuild/bin \\
        --llama-bin avx2=/work/llama-build/cbuild-avx2/bin

A llama.cpp build named like a pdserve build (``avx512``, ``avx2``) is its baseline: ratios
are printed against the llama.cpp build of the same instruction set, at the same batch and
against that build's best batched figure (its highest tokens/s over the batch sizes).

``--weights`` names formats; ``int8:fp32`` / ``q4:fp32`` are those weights with fp32
activations (the exact kernel) instead of the default int8 ones (kernels/csrc/quant_dot_cpu.cpp).

Each round measures pdserve in a fresh process (``--child``), as each llama.cpp run is one, so
both engines are measured the same way, round by round, while a VM's speed moves 15-30% from
minute to minute. The child is ``python -m pdserve.bench quant --child``, whose entry point asks
for huge pages before torch loads, as pdserve's own processes do (engine/hugepages.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from engine.model_files import embedded_gguf_path
from kernels import cpu_extension
from pdserve.bench.micro import engine as bench_engine


def llama_batched(binary: Path, gguf: Path, threads: int, context: int, gen: int, batches):
    """llama.cpp's decode tokens/s per batch size (its ``speed_tg``: batch x gen / time), the
    better of llama-batched-bench and, at batch 1, llama-bench (batched-bench's first
    configuration runs cold: it is run twice and the faster counts)."""
    batches = (batches[0], *batches)
    cmd = [
        str(binary / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
        "-c", str(max(batches) * (context + gen) + 64), "-b", "2048", "-ub", "512",
        "-npp", str(context), "-ntg", str(gen), "-npl", ",".join(map(str, batches)),
        "--output-format", "jsonl",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    best: dict[int, float] = {}
    for r in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
        best[int(r["pl"])] = max(best.get(int(r["pl"]), 0.0), float(r["speed_tg"]))
    if 1 in best:
        best[1] = max(best[1], llama_bench_tg(binary, gguf, threads, context, gen))
    return best


def llama_bench_tg(binary: Path, gguf: Path, threads: int, context: int, gen: int) -> float:
    """llama-bench's one-sequence generation tokens/s at depth ``context``."""
    cmd = [
        str(binary / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
        "-n", str(gen), "-d", str(context), "-r", "3", "-o", "json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    return max(float(r["avg_ts"]) for r in json.loads(out))


def pdserve_tokens_per_s(engine, batch: int, context: int, steps: int) -> float:
    """Mean decode tokens/s over ``steps`` steps of ``batch`` sequences at ``context``."""
    runner = bench_engine.EngineRunner(engine)
    seqs = runner._batch(batch, context, 1)
    for _ in range(2):
        runner.runner.execute(seqs)
    start = time.perf_counter()
    for _ in range(steps):
        runner.runner.execute(seqs)
    return batch * steps / (time.perf_counter() - start)


def measure_round(llama_bins, gguf, args, batches) -> dict:
    out: dict[str, dict[int, float]] = {}
    for name, binary in llama_bins.items():
        out[f"llama.cpp {name}"] = llama_batched(
            binary, gguf, args.threads, args.context, args.gen, batches
        )
    out.update(pdserve_in_child(args))
    return out


def pdserve_in_child(args) -> dict[str, dict[int, float]]:
    """One round of every pdserve row, measured by a fresh process of this subcommand."""
    cmd = [sys.executable, "-m", "pdserve.bench", "quant", "--child",
           "--threads", str(args.threads), "--batches", args.batches,
           "--context", str(args.context), "--gen", str(args.gen),
           "--weights", args.weights, "--cpu-kernels", args.cpu_kernels,
           "--kv-dtype", args.kv_dtype]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    return {name: {int(b): tps for b, tps in per_batch.items()} for name, per_batch in rows.items()}


def measure_pdserve(args, batches) -> dict[str, dict[int, float]]:
    """Every pdserve row (format x build) once, in this process."""
    variants = tuple(v for v in args.cpu_kernels.split(",") if v) or (
        cpu_extension.selected_variant(),
    )
    out = {}
    for fmt in args.weights.split(","):
        engine = bench_engine._engine(
            "embedded", (16,), batches, (args.context + 8,), fmt.split(":")[0], args.kv_dtype,
            activations=(fmt.split(":") + ["int8"])[1],
        )[1]  # fmt: skip
        for v in variants:
            bench_engine.use_cpu_kernels(engine.runner.model, v)
            out[f"pdserve {fmt} {v}"] = {
                b: pdserve_tokens_per_s(engine, b, args.context, args.gen) for b in batches
            }
    return out


def best_of(rounds: list[dict]) -> dict:
    best: dict[str, dict[int, float]] = {}
    for r in rounds:
        for name, per_batch in r.items():
            for b, tps in per_batch.items():
                best.setdefault(name, {})[b] = max(best.get(name, {}).get(b, 0.0), tps)
    return best


def baselines_for(name: str, best: dict) -> list[str]:
    """The llama.cpp rows a pdserve row is compared with: the build of the same instruction set
    (``pdserve q4 avx2`` with ``llama.cpp avx2``) where there is one, else every llama.cpp row."""
    llamas = [n for n in best if n.startswith("llama.cpp")]
    same_isa = f"llama.cpp {name.rsplit(' ', 1)[-1]}"
    return [same_isa] if same_isa in llamas else llamas


def report(best: dict, batches, meta: dict) -> str:
    lines = [
        (
            f"CPU {meta['cpu_model']}  ISA {meta['cpu_isa']}  threads {meta['threads']}  "
            f"load average before {meta['load_before']}  after {meta['load_after']}"
        ),
        (
            f"context {meta['context']} tokens, {meta['gen']} decode steps, pdserve KV "
            f"{meta['kv_dtype']}; tokens/s (best round)"
        ),
        f"{'engine':<28}" + "".join(f"{'b=' + str(b):>10}" for b in batches),
    ]
    for name, per_batch in best.items():
        lines.append(f"{name:<28}" + "".join(f"{per_batch[b]:>10.1f}" for b in batches))
    lines.append("ratios: pdserve / llama.cpp at the same batch (same instruction set)")
    for name, per_batch in best.items():
        if not name.startswith("pdserve"):
            continue
        for lname in baselines_for(name, best):
            lrow = best[lname]
            top = max(lrow.values())
            same = "".join(f"{per_batch[b] / lrow[b]:>9.2f}x" for b in batches)
            vs_top = " ".join(f"{per_batch[b] / top:.2f}x" for b in batches if b > 1)
            lines.append(f"  {name:<26}{same}   vs {lname} (b>1 vs its best {top:.1f}: {vs_top})")
    return "\n".join(lines)


def add_parser(sub) -> None:
    doc = __doc__.splitlines()[0]
    p = sub.add_parser("quant", help="decode tokens/s of fp32 / int8 / q4 weights vs llama.cpp",
                       description=doc)  # fmt: skip
    p.add_argument("--llama-bin", action="append", default=[],
                   help="NAME=FOLDER (or FOLDER) of llama.cpp binaries; repeatable")  # fmt: skip
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--weights", default="fp32,int8,q4")
    p.add_argument("--cpu-kernels", default="", help="pdserve variants, e.g. avx512,avx2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-dtype", default="fp32", help="pdserve's KV cache: fp32 | int8")
    p.add_argument("--llama-gguf", default=None,
                   help="the GGUF file llama.cpp runs (default: the embedded Q4_1 one); an f32 "
                        "conversion compares fp32 with fp32")  # fmt: skip
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help="measure pdserve once; print JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    torch.set_num_threads(args.threads)
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.child:
        print(json.dumps(measure_pdserve(args, batches)))
        return 0
    llama_bins = dict((s.split("=", 1) if "=" in s else (Path(s).name, s)) for s in args.llama_bin)
    llama_bins = {k: Path(v) for k, v in llama_bins.items()}
    load_before = os.getloadavg()
    gguf = Path(args.llama_gguf) if args.llama_gguf else embedded_gguf_path()
    rounds = [measure_round(llama_bins, gguf, args, batches) for _ in range(args.rounds)]
    best = best_of(rounds)
    meta = {
        **cpu_extension.describe(),
        "threads": args.threads,
        "context": args.context,
        "gen": args.gen,
        "kv_dtype": args.kv_dtype,
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "gguf": str(gguf),
    }
    print(report(best, batches, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=2))
    return 0
