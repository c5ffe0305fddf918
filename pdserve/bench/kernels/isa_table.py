"""The side-by-side table of docs/results/isa_variants.md from repeated ``bench engine`` runs.

Each JSON is one run (``pdserve bench engine --cpu-kernels ... --json``); runs of the same
setting (same CPU and ISA caps) are merged by taking each row's fastest time across runs: on a
shared machine the fastest is the least disturbed, as within a run. The transformers column
is merged the same way; MBU and MFU are recomputed against the best limits of the runs.

    pdserve bench isa-table RUN.json [RUN.json ...]
"""

from __future__ import annotations

import json
from collections import defaultdict


def setting(result: dict) -> str:
    caps = result.get("isa_limits") or {}
    cap = "AVX2-only emulation (" + ", ".join(f"{k}={v}" for k, v in caps.items()) + ")"
    return f"{result['cpu_model']}, {result['cpu_isa']}; torch/oneDNN/MKL: " + (
        cap if caps else "native"
    )


def merge(results: list[dict]) -> dict:
    """Fastest seconds per (kind, batch, tokens, variant) and of transformers, across runs."""
    best: dict = defaultdict(lambda: float("inf"))
    hf: dict = defaultdict(lambda: float("inf"))
    ratio_per_second: dict = {}
    for res in results:
        for r in res["rows"]:
            key = (r["kind"], r["batch"], r["tokens"])
            best[(*key, r["cpu_kernels"])] = min(best[(*key, r["cpu_kernels"])], r["seconds"])
            hf[key] = min(hf[key], r["hf_seconds"])
            # ratio * seconds = work / limit: constant per workload up to the limit measured
            limit_scale = r["ratio"] * r["seconds"]
            ratio_per_second[key] = min(ratio_per_second.get(key, limit_scale), limit_scale)
    return {"best": best, "hf": hf, "ratio_per_second": ratio_per_second}


def table(results: list[dict]) -> str:
    merged = merge(results)
    variants = results[0]["cpu_kernels"]
    lines = [
        f"**{setting(results[0])}** — {len(results)} run(s), threads {results[0]['threads']}",
        "",
        "| workload | " + " | ".join(f"{v} ms (ratio)" for v in variants)
        + " | transformers ms | best variant vs transformers |",
        "|---|" + "---:|" * (len(variants) + 2),
    ]  # fmt: skip
    for key, hf_s in merged["hf"].items():
        kind, batch, tokens = key
        name = f"prefill {tokens}" if kind == "prefill" else f"decode b{batch} ctx {tokens}"
        scale = merged["ratio_per_second"][key]
        cells = []
        for v in variants:
            s = merged["best"][(*key, v)]
            cells.append(f"{s * 1e3:.1f} ({scale / s:.2f})")
        fastest = min(merged["best"][(*key, v)] for v in variants)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {hf_s * 1e3:.1f} | "
                     f"{hf_s / fastest:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def add_parser(sub) -> None:
    doc = __doc__.splitlines()[0]
    p = sub.add_parser("isa-table", help="merge `bench engine` runs into the ISA variants table",
                       description=doc)  # fmt: skip
    p.add_argument("paths", nargs="+", metavar="RUN.json", help="`bench engine --json` files")
    p.set_defaults(func=run)


def run(args) -> int:
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in args.paths:
        with open(path) as f:
            result = json.load(f)
        groups[setting(result) + "/" + ",".join(result["cpu_kernels"])].append(result)
    print("\n\n".join(table(runs) for runs in groups.values()))
    return 0
