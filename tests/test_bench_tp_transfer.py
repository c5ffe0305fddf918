"""``pdserve bench tp-transfer``'s parsing, its order of requests and its report math, with a
fake cluster (no timing is asserted: the figures are made up)."""

from __future__ import annotations

import contextlib

import pytest

from pdserve.bench.micro.tp_transfer import (
    Pair,
    Sample,
    collect_samples,
    format_report,
    parse_pairs,
    ratios,
    summarize,
)


def test_pairs_parse_in_order_and_bad_ones_are_refused():
    assert parse_pairs("1:1, 2:1,1:2") == [Pair(1, 1), Pair(2, 1), Pair(1, 2)]
    for bad in ("1-2", "0:1", "1:1,1:1", "", "2:x"):
        with pytest.raises(SystemExit):
            parse_pairs(bad)


def fake_sender(calls: list):
    """A cluster per pair whose requests take (a + b) / 10 s of TTFT, b / 100 s of it exposed
    transfer; it logs each open, request and close."""

    @contextlib.contextmanager
    def open_sender(pair: Pair):
        calls.append(("open", pair.name))

        def send() -> Sample:
            calls.append(("send", pair.name))
            ttft = (pair.prefill_tp + pair.decode_tp) / 10
            return Sample(ttft / 2, pair.decode_tp / 100, ttft, 1000)

        yield send
        calls.append(("close", pair.name))

    return open_sender


def test_interleaved_requests_go_one_per_pair_a_round_after_one_warm_up_each():
    calls = []
    pairs = parse_pairs("1:1,2:1")
    samples = collect_samples(pairs, 2, fake_sender(calls), interleave=True)
    sends = [name for what, name in calls if what == "send"]
    assert calls[:2] == [("open", "1->1"), ("open", "2->1")]  # both live at once
    assert sends == ["1->1", "2->1"] * 3  # warm-up round, then 2 timed rounds
    assert [len(samples[p]) for p in pairs] == [2, 2]  # the warm-up is not kept


def test_by_default_each_cluster_closes_before_the_next_opens():
    calls = []
    collect_samples(parse_pairs("1:1,2:1"), 1, fake_sender(calls))
    assert [c for c in calls if c[0] != "send"] == [
        ("open", "1->1"), ("close", "1->1"), ("open", "2->1"), ("close", "2->1"),
    ]  # fmt: skip


def test_medians_share_and_the_ratio_against_the_same_prefill_degree():
    a_to_a = [Sample(0.5, 0.1, 1.0, 100), Sample(0.5, 0.3, 2.0, 100), Sample(0.5, 0.2, 4.0, 100)]
    a_to_b = [Sample(0.5, 0.4, 2.0, 100), Sample(0.5, 0.4, 2.0, 100), Sample(0.5, 0.4, 2.0, 100)]
    pairs = [Pair(2, 2), Pair(2, 1), Pair(1, 2)]  # 1->2 has no 1->1 here: no ratio
    rows = [summarize(pairs[0], a_to_a), summarize(pairs[1], a_to_b), summarize(pairs[2], a_to_b)]
    assert (rows[0].kv_transfer_s, rows[0].ttft_s) == (0.2, 2.0)
    assert rows[0].share_of_ttft == pytest.approx(0.1)  # median of 0.1, 0.15, 0.05
    (r,) = ratios(pairs, rows)
    assert (r.pair, r.against) == ("2->1", "2->2")
    assert r.kv_transfer == pytest.approx(2.0) and r.ttft == pytest.approx(1.0)
    assert r.share_points == pytest.approx(10.0)  # 20% of TTFT against 10%
    report = format_report(rows, [r], "setup")
    assert "2->1 vs 2->2" in report and "+10.00" in report


def test_a_base_that_exposed_nothing_gives_no_transfer_ratio():
    rows = [
        summarize(Pair(1, 1), [Sample(1.0, 0.0, 1.0, 10)]),
        summarize(Pair(1, 2), [Sample(1.0, 0.1, 1.1, 10)]),
    ]
    (r,) = ratios([Pair(1, 1), Pair(1, 2)], rows)
    assert r.kv_transfer is None
    ratio_line = format_report(rows, [r], "setup").splitlines()[-2]
    assert ratio_line.split()[:4] == ["1->2", "vs", "1->1", "-"]
