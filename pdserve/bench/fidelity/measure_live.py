"""What a live worker's steps cost over the bare engine's that the profile's tables time.

A disaggregated prefill worker ships each layer's KV while the next layer computes: its KV
threads build and send frames on the cores the forward runs on, which a colocated worker does
not. This measures what that costs: the worker's own ``prefill_s`` against
``WorkerTimer.prefill`` at the same length, through a real pair (worker processes, the
configured KV transport, the router), one request at a time, random prompts (no prefix-cache
hits). On a quiet 2-vCPU Xeon VM it read 1.01 (docs/PLANNING.md section 4): alone the shipping
costs little; what costs is a busy neighbour, which the co-run slowdowns price.
"""

from __future__ import annotations

import statistics

import numpy as np

# The config fields that make the worker what the profile times; the rest (addresses, ports,
# security) stay the local harness's loopback defaults.
ENGINE_FIELDS = (
    "model",
    "kv_transport",
    "block_size",
    "num_blocks",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "prefill_chunk_size",
    "weights",
    "weight_group",
    "kv_dtype",
    "prefill_gemm",
    "activations",
)
SIZES = (64, 256, 512)  # prompt tokens: short, middle and a whole chunk of the default budget
RUNS = 4  # per size, after one warm-up request


def live_prefill_seconds(cfg, threads: int, sizes=SIZES, runs: int = RUNS, seed: int = 0):
    """{prompt tokens: median prefill seconds} as a live 1P1D pair's prefill worker reports
    them (its ``prefill_s``: scheduled to first token), one request at a time."""
    from engine.loader import load_config
    from pdserve.client import Client
    from pdserve.cluster.local import ClusterSpec, LocalCluster

    fields = {name: getattr(cfg, name) for name in ENGINE_FIELDS}
    spec = ClusterSpec(separate_processes=True, threads_per_worker=threads, **fields)
    rng = np.random.default_rng(seed)
    out = {}
    with LocalCluster(spec) as cluster, Client(cluster.address) as client:
        vocab = load_config(cluster.model_dir).vocab_size
        low = 3 if vocab < 1000 else 100  # clear of special tokens

        def prefill_s(n: int) -> float:
            ids = rng.integers(low, vocab, n).tolist()
            return client.generate(
                token_ids=ids, max_tokens=2, include_timings=True
            ).timings.prefill_s

        for n in sizes:
            prefill_s(n)  # warm-up: this length's first step
            out[n] = statistics.median(prefill_s(n) for _ in range(runs))
    return out
