"""Overload soak (issue 19): a local cluster on the embedded model under twice the load it can
sustain, for minutes. Every request must either complete or get a 429 at once: no 5xx. It
reports completed / 429 / 5xx / other counts, how fast a 429 comes back (p50, p99), the
latency of the completed ones, memory (RSS of the router and each worker) before and after,
and whether every KV block is free at the end.

The sustainable rate is measured first, in the same run: a closed loop of ``--concurrency``
clients, completed requests per second. The soak then sends Poisson arrivals at
``--factor`` times that rate (open loop: arrivals do not wait for answers).

    pdserve bench overload-soak                 # 2x for 180 s, JSON report on stdout
    pdserve bench overload-soak --seconds 30 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from pathlib import Path

import grpc
import httpx

from kernels.cpu_extension import cpu_model
from pdserve.cluster.local import ClusterSpec, LocalCluster
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc as pb_grpc


def rss_mib(pid: int) -> float:
    """Resident memory of a process (Linux /proc), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def memory(cluster: LocalCluster) -> dict[str, float]:
    procs = {"router": os.getpid()}
    roles = cluster._roles()  # the order the harness starts its worker processes in
    procs.update({f"{roles[i]}{i}": p.pid for i, p in enumerate(cluster._procs)})
    return {name: round(rss_mib(pid), 1) for name, pid in procs.items()}


def pool_state(cluster: LocalCluster) -> list[dict]:
    out = []
    for role, addresses in (
        ("prefill", cluster.prefill_addresses),
        ("decode", cluster.decode_addresses),
    ):
        stub_cls = pb_grpc.PrefillWorkerStub if role == "prefill" else pb_grpc.DecodeWorkerStub
        for address in addresses:
            with grpc.insecure_channel(address) as ch:
                st = stub_cls(ch).Status(pb.StatusRequest(), timeout=5)
            out.append(
                {
                    "role": role,
                    "free_blocks": st.num_free_blocks,
                    "total_blocks": st.num_total_blocks,
                    "leases": st.num_leases,
                    "running": st.num_running,
                    "waiting": st.num_waiting,
                }
            )
    return out


def all_free(state: list[dict]) -> bool:
    return all(
        s["free_blocks"] == s["total_blocks"] and not (s["leases"] or s["running"] or s["waiting"])
        for s in state
    )


def wait_all_free(cluster: LocalCluster, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    state = pool_state(cluster)
    while not all_free(state) and time.monotonic() < deadline:
        time.sleep(0.2)
        state = pool_state(cluster)
    return state


class Load:
    """Requests of one shape (random prompt ids, fixed lengths), and what came back."""

    def __init__(self, client: httpx.AsyncClient, args, seed: int):
        self.client = client
        self.args = args
        self.rng = random.Random(seed)
        self.results: list[tuple[int, float]] = []  # (HTTP status or -1 on a transport error, s)
        self.errors: dict[str, int] = {}  # the message of each non-429 error, counted
        self.refusals: dict[str, list[float]] = {}  # a 429's reason (digits dropped) -> s

    def body(self) -> dict:
        prompt = [self.rng.randrange(1000, 20000) for _ in range(self.args.prompt_tokens)]
        return {
            "prompt": prompt,
            "max_tokens": self.args.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }

    async def one(self) -> None:
        start = time.monotonic()
        try:
            resp = await self.client.post("/v1/completions", json=self.body())
            status = resp.status_code
            message = resp.text[:160] if status not in (200, 429) else None
        except httpx.HTTPError as e:
            status, message = -1, repr(e)[:160]
        self.results.append((status, time.monotonic() - start))
        if status == 429:
            reason = re.sub(r"[0-9.]+", "N", resp.json()["error"]["message"])[:100]
            self.refusals.setdefault(reason, []).append(time.monotonic() - start)
        if message is not None:
            key = f"{status} {message}"
            self.errors[key] = self.errors.get(key, 0) + 1

    async def closed_loop(self, concurrency: int, seconds: float) -> float:
        """Completed requests per second with ``concurrency`` clients back to back."""
        end = time.monotonic() + seconds

        async def client_loop():
            while time.monotonic() < end:
                await self.one()

        start = time.monotonic()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        done = sum(1 for s, _ in self.results if s == 200)
        return done / (time.monotonic() - start)

    async def open_loop(self, rate: float, seconds: float) -> None:
        """Poisson arrivals at ``rate`` per second for ``seconds``; waits for every answer."""
        tasks, end = [], time.monotonic() + seconds
        next_at = time.monotonic()
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one()))
            next_at += self.rng.expovariate(rate)
        await asyncio.gather(*tasks)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 4)


