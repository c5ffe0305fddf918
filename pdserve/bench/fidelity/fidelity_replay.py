"""Re-simulate stored fidelity runs (``pdserve bench fidelity --json``) on a profile.

A stored run keeps its measured summary and each completed request's prompt and output tokens
as the server counted them; the send times come from the seeded Poisson schedule, and where a
run kept less, the requests are rebuilt as the run made them: the load generator's seeded
workload (``make_workload``, with the run's nonce) through the router's tokenizer and chat
template for the prompt lengths, ``max_tokens`` for the output lengths (the runs use
``ignore_eos``). So a new simulator model is scored against the same real measurements, on the
same requests the live simulation replayed, without running a cluster again.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from pdserve.metrics import SLO, BenchResult
from pdserve.planner.profile import Profile, read_json
from pdserve.planner.sim import SimConfig, Split, simulate
from pdserve.planner.workload import TraceRequest

METRICS = ("p50_ttft_ms", "p90_ttft_ms", "p50_tpot_ms", "goodput")
NONCE = "0" * 8  # as long as new_nonce()'s; a real nonce tokenizes to up to 6 tokens fewer
SHARED_PREFIX_SAMPLE = 40  # requests: most of them share an index digit with an earlier one


def summary(res: BenchResult) -> dict:
    return {
        "p50_ttft_ms": res.ttft_ms.median,
        "p90_ttft_ms": res.ttft_ms.p90,
        "p50_tpot_ms": res.tpot_ms.median,
        "goodput": res.request_goodput or 0.0,
        "attainment": res.slo_attainment or 0.0,
        "completed": res.completed,
    }


def err(sim: float, real: float) -> float:
    return abs(sim - real) / real if real else (0.0 if sim == 0 else 1.0)


def mape(rows: list[dict]) -> dict:
    return {m: sum(r["error"][m] for r in rows) / len(rows) for m in METRICS}


def mape_of(rows: list[dict], side: str) -> dict:
    """The MAPE of another simulated side a row keeps (``sim_as_profiled``)."""
    return {m: sum(err(r[side][m], r["real"][m]) for r in rows) / len(rows) for m in METRICS}


def sent_requests(res: BenchResult, rate: float, seed: int, n: int) -> list[TraceRequest]:
    """A real run's requests as the simulator replays them: each completed request's prompt and
    output tokens at its own send offset in the same seeded Poisson schedule the load generator
    used (a failed request is left out, and the ones after it keep their offsets)."""
    from pdserve.bench.loadgen.serve import poisson_schedule

    offsets = poisson_schedule(n, rate, seed).tolist()
    return [
        TraceRequest(offsets[i], p, o)
        for i, p, o in zip(res.sent_indices, res.input_lens, res.output_lens, strict=True)
    ]


def per_request(res: BenchResult) -> dict:
    """Each completed request's figures in send order, to read residuals request by request
    (TPOT None for a one-token answer, as the metrics leave it out)."""
    tpots = [
        round((e2el - ttft) / (out - 1), 5) if out > 1 else None
        for ttft, e2el, out in zip(res.ttfts, res.e2els, res.output_lens, strict=True)
    ]
    return {
        "ttft_s": [round(t, 5) for t in res.ttfts],
        "tpot_s": tpots,
        "prompt_tokens": res.input_lens,
        "output_tokens": res.output_lens,
        "sent_index": res.sent_indices,
    }


def rebuild_requests(
    workload: str, n: int, rate: float, seed: int, tokenizer, nonce: str = NONCE
) -> list:
    """The ``n`` requests a seeded fidelity run sent: TraceRequests of (send offset, prompt
    tokens, output tokens); exact with the run's own ``nonce``, within a few prompt tokens
    without it."""
    from pdserve.bench.loadgen.serve import poisson_schedule
    from pdserve.bench.loadgen.workloads import make_workload
    from router.tokenize import tokenize

    reqs = make_workload(workload, n, seed, nonce).requests
    offsets = poisson_schedule(n, rate, seed).tolist()
    return [
        TraceRequest(t, len(tokenize(tokenizer, None, r.as_messages())), r.max_tokens)
        for t, r in zip(offsets, reqs, strict=True)
    ]


def shared_prefix_tokens(
    workload: str, tokenizer, nonce: str = NONCE, requests: int = SHARED_PREFIX_SAMPLE
) -> int:
    """How many leading tokens a run's typical prompt (the median over its first ``requests``)
    shares with the earlier prompt it shares most with, as the workers' prefix caches serve
    them: the chat template's preamble (SmolLM2's default system prompt), the run's nonce line,
    and the leading digits of the request's index that an earlier index shares (request 14
    with requests 10-13). A nonce that tokenizes 4 tokens shorter leaves 31 tokens shared
    between requests 0 and 1, yet 32 (two blocks) for most of a run's requests."""
    from pdserve.bench.loadgen.workloads import make_workload
    from router.tokenize import tokenize

    reqs = make_workload(workload, requests, 0, nonce).requests
    prompts = [tokenize(tokenizer, None, r.as_messages()) for r in reqs]
    best = [max(_common_prefix(p, q) for q in prompts[:i]) for i, p in enumerate(prompts) if i]
    return int(statistics.median_low(best))


