"""TTFT by kind of request (chat, longdoc, turn1..turnN): ``BenchResult.ttft_by_kind`` and
its lines in ``bench serve``'s report and ``bench compare``'s summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.bench import main as bench_main
from pdserve.metrics import RequestRecord, compute_result, format_result
from tests.test_bench_serve import fake_server, record  # noqa: F401 (fake_server: a fixture)


def test_ttft_by_kind_lines_up_with_the_completed_requests():
    """A failed request shifts no kind: each completed request's TTFT is counted under its
    own kind, and the report prints the kinds' medians and p90s."""
    kinds = ["turn1", "turn2", "turn2", "turn1", "turn2"]
    records = [record(t, [0.01], usage=2) for t in (1.0, 0.1, 0.2, 2.0, 0.3)]
    for r, kind in zip(records, kinds):
        r.kind = kind
    records.insert(1, RequestRecord(send_time=0.0, end_time=0.1, error="HTTP 500", kind="turn1"))
    res = compute_result(records, duration=1.0)
    by_kind = res.ttft_by_kind()
    assert list(by_kind) == ["turn1", "turn2"]
    assert by_kind["turn1"].median == pytest.approx(1500.0)
    assert by_kind["turn2"].median == pytest.approx(200.0)
    assert by_kind["turn2"].p90 == pytest.approx(np.percentile([100.0, 200.0, 300.0], 90))
    assert res.to_dict()["ttft_by_kind_ms"]["turn1"]["median"] == pytest.approx(1500.0)
    report = format_result(res)
    assert "turn1 (2)" in report and "turn2 (3)" in report and "1500.00" in report


def test_bench_compare_prints_each_kinds_p90_ttft(fake_server, tmp_path, capsys):  # noqa: F811
    url, _ = fake_server
    out = tmp_path / "compare.json"
    args = ["compare", "--url", url, "--name", "a", "--against", f"b={url}"]
    args += ["--workload", "mixed", "--num-requests", "8", "--seed", "1", "--rates", "50"]
    args += ["--slo-ttft", "5", "--warmup", "0", "--no-progress", "--cold-start", "0"]
    assert bench_main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    table = text[text.index("p90 TTFT by kind") :].splitlines()
    assert "chat" in table[0] and "longdoc" in table[0]
    run = json.loads(out.read_text())["b"]["runs"][0]
    chat_p90 = run["ttft_by_kind_ms"]["chat"]["p90"]
    assert [line.split()[:2] for line in table[1:3]] == [["a", "50"], ["b", "50"]]
    assert f"{chat_p90:.0f}" in table[2].split()[2:]