def summarize(results: list[tuple[int, float]], seconds: float) -> dict:
    ok = [t for s, t in results if s == 200]
    refused = [t for s, t in results if s == 429]
    return {
        "requests": len(results),
        "completed": len(ok),
        "http_429": len(refused),
        "http_5xx": sum(1 for s, _ in results if s >= 500),
        "other": sorted({s for s, _ in results if s not in (200, 429) and s < 500}),
        "completed_per_s": round(len(ok) / seconds, 2),
        "latency_429_s": {"p50": percentile(refused, 50), "p99": percentile(refused, 99)},
        "latency_completed_s": {"p50": percentile(ok, 50), "p99": percentile(ok, 99)},
    }


async def soak(cluster: LocalCluster, args) -> dict:
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=512)
    timeout = httpx.Timeout(600.0)
    base = f"http://{cluster.http_address}"
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        await Load(client, args, seed=0).closed_loop(2, 5.0)  # warm the path
        calibration = Load(client, args, seed=1)
        rate = await calibration.closed_loop(args.concurrency, args.calibrate_s)
        before = memory(cluster)
        load_before = [round(x, 2) for x in os.getloadavg()]
        load = Load(client, args, seed=2)
        start = time.monotonic()
        await load.open_loop(args.factor * rate, args.seconds)
        elapsed = time.monotonic() - start
    state = wait_all_free(cluster)
    return {
        "sustainable_rate_per_s": round(rate, 2),
        "offered_rate_per_s": round(args.factor * rate, 2),
        "calibration": summarize(calibration.results, args.calibrate_s),
        "soak": summarize(load.results, elapsed),
        "soak_errors": dict(sorted(load.errors.items(), key=lambda kv: -kv[1])[:10]),
        "soak_429_reasons": {  # which bound refused, how many, and how fast
            reason: {"n": len(ts), "p50_s": percentile(ts, 50), "p99_s": percentile(ts, 99)}
            for reason, ts in sorted(load.refusals.items(), key=lambda kv: -len(kv[1]))
        },
        "soak_wall_s": round(elapsed, 1),
        "load_average_before": load_before,
        "rss_mib_before": before,
        "rss_mib_after": memory(cluster),
        "all_blocks_free": all_free(state),
        "pools": state,
    }


# What the CLI adds to the parsed flags: the report keeps only the soak's own arguments.
_NOT_FLAGS = ("func", "command", "bench_command")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "overload-soak",
        help="a local cluster at twice its sustainable rate: every request done or a quick 429",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--model", default="embedded")
    p.add_argument("--seconds", type=float, default=180.0, help="soak length")
    p.add_argument("--factor", type=float, default=2.0, help="offered load / sustainable rate")
    p.add_argument("--calibrate-s", type=float, default=30.0)
    p.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="closed-loop clients (calibration): enough "
        "to fill the decode batch, so the rate measured is the most the cluster completes",
    )
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--in-process", action="store_true", help="workers as threads of this process")
    p.add_argument("--out", help="also write the JSON report here")
    p.set_defaults(func=run)


def run(args) -> int:
    spec = ClusterSpec(
        model=args.model,
        num_decode=args.num_decode,
        http_port=0,
        separate_processes=not args.in_process,
        max_model_len=512,
    )
    with LocalCluster(spec) as cluster:
        report = asyncio.run(soak(cluster, args))
    report["machine"] = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    report["args"] = {k: v for k, v in vars(args).items() if k not in _NOT_FLAGS}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if report["soak"]["http_5xx"] == 0 and report["all_blocks_free"] else 1