def _common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def stored_requests(row: dict, seed: int, tokenizer) -> tuple[list[TraceRequest], int]:
    """A stored run's requests as the simulator replays them, and the prompts' shared prefix.
    Each completed request keeps the prompt and output tokens the server reported
    (``per_request``) at its send offset in the seeded schedule. Rebuilt from the seeded
    workload alone, a run stored without its nonce comes out a few tokens off: the stored
    runs' nonces tokenize to 0-4 tokens fewer than the placeholder, and a 20-token prompt
    step's price moves some 2.6 ms a token. Such a run's nonce line is taken as long as its
    prompts say (the shift between the server's counts and the rebuilt ones), shared prefix
    included."""
    nonce = row.get("nonce") or NONCE
    rebuilt = rebuild_requests(
        row["workload"], row["requests"], row["rate"], seed, tokenizer, nonce
    )
    shared = shared_prefix_tokens(row["workload"], tokenizer, nonce)
    real = (row.get("per_request") or {}).get("real")
    if not real:  # stored before per_request
        return rebuilt, shared
    prompts, outputs = real["prompt_tokens"], real["output_tokens"]
    sent = real.get("sent_index")
    # Paired by send index where the run kept it; before that, in order (a shed request
    # misaligns only the pairs after it, and the shift is the commonest difference).
    paired = [rebuilt[i] for i in sent] if sent else rebuilt
    shift = Counter(p - r.prompt_tokens for p, r in zip(prompts, paired)).most_common(1)[0][0]
    sent = sent or match_sent(rebuilt, prompts, outputs, shift)
    trace = [
        TraceRequest(rebuilt[i].arrival_s, p, o)
        for i, p, o in zip(sent, prompts, outputs, strict=True)
    ]
    return trace, shared + shift


def match_sent(rebuilt: list, prompts: list[int], outputs: list[int], shift: int) -> list[int]:
    """Each completed request's place in send order, for a run stored before ``sent_index``:
    the completed requests, in order, matched to the earliest rebuilt request after the last
    match with the same output tokens and the same prompt tokens once shifted by ``shift``."""
    counts = [(r.prompt_tokens + shift, r.output_tokens) for r in rebuilt]
    sent, i = [], 0
    for wanted in zip(prompts, outputs, strict=True):
        while i < len(counts) and counts[i] != wanted:
            i += 1
        if i == len(counts):
            raise ValueError("a stored run's requests do not match its seeded workload")
        sent.append(i)
        i += 1
    return sent


def replay(
    profile: Profile, split: Split, trace: list, slo: SLO, cores: int, shared_prefix: int = 0
) -> BenchResult:
    """A run's requests through the simulator, the workers sharing ``cores`` cores, every
    prompt beginning with the same ``shared_prefix`` tokens."""
    cfg = SimConfig(split, cpu_cores=cores, shared_prefix_tokens=shared_prefix)
    return simulate(profile, trace, cfg, slo).result


def run_name(row: dict) -> str:
    """A fidelity run's name, as its step-trace folder is named."""
    return f"{row['split']}_{row['workload']}_{row['rate']}"


