"""What the router adds to TTFT, against workers that answer at once (``pdserve profile``'s
``router_overhead_s``; ``pdserve bench router`` prints it).

As deployed, each in its own process: fake prefill and decode workers (real gRPC servers,
instant answers), the router (``python -m router``) and this client. The same first-token
round trip is timed straight to the fake prefill worker and through the router (validate,
reserve on decode and prefill, first token back), interleaved in rounds; the difference at p50
is the router's cost. Two request patterns: back to back (each request starts as the last one's
first token lands, while the router still finishes it) and spaced 10 ms apart. A second router
that always reserves before prefilling runs beside the default one, to show what sending the
reservation and the prefill together saves.

The floor, measured in the same run: a bare relay in its own process (a ``grpc.aio`` server
whose Generate makes the same Prefill call and returns its first token, nothing else), i.e.
one Python gRPC hop. What the router adds beyond the relay is its own work (validation,
routing, the reservation, bookkeeping).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures

import grpc

from engine.block_manager import blocks_for
from engine.config import CacheConfig
from pdserve.cluster.local import wait_ready
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc

BLOCK_SIZE = CacheConfig.block_size  # the workers' default, which the router assumes


class InstantDecode(pb_grpc.DecodeWorkerServicer):
    def Reserve(self, request, context):
        n = blocks_for(request.num_tokens, BLOCK_SIZE)
        return pb.ReserveResponse(
            lease_id="l",
            block_ids=list(range(n)),
            block_size=BLOCK_SIZE,
            kv_endpoint="local://none",
            kv_transport="local",
            deadline_s=30,
        )

    def Release(self, request, context):
        return pb.ReleaseResponse(released=True)

    def Decode(self, request, context):
        yield pb.TokenChunk(token_ids=[6], finish_reason="length")

    def Status(self, request, context):
        return pb.WorkerStatus(
            role="decode",
            num_free_blocks=10_000,
            num_total_blocks=10_000,
            block_size=BLOCK_SIZE,
            kv_endpoint="local://none",
            kv_transport="local",
        )


class InstantPrefill(pb_grpc.PrefillWorkerServicer):
    def Prefill(self, request, context):
        yield pb.PrefillEvent(first_token=pb.FirstToken(token_id=5))
        yield pb.PrefillEvent(transfer_done=pb.TransferDone())

    def Status(self, request, context):
        return pb.WorkerStatus(role="prefill")


def _serve(servicer, add) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def _tokenizer_dir() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tempfile.mkdtemp(prefix="pdserve-bench-router-")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(f"{path}/tokenizer.json")
    with open(f"{path}/config.json", "w") as f:  # what marks a model folder; the router reads
        f.write("{}")  # only the tokenizer
    return path


async def _first_token_seconds(call_factory, n: int, gap_s: float = 0.0) -> list[float]:
    out = []
    for _ in range(n):
        if gap_s:
            await asyncio.sleep(gap_s)
        t = time.perf_counter()
        call = call_factory()
        await call.read()
        out.append(time.perf_counter() - t)
        call.cancel()
    return out


def _spawn(args: list[str], tree: str | None = None) -> tuple[subprocess.Popen, list[str]]:
    """Start a child that prints ``READY addr...`` and serves until its stdin closes; with
    ``tree``, its modules come from that source tree."""
    env = {**os.environ, "GRPC_VERBOSITY": "ERROR"}
    if tree is not None:
        env["PYTHONPATH"] = os.path.abspath(tree)
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tree,
    )
    return proc, wait_ready(proc)


class BareRelay(pb_grpc.GenerationServicer):
    """One ``grpc.aio`` hop: the Prefill call the router makes, and its first token back."""

    def __init__(self, prefill_address: str):
        self.channel = grpc.aio.insecure_channel(prefill_address)
        self.stub = pb_grpc.PrefillWorkerStub(self.channel)

    async def Generate(self, request, context):
        call = self.stub.Prefill(
            pb.PrefillRequest(
                request_id="relay",
                prompt_token_ids=request.token_ids.ids,
                sampling=request.sampling,
            )
        )
        event = await call.read()
        call.cancel()
        yield pb.GenerateResponse(request_id="relay", token_ids=[event.first_token.token_id])


async def serve_relay(prefill_address: str) -> None:
    """The relay's process: print its address, serve until stdin closes."""
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(BareRelay(prefill_address), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


def _router(
    prefill: str, decode: str, headroom: float, extra=(), tree: str | None = None
) -> tuple[subprocess.Popen, list[str]]:
    """A router process; ``tree``: run the router of another source tree (a checkout from
    before a change, to compare in the same run)."""
    cmd = ["-m", "router", "--model", _tokenizer_dir(), "--prefill", prefill, "--decode", decode]
    cmd += [
        "--port",
        "0",
        "--max-model-len",
        "4096",
        "--concurrent-reserve-headroom",
        str(headroom),
        *extra,
    ]
    return _spawn(cmd, tree)


class SpanSink(grpc.GenericRpcHandler):
    """An OTLP/gRPC trace endpoint that takes every export and keeps nothing: what a traced
    router's exporter costs it, without a collector's own CPU in the measurement. (An empty
    reply is an empty ExportTraceServiceResponse.)"""

    EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

    def __init__(self):
        self.exports = 0  # batches taken: proof that the traced router did export

    def service(self, details):
        if details.method != self.EXPORT:
            return None
        return grpc.unary_unary_rpc_method_handler(self._take)

    def _take(self, request: bytes, context) -> bytes:
        self.exports += 1
        return b""


def serve_span_sink(count_path: str) -> None:
    """The sink's process: print its address, take exports until stdin closes, then write
    how many batches it took to ``count_path``."""
    sink = SpanSink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[sink])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"READY 127.0.0.1:{port}", flush=True)
    sys.stdin.read()
    server.stop(None)
    with open(count_path, "w") as f:
        f.write(str(sink.exports))


