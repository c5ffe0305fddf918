"""Roofline profiles per (GPU, model, dtype, TP degree), from published figures.

None of these is measured: each file's ``meta.source`` says roofline and its ``validation``
says none, and ``pdserve plan`` prints that beside every figure it derives from one. They let an
operator size a deployment before owning the hardware (and show the planner's shape search);
re-measure with ``pdserve profile --device cuda`` or import a ``pdserve bench sweep`` of the
engine that will run (``pdserve profile --from-sweep``) before trusting a plan.

    pdserve bench gpu-profile --catalog cluster_configs/profiles
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pdserve.planner.analytic import Hardware, ModelShape, analytic_profile
from pdserve.planner.profile import EngineSettings, Profile

# Datasheets: dense BF16 FLOP/s, HBM bandwidth and size; NVLink per direction at the ~80% that
# NCCL's ring all-reduce reaches. KV between nodes: one 400 Gb/s NIC a GPU (~45 GB/s each).
GPUS = {
    "h100": Hardware(
        name="NVIDIA H100 SXM5 80GB",
        peak_flops=989e12,
        mem_bandwidth=3.35e12,
        link_bandwidth=45e9,
        link_latency_s=30e-6,
        step_overhead_s=2e-3,
        memory_bytes=80e9,
        interconnect_bandwidth=360e9,
    ),
    "h200": Hardware(
        name="NVIDIA H200 SXM 141GB",
        peak_flops=989e12,
        mem_bandwidth=4.8e12,
        link_bandwidth=45e9,
        link_latency_s=30e-6,
        step_overhead_s=2e-3,
        memory_bytes=141e9,
        interconnect_bandwidth=360e9,
    ),
    "a100": Hardware(
        name="NVIDIA A100 SXM4 80GB",
        peak_flops=312e12,
        mem_bandwidth=2.039e12,
        link_bandwidth=22e9,  # 200 Gb/s HDR
        link_latency_s=30e-6,
        step_overhead_s=2.5e-3,
        memory_bytes=80e9,
        interconnect_bandwidth=240e9,
    ),
}

# config.json of each: layers, hidden, heads x head_dim, 8 KV heads of 128; BF16.
MODELS = {
    "llama3_8b": ModelShape(
        name="meta-llama/Llama-3.1-8B-Instruct (bf16)",
        params=7.50e9,
        weight_bytes=2 * 8.03e9 - 2 * 0.525e9,
        num_layers=32,
        q_size=32 * 128,
        kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
        hidden=4096,
    ),
    "llama3_70b": ModelShape(
        name="meta-llama/Llama-3.1-70B-Instruct (bf16)",
        params=69.5e9,  # 70.55 B less the input embedding's 1.05 B
        weight_bytes=2 * 69.5e9,
        num_layers=80,
        q_size=64 * 128,
        kv_bytes_per_token=2 * 80 * 8 * 128 * 2,
        hidden=8192,
    ),
}
# The (model, TP degrees) written: 70B needs 4 devices at least (141 GB of BF16 weights).
SHAPES = {"llama3_8b": (1, 2), "llama3_70b": (4, 8)}
ACTIVATIONS_BYTES = 6e9  # per device: activations, CUDA graphs, the allocator's slack
MEMORY_UTILIZATION = 0.9  # vLLM's gpu_memory_utilization


def engine_for(hw: Hardware, model: ModelShape, tp: int) -> EngineSettings:
    """KV blocks left on ``tp`` devices once the weights and activations are in."""
    free = hw.memory_bytes * tp * MEMORY_UTILIZATION - model.weight_bytes - ACTIVATIONS_BYTES * tp
    if free <= 0:
        raise ValueError(f"{model.name} does not fit {tp} x {hw.name}")
    return EngineSettings(
        num_blocks=int(free / model.kv_bytes_per_token / 16),
        max_model_len=8192,
        max_num_batched_tokens=8192,
        max_num_seqs=256,
        tensor_parallel_size=tp,
    )


def roofline_profile(gpu: str, model: str, tp: int) -> Profile:
    hw, shape = GPUS[gpu], MODELS[model]
    # Each rank pushes its KV shard over its own NIC: tp NICs carry a worker's transfer.
    hw_tp = replace(hw, link_bandwidth=hw.link_bandwidth * tp)
    meta = {
        "dtype": "bfloat16",
        "device": gpu,
        "validation": {"none": "roofline from published figures, not measured"},
    }
    return analytic_profile(hw_tp, shape, engine_for(hw, shape, tp), meta, tp=tp)


def write_catalog(out: str | Path) -> list[Path]:
    """Every (GPU, model, TP degree) of SHAPES as ``roofline_{gpu}_{model}_tp{k}.json``."""
    paths = []
    for gpu in GPUS:
        for model, degrees in SHAPES.items():
            for tp in degrees:
                path = Path(out) / f"roofline_{gpu}_{model}_tp{tp}.json"
                roofline_profile(gpu, model, tp).save(path)
                paths.append(path)
    return paths
