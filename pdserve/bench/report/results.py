"""Rewrite the "Current results" section of a benchmarks page from benchmark JSON files.

    pdserve bench report OUT_DIR DOC        # scripts/benchmarks.sh: DOC is docs/BENCHMARKS.md

Reads whichever of OUT_DIR/{transfer,engine,router,serve,sweep}.json exist and replaces the
text between the ``<!-- results:start -->`` and ``<!-- results:end -->`` markers with: the
machine (CPU model), the limits measured in the same run, the targets that these files can
decide, and one table per benchmark. Everything else in the page is left alone. The page must
hold each marker once, the start marker under a ``## Current results`` heading; a page that
does not is refused, unchanged.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from kernels.cpu_extension import cpu_flags
from kernels.cpu_extension import cpu_model as cpu_name
from pdserve.bench.report.sections import (
    engine_section,
    markdown_table,
    router_section,
    serve_section,
    sweep_section,
    transfer_section,
)

START, END = "<!-- results:start -->", "<!-- results:end -->"
HEADING = "## Current results"
NAMES = ("transfer", "engine", "router", "serve", "sweep")


def cpu_model() -> str:
    """The CPU's model name and the vector extensions the kernels care about."""
    flags = cpu_flags()
    isa = [
        label
        for label, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
        if flag in flags
    ]
    return cpu_name() + (f" ({', '.join(isa)})" if isa else "")


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
    return ["### Limits measured in this run", ""] + markdown_table(
        ["limit", "value", "divides"], rows
    )


def _engine_row(e: dict, kind: str, batch: int, tokens: int) -> dict | None:
    rows = [r for r in e["rows"] if r["kind"] == kind and r["batch"] == batch]
    exact = [r for r in rows if r["tokens"] == tokens]
    return (exact or sorted(rows, key=lambda r: abs(r["tokens"] - tokens)) or [None])[0]


def _target(target: str, figure: str, met: bool) -> list[str]:
    return [target, figure, "yes" if met else "no"]


def _engine_targets(e: dict) -> list[list[str]]:
    rows = []
    if r := _engine_row(e, "decode", 1, 256):
        figure = f"{r['ratio']:.2f} at context {r['tokens']} (transformers {r['hf_ratio']:.2f})"
        rows.append(_target("decode, batch 1: MBU >= 0.8", figure, r["ratio"] >= 0.8))
    if r := _engine_row(e, "decode", 32, 256):
        rows.append(
            _target(
                "decode, batch 32, context 256: >= 1.5x transformers",
                f"{r['speedup']:.2f}x at context {r['tokens']}",
                r["speedup"] >= 1.5,
            )
        )
    if r := _engine_row(e, "prefill", 1, 1024):
        figure = f"{r['ratio']:.2f} at {r['tokens']} tokens (transformers {r['hf_ratio']:.2f})"
        rows.append(_target("prefill of 1,024 tokens: MFU >= 0.7", figure, r["ratio"] >= 0.7))
    return rows


def _transfer_targets(t: dict) -> list[list[str]]:
    rows = []
    grpc_like = [x for x in t["transports"] if x["transport"] in ("grpc", "flight")]
    if grpc_like:
        best = max(x["ratio_to_loopback"] for x in grpc_like)
        rows.append(
            _target(
                "gRPC KV transfer >= 0.5x loopback",
                ", ".join(f"{x['transport']} {x['ratio_to_loopback']:.2f}x" for x in grpc_like),
                best >= 0.5,
            )
        )
    if t.get("ttft"):
        worst = max(x["share_of_ttft"] for x in t["ttft"])
        rows.append(
            _target(
                f"exposed KV transfer < 5% of TTFT ({t['ttft'][0]['prompt_tokens']} tokens)",
                ", ".join(f"{x['transport']} {x['share_of_ttft']:.1%}" for x in t["ttft"]),
                worst < 0.05,
            )
        )
    return rows


def targets_section(data: dict) -> list[str]:
    """The targets these files decide, each with its figure from this run."""
    rows = _engine_targets(data["engine"]) if data.get("engine") else []
    rows += _transfer_targets(data["transfer"]) if data.get("transfer") else []
    if (cold := (data.get("serve") or {}).get("cold_start")) is not None:
        rows.append(
            _target(
                "first request after ready: TTFT <= 1.5x the median of the next ten",
                f"{cold['ratio']:.2f}x ({cold['first_ttft_s'] * 1e3:.0f} vs "
                f"{cold['median_next_ttft_s'] * 1e3:.0f} ms)",
                cold["ratio"] <= cold.get("target", 1.5),
            )
        )
    if r := data.get("router"):
        added = r["router_added_p50_ms"]
        met = added < r.get("target_ms", 2.0)
        rows.append(_target("router adds < 2 ms to TTFT at p50", f"{added:.2f} ms", met))
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
    ] + markdown_table(["target", "this run", "met?"], rows)


def generic_section(name: str, d) -> list[str]:
    """For benchmarks without a renderer here: rows of dicts, or top-level scalars."""
    out = [f"### {name} (`bench {name}`)", ""]
    rows = d.get("rows") if isinstance(d, dict) else d
    if isinstance(rows, list) and rows and isinstance(rows[0], dict):
        header = list(rows[0])
        return out + markdown_table(header, [[r.get(k, "") for k in header] for r in rows])
    scalars = [[k, v] for k, v in d.items() if isinstance(v, (int, float, str))]
    return out + markdown_table(["field", "value"], scalars)


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


def layout_error(text: str) -> str | None:
    """Why ``text`` cannot take the results section (None when it can): each marker once, the
    start marker before the end one and under the ``## Current results`` heading."""
    if text.count(START) != 1 or text.count(END) != 1:
        return f"markers {START} / {END} not found exactly once"
    if text.index(START) > text.index(END):
        return f"{END} comes before {START}"
    if HEADING not in text or text.index(HEADING) > text.index(START):
        return f"{START} is not under a '{HEADING}' heading"
    return None


def rewrite(out_dir: Path, doc: Path) -> int:
    """Replace the section of ``doc`` between the markers; 1 (and ``doc`` untouched) when its
    layout is wrong."""
    text = doc.read_text()
    if error := layout_error(text):
        print(f"{doc}: {error}", file=sys.stderr)
        return 1
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{START}\n{render(out_dir)}{END}{tail}")
    print(f"updated {doc}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="rewrite a page's results section from benchmark JSON",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("out_dir", type=Path, help="the folder of {transfer,engine,...}.json")
    p.add_argument("doc", type=Path, help="the page to rewrite (docs/BENCHMARKS.md)")
    p.set_defaults(func=lambda args: rewrite(args.out_dir, args.doc))
