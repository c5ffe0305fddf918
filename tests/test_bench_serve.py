"""`bench serve` and `bench sweep`: metric math on synthetic timestamps, the Poisson schedule,
SSE parsing, and whole runs against a fake OpenAI-compatible server in this process."""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pdserve.bench import main as bench_main
from pdserve.bench.loadgen.serve import apply_sse_line, poisson_schedule
from pdserve.bench.loadgen.sweep import SweepPoint, goodput_of
from pdserve.metrics import SLO, RequestRecord, compute_result, format_result

CHUNKS = 4  # tokens the fake server streams per request (fewer if max_tokens is smaller)


def record(ttft: float, gaps: list[float], send: float = 0.0, usage: int | None = None):
    times = list(send + ttft + np.cumsum([0.0, *gaps]))
    return RequestRecord(
        send_time=send,
        end_time=times[-1],
        token_times=times,
        prompt_tokens=10,
        completion_tokens=usage,
        success=True,
    )


def test_ttft_tpot_itl_and_e2el_follow_vllm_definitions():
    r = record(0.1, [0.05, 0.1, 0.05], send=2.0, usage=4)
    assert r.ttft == pytest.approx(0.1)
    assert r.e2el == pytest.approx(0.3)
    assert r.tpot == pytest.approx((0.3 - 0.1) / 3)
    assert r.itls == pytest.approx([0.05, 0.1, 0.05])


def test_usage_token_count_wins_and_chunk_count_is_the_fallback():
    assert record(0.1, [0.1], usage=6).output_tokens == 6  # a chunk may carry several tokens
    assert record(0.1, [0.1, 0.1]).output_tokens == 3
    assert record(0.2, []).tpot is None  # one token: no TPOT


def test_percentiles_throughput_goodput_and_attainment():
    records = [record(0.1 * (i + 1), [0.01] * 4, usage=5) for i in range(10)]
    records.append(RequestRecord(send_time=0.0, end_time=0.5, error="HTTP 500"))
    res = compute_result(records, duration=2.0, slo=SLO(ttft_s=0.55, tpot_s=0.02))
    ttfts_ms = [100.0 * (i + 1) for i in range(10)]
    assert (res.completed, res.failed, res.num_requests) == (10, 1, 11)
    assert res.ttft_ms.mean == pytest.approx(550.0)
    assert res.ttft_ms.median == pytest.approx(550.0)
    assert res.ttft_ms.p90 == pytest.approx(np.percentile(ttfts_ms, 90))
    assert res.ttft_ms.p99 == pytest.approx(np.percentile(ttfts_ms, 99))
    assert res.tpot_ms.mean == pytest.approx(10.0)
    assert len(res.itls) == 40 and res.itl_ms.median == pytest.approx(10.0)
    assert res.request_throughput == pytest.approx(5.0)
    assert res.output_throughput == pytest.approx(25.0)
    assert res.total_token_throughput == pytest.approx(75.0)
    assert res.request_goodput == pytest.approx(5 / 2.0)  # ttft 0.1 .. 0.5 meet the SLO
    assert res.slo_attainment == pytest.approx(5 / 11)  # the failed request misses it
    tight = compute_result(records, 2.0, SLO(ttft_s=10.0, tpot_s=0.005))
    assert tight.slo_attainment == 0.0  # TPOT 10 ms > 5 ms for all


def test_results_have_vllm_field_names_and_no_goodput_without_slo():
    res = compute_result([record(0.1, [0.01], usage=2)], duration=1.0)
    d = res.to_dict()
    for key in (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "request_goodput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p90_itl_ms",
        "p99_e2el_ms",
        "std_ttft_ms",
        "ttfts",
        "itls",
    ):
        assert key in d, key
    assert d["request_goodput"] is None and d["slo_attainment"] is None
    assert "Successful requests:" in format_result(res)


def test_one_token_output_meets_a_tpot_slo():
    assert SLO(tpot_s=0.001).met_by(record(0.1, [], usage=1))


