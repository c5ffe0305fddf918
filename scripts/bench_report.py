"""Rewrite the "Current results" section of docs/BENCHMARKS.md from benchmark JSON files.

    python scripts/bench_report.py OUT_DIR [docs/BENCHMARKS.md]

Reads whichever of OUT_DIR/{transfer,engine,router,serve,sweep}.json exist and replaces the
text between the ``<!-- results:start -->`` and ``<!-- results:end -->`` markers with: the
machine (CPU model), the limits measured in the same run, the targets that these files can
decide, and one table per benchmark. Everything else in the page is left alone.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from pdserve.bench.micro.transfer import own_stack_ratio

START, END = "<!-- results:start -->", "<!-- results:end -->"
NAMES = ("transfer", "engine", "router", "serve", "sweep")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` elsewhere) and the
    vector extensions the kernels care about."""
    name, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    isa = [
        label
        for label, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
        if flag in flags
    ]
    return name + (f" ({', '.join(isa)})" if isa else "")


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _stack_sentence(d: dict) -> str:
    out = ""
    for key, what in (
        (
            "grpc_stack_best_mb_s",
            "A bare grpcio stream of 4 MiB messages (Python gRPC's own ceiling)",
        ),
        ("flight_stack_best_mb_s", "A bare Arrow Flight stream of 4 MiB batches"),
    ):
        if stack := d.get(key):
            out += f" {what} reaches {stack:,.0f} MB/s = {stack / d['loopback_best_mb_s']:.2f}x loopback."
    return out


def transfer_section(d: dict) -> list[str]:
    s = d["shape"]
    out = [
        "### KV transfer (`bench transfer`)",
        "",
        (
            f"{s['bytes_per_push'] / 2**20:.1f} MiB per push ({s['tokens']} tokens, "
            f"{s['num_layers']} layers, {s['dtype']}). Limit: loopback TCP, best "
            f"{d['loopback_best_mb_s']:,.0f} MB/s (median {d['loopback_median_mb_s']:,.0f})."
            + _stack_sentence(d)
        ),
        "",
    ]
    rows = [
        [
            t["transport"],
            f"{t['best_mb_s']:,.0f}",
            f"{t['median_mb_s']:,.0f}",
            f"{t['ratio_to_loopback']:.2f}",
            own_stack_ratio(d, t["transport"], t["best_mb_s"]),
            "yes" if t["bytes_ok"] else "NO",
        ]
        for t in d["transports"]
    ]
    out += _table(
        ["transport", "best MB/s", "median MB/s", "x loopback", "x own bare stack", "bytes ok"],
        rows,
    )
    if d.get("ttft"):
        rows = [
            [
                t["transport"],
                t["prompt_tokens"],
                f"{t['prefill_s']:.3f}",
                f"{t['kv_transfer_s']:.4f}",
                f"{t['ttft_s']:.3f}",
                f"{t['share_of_ttft']:.1%}",
            ]
            for t in d["ttft"]
        ]
        out += ["", "Share of TTFT (layer-wise streaming; median of runs):", ""]
        out += _table(
            [
                "transport",
                "prompt tokens",
                "prefill s",
                "exposed KV s",
                "TTFT s",
                "KV share of TTFT",
            ],
            rows,
        )
    return out


