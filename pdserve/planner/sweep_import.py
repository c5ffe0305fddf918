"""A profile from a rate sweep of any OpenAI server (``pdserve bench sweep --json``, or ``vllm
bench serve --save-result --save-detailed`` runs): plan from the numbers of the engine you run.

What a sweep shows from outside: each request's TTFT, TPOT and lengths, at each rate.
- Prefill: the time to first token over the prompt length, where nothing queued in front of
  it: per prompt-length bin, the 10th percentile of TTFT over every run (queueing only adds),
  fitted as ``a + b n + c n^2`` (GEMMs linear in the tokens, attention quadratic) and
  written on the planner's grid, an offset of ``o`` tokens costing the attention of ``n (n +
  2 o)`` as the fit's quadratic term says.
- Decode: the TPOT over the batch, and over the context: per run, the batch decoding at once
  is Little's law's ``served rate x mean decode time`` (completed / duration: past the knee
  the offered rate overstates it) and the context the mean prompt plus half
  the output; TPOT = ``a + b batch + c batch x context`` fitted (non-negative) over the runs.
The server is one colocated engine: plan it colocated. Its limits (``max_num_seqs``, KV
blocks) are the operator's to give; the record says the profile was imported, from what.
"""

from __future__ import annotations

import itertools

import numpy as np

from pdserve.planner.analytic import BATCHES, CONTEXTS, OFFSETS, PREFILL_TOKENS
from pdserve.planner.profile import EngineSettings, Profile, Table2D, read_json

MIN_POINTS = 3


def _runs(data: dict) -> list[dict]:
    """The per-rate runs of a ``bench sweep`` JSON, or a list of single runs."""
    runs = data.get("runs") if isinstance(data, dict) else data
    if not isinstance(runs, list) or not runs:
        raise ValueError("no runs: want a `pdserve bench sweep --json` file (or a list of runs)")
    for r in runs:
        if not {"ttfts", "input_lens", "output_lens"} <= set(r):
            raise ValueError("a run lacks per-request ttfts / input_lens / output_lens")
    return runs


def _fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (drop a negative one and refit)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        bad = [i for i in keep if coef[i] < 0]
        if not bad:
            return coef
        keep.remove(bad[0])


def fit_prefill(runs: list[dict]) -> np.ndarray:
    """``(a, b, c)``: TTFT alone ~ a + b n + c n^2 over prompt length n."""
    lens = np.concatenate([np.asarray(r["input_lens"], float)[: len(r["ttfts"])] for r in runs])
    ttft = np.concatenate([np.asarray(r["ttfts"], float) for r in runs])
    edges = np.unique(np.quantile(lens, np.linspace(0, 1, 9)))
    xs, ys = [], []
    for lo, hi in itertools.pairwise(edges):
        inside = (lens >= lo) & (lens <= hi)
        if inside.sum() >= MIN_POINTS:
            xs.append(lens[inside].mean())
            ys.append(np.quantile(ttft[inside], 0.1))
    if not xs:
        raise ValueError("too few requests to fit TTFT over prompt length")
    n = np.asarray(xs)
    return _fit_nonnegative(np.stack([np.ones_like(n), n, n * n], 1), np.asarray(ys))


def served_rate(run: dict) -> float:
    """Requests completed per second of the run (Little's law's arrival rate in a steady
    state); the offered rate where the run does not say. Past the server's knee the offered
    rate overstates what it served, and with it the batch it ran."""
    completed, duration = run.get("completed"), run.get("duration")
    if completed and duration:
        return float(completed) / float(duration)
    return float(run.get("rate") or run.get("request_rate") or 0.0)


