"""The fidelity runs' setups and the tokenizer their prompt lengths come from: one place for
the live runs and the stored-run modes, which rebuild the same requests."""

from __future__ import annotations

import functools

from pdserve.bench.fidelity.fidelity_replay import NONCE, shared_prefix_tokens
from pdserve.metrics import SLO

# (split, workload, SLO). Rates: LOW and NEAR x the simulated capacity (highest rate at 90%).
# SLOs suit a 2-vCPU VM: a 1,300-token document alone takes 2-4 s to prefill on one thread.
SETUPS = [
    ("1P1D", "mixed", SLO(10.0, 0.2)),
    ("1P2D", "chat", SLO(2.0, 0.15)),
    ("colo2", "mixed", SLO(10.0, 0.2)),
]
SLOS = {workload: slo for _, workload, slo in SETUPS}
LOW, NEAR = 0.4, 0.85
# (workload, SLO, share of the recommended split's simulated capacity to run at)
RECOMMEND = [("longdoc", SLO(12.0, 0.2), 0.9), ("chat", SLO(2.0, 0.15), 0.9)]
FALLBACK_RATE = 0.1  # when the simulation holds no rate at 90%
# A live run apart from the scored ones (another seed and rate) to measure the co-run slowdowns.
CALIBRATION = ("1P1D", "mixed", 0.5, 45, 7)  # split, workload, rate, requests, seed


@functools.cache
def embedded_tokenizer():
    """The router's tokenizer for the embedded model: the runs' prompt lengths come from it."""
    from engine.tokenizer import Tokenizer
    from pdserve.planner.measure import engine_dir

    return Tokenizer(engine_dir("embedded"))


@functools.cache
def shared_prefix(workload: str, nonce: str = NONCE) -> int:
    """The leading tokens a run's prompts share (its chat preamble and its nonce line), which
    the live workers' prefix caches serve after the first request."""
    return shared_prefix_tokens(workload, embedded_tokenizer(), nonce)
