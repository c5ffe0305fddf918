"""Issue 54's whole-engine figures: a random-weight Llama-3.1-8B (load_format dummy, bf16 by
the CUDA default) on one GPU, its decode step at batch 1 as a fraction of the copy bandwidth
(MBU: weights + KV read per step) eagerly and under CUDA graphs (engine/cuda_graphs.py), and
a 4,096-token prefill as a fraction of the bf16 matmul rate (MFU: 2 FLOPs a parameter a token,
plus causal attention). Limits measured in the same run (gpu_limits.py).

    python -m pdserve.bench.kernels.gpu_engine_step [--json PATH] [--model DIR]

Steps are timed through ``LLMEngine.generate`` (scheduler, sampler and all): decode as the
difference between 1 + N and 1 generated tokens over N, prefill as a 1-token generation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pdserve.bench.kernels import gpu_limits as gl

MODEL = "cluster_configs/models/llama3_8b"
PREFILL_TOKENS, DECODE_CONTEXT, DECODE_STEPS = 4096, 512, 64
DECODE_MBU, PREFILL_MFU = 0.7, 0.5


def build(model: str, device: str, max_model_len: int, dtype: str = "auto"):
    from engine.llm_engine import build_engine
    from engine.settings import EngineSettings

    settings = EngineSettings(
        model=model,
        device=device,
        dtype=dtype,
        load_format="dummy",
        block_size=16,
        num_blocks=2 * -(-max_model_len // 16) + 64,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        max_num_seqs=8,
    )
    return build_engine(settings)


def timed_generate(engine, prompt: list[int], tokens: int, device: str) -> float:
    from engine.request import SamplingParams

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate([prompt], params)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def fresh_prompt(engine, length: int) -> list[int]:
    """Random ids no earlier prompt shares a block with, so no prefix cache hit shortens a
    prefill being timed."""
    vocab = engine.runner.model.cfg.vocab_size
    return torch.randint(3, vocab, (length,)).tolist()


def decode_step_seconds(engine, context: int, steps: int, device: str) -> float:
    timed_generate(engine, fresh_prompt(engine, context), steps + 1, device)  # warm-up
    # Both timed runs prefill a fresh prompt of the same length, so the difference is steps.
    first = timed_generate(engine, fresh_prompt(engine, context), 1, device)
    whole = timed_generate(engine, fresh_prompt(engine, context), steps + 1, device)
    return max(whole - first, 1e-9) / steps


def decode_bytes(engine, context: int) -> int:
    """Weights a step reads plus the KV of ``context`` tokens (every layer, K and V)."""
    model = engine.runner.model
    k_cache = engine.runner.kv_caches[0][0]
    per_token_layer = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return model.weight_bytes_per_step() + context * per_token_layer * len(model.layers)


def prefill_flops(engine, tokens: int) -> float:
    """2 FLOPs per parameter per token in the projections (embeddings excluded: a lookup),
    plus causal attention in every layer."""
    model, cfg = engine.runner.model, engine.runner.model.cfg
    params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        params += model.lm_head.weight.numel()
    attention = gl.attention_flops(cfg.num_heads, cfg.head_dim, tokens, tokens) * cfg.num_layers
    return 2.0 * params * tokens + attention


def collect(engine, device: str, peak: float, bandwidth: float, prefill_tokens: int, context):
    """Decode at batch 1 over ``context`` tokens (eager; on CUDA also graphed), then one
    prefill of ``prefill_tokens``."""
    from engine.cuda_graphs import BATCH_BUCKETS, DecodeGraphs

    runner = engine.runner
    work = decode_bytes(engine, context)
    runner.graphs = None
    eager = decode_step_seconds(engine, context, DECODE_STEPS, device)
    figures = [gl.Figure("engine decode b1 eager", eager, work, bandwidth, "B", DECODE_MBU)]
    print(figures[-1].line(), flush=True)  # each as measured: a timeout keeps what was done
    if device == "cuda":
        max_len = runner.model.rope.cos.shape[0]
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv_caches, max_len, runner.block_size, list(BATCH_BUCKETS[:1])
        )
        graphed = decode_step_seconds(engine, context, DECODE_STEPS, device)
        figures.append(
            gl.Figure("engine decode b1 CUDA graph", graphed, work, bandwidth, "B", DECODE_MBU)
        )
        print(figures[-1].line(), flush=True)
        runner.graphs = None
    timed_generate(engine, fresh_prompt(engine, prefill_tokens), 1, device)  # autotune
    seconds = timed_generate(engine, fresh_prompt(engine, prefill_tokens), 1, device)
    flops = prefill_flops(engine, prefill_tokens)
    figures.append(
        gl.Figure(f"engine prefill {prefill_tokens}", seconds, flops, peak, "FLOP", PREFILL_MFU)
    )
    print(figures[-1].line(), flush=True)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL, help="a folder with the model's config.json")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_engine_step: no CUDA device", file=sys.stderr)
        return 2
    peak, bandwidth = gl.measure_matmul_rate(), gl.measure_copy_bandwidth()
    print(f"limits: bf16 matmul {peak / 1e12:.1f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s")
    torch.manual_seed(0)
    engine = build(args.model, "cuda", PREFILL_TOKENS + 64)
    print(f"model {args.model} dtype {engine.runner.model.embed_tokens.weight.dtype}", flush=True)
    figures = collect(engine, "cuda", peak, bandwidth, PREFILL_TOKENS, DECODE_CONTEXT)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "figures": [
                fig.as_dict() for fig in figures]}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
