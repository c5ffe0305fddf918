"""Discrete-event simulation of a pdserve cluster: xPyD or colocated, one router.

The router side mirrors router/flow/lifecycle.py: decode first (reserve a lease on the decode worker
the decode policy picks; wait when none has room, 429 after ``reserve_timeout_s``), prefill on the
worker the prefill policy picks, the first token out as soon as it is sampled, decoding once the
KV is committed (the exposed part of the transfer), and a preempted request sent around again
with its tokens appended. Colocated (no prefill workers), or prompts up to
``local_prefill_max_tokens``: the decode worker prefills in its own batch. The router's policies
are router/policies.py's, called on the simulated workers.

The result is a ``BenchResult`` from pdserve.metrics.compute_result over the same
``RequestRecord``s a real run produces, so real and simulated metrics share one definition.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from engine.block_manager import blocks_for
from pdserve.metrics import SLO, BenchResult, RequestRecord, compute_result
from pdserve.planner.cpu_share import CpuShare
from pdserve.planner.kv_link import KvLink, LinkQueue
from pdserve.planner.profile import EngineSettings, Profile
from pdserve.planner.sim_workers import Clock, SimDecodeWorker, SimPrefillWorker
from pdserve.planner.workload import TraceRequest
from router.policies import get_policy

NO_SLO = SLO()


@dataclass(frozen=True)
class Split:
    """``num_prefill`` prefill + ``num_decode`` decode workers; no prefill workers = colocated."""

    num_prefill: int
    num_decode: int

    @property
    def colocated(self) -> bool:
        return self.num_prefill == 0

    @property
    def workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def label(self) -> str:
        return (
            f"colo{self.num_decode}" if self.colocated else f"{self.num_prefill}P{self.num_decode}D"
        )

    @classmethod
    def parse(cls, text: str) -> Split:
        """``1P2D`` or ``colo3``."""
        t = text.strip().lower()
        try:
            if t.startswith("colo"):
                return cls(0, int(t[4:]))
            p, _, d = t.partition("p")
            split = cls(int(p), int(d.removesuffix("d")))
        except ValueError:
            raise ValueError(f"bad split {text!r}: want xPyD (e.g. 1P2D) or coloN") from None
        if split.num_prefill < 1 or split.num_decode < 1:
            raise ValueError(f"bad split {text!r}: both pools need >= 1 worker")
        return split


@dataclass(frozen=True)
class SimConfig:
    split: Split
    engine: EngineSettings | None = None  # None: the profile's
    decode_num_blocks: int | None = None  # None: engine.num_blocks
    prefill_policy: str = "least_queued"
    decode_policy: str = "most_free_blocks"
    local_prefill_max_tokens: int = 0
    reserve_timeout_s: float = 30.0
    max_attempts: int = 8
    # This router streams the first token before the KV transfer commits; a system that waits
    # for the commit (reserve, prefill, transfer, then token) sets this.
    first_token_waits_for_kv: bool = False
    # Workers sharing this many CPU cores (one small machine); None: each has its own.
    cpu_cores: int | None = None
    # Every request's sampling temperature: OpenAI's default (1.0) unless clients ask for
    # greedy (0); a sampled row costs the profile's sample_seconds_per_row more.
    temperature: float = 1.0
    # The tokens every prompt begins with (a chat template's preamble): the workers' prefix
    # caches serve its full blocks, so a prompt computes the rest only. 0: prompts share none.
    shared_prefix_tokens: int = 0
    # The KV link as a shared, queueing resource; None: each transfer priced alone by the
    # profile's table (what the CPU validation ran with).
    kv_link: KvLink | None = None


@dataclass
class _Req:
    """The router's request: what the client has seen so far, across attempts."""

    rid: str
    trace: TraceRequest
    record: RequestRecord
    outputs: int = 0
    attempts: int = 0
    lease: list[int] | None = None
    decode: SimDecodeWorker | None = None
    waiting_since: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.trace.prompt_tokens + self.outputs

    @property
    def attempt_id(self) -> str:
        return self.rid if self.attempts <= 1 else f"{self.rid}#{self.attempts - 1}"


@dataclass
class SimRun:
    result: BenchResult
    wall_s: float
    preemptions: int
    busy: dict = field(default_factory=dict)  # worker -> share of the run spent in forwards
    records: list = field(default_factory=list, repr=False)  # per request, in send order