def test_poisson_schedule_is_seeded_and_has_the_mean_rate():
    a, b = poisson_schedule(20_000, 4.0, seed=7), poisson_schedule(20_000, 4.0, seed=7)
    assert np.array_equal(a, b) and a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert not np.array_equal(a, poisson_schedule(20_000, 4.0, seed=8))
    assert (len(a) - 1) / a[-1] == pytest.approx(4.0, rel=0.03)
    gaps = np.diff(a)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    assert not poisson_schedule(5, math.inf).any()


def test_sse_lines_time_only_chunks_with_text():
    r = RequestRecord(send_time=0.0)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert apply_sse_line("data: " + json.dumps(role), r, 0.1)
    assert apply_sse_line('data: {"choices": [{"delta": {"content": "Hi"}}]}', r, 0.2)
    assert apply_sse_line('data: {"choices": [{"text": " there"}]}', r, 0.3)
    assert apply_sse_line(": keep-alive", r, 0.35)
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    assert apply_sse_line("data: " + json.dumps(usage), r, 0.4)
    assert not apply_sse_line("data: [DONE]", r, 0.5)
    assert r.token_times == [0.2, 0.3]
    assert (r.prompt_tokens, r.output_tokens) == (7, 3)


# ---- a fake OpenAI-compatible server ------------------------------------------------------


