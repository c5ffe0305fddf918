"""`pdserve bench report`: the regenerated results section of a benchmarks page (layout, never
speed), on pages the tests build themselves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.report import results as report

TRANSFER = {
    "shape": {"tokens": 1024, "num_layers": 30, "dtype": "float32", "bytes_per_push": 47185920},
    "loopback_best_mb_s": 3000.0,
    "loopback_median_mb_s": 2900.0,
    "grpc_stack_best_mb_s": 1200.0,
    "flight_stack_best_mb_s": 1800.0,
    "transports": [
        {"transport": "grpc", "best_mb_s": 600.0, "median_mb_s": 550.0,
         "ratio_to_loopback": 0.2, "bytes_ok": True},
        {"transport": "flight", "best_mb_s": 900.0, "median_mb_s": 850.0,
         "ratio_to_loopback": 0.3, "bytes_ok": True},
    ],
    "ttft": [
        {"transport": "grpc", "prompt_tokens": 1024, "prefill_s": 1.7, "kv_transfer_s": 0.012,
         "ttft_s": 1.71, "share_of_ttft": 0.007},
    ],
}  # fmt: skip
ENGINE = {
    "threads": 1,
    "huge_pages": True,
    "gemm_peak_gflops": 190.0,
    "read_bandwidth_gbs": 14.0,
    "rows": [
        {"kind": "prefill", "batch": 1, "tokens": 1024, "seconds": 1.8, "hf_seconds": 2.9,
         "ratio": 0.75, "hf_ratio": 0.46, "speedup": 1.61},
        {"kind": "decode", "batch": 1, "tokens": 256, "seconds": 0.046, "hf_seconds": 0.077,
         "ratio": 0.81, "hf_ratio": 0.49, "speedup": 1.65},
        {"kind": "decode", "batch": 32, "tokens": 256, "seconds": 0.138, "hf_seconds": 0.28,
         "ratio": 0.46, "hf_ratio": 0.23, "speedup": 2.02},
    ],
}  # fmt: skip
ROUTER = {
    "prompt_tokens": 512,
    "separate_processes": True,
    "rows": [
        {"pattern": "back to back", "direct_p50_ms": 0.7, "routed_p50_ms": 2.6,
         "router_added_p50_ms": 1.9, "reserve_first_added_p50_ms": 2.4,
         "relay_added_p50_ms": 0.9},
    ],
    "router_added_p50_ms": 1.9,
    "relay_added_p50_ms": 0.9,
    "target_ms": 2.0,
}  # fmt: skip


PAGE = "# head\n\n## Current results\n\n<!-- results:start -->\nold\n<!-- results:end -->\n\ntail\n"


def _doc(tmp_path: Path, text: str = PAGE) -> Path:
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(text)
    return doc


def test_section_names_the_cpu_the_limits_and_the_targets(tmp_path):
    for name, data in (("transfer", TRANSFER), ("engine", ENGINE), ("router", ROUTER)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    doc = _doc(tmp_path)
    assert report.rewrite(tmp_path, doc) == 0
    text = doc.read_text()
    assert text.startswith("# head\n") and text.endswith("<!-- results:end -->\n\ntail\n")
    assert "old" not in text
    assert report.cpu_model() in text
    limits = text.split("### Limits measured in this run")[1].split("###")[0]
    for figure in ("3,000 MB/s", "1,200 MB/s = 0.40x", "1,800 MB/s = 0.60x", "190 GFLOP/s",
                   "14.0 GB/s", "0.90 ms"):  # fmt: skip
        assert figure in limits
    targets = text.split("### Targets decided by this run")[1].split("###")[0]
    assert (
        "| decode, batch 1: MBU >= 0.8 | 0.81 at context 256 (transformers 0.49) | yes |" in targets
    )
    assert "| gRPC KV transfer >= 0.5x loopback | grpc 0.20x, flight 0.30x | no |" in targets
    assert "| router adds < 2 ms to TTFT at p50 | 1.90 ms | yes |" in targets
    for section in ("### KV transfer", "### Engine", "### Router"):
        assert section in text
    # Regenerating from the same files gives the same page, and the page keeps its layout.
    report.rewrite(tmp_path, doc)
    assert doc.read_text() == text
    assert report.layout_error(text) is None


def test_no_files_leaves_a_note_and_missing_markers_fail(tmp_path):
    doc = _doc(tmp_path)
    assert report.rewrite(tmp_path, doc) == 0
    assert "_No results yet" in doc.read_text()
    doc.write_text("no markers\n")
    assert report.rewrite(tmp_path, doc) == 1


@pytest.mark.parametrize(
    "page",
    [
        PAGE.replace("<!-- results:end -->", "<!-- results:end --><!-- results:start -->"),
        PAGE + "<!-- results:end -->\n",
        PAGE.replace("## Current results\n\n", "") + "## Current results\n",
        "## Current results\n<!-- results:end -->\n<!-- results:start -->\n",
    ],
    ids=["two starts", "two ends", "not under the heading", "end before start"],
)
def test_a_page_without_one_marker_pair_under_the_heading_is_refused_unchanged(tmp_path, page):
    # The page needs each marker once, the start under "## Current results", or the section
    # would land in the wrong place; the refusal leaves the page as it was.
    doc = _doc(tmp_path, page)
    assert report.layout_error(page) is not None
    assert report.rewrite(tmp_path, doc) == 1
    assert doc.read_text() == page


def test_the_report_subcommand_takes_the_page_as_an_argument(tmp_path, capsys):
    from pdserve.bench import main as bench_main

    doc = _doc(tmp_path)
    assert bench_main(["report", str(tmp_path), str(doc)]) == 0
    assert "_No results yet" in doc.read_text() and "updated" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:  # no default page: the path is required
        bench_main(["report", str(tmp_path)])
    assert exit_info.value.code == 2


def test_the_cold_start_ratio_is_a_target_row():
    cold = {"first_ttft_s": 0.3, "median_next_ttft_s": 0.12, "ratio": 2.5, "target": 1.5}
    text = "\n".join(report.targets_section({"serve": {"cold_start": cold}}))
    assert "first request after ready" in text and "2.50x (300 vs 120 ms) | no" in text
    cold = {**cold, "first_ttft_s": 0.13, "ratio": 13 / 12}
    text = "\n".join(report.targets_section({"serve": {"cold_start": cold}}))
    assert "1.08x (130 vs 120 ms) | yes" in text
