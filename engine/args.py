"""Engine options shared by every process that hosts an engine (workers, CLI)."""

from __future__ import annotations

import argparse

from engine.config import CacheConfig, SchedulerConfig, check_device_name


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="embedded", help="HF folder, .gguf file, or 'embedded'")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=2048)
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--prefill-chunk-size", type=int, default=0)
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    g.add_argument(
        "--device",
        type=device_name,
        default="auto",
        help="cpu, cuda[:N], or auto (cuda where a GPU is visible)",
    )


def device_name(value: str) -> str:
    try:
        return check_device_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_from_args(args: argparse.Namespace, progress: bool = False):
    import torch

    from engine.llm_engine import LLMEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    return LLMEngine.from_model_path(
        args.model,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            prefill_chunk_size=args.prefill_chunk_size,
        ),
        max_model_len=args.max_model_len,
        progress=progress,
        device=args.device,
    )