def resimulate(
    report: dict, profile: Profile, slos: dict, tokenizer, seed: int = 0, costs=None
) -> dict:
    """``report`` (a fidelity JSON) with every run's simulated side, errors and MAPE redone on
    ``profile``; the measured side is kept. ``slos``: workload -> SLO the runs were scored on.
    ``costs``: run name -> profile fields to replace for that run alone (its leave-one-out
    calibration), or None."""
    cores = int(report.get("cpu_cores") or 2)
    rows = []
    for row in report["fidelity"]:
        trace, shared = stored_requests(row, seed, tokenizer)
        split, slo = Split.parse(row["split"]), slos[row["workload"]]
        speed = (row.get("speed") or {}).get("used")  # the run's probed speed, if it had one
        own = profile.with_cpu(**costs[run_name(row)]) if costs else profile
        now = own.at_speed(**speed) if speed else own
        sim = replay(now, split, trace, slo, cores, shared)
        new = {**row, "sim": summary(sim)}
        if costs:
            new["costs"] = costs[run_name(row)]
        new["error"] = {m: err(new["sim"][m], row["real"][m]) for m in METRICS}
        rows.append(new)
    return {**report, "fidelity": rows, "mape": mape(rows)}


def load_report(path: str | Path) -> dict:
    """A stored fidelity report (``pdserve bench fidelity --json``); ValueError naming the
    file if it cannot be read or holds no runs."""
    report = read_json(path)
    if not isinstance(report, dict) or "fidelity" not in report:
        raise ValueError(f"{path} is not a fidelity report (no runs)")
    return report


def repeat_spread(first: dict, second: dict) -> dict:
    """Two fidelity reports of the same requests (same seed and rates, run one after the
    other): how far the real cluster lands from itself. Per metric, the MAPE of each run's
    real side taken as the prediction of the other's (a simulator that predicted one run
    exactly would score that on its repeat: the floor a single run's MAPE is read against),
    and of each report's simulated side scored on the other's real one."""
    pairs = list(zip(first["fidelity"], second["fidelity"], strict=True))
    for a, b in pairs:
        same = ("split", "workload", "rate", "requests")
        if any(a[k] != b[k] for k in same):
            raise ValueError(
                f"not a repeat: {run_name(a)} ({a['requests']} requests) against "
                f"{run_name(b)} ({b['requests']} requests)"
            )

    def score(x_of, y_of) -> dict:  # x_of(pair) predicts y_of(pair)
        return {m: sum(err(x_of(p)[m], y_of(p)[m]) for p in pairs) / len(pairs) for m in METRICS}

    return {
        "first_predicts_second": score(lambda p: p[0]["real"], lambda p: p[1]["real"]),
        "second_predicts_first": score(lambda p: p[1]["real"], lambda p: p[0]["real"]),
        "first_sim_on_second": score(lambda p: p[0]["sim"], lambda p: p[1]["real"]),
        "second_sim_on_first": score(lambda p: p[1]["sim"], lambda p: p[0]["real"]),
        "runs": [{"run": run_name(a), "real": a["real"], "repeat": b["real"]} for a, b in pairs],
    }


SPREAD_LABELS = {
    "first_predicts_second": "the first run's real side predicting the second's",
    "second_predicts_first": "the second run's real side predicting the first's",
    "first_sim_on_second": "the first run's simulation scored on the second",
    "second_sim_on_first": "the second run's simulation scored on the first",
}


def format_spread(spread: dict) -> str:
    """``repeat_spread``'s figures: each run's real side and its repeat's, then the MAPEs."""
    lines = []
    for run in spread["runs"]:
        a, b = run["real"], run["repeat"]
        cells = (f"{m} {a[m]:.4g}/{b[m]:.4g} ({err(a[m], b[m]):.0%})" for m in METRICS)
        lines.append(f"{run['run']:<22}" + "  ".join(cells))
    for key, label in SPREAD_LABELS.items():
        figures = "  ".join(f"{m} {v:.1%}" for m, v in spread[key].items())
        lines.append(f"MAPE {label}: {figures}")
    return "\n".join(lines)
