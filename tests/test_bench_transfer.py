"""`bench transfer`: report structure and byte accounting (never speed) on small caches."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from pdserve.bench import main as bench_main
from pdserve.bench.micro.transfer import (
    TRANSPORT_NAMES,
    format_report,
    measure_ttft_share,
    run_transfer_bench,
)
from pdserve.bench.micro.transfer_limits import (
    MiB,
    flight_stack_seconds,
    grpc_stack_seconds,
    loopback_seconds,
)
from pdserve.measure.kv_push import KVShape
from tests.conftest import tiny_llama_dir
from tests.transport_params import requires_transport

SMALL = KVShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, tokens=30)


def test_kv_shape_counts_bytes_of_every_layer():
    assert SMALL.num_blocks == 8  # 30 tokens in blocks of 4
    assert SMALL.bytes_per_push == 2 * 3 * 8 * 4 * 2 * 8 * 4
    smollm2 = KVShape()
    assert smollm2.bytes_per_push == 2 * 30 * 1024 * 3 * 64 * 4  # 45 MiB per 1,024 tokens
    # int8 rows: 64 codes and a 4-byte scale per token and head, 12,240 bytes a token
    int8 = KVShape(kv_dtype="int8")
    assert int8.bytes_per_push == 1024 * 12_240
    (k, v), *_ = int8.make_cache()
    assert k.dtype == v.dtype == torch.int8 and k.shape == (64, 16, 3, 68)
    (k, v), *_ = KVShape(kv_dtype="int8", cache_blocks=1024).make_cache()  # a worker's cache
    assert k.shape == (1024, 16, 3, 68) and k[:64].any() and not k[64:].any()  # prompt first


def test_loopback_moves_every_byte():
    assert loopback_seconds(8 * MiB, chunk=MiB) > 0


def test_bare_grpc_stream_carries_every_byte():
    # grpc_stack_seconds asserts the server counted every byte before it returns a time.
    assert grpc_stack_seconds(8 * MiB, chunk=MiB, calls=1) > 0


def test_bare_flight_stream_carries_every_byte():
    # flight_stack_seconds asserts the server counted every byte before it returns a time.
    assert flight_stack_seconds(8 * MiB, chunk=MiB, calls=1) > 0


def test_transfer_report_covers_every_transport_and_bytes_match():
    logs: list[str] = []
    report = run_transfer_bench(
        SMALL, TRANSPORT_NAMES, repeats=2, loopback_bytes=4 * MiB, ttft_model=None, log=logs.append
    )
    assert report.loopback_best_mb_s >= report.loopback_median_mb_s > 0
    assert report.grpc_stack_best_mb_s > 0 and report.flight_stack_best_mb_s > 0
    assert [t.transport for t in report.transports] == list(TRANSPORT_NAMES)
    for t in report.transports:
        assert t.bytes_ok and t.bytes_per_push == SMALL.bytes_per_push
        assert len(t.seconds) == 2 and t.frames_per_push == SMALL.num_layers
        assert t.best_mb_s >= t.median_mb_s > 0
        assert t.ratio_to_loopback == pytest.approx(t.best_mb_s / report.loopback_best_mb_s)
    text = format_report(report)
    assert all(name in text for name in TRANSPORT_NAMES) and "x loopback" in text
    assert "x stack" in text and "bare grpcio stream" in text
    assert "bare Arrow Flight stream" in text
    assert report.memcpy_best_mb_s > 0 and "single-thread memcpy" in text and "x memcpy" in text
    assert len(logs) == 4 + len(TRANSPORT_NAMES)
    d = report.to_dict()
    assert d["shape"]["bytes_per_push"] == SMALL.bytes_per_push and d["shape"]["dtype"] == "float32"
    json.dumps(d)


def test_transfer_report_pushes_each_kv_format_side_by_side():
    report = run_transfer_bench(
        SMALL,
        ["local", "grpc"],
        repeats=1,
        loopback_bytes=4 * MiB,
        ttft_model=None,
        log=lambda _: None,
        kv_dtypes=("fp32", "int8"),
    )
    got = [(t.transport, t.kv_dtype, t.bytes_per_push, t.bytes_ok) for t in report.transports]
    int8_bytes = 2 * 3 * 8 * 4 * 2 * (8 + 4)  # K+V, layers, blocks, block, heads, codes+scale
    assert got == [
        ("local", "fp32", SMALL.bytes_per_push, True),
        ("grpc", "fp32", SMALL.bytes_per_push, True),
        ("local", "int8", int8_bytes, True),
        ("grpc", "int8", int8_bytes, True),
    ]
    assert "int8" in format_report(report)


def test_ttft_share_on_a_tiny_model(tmp_path):
    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, layers=2, seed=1)
    share = measure_ttft_share(str(path), "local", prompt_tokens=64, runs=2)
    assert share.runs == 2 and share.prompt_tokens == 64
    assert share.kv_bytes == 2 * 2 * 64 * 2 * 16 * 4  # K+V, layers, tokens, kv heads, head dim
    assert 0 < share.prefill_s <= share.ttft_s
    assert 0 <= share.kv_transfer_s <= share.ttft_s and 0 <= share.share_of_ttft <= 1
    int8 = measure_ttft_share(str(path), "local", prompt_tokens=64, runs=1, kv_dtype="int8")
    assert int8.kv_dtype == "int8" and int8.kv_bytes == 2 * 2 * 64 * 2 * (16 + 4)


def test_bench_transfer_names_an_unknown_kv_dtype():
    with pytest.raises(SystemExit, match="--kv-dtypes"):
        bench_main(["transfer", "--kv-dtypes", "fp4", "--ttft-transports", ""])


def test_bench_transfer_command_writes_json(tmp_path, capsys):
    out = tmp_path / "transfer.json"
    rc = bench_main(
        [
            "transfer",
            "--transports",
            "local,grpc",
            "--tokens",
            "16",
            "--layers",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "4",
            "--repeats",
            "1",
            "--loopback-mib",
            "4",
            "--ttft-transports",
            "",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert [t["transport"] for t in res["transports"]] == ["local", "grpc"]
    assert res["ttft"] == [] and all(t["bytes_ok"] for t in res["transports"])
    assert "KV Transfer Benchmark" in capsys.readouterr().out


def test_source_blocks_are_shuffled_or_in_order():
    shuffled = KVShape(tokens=1024).source_ids()
    assert sorted(shuffled) == list(range(64)) and shuffled != list(range(64))
    assert KVShape(tokens=1024, src_blocks="in-order").source_ids() == list(range(64))
    with pytest.raises(ValueError, match="src_blocks"):
        KVShape(src_blocks="sorted").source_ids()


@requires_transport("nixl")
@pytest.mark.parametrize("src_blocks", ["shuffled", "in-order"])
def test_transfer_between_two_processes_moves_every_byte(src_blocks):
    """--processes: the receiver in a second process; nixl and grpc deliver every byte, from
    fragmented source blocks and from in-order ones (nixl's merged writes)."""
    report = run_transfer_bench(
        replace(SMALL, src_blocks=src_blocks),
        ["local", "nixl", "grpc"],
        repeats=1,
        loopback_bytes=4 * MiB,
        ttft_model=None,
        log=lambda _: None,
        processes=True,
    )
    assert report.processes and [t.transport for t in report.transports] == ["nixl", "grpc"]
    assert all(t.bytes_ok and t.bytes_per_push == SMALL.bytes_per_push for t in report.transports)
    assert "receivers in a second process" in format_report(report)
