"""`pdserve bench serve`: an open-loop load generator for any OpenAI-compatible server.

Requests leave on a seeded Poisson schedule whatever the server's state (open loop), stream
their answers over SSE (``stream_options.include_usage`` for exact token counts), and every token
chunk's arrival is timed on the client. Metrics and field names follow `vllm bench serve` (see
metrics.py), so a run against pdserve and one against vLLM compare line by line.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from kernels import cpu_extension
from pdserve.bench.loadgen.multiturn import multiturn_workload, run_conversations
from pdserve.bench.loadgen.workloads import (
    MULTITURN,
    BenchRequest,
    Workload,
    get_workload,
    warmup_requests,
)
from pdserve.measure.cold_start import (
    DEFAULT_FOLLOWERS,
    PROBE_MAX_TOKENS,
    ColdStart,
    measure_cold_start,
    probe_prompt,
)
from pdserve.metrics import (
    SLO,
    BenchResult,
    RequestRecord,
    compute_result,
    format_result,
)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(frozen=True)
class ServeConfig:
    url: str  # server base, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)
    workload: str = "mixed"  # chat | longdoc | mixed | path to a JSONL file
    num_requests: int = 100
    rate: float = math.inf  # requests/s of the Poisson process; inf sends all at once
    seed: int = 0
    nonce: str | None = None  # None: a fresh one, so no prompt repeats an earlier run's
    endpoint: str = "chat"  # chat | completions
    model: str | None = None  # None: the first model of GET /v1/models
    slo: SLO = field(default_factory=SLO)
    warmup: int = 2  # requests sent (one at a time) before the timed run
    # Requests after the first in the cold-start probe (first TTFT / median of these); 0: none.
    cold_start: int = DEFAULT_FOLLOWERS
    max_concurrency: int | None = None
    timeout_s: float = 600.0
    api_key: str | None = None
    temperature: float | None = None  # None: the server's default, as vLLM's bench does
    ignore_eos: bool = (
        False  # not vLLM's default; for fixed-length runs against servers that know it
    )
    progress: bool = True
    turns: int = 6  # multiturn: turns per conversation
    think_s: float = 2.0  # multiturn: mean think time between an answer and the next question

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url.removesuffix("/v1")


class BenchError(Exception):
    """The benchmark cannot run (server unreachable, no model, warm-up failed)."""


def poisson_schedule(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Send offsets in seconds from the start: the first at 0, then exponential gaps of mean
    1/rate (a Poisson process); all zeros for an infinite rate."""
    if num_requests <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(num_requests)
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def build_payload(req: BenchRequest, cfg: ServeConfig, model: str) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        payload["messages"] = req.as_messages()
    else:
        payload["prompt"] = req.text()
    if cfg.temperature is not None:
        payload["temperature"] = cfg.temperature
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
        payload["min_tokens"] = req.max_tokens
    return payload


def _chunk_has_text(choice: dict) -> bool:
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text"))


def apply_sse_line(line: str, record: RequestRecord, now: float, answer=None) -> bool:
    """Update ``record`` from one SSE line; return False once the stream is done. ``answer``:
    a list the text deltas are appended to (a multi-turn conversation keeps the answer)."""
    line = line.strip()
    if not line.startswith("data:"):
        return True
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return False
    chunk = json.loads(data)
    if chunk.get("error"):
        record.error = f"server error: {chunk['error']}"[:300]
        return False
    choices = chunk.get("choices") or []
    if choices and _chunk_has_text(choices[0]):
        record.token_times.append(now)
        if answer is not None:
            choice = choices[0]
            answer.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if usage.get("completion_tokens") is not None:
            record.completion_tokens = int(usage["completion_tokens"])
    return True


