"""Issue 54's GPU figures, each as a fraction of a limit measured in the same run
(pdserve/bench/kernels/gpu_limits.py) and beside torch's own path on the same inputs:

- prefill attention at Llama-3.1-8B's shapes (32 heads, 8 KV heads, head dim 128, 4,096
  tokens, causal, bf16): the Triton kernel (kernels/triton_kernels.py) against the bf16
  matmul rate (target 50%) and torch's SDPA (target 0.9x);
- decode paged attention, batch 1 and 32, context 4,096 and 32,768: the Triton kernel
  (split-K as chosen by kernels/triton_decode_splitk.py, and forced single-pass) against the
  copy bandwidth (target 70%), beside SDPA on contiguous (unpaged) K/V.

    python -m pdserve.bench.kernels.gpu_figures [--json PATH] [--quick]

CUDA only; imports the kernels and torch, no serving package (scripts/gpu_check.sh runs it
on a bare GPU image). Exit status 0 whether or not figures reach their targets (the lines
say PASS / BELOW); 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from pdserve.bench.kernels import gpu_limits as gl

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3.1-8B's attention
PREFILL_TOKENS = 4096
DECODE_SHAPES = [(1, 4096), (1, 32768), (32, 4096), (32, 32768)]  # (batch, context)
PREFILL_MFU, PREFILL_VS_SDPA, DECODE_MBU = 0.5, 0.9, 0.7
# tests/test_gpu_limits.py dry-runs the code on "cpu" in fp32 (the Triton interpreter has no
# bf16 dot) at tiny shapes.
DEVICE, DTYPE = "cuda", torch.bfloat16


def paged_inputs(batch: int, context: int, q_len: int):
    """Query [batch * q_len, h, d], paged caches holding ``context`` tokens per sequence
    (blocks in a shuffled order, as a serving cache's are) and their metadata."""
    from kernels.metadata import AttentionMetadata

    per_seq = -(-context // BLOCK_SIZE)
    order = torch.randperm(batch * per_seq).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([q_len] * batch, [context] * batch, tables, BLOCK_SIZE, DEVICE)
    shape = (batch * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    query = torch.randn(batch * q_len, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return query, k_cache, v_cache, meta


def contiguous_kv(k_cache, meta, batch: int, context: int) -> torch.Tensor:
    """The paged cache's tokens as SDPA takes them: [batch, kv_heads, context, d]."""
    rows = k_cache[meta.block_tables.long()]  # [b, blocks, block_size, kvh, d]
    rows = rows.reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :context]
    return rows.transpose(1, 2).contiguous()


def time_torch(fn, reps: int) -> float | None:
    """Seconds per call of torch's path, None (reported, not fatal) where it fails."""
    try:
        return gl.time_cuda([fn], reps)
    except RuntimeError as e:
        print(f"torch path failed: {e}", flush=True)
        return None


def prefill_figure(peak_flops: float, reps: int) -> tuple[gl.Figure, float]:
    """Ours vs SDPA at 8B shapes; also the max abs difference between the two outputs."""
    from kernels.triton_kernels import prefill_attention_triton

    n, scale = PREFILL_TOKENS, HEAD_DIM**-0.5
    query, k_cache, v_cache, meta = paged_inputs(1, n, n)
    q = query.view(1, n, HEADS, HEAD_DIM).transpose(1, 2)
    k = contiguous_kv(k_cache, meta, 1, n)
    v = contiguous_kv(v_cache, meta, 1, n)

    def ours():
        return prefill_attention_triton(query, k_cache, v_cache, meta, scale)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    try:
        diff = (ours().view(1, n, HEADS, HEAD_DIM).transpose(1, 2) - sdpa()).abs().max().item()
    except RuntimeError as e:  # SDPA refused the inputs: still report our kernel
        print(f"prefill: no SDPA comparison: {e}", flush=True)
        diff = float("nan")
    figure = gl.Figure(
        f"prefill {n} tok h{HEADS}/{KV_HEADS} d{HEAD_DIM}",
        gl.time_cuda([ours], reps),
        gl.attention_flops(HEADS, HEAD_DIM, n, n),
        peak_flops,
        "FLOP",
        PREFILL_MFU,
        torch_seconds=time_torch(sdpa, reps),
        torch_target=PREFILL_VS_SDPA,
    )
    return figure, diff


def decode_figures(batch: int, context: int, bandwidth: float, reps: int) -> list[gl.Figure]:
    """The Triton decode kernel as the dispatcher runs it (split-K where it chooses) and forced
    single-pass, over enough input copies that L2 holds none between calls; SDPA on
    contiguous K/V (one copy: at these sizes its own reads exceed L2 except at batch 1 x 4k,
    where it is flattered, which only makes the comparison stricter)."""
    from kernels.triton_decode_splitk import choose_num_splits
    from kernels.triton_kernels import decode_attention_triton

    scale = HEAD_DIM**-0.5
    elem = DTYPE.itemsize
    work = gl.decode_attention_bytes(batch, context, HEADS, KV_HEADS, HEAD_DIM, elem, BLOCK_SIZE)
    sets = [paged_inputs(batch, context, 1) for _ in range(gl.copies_to_exceed(work))]
    splits = choose_num_splits(batch, KV_HEADS, context)
    query, k_cache, v_cache, meta = sets[0]
    q = query.view(batch, HEADS, 1, HEAD_DIM)
    k, v = (
        contiguous_kv(k_cache, meta, batch, context),
        contiguous_kv(v_cache, meta, batch, context),
    )

    def run(num_splits):
        return [lambda s=s: decode_attention_triton(*s, scale, num_splits=num_splits) for s in sets]

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)

    sdpa_seconds = time_torch(sdpa, reps)
    name = f"decode b{batch} ctx{context}"
    figures = [
        gl.Figure(
            f"{name} split-K x{splits}",
            gl.time_cuda(run(None), reps),
            work,
            bandwidth,
            "B",
            DECODE_MBU,
            torch_seconds=sdpa_seconds,
        )
    ]
    if splits > 1:  # the single pass, to show what the split buys
        figures.append(
            gl.Figure(
                f"{name} single pass", gl.time_cuda(run(1), reps), work, bandwidth, "B", DECODE_MBU
            )
        )
    return figures


def collect_figures(peak: float, bandwidth: float, reps: int, decode_shapes):
    """Every figure, printed as it is measured; and the prefill's max |ours - SDPA|."""
    prefill, diff = prefill_figure(peak, reps)
    print(prefill.line() + f"  (max |ours - SDPA| {diff:.3g})", flush=True)
    figures = [prefill]
    for batch, context in decode_shapes:
        for figure in decode_figures(batch, context, bandwidth, reps):
            print(figure.line(), flush=True)
            figures.append(figure)
        if DEVICE == "cuda":  # this shape's inputs (up to ~17 GB) before the next one's
            torch.cuda.empty_cache()
    return figures, diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="decode at batch 1 x 4k only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_figures: no CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    peak, bandwidth = gl.measure_matmul_rate(), gl.measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}")
    print(f"limits: bf16 matmul {peak / 1e12:.1f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s")
    shapes = DECODE_SHAPES[:1] if args.quick else DECODE_SHAPES
    figures, diff = collect_figures(peak, bandwidth, args.reps, shapes)
    if args.json:
        with open(args.json, "w") as f:
            limits = {"bf16_matmul_flops": peak, "copy_bytes_per_s": bandwidth}
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "limits": limits,
                    "prefill_max_abs_diff_vs_sdpa": diff,
                    "figures": [fig.as_dict() for fig in figures],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