PATTERNS = {"back to back": 0.0, "spaced 10 ms": 0.01}


async def _rounds(
    p_addr: str, routers: dict[str, str], n: int, prompt_tokens: int, rounds: int = 2
) -> dict:
    prompt = (list(range(1, 128)) * (prompt_tokens // 127 + 1))[:prompt_tokens]
    direct_req = pb.PrefillRequest(request_id="x", prompt_token_ids=prompt)
    routed_req = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=2)
    )
    channels = {name: grpc.aio.insecure_channel(a) for name, a in routers.items()}
    direct_channel = grpc.aio.insecure_channel(p_addr)
    try:
        calls = {"direct": lambda: pb_grpc.PrefillWorkerStub(direct_channel).Prefill(direct_req)}
        for name, ch in channels.items():
            stub = pb_grpc.GenerationStub(ch)
            calls[name] = lambda stub=stub: stub.Generate(routed_req)
        for call in calls.values():  # warm up every path
            await _first_token_seconds(call, 20)
        times = {(p, name): [] for p in PATTERNS for name in calls}
        for _ in range(rounds):  # interleaved, so a noisy stretch hits every path
            for pattern, gap in PATTERNS.items():
                for name, call in calls.items():
                    times[pattern, name] += await _first_token_seconds(call, n // rounds, gap)
        return times
    finally:
        for ch in [direct_channel, *channels.values()]:
            await ch.close()


async def measure(
    n: int,
    prompt_tokens: int,
    traced: bool = False,
    baseline_tree: str | None = None,
    rounds: int = 2,
) -> dict:
    """``traced``: a third default router beside the others, exporting its spans over OTLP to
    a sink (tracing on vs off, same run; needs pdserve[tracing]). ``baseline_tree``: a router
    from that source tree beside them too (e.g. a checkout from before a change). ``rounds``:
    each path's ``n`` requests a pattern go in this many interleaved blocks (more: a noisy
    stretch of a shared machine spreads over every path)."""
    me = ["-m", "pdserve.measure.router_overhead"]
    fakes, (p_addr, d_addr) = _spawn(me)
    routed, reserve_first = (_router(p_addr, d_addr, h) for h in (0.1, -1.0))
    relay = _spawn([*me, "--relay", p_addr])
    paths = {"routed": routed, "reserve_first": reserve_first, "relay": relay}
    sink = None
    if traced:
        count_path = os.path.join(tempfile.mkdtemp(prefix="pdserve-span-sink-"), "exports")
        sink, (sink_addr,) = _spawn([*me, "--span-sink", count_path])
        paths["traced"] = _router(p_addr, d_addr, 0.1, ["--otlp-traces-endpoint", sink_addr])
    if baseline_tree is not None:
        paths["baseline"] = _router(p_addr, d_addr, 0.1, tree=baseline_tree)
    try:
        addresses = {name: addrs[0] for name, (_, addrs) in paths.items()}
        times = await _rounds(p_addr, addresses, n, prompt_tokens, rounds)
    finally:
        for proc in [fakes, *(proc for proc, _ in paths.values())]:  # routers flush first
            proc.stdin.close()
            proc.terminate()
            proc.wait(timeout=10)
    summary = _summary(times, prompt_tokens)
    if sink is not None:  # after the traced router's last export
        summary["traced_exports"] = _sink_exports(sink, count_path)
    return summary


def _sink_exports(sink: subprocess.Popen, count_path: str) -> int:
    sink.stdin.close()
    sink.wait(timeout=10)
    with open(count_path) as f:
        return int(f.read())


def _p(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3


def _summary(times: dict, prompt_tokens: int) -> dict:
    rows = []
    for pattern in PATTERNS:
        direct, routed = times[pattern, "direct"], times[pattern, "routed"]
        first, relay = times[pattern, "reserve_first"], times[pattern, "relay"]
        rows.append(
            {
                "pattern": pattern,
                "direct_p50_ms": _p(direct, 50),
                "routed_p50_ms": _p(routed, 50),
                "routed_p90_ms": _p(routed, 90),
                "router_added_p50_ms": _p(routed, 50) - _p(direct, 50),
                "reserve_first_added_p50_ms": _p(first, 50) - _p(direct, 50),
                "relay_added_p50_ms": _p(relay, 50) - _p(direct, 50),
                "router_beyond_relay_p50_ms": _p(routed, 50) - _p(relay, 50),
            }
        )
        for other in ("traced", "baseline"):  # beside the default router, when measured
            if (pattern, other) in times:
                rows[-1][f"{other}_added_p50_ms"] = _p(times[pattern, other], 50) - _p(direct, 50)
                rows[-1][f"routed_minus_{other}_p50_ms"] = _p(routed, 50) - _p(
                    times[pattern, other], 50
                )
    return {
        "prompt_tokens": prompt_tokens,
        "separate_processes": True,
        "rows": rows,
        "router_added_p50_ms": max(r["router_added_p50_ms"] for r in rows),
        "relay_added_p50_ms": max(r["relay_added_p50_ms"] for r in rows),
        "target_ms": 2.0,
    }


def serve_fakes() -> None:
    """The fake workers' process: print the addresses, serve until stdin closes."""
    prefill, p_addr = _serve(InstantPrefill(), pb_grpc.add_PrefillWorkerServicer_to_server)
    decode, d_addr = _serve(InstantDecode(), pb_grpc.add_DecodeWorkerServicer_to_server)
    print(f"READY {p_addr} {d_addr}", flush=True)
    sys.stdin.read()
    prefill.stop(None)
    decode.stop(None)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--relay"]:
        asyncio.run(serve_relay(sys.argv[2]))
    elif sys.argv[1:2] == ["--span-sink"]:
        serve_span_sink(sys.argv[2])
    else:
        serve_fakes()
