"""A profile from published figures instead of measurements (a GPU this machine does not have).

Roofline with efficiency factors: prefill is bound by FLOPs (GEMMs at ``mfu`` of peak, causal
attention on top), a decode step by bytes (every weight plus the batch's KV at ``mbu`` of
bandwidth, or the GEMM FLOPs when the batch is large enough to be compute bound), plus a fixed
cost per forward (kernel launches, scheduling). The KV link is latency + bytes / bandwidth.

A worker of ``tp`` devices (tensor parallel) splits every GEMM and the KV over them: ``tp``
times the FLOPs and the bandwidth, less two all-reduces of the step's activations per layer
over the devices' interconnect (ring: 2 (tp - 1) / tp of the bytes, plus a launch latency).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.profile import EngineSettings, Profile, Table2D

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
OFFSETS = (0, 1024, 2048, 4096, 8192)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CONTEXTS = (128, 512, 1024, 2048, 4096, 8192)
TRANSFER_BYTES = (2**20, 2**24, 2**27, 2**30, 2**32)


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense, the model's dtype
    mem_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s between a prefill and a decode worker
    link_latency_s: float = 50e-6
    mfu: float = 0.5  # share of peak a prefill GEMM reaches
    mbu: float = 0.7  # share of bandwidth a decode step reaches
    step_overhead_s: float = 4e-3  # per forward: launches, scheduling, sampling
    memory_bytes: float = 80e9  # HBM per device
    interconnect_bandwidth: float = 450e9  # bytes/s per direction between the TP group's devices
    allreduce_latency_s: float = 8e-6  # one all-reduce's fixed cost


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float  # non-embedding parameters
    weight_bytes: float  # every weight a decode step reads
    num_layers: int
    q_size: int  # heads x head_dim
    kv_bytes_per_token: int  # K and V, every layer
    hidden: int = 0  # the residual stream's width (what a TP all-reduce moves per token)
    activation_bytes: int = 2  # bf16


def allreduce_seconds(hw: Hardware, model: ModelShape, tokens: int, tp: int) -> float:
    """Two ring all-reduces per layer over ``tokens`` rows of the residual stream."""
    if tp <= 1:
        return 0.0
    nbytes = tokens * model.hidden * model.activation_bytes * 2 * (tp - 1) / tp
    one = hw.allreduce_latency_s + nbytes / hw.interconnect_bandwidth
    return 2 * model.num_layers * one


def analytic_profile(
    hw: Hardware,
    model: ModelShape,
    engine: EngineSettings,
    meta: dict | None = None,
    tp: int = 1,
) -> Profile:
    flops = hw.peak_flops * hw.mfu * tp
    bw = hw.mem_bandwidth * hw.mbu * tp

    def prefill(n: int, offset: int) -> float:
        attention = 4.0 * n * (offset + n / 2) * model.q_size * model.num_layers
        compute = (2.0 * model.params * n + attention) / flops
        return hw.step_overhead_s + compute + allreduce_seconds(hw, model, n, tp)

    def decode(b: int, ctx: int) -> float:
        weights = max(model.weight_bytes / bw, 2.0 * model.params * b / flops)
        kv = b * ctx * model.kv_bytes_per_token / bw
        return hw.step_overhead_s + weights + kv + allreduce_seconds(hw, model, b, tp)

    return Profile(
        prefill=Table2D(
            PREFILL_TOKENS,
            OFFSETS,
            tuple(tuple(prefill(n, c) for c in OFFSETS) for n in PREFILL_TOKENS),
        ),
        decode=Table2D(
            BATCHES, CONTEXTS, tuple(tuple(decode(b, c) for c in CONTEXTS) for b in BATCHES)
        ),
        transfer_bytes=TRANSFER_BYTES,
        transfer_seconds=tuple(hw.link_latency_s + b / hw.link_bandwidth for b in TRANSFER_BYTES),
        router_overhead_s=1e-3,
        kv_bytes_per_token=model.kv_bytes_per_token,
        num_layers=model.num_layers,
        engine=engine,
        meta={
            "source": "analytic roofline (published figures, not measured)",
            "tp": tp,
            "hardware": hw.__dict__,
            "model": model.__dict__,
            **(meta or {}),
        },
    )