class FakeOpenAI(BaseHTTPRequestHandler):
    """Streams min(max_tokens, CHUNKS) one-token chunks 5 ms apart; prompts with FAIL -> 500.
    The first request waits ``first_delay_s`` before its first chunk (a cold server)."""

    requests: list[dict]  # set per server class
    first_delay_s: float = 0.0

    def log_message(self, *args) -> None:
        pass

    def _send_json(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send_json(200, {"object": "list", "data": [{"id": "fake-model"}]})

    def _event(self, body: dict) -> None:
        self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append({"path": self.path, **body})
        if "FAIL" in json.dumps(body.get("messages") or body.get("prompt")):
            return self._send_json(500, {"error": "boom"})
        chat = self.path.endswith("/chat/completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if len(self.requests) == 1:
            time.sleep(self.first_delay_s)
        n = min(body["max_tokens"], CHUNKS)
        for i in range(n):
            time.sleep(0.005)
            piece = {"delta": {"content": f"w{i} "}} if chat else {"text": f"w{i} "}
            self._event({"choices": [{"index": 0, **piece}]})
        self._event({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}})
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server(request):
    delay = getattr(request, "param", 0.0)
    handler = type("Handler", (FakeOpenAI,), {"requests": [], "first_delay_s": delay})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    host, port = server.server_address
    yield f"http://{host}:{port}", handler.requests
    server.shutdown()
    server.server_close()


def test_bench_serve_end_to_end_writes_json_and_plot(fake_server, tmp_path):
    url, seen = fake_server
    out, png = tmp_path / "serve.json", tmp_path / "cdf.png"
    rc = bench_main(
        [
            "serve",
            "--url",
            url + "/v1",
            "--workload",
            "mixed",
            "--num-requests",
            "10",
            "--rate",
            "100",
            "--seed",
            "1",
            "--slo-ttft",
            "5",
            "--slo-tpot",
            "1",
            "--no-progress",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 10 and res["failed"] == 0
    assert res["model"] == "fake-model" and res["request_rate"] == 100
    assert res["total_output_tokens"] == 10 * CHUNKS and res["total_input_tokens"] == 110
    assert res["slo_attainment"] == 1.0 and res["request_goodput"] > 0
    assert len(res["itls"]) == 10 * (CHUNKS - 1)
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    assert png.stat().st_size > 0
    # The cold-start probe first (11 raw completions, one at a time), then two warm-ups.
    probes, seen = seen[:11], seen[11:]
    assert all(r["path"] == "/v1/completions" and r["max_tokens"] == 2 for r in probes)
    assert len({r["prompt"] for r in probes}) == 11  # no shared prefix cache between them
    assert len({len(r["prompt"]) for r in probes}) == 1  # the same size
    cold = res["cold_start"]
    # What the record says of the probe's timings, not how fast they were (a timing here
    # follows the machine's load: a fake's first TTFT of 13 ms read 1.58x its median once).
    assert len(cold["next_ttfts_s"]) == 10 and cold["first_ttft_s"] > 0
    assert cold["median_next_ttft_s"] == statistics.median(cold["next_ttfts_s"])
    assert cold["ratio"] == pytest.approx(cold["first_ttft_s"] / cold["median_next_ttft_s"])
    assert len(seen) == 2 + 10  # two warm-up requests first
    timed = seen[2:]
    assert all(r["path"] == "/v1/chat/completions" and r["stream"] for r in timed)
    assert all(r["stream_options"] == {"include_usage": True} for r in timed)
    assert not any("ignore_eos" in r or "min_tokens" in r for r in timed)
    prompts = [r["messages"][0]["content"] for r in seen]
    assert len(set(prompts)) == len(prompts)


@pytest.mark.parametrize("fake_server", [0.4], indirect=True)
def test_cold_start_probe_flags_a_slow_first_request(fake_server, tmp_path, capsys):
    url, seen = fake_server
    out = tmp_path / "serve.json"
    args = ["serve", "--url", url, "--num-requests", "1", "--warmup", "0", "--cold-start", "3"]
    assert bench_main([*args, "--no-progress", "--json", str(out)]) == 0
    cold = json.loads(out.read_text())["cold_start"]
    assert cold["first_ttft_s"] >= 0.4 > max(cold["next_ttfts_s"])
    assert cold["ratio"] > 1.5
    assert "ratio" in capsys.readouterr().out.split("first request after ready")[1]
    assert "NOT met" in json.loads(out.read_text())["cold_start_line"]


def test_failed_requests_are_counted_from_a_jsonl_file(fake_server, tmp_path):
    url, seen = fake_server
    path = tmp_path / "load.jsonl"
    rows = [{"prompt": "Once upon a time", "max_tokens": 3}, {"prompt": "FAIL", "max_tokens": 3}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "serve.json"
    rc = bench_main(
        [
            "serve",
            "--url",
            url,
            "--workload",
            str(path),
            "--num-requests",
            "4",
            "--endpoint",
            "completions",
            "--warmup",
            "0",
            "--cold-start",
            "0",
            "--no-progress",
            "--model",
            "m",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (2, 2)
    assert all(e.startswith("HTTP 500") for e in res["errors"])
    assert res["total_output_tokens"] == 6 and res["request_goodput"] is None
    assert all(r["path"] == "/v1/completions" and r["model"] == "m" for r in seen)


def test_goodput_is_the_highest_rate_with_90_percent_attainment():
    points = [
        SweepPoint(r, a, 0.0, 0.0, 0.0, 0.0, 0)
        for r, a in [(0.5, 1.0), (1.0, 0.95), (2.0, 0.89), (4.0, 0.3)]
    ]
    assert goodput_of(points) == 1.0
    assert goodput_of(points[2:]) == 0.0


def test_bench_sweep_reports_attainment_per_rate(fake_server, tmp_path, capsys):
    url, seen = fake_server
    out = tmp_path / "sweep.json"
    rc = bench_main(
        [
            "sweep",
            "--url",
            url,
            "--workload",
            "chat",
            "--num-requests",
            "3",
            "--rates",
            "50,20",
            "--slo-ttft",
            "5",
            "--warmup",
            "1",
            "--cold-start",
            "2",
            "--no-progress",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert [p["rate"] for p in res["points"]] == [20.0, 50.0]
    assert "cold_start" in res["runs"][0] and "cold_start" not in res["runs"][1]
    seen = seen[3:]  # a cold-start probe of 3 requests, once for the whole sweep
    assert res["goodput"] == 50.0 and all(p["slo_attainment"] == 1.0 for p in res["points"])
    assert len(seen) == 1 + 2 * 3  # one warm-up for the whole sweep
    prompts = [r["messages"][0]["content"] for r in seen]
    assert len(set(prompts)) == len(prompts)  # a fresh nonce per rate
    assert "goodput" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["serve"], ["sweep"], ["transfer"]])
def test_bench_help_renders(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main([*command, "--help"])
    assert exit_info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_register_adds_bench_with_extra_subcommands():
    import argparse

    from pdserve.bench import register

    def add_hello(sub):
        sub.add_parser("hello").set_defaults(func=lambda args: 7)

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"), extra=[add_hello])
    args = parser.parse_args(["bench", "hello"])
    assert args.func(args) == 7
    assert parser.parse_args(["bench", "serve", "--url", "u"]).func.__name__ == "cmd_serve"


def test_bench_compare_interleaves_servers_rate_by_rate(fake_server, tmp_path, capsys):
    url, seen = fake_server
    out = tmp_path / "compare.json"
    args = ["compare", "--url", url, "--name", "a", "--against", f"b={url}"]
    args += ["--against", f"c={url}", "--workload", "chat", "--num-requests", "2"]
    args += ["--rates", "50,20", "--slo-ttft", "5", "--warmup", "1", "--no-progress"]
    args += ["--cold-start", "0"]
    assert bench_main([*args, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert list(res) == ["a", "b", "c"]
    for name in "abc":
        assert [p["rate"] for p in res[name]["points"]] == [20.0, 50.0]
        assert res[name]["goodput"] == 50.0
    # warm-up once per system, then 2 rates x 3 systems x 2 requests; every prompt new
    assert len(seen) == 3 + 2 * 3 * 2
    prompts = [r["messages"][0]["content"] for r in seen]
    assert len(set(prompts)) == len(prompts)
    text = capsys.readouterr().out
    assert "goodput a: 50 req/s" in text and "goodput c: 50 req/s" in text
    assert "p90 TTFT by kind" not in text  # chat alone: one kind


def test_compare_rotates_the_order_and_checks_its_arguments():
    from pdserve.bench.loadgen.compare import System, parse_system, run_order
    from pdserve.bench.loadgen.serve import BenchError

    systems = [System(n, f"http://{n}") for n in "abc"]
    assert [[s.name for s in run_order(systems, i)] for i in range(4)] == [
        ["a", "b", "c"],
        ["b", "c", "a"],
        ["c", "a", "b"],
        ["a", "b", "c"],
    ]
    assert parse_system("vllm=http://127.0.0.1:8011") == System("vllm", "http://127.0.0.1:8011")
    for bad in ("http://x", "=http://x", "name="):
        with pytest.raises(BenchError, match="NAME=URL"):
            parse_system(bad)


def test_bench_compare_needs_an_slo_and_distinct_names(fake_server, capsys):
    url, _ = fake_server
    base = ["compare", "--url", url, "--rates", "1", "--no-progress"]
    assert bench_main(base) == 2
    assert "needs --slo-ttft" in capsys.readouterr().err
    assert bench_main([*base, "--slo-ttft", "1", "--name", "x", "--against", f"x={url}"]) == 2
    assert "names must differ" in capsys.readouterr().err


def test_multiturn_sends_each_turn_with_the_whole_history_and_the_servers_answers(
    fake_server, tmp_path
):
    url, seen = fake_server
    out = tmp_path / "multiturn.json"
    args = ["serve", "--url", url, "--workload", "multiturn", "--num-requests", "8"]
    args += ["--turns", "4", "--think-s", "0.01", "--rate", "100", "--cold-start", "0"]
    args += ["--no-progress", "--json", str(out)]
    assert bench_main(args) == 0
    res = json.loads(out.read_text())
    assert res["completed"] == 8 and res["failed"] == 0
    timed = seen[2:]  # after the two warm-ups
    assert len(timed) == 8
    conversations: dict[str, list[list[dict]]] = {}
    for r in timed:
        conversations.setdefault(r["messages"][0]["content"], []).append(r["messages"])
    assert len(conversations) == 2 and all(len(turns) == 4 for turns in conversations.values())
    for turns in conversations.values():
        turns.sort(key=len)
        for n, messages in enumerate(turns):
            assert len(messages) == 2 * n + 1  # every earlier question and answer, then one
            answers = [m["content"] for m in messages if m["role"] == "assistant"]
            # The fake streams "w0 w1 ..." up to its chunk count: the answers are its own.
            assert all(a == "".join(f"w{i} " for i in range(CHUNKS)) for a in answers)
            assert messages[: 2 * n - 1] == turns[n - 1][: 2 * n - 1] if n else True
