"""``pdserve bench router``: what the router adds to TTFT, against workers that answer at once.

Fake prefill and decode workers (real gRPC servers, instant answers) sit behind a real router.
The same first-token round trip is timed twice in one run: straight to the fake prefill worker,
and through the router (tokenize, validate, reserve on decode, prefill, first token back). The
difference at p50 is the router's cost.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from concurrent import futures

import grpc

from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc


class InstantDecode(pb_grpc.DecodeWorkerServicer):
    def Reserve(self, request, context):
        n = -(-request.num_tokens // 16)
        return pb.ReserveResponse(
            lease_id="l",
            block_ids=list(range(n)),
            block_size=16,
            kv_endpoint="local://none",
            kv_transport="local",
            deadline_s=30,
        )

    def Release(self, request, context):
        return pb.ReleaseResponse(released=True)

    def Decode(self, request, context):
        yield pb.TokenChunk(token_ids=[6], finish_reason="length")

    def Status(self, request, context):
        return pb.WorkerStatus(role="decode", num_free_blocks=10_000, num_total_blocks=10_000)


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
    return path


async def _first_token_seconds(call_factory, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call = call_factory()
        await call.read()
        out.append(time.perf_counter() - t)
        call.cancel()
    return out


async def _measure(n: int, prompt_tokens: int) -> dict:
    from router.app import start_router
    from router.core import RouterConfig

    decode, d_addr = _serve(InstantDecode(), pb_grpc.add_DecodeWorkerServicer_to_server)
    prefill, p_addr = _serve(InstantPrefill(), pb_grpc.add_PrefillWorkerServicer_to_server)
    servers = await start_router(
        RouterConfig(model_dir=_tokenizer_dir(), max_model_len=4096), [p_addr], [d_addr]
    )
    prompt = list(range(1, 128)) * (prompt_tokens // 127 + 1)
    prompt = prompt[:prompt_tokens]
    try:
        async with (
            grpc.aio.insecure_channel(p_addr) as p_ch,
            grpc.aio.insecure_channel(servers.grpc_address) as r_ch,
        ):
            p_stub, r_stub = pb_grpc.PrefillWorkerStub(p_ch), pb_grpc.GenerationStub(r_ch)
            direct_req = pb.PrefillRequest(request_id="x", prompt_token_ids=prompt)
            routed_req = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=2)
            )
            await _first_token_seconds(lambda: p_stub.Prefill(direct_req), 20)  # warm up both paths
            await _first_token_seconds(lambda: r_stub.Generate(routed_req), 20)
            direct = await _first_token_seconds(lambda: p_stub.Prefill(direct_req), n)
            routed = await _first_token_seconds(lambda: r_stub.Generate(routed_req), n)
    finally:
        await servers.stop()
        decode.stop(None)
        prefill.stop(None)
    return _summary(direct, routed, prompt_tokens)


def _summary(direct: list[float], routed: list[float], prompt_tokens: int) -> dict:
    def pct(xs, q):
        return statistics.quantiles(xs, n=100)[q - 1] * 1e3

    return {
        "prompt_tokens": prompt_tokens,
        "direct_p50_ms": pct(direct, 50),
        "routed_p50_ms": pct(routed, 50),
        "routed_p90_ms": pct(routed, 90),
        "router_added_p50_ms": pct(routed, 50) - pct(direct, 50),
        "target_ms": 2.0,
    }


def add_parser(sub) -> None:
    p = sub.add_parser("router", help="what the router adds to TTFT (instant fake workers)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--json", default=None)
    p.set_defaults(func=_main)


def _main(args) -> int:
    result = asyncio.run(_measure(args.requests, args.prompt_tokens))
    print(
        f"first token straight from an instant prefill worker: p50 {result['direct_p50_ms']:.2f} ms"
    )
    print(
        f"first token through the router:                      p50 {result['routed_p50_ms']:.2f} ms "
        f"(p90 {result['routed_p90_ms']:.2f})"
    )
    print(f"router adds p50 {result['router_added_p50_ms']:.2f} ms to TTFT (target < 2 ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