async def send_request(
    client, path: str, payload: dict, kind: str = "", answer=None
) -> RequestRecord:
    """POST one streaming request and time every chunk; never raises. ``answer``: a list
    the streamed text is appended to."""
    record = RequestRecord(send_time=time.perf_counter(), kind=kind)
    try:
        async with client.stream("POST", path, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error = f"HTTP {resp.status_code}: {body[:300]}"
                return record
            async for line in resp.aiter_lines():
                if not apply_sse_line(line, record, time.perf_counter(), answer):
                    break
        if not record.error:
            record.success = bool(record.token_times)
            record.error = "" if record.success else "no tokens streamed"
    except Exception as e:  # noqa: BLE001 -- a failed request is a result, not a crash
        record.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        record.end_time = time.perf_counter()
    return record


async def fetch_model(client) -> str:
    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        models = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError, KeyError) as e:
        raise BenchError(f"cannot list models at {client.base_url}: {e}") from e
    if not models:
        raise BenchError(f"{client.base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def _warm_up(client, cfg: ServeConfig, model: str, nonce: str) -> None:
    path = ENDPOINTS[cfg.endpoint]
    for req in warmup_requests(cfg.warmup, nonce):
        record = await send_request(client, path, build_payload(req, cfg, model), "warmup")
        if not record.success:
            raise BenchError(f"warm-up request failed: {record.error}")


async def _cold_start(client, cfg: ServeConfig, model: str, nonce: str) -> ColdStart:
    """The cold-start probe over /v1/completions (raw prompts: no shared chat-template prefix)."""

    async def first_token_after(i: int) -> float:
        payload = {
            "model": model,
            "prompt": probe_prompt(i, nonce),
            "max_tokens": PROBE_MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        record = await send_request(client, ENDPOINTS["completions"], payload, "cold-start")
        if not record.success:
            raise BenchError(f"cold-start request {i} failed: {record.error}")
        return record.token_times[0] - record.send_time

    return await measure_cold_start(first_token_after, cfg.cold_start)


async def _timed_run(client, cfg: ServeConfig, model: str, workload: Workload):
    from tqdm.auto import tqdm

    path = ENDPOINTS[cfg.endpoint]
    limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(
        total=workload.num_requests,
        desc="bench serve",
        unit="req",
        disable=not cfg.progress,
        file=sys.stderr,
    )

    async def one(req: BenchRequest) -> RequestRecord:
        payload = build_payload(req, cfg, model)
        if limit is None:
            record = await send_request(client, path, payload, req.kind)
        else:
            async with limit:
                record = await send_request(client, path, payload, req.kind)
        bar.update(1)
        return record

    if workload.conversations is not None:
        if cfg.endpoint != "chat":
            raise ValueError("the multiturn workload needs the chat endpoint")
        return await _conversations(client, cfg, model, workload, limit, bar)
    offsets = poisson_schedule(len(workload.requests), cfg.rate, cfg.seed)
    start = time.perf_counter()
    tasks = []
    for offset, req in zip(offsets, workload.requests):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    return list(records), duration


async def _conversations(client, cfg: ServeConfig, model: str, workload: Workload, limit, bar):
    path = ENDPOINTS["chat"]

    async def send(req: BenchRequest):
        answer: list[str] = []
        payload = build_payload(req, cfg, model)
        if limit is None:
            record = await send_request(client, path, payload, req.kind, answer)
        else:
            async with limit:
                record = await send_request(client, path, payload, req.kind, answer)
        return record, "".join(answer)

    conversations = workload.conversations
    turns = max((len(c.questions) for c in conversations), default=1)
    starts = poisson_schedule(len(conversations), cfg.rate / turns, cfg.seed)
    records, duration = await run_conversations(conversations, starts, send, lambda: bar.update(1))
    bar.close()
    return records, duration


def _client(cfg: ServeConfig):
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    n = max(cfg.num_requests, 1)
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    return httpx.AsyncClient(
        base_url=cfg.base_url, headers=headers, limits=limits, timeout=timeout, trust_env=False
    )


async def run_benchmark(cfg: ServeConfig, workload: Workload | None = None) -> BenchResult:
    """Warm up, then send the workload on the Poisson schedule and measure."""
    if cfg.endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {cfg.endpoint!r}; known: {', '.join(ENDPOINTS)}")
    if workload is None:
        if cfg.workload == MULTITURN:
            workload = multiturn_workload(
                cfg.num_requests, cfg.seed, cfg.nonce, cfg.turns, cfg.think_s
            )
        else:
            workload = get_workload(cfg.workload, cfg.num_requests, cfg.seed, cfg.nonce)
    async with _client(cfg) as client:
        model = cfg.model or await fetch_model(client)
        cold = None
        if cfg.cold_start:
            cold = await _cold_start(client, cfg, model, workload.nonce)
        await _warm_up(client, cfg, model, workload.nonce)
        records, duration = await _timed_run(client, cfg, model, workload)
    meta = {
        "url": cfg.url,
        "model": model,
        "endpoint": cfg.endpoint,
        "workload": cfg.workload,
        "request_rate": cfg.rate if math.isfinite(cfg.rate) else "inf",
        "seed": cfg.seed,
        "nonce": workload.nonce,
        "max_concurrency": cfg.max_concurrency,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        # The client's machine (the server's may differ: its workers log their CPU kernels).
        "client_cpu": cpu_extension.cpu_model(),
        "client_cpu_isa": cpu_extension.cpu_isa(),
    }
    if cold is not None:
        meta["cold_start"] = cold.to_dict()
        meta["cold_start_line"] = cold.line()
    return compute_result(records, duration, cfg.slo, meta)


# ---- command line -------------------------------------------------------------------------


def add_load_args(p) -> None:
    """Arguments shared by `bench serve` and `bench sweep`."""
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--workload", default="mixed", help="chat | longdoc | mixed | multiturn | a JSONL FILE"
    )
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--turns", type=int, default=6, help="multiturn: turns per conversation")
    p.add_argument(
        "--think-s", type=float, default=2.0, help="multiturn: mean think time between turns"
    )
    p.add_argument("--seed", type=int, default=0, help="fixes the workload's shape and schedule")
    p.add_argument("--nonce", default=None, help="prompt nonce (default: fresh per run)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    p.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before timing")
    p.add_argument(
        "--cold-start",
        type=int,
        default=DEFAULT_FOLLOWERS,
        metavar="N",
        help="first request's TTFT against the median of the N after it, before anything "
        "else (run right after the server is ready; 0: skip)",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")


def config_from_args(args, rate: float) -> ServeConfig:
    return ServeConfig(
        url=args.url,
        workload=args.workload,
        num_requests=args.num_requests,
        rate=rate,
        seed=args.seed,
        nonce=args.nonce,
        endpoint=args.endpoint,
        model=args.model,
        slo=SLO(args.slo_ttft, args.slo_tpot),
        warmup=args.warmup,
        cold_start=args.cold_start,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        api_key=args.api_key,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
        turns=args.turns,
        think_s=args.think_s,
    )


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="open-loop load test of an OpenAI-compatible server")
    add_load_args(p)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (default: inf)")
    p.add_argument("--plot", default=None, help="write latency CDFs to this PNG")
    p.set_defaults(func=cmd_serve)


def write_json(path: str | Path, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def cmd_serve(args) -> int:
    cfg = config_from_args(args, args.rate)
    try:
        result = asyncio.run(run_benchmark(cfg))
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_result(result))
    if "cold_start_line" in result.meta:
        print(result.meta["cold_start_line"])
    if args.json_out:
        write_json(args.json_out, result.to_dict())
    if args.plot:
        from pdserve.bench.loadgen.plot import plot_cdfs

        plot_cdfs(result, args.plot)
    return 0 if result.completed else 1


def with_rate(cfg: ServeConfig, rate: float, **changes) -> ServeConfig:
    return replace(cfg, rate=rate, **changes)
