"""``pdserve bench gpu-profile``: write the hand-made GPU profile and the 64-GPU example trace
quoted in docs/PLANNING.md.

No GPU is measured here: the profile is a roofline from published figures (sources below),
through pdserve.planner.analytic. Re-measure with ``pdserve profile --device cuda`` on the
real hardware before trusting a plan made with it.

    pdserve bench gpu-profile --out /tmp/planner
"""

from __future__ import annotations

from pathlib import Path

from pdserve.planner.analytic import Hardware, ModelShape, analytic_profile
from pdserve.planner.profile import EngineSettings
from pdserve.planner.workload import (
    LengthDist,
    TraceRequest,
    arrival_times,
    write_trace,
)

# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3. Prefill and decode
# workers on different nodes, KV over 400 Gb/s InfiniBand (NCCL reaches ~45 GB/s of 50).
H100 = Hardware(
    name="NVIDIA H100 SXM5 80GB",
    peak_flops=989e12,
    mem_bandwidth=3.35e12,
    link_bandwidth=45e9,
    link_latency_s=30e-6,
    mfu=0.5,  # large-batch prefill GEMMs in vLLM/SGLang reach 40-60% of dense peak
    mbu=0.7,  # decode steps reach 60-80% of HBM bandwidth
    step_overhead_s=2e-3,  # launches, scheduling and sampling per forward (CUDA graphs off)
)
# Llama-3.1-8B (config.json): 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128;
# 8.03 B parameters, 7.50 B outside the embedding; BF16 weights.
LLAMA3_8B = ModelShape(
    name="meta-llama/Llama-3.1-8B-Instruct (bf16)",
    params=7.50e9,
    weight_bytes=2 * 8.03e9 - 2 * 0.525e9,  # every weight but the embedding rows
    num_layers=32,
    q_size=32 * 128,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # K and V, 32 layers, 8 heads x 128, bf16
)
# 80 GB less 16 GB of weights and ~9 GB of activations and graphs: ~55 GB of KV, 16-token blocks.
ENGINE = EngineSettings(
    num_blocks=int(55e9 / LLAMA3_8B.kv_bytes_per_token / 16),
    max_model_len=8192,
    max_num_batched_tokens=8192,
    max_num_seqs=256,
)

# The example trace: a chat service with a RAG share, bursty (gamma arrivals, cv 2).
TRACE_MIX = [
    (0.7, LengthDist((200, 1500), (100, 500))),  # chat turns with history
    (0.3, LengthDist((2000, 6000), (50, 200))),  # retrieval-augmented questions, summaries
]


def example_trace(n: int = 2000, rate: float = 40.0, seed: int = 0) -> list[TraceRequest]:
    import numpy as np

    times = arrival_times(n, rate, seed, "gamma", cv=2.0)
    rng = np.random.default_rng([seed, 3])
    out = []
    for t in times:
        weights = [w for w, _ in TRACE_MIX]
        dist = TRACE_MIX[rng.choice(len(TRACE_MIX), p=weights)][1]
        p, o = dist.sample(rng, 1)
        out.append(TraceRequest(float(t), int(p[0]), int(o[0])))
    return out


def add_parser(sub) -> None:
    p = sub.add_parser("gpu-profile", help="the hand-made H100 profile and example trace")
    p.add_argument("--out", default=None, help="folder for the profile and the trace")
    p.add_argument(
        "--catalog",
        default=None,
        help="folder for the roofline profiles per GPU, model and TP degree (cluster_configs/"
        "profiles)",
    )
    p.set_defaults(func=write)


def write(args) -> int:
    if args.catalog:
        from pdserve.planner.gpu_catalog import write_catalog

        for path in write_catalog(args.catalog):
            print(f"wrote {path}")
    if not args.out:
        return 0
    out = Path(args.out)
    meta = {"note": "hand-written from published figures; not measured"}
    analytic_profile(H100, LLAMA3_8B, ENGINE, meta).save(out / "profile_h100_llama3_8b.json")
    write_trace(out / "trace_chat_rag.jsonl", example_trace())
    print(f"wrote {out / 'profile_h100_llama3_8b.json'} and {out / 'trace_chat_rag.jsonl'}")
    return 0
