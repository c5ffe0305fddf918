"""What the router and the client cost in CPU, per request and per streamed token.

On a small machine the router and the load generator run on the cores the workers use: the
fidelity runs (``pdserve bench fidelity``) run ``LocalCluster``, whose router serves on an
asyncio thread inside the load generator's own process, one GIL for both. Each streamed token
costs that process a gRPC receive, a detokenize, an SSE write and the client's SSE parse; each
request a tokenize, the chat template, a reservation and a prefill call. This measures both as
the fidelity runs have them: fake workers in their own process (real gRPC servers that answer
at once, and stream tokens ``gap_s`` apart as a decode step would), the router on a thread of
this process with the model's own tokenizer, and ``pdserve bench serve``'s HTTP client.

CPU time, not wall time, so a loaded machine disturbs it little: this process's CPU over a
run (``time.process_time``, every thread), less what it burns idle (the router's status polls)
over the same time. Two runs, one of 2-token requests and one of long ones, give the cost per
request and per token (two equations, two unknowns). The fake decode worker's own CPU per token
is reported too: what a real decode worker's gRPC threads spend streaming each token.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from dataclasses import dataclass

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

# Token ids the fake decode worker streams: " the quick brown fox jumps over a lazy dog and
# runs" in the embedded model's tokenizer, so the detokenizer does the work real text costs.
WORD_IDS = (260, 2365, 6354, 16438, 27003, 690, 253, 23790, 2767, 284, 7313)


@dataclass(frozen=True)
class RouterCpu:
    per_request_s: float  # router + client CPU per request, beyond its tokens
    per_token_s: float  # router + client CPU per streamed token
    worker_per_token_s: float  # the (fake) decode worker's gRPC CPU per streamed token
    idle_share: float  # router process CPU while idle (status polls), cores


def _decode_servicer(gap_s: float):
    from pdserve.measure.router_overhead import InstantDecode

    class PacedDecode(InstantDecode):
        """Streams the request's remaining tokens one chunk each, ``gap_s`` apart."""

        def Decode(self, request, context):
            n = max(request.sampling.max_tokens - len(request.output_token_ids), 1)
            for i in range(n):
                time.sleep(gap_s)
                last = i == n - 1
                tok = WORD_IDS[i % len(WORD_IDS)]
                yield pb.TokenChunk(token_ids=[tok], finish_reason="length" if last else "")

    return PacedDecode()


def serve_fakes(gap_s: float) -> None:
    """The fake workers' process: print the addresses, serve until stdin closes."""
    from pdserve.measure.router_overhead import InstantPrefill, _serve

    prefill, p_addr = _serve(InstantPrefill(), pb_grpc.add_PrefillWorkerServicer_to_server)
    decode, d_addr = _serve(_decode_servicer(gap_s), pb_grpc.add_DecodeWorkerServicer_to_server)
    print(f"READY {p_addr} {d_addr}", flush=True)
    sys.stdin.read()
    prefill.stop(None)
    decode.stop(None)


def proc_cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _RouterThread:
    """The router on an asyncio loop in a thread of this process, as LocalCluster runs it."""

    def __init__(self, model_dir: str, prefill: str, decode: str):
        from router.settings import RouterSettings

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.settings = RouterSettings(model_dir=model_dir)
        self.servers = self.run(self._start(prefill, decode))

    async def _start(self, prefill: str, decode: str):
        from router.app import start_router

        return await start_router(self.settings, [prefill], [decode], http_port=0)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self.run(self.servers.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def _payload(model: str, index: int, tokens: int) -> dict:
    content = f"Session cpu-{index}. Explain how a compiler turns source code into machine code."
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": tokens,
        "min_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _stream_all(url: str, model: str, requests: int, tokens: int, concurrency: int):
    """``requests`` streaming chat requests, ``concurrency`` at a time; streamed tokens seen."""
    import httpx

    from pdserve.bench.loadgen.serve import send_request

    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as client:

        async def one(i: int) -> int:
            async with limit:
                record = await send_request(
                    client, "/v1/chat/completions", _payload(model, i, tokens)
                )
            if record.error:
                raise RuntimeError(f"request {i} failed: {record.error}")
            return len(record.token_times)

        return sum(await asyncio.gather(*(one(i) for i in range(requests))))


def _cpu_of_run(router: _RouterThread, url: str, fake_pid: int, run: tuple[int, int, int]):
    """(this process's CPU, the fakes' CPU, wall, tokens) over one run of (requests, tokens,
    concurrency)."""
    model = router.settings.model_name
    cpu0, fake0, t0 = time.process_time(), proc_cpu_s(fake_pid), time.perf_counter()
    seen = asyncio.run(_stream_all(url, model, *run))
    wall = time.perf_counter() - t0
    return time.process_time() - cpu0, proc_cpu_s(fake_pid) - fake0, wall, seen


def _idle_share(seconds: float, windows: int = 3) -> float:
    """This process's CPU share while it waits: the least of a few windows, since the burn is
    a floor (the router's idle loop, gRPC's pollers) and a window that caught a late thread of
    earlier work (a test suite's, say) would take real work out of the runs."""

    def window() -> float:
        cpu0, t0 = time.process_time(), time.perf_counter()
        time.sleep(seconds / windows)
        return (time.process_time() - cpu0) / (time.perf_counter() - t0)

    return min(window() for _ in range(windows))


def measure_router_cpu(
    model_dir: str, requests: int = 64, tokens: int = 64, gap_s: float = 0.02, concurrency: int = 8
) -> RouterCpu:
    """Router + client CPU per request and per token (see the module's docstring)."""
    from pdserve.measure.router_overhead import _spawn

    fakes, (p_addr, d_addr) = _spawn(["-m", "pdserve.bench.fidelity.measure_router", str(gap_s)])
    router = _RouterThread(model_dir, p_addr, d_addr)
    try:
        url = f"http://{router.servers.http_address}"
        _cpu_of_run(router, url, fakes.pid, (8, 4, concurrency))  # warm up every path
        idle = _idle_share(1.0)
        short = _cpu_of_run(router, url, fakes.pid, (requests, 2, concurrency))
        long = _cpu_of_run(router, url, fakes.pid, (requests, tokens, concurrency))
    finally:
        router.close()
        fakes.stdin.close()
        fakes.terminate()
        fakes.wait(10)
    return solve_costs(short, long, requests, idle)


def solve_costs(short, long, requests: int, idle: float) -> RouterCpu:
    """From two runs of ``requests`` requests each, (cpu, fake cpu, wall, tokens seen): the CPU
    per request and per token, with the idle burn over each run's wall time taken out."""
    (cpu_s, fake_s, wall_s, tok_s), (cpu_l, fake_l, wall_l, tok_l) = short, long
    busy_s, busy_l = cpu_s - idle * wall_s, cpu_l - idle * wall_l
    if tok_l <= tok_s:
        raise ValueError("the long run must stream more tokens than the short one")
    per_token = max(0.0, (busy_l - busy_s) / (tok_l - tok_s))
    per_request = max(0.0, (busy_s - per_token * tok_s) / requests)
    worker_per_token = max(0.0, (fake_l - fake_s) / (tok_l - tok_s))
    return RouterCpu(per_request, per_token, worker_per_token, idle)


if __name__ == "__main__":
    serve_fakes(float(sys.argv[1]))
