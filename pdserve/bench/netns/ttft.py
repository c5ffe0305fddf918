"""The exposed KV transfer's share of TTFT across the shaped link, with layer-wise streaming
and without it (``prefill_layerwise_kv: false``): prompts of random token ids (fresh each, so
no prefix-cache hit) sent one at a time from the outsider host through the router; the router's
``kv_transfer_s`` is the transfer time not hidden behind prefill compute, so share =
kv_transfer_s / ttft_s (as `bench transfer` reports it on loopback)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path


def _vocab(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def measure_ttft_share(
    cluster,
    model: str,
    tokens: int,
    runs: int,
    layerwise: bool,
    transport: str = "grpc",
    seed: int = 0,
) -> dict:
    cluster.start_pdserve(model, transport, prefill_layerwise_kv=layerwise)
    vocab = _vocab(model)
    low = 3 if vocab < 1000 else 100  # clear of special tokens
    rng = random.Random(seed)
    prompts = [[rng.randrange(low, vocab) for _ in range(tokens)] for _ in range(runs + 1)]
    outs = cluster.generate(prompts, 2, sequential=True)[1:]  # the first: a warm-up
    med = {
        k: statistics.median(o[k] for o in outs)
        for k in ("prefill_s", "kv_transfer_s", "ttft_s", "kv_bytes")
    }
    share = statistics.median(o["kv_transfer_s"] / o["ttft_s"] for o in outs if o["ttft_s"] > 0)
    return {
        "transport": transport,
        "layerwise": layerwise,
        "prompt_tokens": tokens,
        "runs": len(outs),
        **med,
        "share_of_ttft": share,
    }


def measure_ttft_shares(cluster, model: str, tokens: int, runs: int, log=print) -> list[dict]:
    rows = []
    for layerwise in (True, False):
        row = measure_ttft_share(cluster, model, tokens, runs, layerwise)
        rows.append(row)
        log(
            f"{'layer-wise' if layerwise else 'after the forward':>17}: prefill "
            f"{row['prefill_s']:.3f} s, KV exposed {row['kv_transfer_s']:.4f} s, TTFT "
            f"{row['ttft_s']:.3f} s, {row['kv_bytes'] / 2**20:.1f} MiB: "
            f"{row['share_of_ttft']:.1%} of TTFT"
        )
    cluster.stop_pdserve()
    return rows
