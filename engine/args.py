"""Engine options shared by every process that hosts an engine (the worker processes): the
flags of ``engine.settings.EngineSettings``, with its defaults."""

from __future__ import annotations

import argparse

from engine.config import (
    ACTIVATIONS,
    DTYPES,
    KV_DTYPES,
    LOAD_FORMATS,
    PREFILL_GEMMS,
    WEIGHT_FORMATS,
    WEIGHT_GROUPS,
    check_device_name,
)
from engine.settings import EngineSettings


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineSettings()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="HF folder, .gguf file, or 'embedded'")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--num-blocks", type=int, default=d.num_blocks)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--prefill-chunk-size", type=int, default=d.prefill_chunk_size)
    g.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: default)")
    g.add_argument(
        "--device",
        type=device_name,
        default=d.device,
        help="cpu, cuda[:N], or auto (cuda where a GPU is visible)",
    )
    g.add_argument(
        "--dtype",
        default=d.dtype,
        choices=DTYPES,
        help="the model's float dtype; auto: bf16 on CUDA, fp32 on the CPU",
    )
    g.add_argument("--weights", default=d.weights, choices=WEIGHT_FORMATS)
    g.add_argument("--weight-group", type=int, default=d.weight_group, choices=WEIGHT_GROUPS)
    g.add_argument("--kv-dtype", default=d.kv_dtype, choices=KV_DTYPES)
    g.add_argument(
        "--prefill-gemm",
        default=d.prefill_gemm,
        choices=PREFILL_GEMMS,
        help="prefill's many-row matmuls; int8: int8 / q4 weights' int8-activation kernel; "
        "auto: the fastest of bf16 and int8 for quantized weights, where it beats fp32",
    )
    g.add_argument(
        "--activations",
        default=d.activations,
        choices=ACTIVATIONS,
        help="int8 / q4 weights' decode rows on CPU: int8 (byte dot products) or fp32 (exact)",
    )
    g.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="dummy: random weights of the model folder's config.json (benchmarks, profiles)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=d.tensor_parallel_size,
        help="ranks the model is split over (engine/tp_ranks.py), each with --threads threads",
    )


def engine_settings_from_args(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefill_chunk_size=args.prefill_chunk_size,
        device=args.device,
        threads=args.threads,
        dtype=args.dtype,
        weights=args.weights,
        weight_group=args.weight_group,
        kv_dtype=args.kv_dtype,
        prefill_gemm=args.prefill_gemm,
        activations=args.activations,
        tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
    )


def engine_args(s: EngineSettings) -> list[str]:
    """The flags that ``engine_settings_from_args`` turns back into ``s``."""
    return [
        *("--model", s.model, "--block-size", str(s.block_size)),
        *("--num-blocks", str(s.num_blocks), "--max-model-len", str(s.max_model_len)),
        *("--max-num-batched-tokens", str(s.max_num_batched_tokens)),
        *("--max-num-seqs", str(s.max_num_seqs)),
        *("--prefill-chunk-size", str(s.prefill_chunk_size)),
        *("--threads", str(s.threads), "--device", s.device),
        *("--dtype", s.dtype, "--weights", s.weights, "--weight-group", str(s.weight_group)),
        *("--kv-dtype", s.kv_dtype, "--prefill-gemm", s.prefill_gemm),
        *("--activations", s.activations),
        *("--tensor-parallel-size", str(s.tensor_parallel_size)),
        *("--load-format", s.load_format),
    ]


def device_name(value: str) -> str:
    try:
        return check_device_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