def fit_decode(runs: list[dict], prefill: np.ndarray) -> np.ndarray:
    """``(a, b, c)``: a decode step ~ a + b batch + c batch x context, one point per run. In
    one colocated engine the prompts take their share of the time (``rho`` = the served rate x
    mean prefill time, from the prefill fit), so a step is TPOT x (1 - rho); a run whose
    prompts take over 80% of the time is past its knee and left out."""
    rows, ys = [], []
    pa, pb, pc = prefill
    for r in runs:
        tpots = np.asarray(r.get("tpots") or [], float)
        rate = served_rate(r)
        if not len(tpots) or rate <= 0:
            continue
        lens = np.asarray(r["input_lens"], float)
        rho = rate * float(np.mean(pa + pb * lens + pc * lens * lens))
        if rho >= 0.8:
            continue
        outs = np.asarray(r["output_lens"], float)
        decode_s = float(np.mean(tpots) * max(np.mean(outs) - 1, 0))
        batch = max(1.0, rate * decode_s)  # Little's law: requests decoding at once
        context = float(np.mean(lens) + np.mean(outs) / 2)
        rows.append((1.0, batch, batch * context))
        ys.append(float(np.median(tpots)) * (1 - rho))
    if not rows:
        raise ValueError("no run below its knee with TPOTs and a rate to fit TPOT over batch")
    return _fit_nonnegative(np.asarray(rows), np.asarray(ys))


def profile_from_sweep(
    path: str, engine: EngineSettings, kv_bytes_per_token: int = 0, num_layers: int = 1
) -> Profile:
    data = read_json(path, "sweep")
    runs = _runs(data)
    pa, pb, pc = fit_prefill(runs)
    da, db, dc = fit_decode(runs, np.array([pa, pb, pc]))

    def prefill(n: float, offset: float) -> float:
        return pa + pb * n + pc * n * (n + 2 * offset)

    def decode(b: float, ctx: float) -> float:
        return da + db * b + dc * b * ctx

    return Profile(
        prefill=Table2D(
            PREFILL_TOKENS,
            OFFSETS,
            tuple(tuple(prefill(n, o) for o in OFFSETS) for n in PREFILL_TOKENS),
        ),
        decode=Table2D(
            BATCHES, CONTEXTS, tuple(tuple(decode(b, c) for c in CONTEXTS) for b in BATCHES)
        ),
        transfer_bytes=(1.0,),
        transfer_seconds=(0.0,),
        router_overhead_s=0.0,  # inside the measured TTFT
        kv_bytes_per_token=kv_bytes_per_token,
        num_layers=num_layers,
        engine=engine,
        meta={
            "source": f"imported from a rate sweep ({path}): TTFT over prompt length, TPOT over "
            "batch and context; a colocated engine",
            "sweep_fit": {
                "prefill_a_b_c": [float(pa), float(pb), float(pc)],
                "decode_a_b_c": [float(da), float(db), float(dc)],
            },
            "runs": len(runs),
            "server": (runs[0].get("url") or runs[0].get("base_url") or ""),
            "model": runs[0].get("model") or runs[0].get("model_id") or "",
            "validation": {"none": "imported; check with a sweep it was not fitted on"},
        },
    )


def add_import_args(p) -> None:
    """``pdserve profile --from-sweep``'s flags: the engine limits a sweep cannot show."""
    p.add_argument(
        "--from-sweep",
        default=None,
        metavar="SWEEP_JSON",
        help="import a profile from a `pdserve bench sweep --json` of any OpenAI server "
        "(TTFT over prompt length, TPOT over batch and context) instead of measuring",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="with --from-sweep")
    p.add_argument("--num-blocks", type=int, default=65536, help="with --from-sweep: KV blocks")
    p.add_argument("--max-model-len", type=int, default=8192, help="with --from-sweep")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="with --from-sweep")


def cmd_import(args) -> int:
    import sys

    engine = EngineSettings(
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    try:
        prof = profile_from_sweep(args.from_sweep, engine)
    except ValueError as e:
        print(f"pdserve profile: error: argument --from-sweep: {e}", file=sys.stderr)
        return 2
    prof.save(args.out)
    fit = prof.meta["sweep_fit"]
    print(f"wrote {args.out}: prefill a,b,c {fit['prefill_a_b_c']}, decode {fit['decode_a_b_c']}")
    return 0
