"""The per-benchmark tables of the "Current results" section (pdserve/bench/report/results.py).

One function per benchmark JSON file: ``transfer_section``, ``serve_section``,
``sweep_section``, ``engine_section``, ``router_section``; each returns the section's lines.
"""

from __future__ import annotations

from pdserve.bench.micro.transfer import own_stack_ratio


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
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
    out += markdown_table(
        ["transport", "best MB/s", "median MB/s", "x loopback", "x own bare stack", "bytes ok"],
        rows,
    )
    return out + (_ttft_share(d["ttft"]) if d.get("ttft") else [])


def _ttft_share(ttft: list[dict]) -> list[str]:
    rows = [
        [
            t["transport"],
            t["prompt_tokens"],
            f"{t['prefill_s']:.3f}",
            f"{t['kv_transfer_s']:.4f}",
            f"{t['ttft_s']:.3f}",
            f"{t['share_of_ttft']:.1%}",
        ]
        for t in ttft
    ]
    header = ["transport", "prompt tokens", "prefill s", "exposed KV s", "TTFT s"]
    return ["", "Share of TTFT (layer-wise streaming; median of runs):", ""] + markdown_table(
        header + ["KV share of TTFT"], rows
    )


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
    return out + markdown_table(["metric", "value"], rows)


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
    return out + markdown_table(
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
    return out + markdown_table(header + ["speedup"], rows)


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
    return out + markdown_table(header + ["bare hop added ms"], rows)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.2f}"