def serve_section(d: dict) -> list[str]:
    def opt(v, fmt):
        return "n/a" if v is None else fmt.format(v)

    out = [
        "### Serving (`bench serve`)",
        "",
        (
            f"{d.get('workload')} workload, {d['num_requests']} requests at "
            f"{d.get('request_rate')} req/s, model {d.get('model')}, SLOs TTFT "
            f"{d.get('slo_ttft_s')} s / TPOT {d.get('slo_tpot_s')} s."
        ),
        "",
    ]
    rows = [
        ["completed / failed", f"{d['completed']} / {d['failed']}"],
        ["request throughput (req/s)", f"{d['request_throughput']:.3f}"],
        ["request goodput (req/s)", opt(d.get("request_goodput"), "{:.3f}")],
        ["SLO attainment", opt(d.get("slo_attainment"), "{:.1%}")],
        ["output throughput (tok/s)", f"{d['output_throughput']:.1f}"],
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        rows.append(
            [
                f"{metric.upper()} mean / p50 / p90 / p99 (ms)",
                " / ".join(
                    f"{d[f'{s}_{metric}_ms']:.0f}" for s in ("mean", "median", "p90", "p99")
                ),
            ]
        )
    return out + _table(["metric", "value"], rows)


def sweep_section(d: dict) -> list[str]:
    rows = [
        [
            p["rate"],
            f"{p['slo_attainment']:.1%}",
            f"{p['request_goodput']:.3f}",
            f"{p['p90_ttft_ms']:.0f}",
            f"{p['p90_tpot_ms']:.1f}",
        ]
        for p in d["points"]
    ]
    out = [
        "### Rate sweep (`bench sweep`)",
        "",
        (
            f"Goodput (highest rate with >= {d['attainment_target']:.0%} of requests meeting "
            f"both SLOs): **{d['goodput']:g} req/s**."
        ),
        "",
    ]
    return out + _table(
        ["rate (req/s)", "attainment", "goodput (req/s)", "p90 TTFT ms", "p90 TPOT ms"], rows
    )


def engine_section(d: dict) -> list[str]:
    out = [
        "### Engine (`bench engine`)",
        "",
        (
            f"{d['threads']} thread(s). Limits: fp32 GEMM peak {d['gemm_peak_gflops']:.0f} GFLOP/s, "
            f"streaming read bandwidth {d['read_bandwidth_gbs']:.1f} GB/s"
            + (
                ""
                if "huge_pages" not in d
                else f", huge pages {'on' if d['huge_pages'] else 'off'}"
            )
            + ". Ratio = MFU for prefill, MBU for decode; transformers on the same workload and "
            "threads beside it."
        ),
        "",
    ]
    rows = [
        [
            r["kind"],
            r["batch"],
            r["tokens"],
            f"{r['seconds'] * 1e3:.1f}",
            f"{r['hf_seconds'] * 1e3:.1f}",
            f"{r['ratio']:.2f}",
            f"{r['hf_ratio']:.2f}",
            f"{r['speedup']:.2f}x",
        ]
        for r in d["rows"]
    ]
    header = ["phase", "batch", "tokens", "pdserve ms", "transformers ms", "ratio", "hf ratio"]
    return out + _table(header + ["speedup"], rows)


def router_section(d: dict) -> list[str]:
    where = "in separate processes" if d.get("separate_processes") else "in one process"
    out = [
        "### Router (`bench router`)",
        "",
        (
            f"{d['prompt_tokens']}-token prompts; instant fake workers, the router and the "
            f"client {where}. Added = routed p50 - direct p50."
        ),
        "",
    ]
    rows = d.get("rows") or [{"pattern": "all", **d}]  # older files: no patterns
    rows = [
        [
            r["pattern"],
            f"{r['direct_p50_ms']:.2f}",
            f"{r['routed_p50_ms']:.2f}",
            f"{r['router_added_p50_ms']:.2f}",
            _ms(r.get("reserve_first_added_p50_ms")),
            _ms(r.get("relay_added_p50_ms")),
        ]
        for r in rows
    ]
    header = ["requests", "direct p50 ms", "routed p50 ms", "added ms", "reserve-first added ms"]
    return out + _table(header + ["bare hop added ms"], rows)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def limits_section(data: dict) -> list[str]:
    """The limits measured in this run, which the figures below are divided by."""
    rows = []
    if t := data.get("transfer"):
        loop = t["loopback_best_mb_s"]
        rows.append(
            [
                "loopback TCP bandwidth (`bench transfer`)",
                f"{loop:,.0f} MB/s best, {t['loopback_median_mb_s']:,.0f} median",
                "KV transfer MB/s",
            ]
        )
        for key, what in (
            ("grpc_stack_best_mb_s", "bare grpcio stream, 4 MiB messages"),
            ("flight_stack_best_mb_s", "bare Arrow Flight stream, 4 MiB batches"),
        ):
            if v := t.get(key):
                rows.append([what, f"{v:,.0f} MB/s = {v / loop:.2f}x loopback", "its transport"])
    if e := data.get("engine"):
        pages = (
            "" if "huge_pages" not in e else f", huge pages {'on' if e['huge_pages'] else 'off'}"
        )
        rows.append(
            [
                f"fp32 GEMM peak, 2,048-cube `torch.mm` ({e['threads']} thread(s){pages})",
                f"{e['gemm_peak_gflops']:.0f} GFLOP/s",
                "prefill FLOP/s (MFU)",
            ]
        )
        rows.append(
            [
                f"streaming read bandwidth, sum over 2 GiB ({e['threads']} thread(s))",
                f"{e['read_bandwidth_gbs']:.1f} GB/s",
                "decode bytes/s (MBU)",
            ]
        )
    if (r := data.get("router")) and r.get("relay_added_p50_ms") is not None:
        rows.append(
            [
                "one bare `grpc.aio` hop (`bench router`)",
                f"{r['relay_added_p50_ms']:.2f} ms at p50",
                "router's added TTFT",
            ]
        )
    if not rows:
        return []
    return ["### Limits measured in this run", ""] + _table(["limit", "value", "divides"], rows)


def _engine_row(e: dict, kind: str, batch: int, tokens: int) -> dict | None:
    rows = [r for r in e["rows"] if r["kind"] == kind and r["batch"] == batch]
    exact = [r for r in rows if r["tokens"] == tokens]
    return (exact or sorted(rows, key=lambda r: abs(r["tokens"] - tokens)) or [None])[0]


def targets_section(data: dict) -> list[str]:
    """The targets these files decide, each with its figure from this run."""
    rows = []

    def add(target: str, figure: str, met: bool) -> None:
        rows.append([target, figure, "yes" if met else "no"])

    if e := data.get("engine"):
        if r := _engine_row(e, "decode", 1, 256):
            add(
                "decode, batch 1: MBU >= 0.8",
                f"{r['ratio']:.2f} at context {r['tokens']} (transformers {r['hf_ratio']:.2f})",
                r["ratio"] >= 0.8,
            )
        if r := _engine_row(e, "decode", 32, 256):
            add(
                "decode, batch 32, context 256: >= 1.5x transformers",
                f"{r['speedup']:.2f}x at context {r['tokens']}",
                r["speedup"] >= 1.5,
            )
        if r := _engine_row(e, "prefill", 1, 1024):
            add(
                "prefill of 1,024 tokens: MFU >= 0.7",
                f"{r['ratio']:.2f} at {r['tokens']} tokens (transformers {r['hf_ratio']:.2f})",
                r["ratio"] >= 0.7,
            )
    if t := data.get("transfer"):
        grpc_like = [x for x in t["transports"] if x["transport"] in ("grpc", "flight")]
        if grpc_like:
            best = max(x["ratio_to_loopback"] for x in grpc_like)
            add(
                "gRPC KV transfer >= 0.5x loopback",
                ", ".join(f"{x['transport']} {x['ratio_to_loopback']:.2f}x" for x in grpc_like),
                best >= 0.5,
            )
        if t.get("ttft"):
            worst = max(x["share_of_ttft"] for x in t["ttft"])
            add(
                f"exposed KV transfer < 5% of TTFT ({t['ttft'][0]['prompt_tokens']} tokens)",
                ", ".join(f"{x['transport']} {x['share_of_ttft']:.1%}" for x in t["ttft"]),
                worst < 0.05,
            )
    if (cold := (data.get("serve") or {}).get("cold_start")) is not None:
        add(
            "first request after ready: TTFT <= 1.5x the median of the next ten",
            f"{cold['ratio']:.2f}x ({cold['first_ttft_s'] * 1e3:.0f} vs "
            f"{cold['median_next_ttft_s'] * 1e3:.0f} ms)",
            cold["ratio"] <= cold.get("target", 1.5),
        )
    if r := data.get("router"):
        added = r["router_added_p50_ms"]
        add("router adds < 2 ms to TTFT at p50", f"{added:.2f} ms", added < r.get("target_ms", 2.0))
    if not rows:
        return []
    return [
        "### Targets decided by this run",
        "",
        (
            "Serving goodput and p99 ITL against colocated and vLLM need `bench compare` "
            "(`scripts/bench_compare.sh`); see the targets table above."
        ),
        "",
    ] + _table(["target", "this run", "met?"], rows)


def generic_section(name: str, d) -> list[str]:
    """For benchmarks without a renderer here: rows of dicts, or top-level scalars."""
    out = [f"### {name} (`bench {name}`)", ""]
    rows = d.get("rows") if isinstance(d, dict) else d
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        header = list(rows[0])
        return out + _table(header, [[r.get(k, "") for k in header] for r in rows])
    scalars = [[k, v] for k, v in d.items() if isinstance(v, (int, float, str))]
    return out + _table(["field", "value"], scalars)


def machine_line() -> str:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return (
        f"_Generated by `scripts/benchmarks.sh` on {time.strftime('%Y-%m-%d')} on "
        f"{cpu_model()}, {os.cpu_count()} logical CPUs, {platform.machine()}, Python "
        f"{platform.python_version()}, torch {torch_version}._"
    )


def render(out_dir: Path) -> str:
    lines = [machine_line(), ""]
    renderers = {
        "transfer": transfer_section,
        "engine": engine_section,
        "router": router_section,
        "serve": serve_section,
        "sweep": sweep_section,
    }
    data = {}
    for name in NAMES:
        path = out_dir / f"{name}.json"
        if path.is_file():
            data[name] = json.loads(path.read_text())
    if not data:
        lines.append("_No results yet: run `bash scripts/benchmarks.sh`._")
        return "\n".join(lines) + "\n"
    for head in (limits_section(data), targets_section(data)):
        if head:
            lines += head + [""]
    for name, d in data.items():
        section = renderers.get(name)
        lines += (section(d) if section else generic_section(name, d)) + [""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str]) -> int:
    out_dir = Path(argv[0])
    doc = Path(argv[1] if len(argv) > 1 else Path(__file__).parent.parent / "docs/BENCHMARKS.md")
    text = doc.read_text()
    if START not in text or END not in text:
        print(f"{doc}: markers {START} / {END} not found", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{START}\n{render(out_dir)}{END}{tail}")
    print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
