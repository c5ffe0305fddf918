"""``pdserve profile``: measure one worker on this hardware and write a latency profile.

- prefill: one forward over a chunk of N new tokens at offset C (tokens already in the cache),
  with the sampler, over N up to the batch token budget and C up to the context;
- decode: whole steps of the real Scheduler (schedule, forward, sample, update) over batch size
  and context per sequence, so the scheduler's own cost per step is in the figure;
- KV transfer: one request's KV pushed and committed over the configured transport, over sizes;
- router: the time to first token through the router with instant fake workers
  (pdserve.measure.router_overhead), which is what the router adds to a request's TTFT;
- sampling: what a row sampled at a temperature costs over a greedy one (the tables are timed
  greedy);
- with ``--cpu-corrections`` only: a step's slowdown while another worker process computes
  beside it, for workers sharing one small machine's cores (cpu_corrections.py). The other
  corrections are fitted from live step traces by the lab (``pdserve bench fidelity``,
  ``pdserve bench cpu-costs``).

Each table point is the median of a few repeats: the steady-state cost a simulated step
stands for.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import asdict, dataclass, replace

import torch

from pdserve.measure.timing import median_time
from pdserve.planner.cpu_corrections import CpuCorrections
from pdserve.planner.machine_meta import machine_meta
from pdserve.planner.profile import EngineSettings, Profile, Table2D, despike, monotone

QUICK_ROUTER_OVERHEAD_S = 2e-3  # --quick does not spawn the router; BENCHMARKS.md run 5


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...]
    offsets: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    transfer_tokens: tuple[int, ...]
    reps: int = 3
    decode_steps: int = 4


# Decode batches are dense: the step's cost is not linear in the batch between them (the CPU
# kernels change path with the row count: on a Zen 5 VM 8 rows took 26.6 ms, 12 rows 32.6 and 16
# rows 27.9), and a live batch of 8 priced between 4 and 16 read 10% low.
FULL = Grid(
    (16, 64, 128, 256, 512),
    (0, 512, 1024, 1536),
    (1, 2, 4, 6, 8, 12, 16, 24, 32),
    (64, 256, 512, 960),
    (128, 512, 1024, 2048),
)
# One model on a GPU of its own: prompts and batches a GPU serves (contexts capped so the grid's
# cache, batch x context, fits beside an 8B model's weights on one 141 GB H200; the tables
# extrapolate linearly past their last point).
GPU = Grid(
    (256, 1024, 2048, 4096, 8192),
    (0, 2048, 4096),
    (1, 8, 32, 64, 128, 256),
    (256, 1024, 2048),
    (512, 2048, 8192),
)
QUICK = Grid((8, 32), (0, 32), (1, 4), (16, 64), (32, 128), reps=1, decode_steps=2)
# With a time budget (``pdserve profile --time-budget``): finer rows to choose from, of which
# every other one is measured first and the rest where the curve bends (adaptive_grid.py).
GPU_FINE = replace(
    GPU,
    prefill_tokens=(128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192),
    batches=(1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256),
)


def grid_for(device: str, quick: bool = False, budgeted: bool = False) -> Grid:
    """The points a profile on ``device`` (resolved: cpu, cuda[:N]) measures (``budgeted``:
    the rows a time budget chooses from)."""
    if quick:
        return QUICK
    if device == "cpu":
        return FULL
    return GPU_FINE if budgeted else GPU


def _fit(grid: Grid, engine: EngineSettings) -> Grid:
    """Drop points the engine cannot run: chunks over the budget, contexts over the model."""
    budget, ctx = engine.max_num_batched_tokens, engine.max_model_len - 2
    return Grid(
        tuple(n for n in grid.prefill_tokens if n <= budget) or (budget,),
        tuple(c for c in grid.offsets if c + min(grid.prefill_tokens) <= ctx),
        tuple(b for b in grid.batches if b <= engine.max_num_seqs),
        tuple(c for c in grid.contexts if c <= ctx),
        tuple(t for t in grid.transfer_tokens if t <= ctx) or (ctx,),
        grid.reps,
        grid.decode_steps,
    )


class WorkerTimer:
    """Times the engine as a worker drives it, on a private cache big enough for the grid."""

    def __init__(self, engine, grid: Grid, aggregate=median_time):
        from engine.block_manager import BlockManager
        from engine.scheduler import Scheduler
        from engine.step import StepHooks, StepLoop

        self.engine = engine
        self.grid = grid
        # Of a point's ``reps`` runs, the median: the simulator wants a step's steady-state cost
        # (best-of read live decode steps 5% fast in step traces of a quiet 1P1D run).
        self.aggregate = aggregate
        self.bs = engine.config.cache.block_size
        self.blocks = BlockManager(engine.config.cache.num_blocks, self.bs, False)
        cfg = engine.config.scheduler
        self.scheduler = Scheduler(cfg, self.blocks, engine.config.max_model_len, False)
        # The engine's own step (schedule, forward, sample, update) on this private scheduler.
        self.step_loop = StepLoop(self.scheduler, engine.executor, StepHooks())

    def prefill(self, n: int, offset: int) -> float:
        from engine.request import Request
        from engine.scheduler import ScheduledSequence

        req = Request("p", [5] * (offset + n))
        req.block_table = self.blocks.allocate(self.blocks.blocks_needed(offset + n))
        req.num_computed_tokens = offset
        batch = [ScheduledSequence(req, n, True)]
        runner, sampler = self.engine.runner, self.engine.sampler

        def once():
            sampler.sample(runner.execute(batch), [req])

        try:
            return self.aggregate(once, reps=self.grid.reps, warmup=1)
        finally:
            self.blocks.free(req.block_table)

    def decode(self, batch: int, context: int) -> float:
        """Mean of ``decode_steps`` whole scheduler steps, median of ``reps`` runs."""
        from engine.request import Request, RequestStatus, SamplingParams

        sampling = SamplingParams(max_tokens=10_000, ignore_eos=True)
        reqs = []
        for i in range(batch):
            req = Request(f"d{i}", [5] * context, sampling, output_token_ids=[6])
            req.block_table = self.blocks.allocate(self.blocks.blocks_needed(context + 1))
            req.num_computed_tokens = context
            self.scheduler.attach_prefilled(req)
            reqs.append(req)
        try:
            self._step()  # admits them all
            steps = self.aggregate(self._steps, reps=self.grid.reps, warmup=1)
            return steps / self.grid.decode_steps
        finally:
            for req in reqs:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def _step(self) -> None:
        self.step_loop.step()

    def _steps(self) -> None:
        for _ in range(self.grid.decode_steps):
            self._step()


def measure_transfer(model_cfg, engine: EngineSettings, transport: str, tokens) -> list[float]:
    from pdserve.measure.kv_push import KVShape, measure_transport

    out = []
    for n in tokens:
        shape = KVShape(  # the cache as the engine stores it: int8/fp8 rows carry scales
            model_cfg.num_layers,
            engine.block_size,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            n,
            engine.kv_dtype,
        )
        result = measure_transport(transport, shape, repeats=2, loopback_best=1.0)
        out.append(min(result.seconds))
    return out


def background_work(model_dir: str, seconds: float, kind: str) -> None:
    """A second worker computing on one thread for ``seconds``: prefill forwards of 256 new
    tokens (``kind`` "prefill") or decode steps of 16 sequences at context 256 ("decode")."""
    from engine.config import CacheConfig
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine.from_model_path(model_dir, CacheConfig(16, 512), progress=False)
    timer = WorkerTimer(engine, QUICK)
    print("READY", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        timer.prefill(256, 0) if kind == "prefill" else timer.decode(16, 256)


def _beside(model_dir: str, kind: str, measure) -> float:
    """``measure()`` while a second worker process runs ``kind`` steps beside it."""
    import sys

    code = (
        "from pdserve.planner.measure import background_work; "
        f"background_work({model_dir!r}, 60, {kind!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()  # READY
        time.sleep(0.5)
        return measure()
    finally:
        proc.terminate()
        proc.wait(10)


def measure_co_run_slowdown(timer: WorkerTimer, model_dir: str, reps: int = 9) -> dict:
    """How much slower a step runs while another worker computes beside it, over its time alone,
    for each pair of kinds: a decode step beside a prefilling and beside a decoding neighbour,
    a prefill step beside each. What a neighbour costs depends on both kinds: a bandwidth-bound
    decode step loses more than a compute-bound prefill, and on vCPUs that are two hyperthreads
    of one core a prefill beside a decode step costs it far more than another decode step does
    (live step traces on an AMD EPYC VM: decode beside decode 1.07, beside prefill 1.35).
    Medians of ``reps`` runs on both sides: the fastest run beside a neighbour is the one it
    happened not to disturb (best-of read 1.00 on a Xeon VM, where step traces of live 1P1D
    runs showed 1.17 and 1.3-1.4). Keys: the CpuCorrections fields they set."""
    batch, ctx = min(16, max(timer.grid.batches)), min(256, max(timer.grid.contexts))
    chunk = min(256, max(timer.grid.prefill_tokens))
    steady = WorkerTimer(timer.engine, replace(timer.grid, reps=reps))
    steps = {
        "decode": lambda: steady.decode(batch, ctx),
        "prefill": lambda: steady.prefill(chunk, 0),
    }
    alone = {kind: step() for kind, step in steps.items()}

    def beside(neighbour: str, kind: str) -> float:
        return max(1.0, _beside(model_dir, neighbour, steps[kind]) / alone[kind])

    return {
        "co_run_slowdown": beside("prefill", "decode"),
        "co_run_slowdown_prefill": beside("decode", "prefill"),
        "co_run_slowdown_decode_pair": beside("decode", "decode"),
        "co_run_slowdown_prefill_pair": beside("prefill", "prefill"),
    }


def measure_sample_cost(engine, batch: int = 8, reps: int = 15) -> float:
    """Seconds a row sampled at temperature 1 (top-p 1, as OpenAI's defaults) costs over a
    greedy row, from the engine's own sampler on ``batch`` rows of random logits. Thread CPU
    time, best of ``reps``: on one thread it is the wall time when alone, and a busy machine
    barely moves it (wall time there is mostly waiting for a core)."""
    from engine.request import Request, SamplingParams

    vocab = engine.config.model.vocab_size
    logits = torch.randn(batch, vocab)

    def best(temperature: float) -> float:
        params = SamplingParams(max_tokens=2, temperature=temperature)
        reqs = [Request(f"s{i}", [5], params) for i in range(batch)]
        times = []
        for _ in range(reps):
            t = time.thread_time()
            engine.sampler.sample(logits, reqs)
            times.append(time.thread_time() - t)
        return min(times)

    return max(0.0, (best(1.0) - best(0.0)) / batch)


def measure_router_overhead(prompt_tokens: int = 256) -> float:
    from pdserve.measure.router_overhead import measure

    summary = asyncio.run(measure(40, prompt_tokens))
    return max(r["routed_p50_ms"] for r in summary["rows"]) / 1e3


def engine_dir(model: str):
    from engine.model_files import resolve_model_dir

    return resolve_model_dir(model, progress=False)


def _measure_tables(timer, grid: Grid, bar, budget_s: float | None):
    """The prefill and decode tables: every grid row, or within ``budget_s`` (45% to each
    table) the coarse rows then those where the curve bends. Returns the grid as measured,
    both tables and the record of what was measured and skipped."""
    from pdserve.planner.adaptive_grid import measure_rows

    def prefill_row(n: int) -> list[float]:
        row = [timer.prefill(n, c) for c in grid.offsets]
        bar.update(len(grid.offsets))
        return row

    def decode_row(b: int) -> list[float]:
        row = [timer.decode(b, c) for c in grid.contexts]
        bar.update(len(grid.contexts))
        return row

    if budget_s is None:
        prefill = [tuple(prefill_row(n)) for n in grid.prefill_tokens]
        decode = [tuple(decode_row(b)) for b in grid.batches]
        return grid, prefill, decode, {"rows": "all", "budget_s": None}
    p_rows, prefill, p_rec = measure_rows(grid.prefill_tokens, prefill_row, budget_s * 0.45)
    d_rows, decode, d_rec = measure_rows(grid.batches, decode_row, budget_s * 0.45)
    record = {"budget_s": budget_s, "prefill": asdict(p_rec), "decode": asdict(d_rec)}
    measured = replace(grid, prefill_tokens=tuple(p_rows), batches=tuple(d_rows))
    return measured, [tuple(r) for r in prefill], [tuple(r) for r in decode], record


def run_profile(
    cfg,
    device: str = "cpu",
    quick: bool = False,
    skip_router: bool = False,
    progress: bool = True,
    cpu_corrections: bool = False,
    time_budget_s: float | None = None,
) -> Profile:
    """Measure the worker ``cfg`` (a pdserve.config.ClusterConfig) describes, on ``device``;
    ``cpu_corrections``: also the co-run slowdowns of workers sharing this machine's cores."""
    from tqdm.auto import tqdm

    from engine.llm_engine import build_engine
    from engine.loader import resolve_device
    from pdserve.settings import settings_from_config

    device = resolve_device(device)
    # The decode pool's engine as the cluster would build it (weights, KV dtype, budgets);
    # only its KV pool is sized to the grid here.
    settings = settings_from_config(cfg, "127.0.0.1").decode.engine
    settings = replace(settings, device=device)
    grid = _fit(grid_for(device, quick, time_budget_s is not None), settings)
    blocks = max(grid.batches) * (max(grid.contexts) // settings.block_size + 2) + 64
    engine = build_engine(replace(settings, num_blocks=blocks))
    settings = replace(settings, max_model_len=engine.config.max_model_len)
    timer = WorkerTimer(engine, grid)
    total = len(grid.prefill_tokens) * len(grid.offsets) + len(grid.batches) * len(grid.contexts)
    bar = tqdm(total=total + 4, desc="profile", unit="pt", disable=not progress)
    grid, prefill, decode, grid_record = _measure_tables(timer, grid, bar, time_budget_s)
    model_cfg = engine.config.model
    bar.set_postfix_str(f"kv transfer ({cfg.kv_transport})")
    transfer = measure_transfer(model_cfg, settings, cfg.kv_transport, grid.transfer_tokens)
    bar.update(1)
    bar.set_postfix_str("beside another worker")
    # Only asked for: workers sharing a small machine's cores (a GPU worker has its device to
    # itself, and a GPU profile carries no CPU corrections).
    co_run = {}
    if cpu_corrections and not quick:
        co_run = measure_co_run_slowdown(timer, str(engine_dir(cfg.model)))
    bar.update(1)
    bar.set_postfix_str("router")
    router_s = QUICK_ROUTER_OVERHEAD_S if quick or skip_router else measure_router_overhead()
    bar.update(1)
    bar.set_postfix_str("sampling")
    sample_s = measure_sample_cost(engine)
    bar.update(1)
    bar.close()
    # One token's K and V rows as the cache holds them (an int8 cache's rows carry scales).
    kv_per_token = sum(k[0, 0].nbytes + v[0, 0].nbytes for k, v in engine.runner.kv_caches)
    meta = machine_meta(engine, device, torch.get_num_threads())
    meta.update(
        raw={"prefill": prefill, "decode": decode},  # before the running maximum
        model=str(cfg.model),
        model_shape={
            k: getattr(model_cfg, k)
            for k in (
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "vocab_size",
            )
        },
        kv_transport=cfg.kv_transport,
        router_overhead="assumed (not measured)" if quick or skip_router else "measured",
        quick=quick,
        grid=grid_record,
    )
    return Profile(
        prefill=Table2D(grid.prefill_tokens, grid.offsets, monotone(despike(prefill))),
        decode=Table2D(grid.batches, grid.contexts, monotone(despike(decode))),
        transfer_bytes=tuple(float(t * kv_per_token) for t in grid.transfer_tokens),
        transfer_seconds=tuple(transfer),
        router_overhead_s=router_s,
        sample_seconds_per_row=sample_s,
        cpu=CpuCorrections(**co_run),
        kv_bytes_per_token=kv_per_token,
        num_layers=model_cfg.num_layers,
        engine=settings,
        meta=meta,
    )