class SimCluster:
    """``profile`` prices the prefill workers (and the router), ``decode_profile`` the decode
    workers (default: the same): pools on different hardware or tensor-parallel degrees."""

    def __init__(self, profile: Profile, cfg: SimConfig, decode_profile: Profile | None = None):
        decode_profile = decode_profile or profile
        check_compatible(profile, decode_profile)
        self.profile = profile
        self.cfg = cfg
        self.engine = cfg.engine or profile.engine
        self.clock = Clock()
        self.prefill_policy = get_policy("prefill", cfg.prefill_policy)
        self.decode_policy = get_policy("decode", cfg.decode_policy)
        threads = int(profile.meta.get("threads") or 1)
        c = profile.cpu
        cpu = CpuShare(
            cfg.cpu_cores,
            threads,
            c.co_run_slowdown,
            c.co_run_slowdown_prefill,
            self.clock,
            c.co_run_pairs,
            {"decode": c.co_run_fixed_s, "prefill": c.co_run_fixed_s_prefill},
            {"prefill": c.oversubscribed_prefill_weight},
            {("decode", "decode"): c.co_run_fixed_s_decode_pair},
        )
        self.cpu = cpu
        # The router's and client's CPU per streamed token, with the decode worker's gRPC
        # threads' (another process, but the same cores: one background queue for both).
        self.cpu_per_token_s = c.router_cpu_per_token_s + c.stream_cpu_per_token_s
        args = (self.clock, profile, self.engine)
        kw = {"temperature": cfg.temperature, "shared_prefix": cfg.shared_prefix_tokens}
        links = self._links(cfg)
        self.prefill = [
            SimPrefillWorker(
                *args,
                self.engine.num_blocks,
                f"p{i}",
                cpu,
                on_first_token=self._first,
                link=links[i] if links else None,
                **kw,
            )
            for i in range(cfg.split.num_prefill)
        ]
        decode_engine = cfg.engine or decode_profile.engine
        decode_blocks = cfg.decode_num_blocks or decode_engine.num_blocks
        self.decode = [
            SimDecodeWorker(
                self.clock,
                decode_profile,
                decode_engine,
                decode_blocks,
                f"d{i}",
                cpu,
                on_token=self._token,
                on_preempted=self._preempted,
                **kw,
            )
            for i in range(cfg.split.num_decode)
        ]
        self.waiting: deque[_Req] = deque()  # no decode worker could reserve yet

    @staticmethod
    def _links(cfg: SimConfig) -> list[LinkQueue]:
        """One queue per prefill worker's NIC, or one the whole cluster shares."""
        link = cfg.kv_link
        if link is None:
            return []
        if link.scope == "cluster":
            return [LinkQueue(link)] * cfg.split.num_prefill
        return [LinkQueue(link) for _ in range(cfg.split.num_prefill)]

    # ---- arrivals and dispatch ------------------------------------------------------------
    def arrive(self, req: _Req) -> None:
        self.cpu.charge(self.clock.now, self.profile.cpu.router_cpu_per_request_s)
        self.clock.at(self.clock.now + self.profile.router_overhead_s, self._dispatch, req)

    def _dispatch(self, req: _Req) -> None:
        req.attempts += 1
        if req.attempts > self.cfg.max_attempts or req.num_tokens >= self.engine.max_model_len:
            self._fail(req, "gave up" if req.attempts > 1 else "prompt exceeds the context")
            return
        if self.cfg.split.colocated or req.num_tokens <= self.cfg.local_prefill_max_tokens:
            self._local(req)
        elif not self._reserve_and_prefill(req):
            req.waiting_since = self.clock.now
            self.waiting.append(req)
            self.clock.at(self.clock.now + self.cfg.reserve_timeout_s, self._reserve_timeout, req)

    def _local(self, req: _Req) -> None:
        blocks = blocks_for(req.num_tokens, self.engine.block_size)
        w = self.decode_policy(self.decode, blocks)[0]
        w.served_requests += 1
        t = req.trace
        w.submit_local(req, req.attempt_id, t.prompt_tokens, req.outputs, t.output_tokens)

    def _reserve_and_prefill(self, req: _Req) -> bool:
        blocks = blocks_for(req.num_tokens, self.engine.block_size)
        for w in self.decode_policy(self.decode, blocks):
            lease = w.reserve(req.num_tokens)
            if lease is not None:
                break
        else:
            return False
        w.served_requests += 1
        req.lease, req.decode = lease, w
        p = self.prefill_policy(self.prefill, [])[0]
        p.inflight_tokens += req.num_tokens
        p.inflight_requests += 1
        p.served_requests += 1
        t = req.trace
        p.submit(req, req.attempt_id, t.prompt_tokens, req.outputs, t.output_tokens)
        return True

    def _retry_waiting(self) -> None:
        while self.waiting and self._reserve_and_prefill(self.waiting[0]):
            self.waiting.popleft()

    def _reserve_timeout(self, req: _Req) -> None:
        if req in self.waiting and self.clock.now - req.waiting_since >= self.cfg.reserve_timeout_s:
            self.waiting.remove(req)
            self._fail(req, "no decode worker could hold the request (429)")

    # ---- worker callbacks -----------------------------------------------------------------
    def _first(self, req: _Req, p, sampled_at: float, committed_at: float) -> None:
        """Prefill worker ``p`` sampled the first token; the KV commits at ``committed_at``."""
        p.inflight_tokens -= req.num_tokens
        p.inflight_requests -= 1
        first = committed_at if self.cfg.first_token_waits_for_kv else sampled_at
        self._emit(req, first + self.profile.cpu.disaggregated_hop_s)
        self.clock.at(committed_at, self._attach, req)

    def _attach(self, req: _Req) -> None:
        w, lease = req.decode, req.lease
        req.decode, req.lease = None, None
        t = req.trace
        w.attach(req, req.attempt_id, t.prompt_tokens, req.outputs, t.output_tokens, lease)

    def _token(self, req: _Req, engine_req, now: float, finished: bool, new_token: bool) -> None:
        if new_token:
            self._emit(req, now)
        if finished:
            req.record.end_time = now
            req.record.success = True
            req.record.completion_tokens = req.outputs
            self._retry_waiting()

    def _preempted(self, req: _Req, worker: SimDecodeWorker) -> None:
        self._retry_waiting()
        self.arrive(req)

    def _emit(self, req: _Req, t: float) -> None:
        if self.cpu.cores:  # else charge() does nothing: not called, once per token
            self.cpu.charge(self.clock.now, self.cpu_per_token_s)
        req.outputs += 1
        req.record.token_times.append(t)

    def _fail(self, req: _Req, why: str) -> None:
        req.record.end_time = self.clock.now
        req.record.error = why

    # ---- a run ----------------------------------------------------------------------------
    def run(self, trace: list[TraceRequest], slo: SLO = NO_SLO) -> SimRun:
        started = time.perf_counter()
        t0 = min(r.arrival_s for r in trace)
        reqs = []
        for i, t in enumerate(sorted(trace, key=lambda r: r.arrival_s)):
            record = RequestRecord(send_time=t.arrival_s - t0, prompt_tokens=t.prompt_tokens)
            req = _Req(f"r{i}", t, record)
            reqs.append(req)
            self.clock.at(record.send_time, self.arrive, req)
        self.clock.run()
        records = [r.record for r in reqs]
        duration = max((r.end_time for r in records), default=0.0)
        workers = self.prefill + self.decode
        meta = {"split": self.cfg.split.label, "simulated": True}
        return SimRun(
            compute_result(records, duration, slo, meta),
            time.perf_counter() - started,
            sum(w.num_preemptions for w in self.decode),
            {w.address: w.busy_s / duration if duration else 0.0 for w in workers},
            records,
        )


def simulate(
    profile: Profile,
    trace: list[TraceRequest],
    cfg: SimConfig | Split,
    slo: SLO = NO_SLO,
    decode_profile: Profile | None = None,
) -> SimRun:
    """Serve ``trace`` on a simulated cluster; ``cfg`` may be just a Split."""
    if isinstance(cfg, Split):
        cfg = SimConfig(cfg)
    return SimCluster(profile, cfg, decode_profile).run(trace, slo)


def check_compatible(prefill: Profile, decode: Profile) -> None:
    """Two pools serve one model only if their KV has the same shape per token."""
    if (prefill.kv_bytes_per_token, prefill.num_layers) != (
        decode.kv_bytes_per_token,
        decode.num_layers,
    ):
        raise ValueError(
            "prefill and decode profiles are of different models: KV "
            f"{prefill.kv_bytes_per_token} vs {decode.kv_bytes_per_token} bytes a token, "
            f"{prefill.num_layers} vs {decode.num_layers} layers"
        )


def with_split(cfg: SimConfig, split: Split) -> SimConfig:
    return replace(cfg, split=split)
