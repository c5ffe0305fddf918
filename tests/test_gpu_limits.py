"""The GPU figures' arithmetic (pdserve/bench/kernels/gpu_limits.py) on CPU, and a dry run of
the figure script (gpu_figures.py) at tiny shapes under the Triton interpreter. No timing is
judged here: the GPU run (scripts/gpu_check.sh) measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
from pdserve.bench.kernels import gpu_limits as gl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (4, 4), (3, 10), (1, 7), (16, 16)])
def test_causal_pairs_count_the_visible_keys(q_len: int, kv_len: int) -> None:
    rows = torch.arange(kv_len - q_len, kv_len)[:, None]
    visible = (torch.arange(kv_len)[None, :] <= rows).sum().item()
    assert gl.causal_pairs(q_len, kv_len) == visible
    with pytest.raises(ValueError):
        gl.causal_pairs(kv_len + 1, kv_len)


def test_prefill_flops_at_8b_shapes() -> None:
    # 4 FLOPs per head-dim element per visible pair: 4096 * 4097 / 2 pairs, 32 heads, d 128.
    assert gl.attention_flops(32, 128, 4096, 4096) == 4 * (4096 * 4097 // 2) * 32 * 128
    # Half (plus the diagonal) of the non-causal 4 * s^2 * h * d: FlashAttention's count.
    full = 4 * 4096**2 * 32 * 128
    assert full / 2 < gl.attention_flops(32, 128, 4096, 4096) < full / 2 * 1.001


def test_decode_bytes_read_each_kv_head_once() -> None:
    kv = 2 * 4096 * 8 * 128 * 2  # K and V, 8 KV heads (not 32 query heads), bf16
    q_and_out = 2 * 32 * 128 * 2
    tables = 4096 // 16 * 4
    assert gl.decode_attention_bytes(1, 4096, 32, 8, 128, 2, 16) == kv + q_and_out + tables
    # A context that does not fill its last block still reads that block's table entry.
    assert (
        gl.decode_attention_bytes(2, 17, 4, 2, 8, 4, 16)
        == 2 * 2 * 17 * 2 * 8 * 4 + (2 * 2 * 4 * 8 * 4) + 2 * 2 * 4
    )


def test_limits_arithmetic() -> None:
    assert gl.matmul_flops(8192) == 2 * 8192**3
    assert gl.copy_bytes(2**31) == 2**32  # read + write
    assert gl.copies_to_exceed(16 * 2**20) == 16  # 16 MB inputs: 16 copies pass 256 MB
    assert gl.copies_to_exceed(4 * 2**30) == 1
    assert gl.copies_to_exceed(100, flush_bytes=250) == 3
    with pytest.raises(ValueError):
        gl.copies_to_exceed(0)
    with pytest.raises(ValueError):
        gl.fraction(1.0, 0.0)


def test_figure_ratios_and_verdict() -> None:
    # 1e12 FLOPs in 2 ms = 500 TFLOP/s against a 800 TFLOP/s limit: 62.5%; torch took 2.4 ms.
    fig = gl.Figure("prefill", 2e-3, 1e12, 800e12, "FLOP", 0.5, 2.4e-3, 0.9)
    assert fig.rate == pytest.approx(500e12)
    assert fig.fraction_of_limit == pytest.approx(0.625)
    assert fig.vs_torch == pytest.approx(1.2)
    assert fig.passes and fig.line().endswith("PASS") and "1.20x torch" in fig.line()
    slower = gl.Figure("prefill", 2e-3, 1e12, 800e12, "FLOP", 0.5, 1.6e-3, 0.9)
    assert slower.vs_torch == pytest.approx(0.8) and not slower.passes  # torch's rule fails
    low = gl.Figure("decode", 1e-3, 1e9, 3e12, "B", 0.7)
    assert low.fraction_of_limit == pytest.approx(1 / 3) and not low.passes
    assert low.vs_torch is None and low.line().endswith("BELOW") and "GB/s" in low.line()
    assert json.loads(json.dumps(low.as_dict()))["passes"] is False


@pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed")
def test_figure_script_dry_run_on_cpu() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu_figures_dry_run"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["diff"] < 1e-4  # our prefill kernel agrees with SDPA on the same inputs
    names = [f["name"] for f in result["figures"]]
    assert names == [
        "prefill 40 tok h4/2 d16",
        "decode b1 ctx300 split-K x2",
        "decode b1 ctx300 single pass",
        "decode b2 ctx50 split-K x1",
    ]


def test_engine_step_figures_dry_run_on_cpu(tmp_path) -> None:
    """The whole-engine figure code (gpu_engine_step.py) on a tiny dummy model on CPU: runs,
    and its FLOP and byte counts follow the model's shape."""
    from pdserve.bench.kernels import gpu_engine_step as ges
    from tests.conftest import tiny_llama_dir

    path, hf_model = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    engine = ges.build(str(path), "cpu", 128)
    cfg = engine.runner.model.cfg
    figures = ges.collect(engine, "cpu", 1e12, 1e11, prefill_tokens=40, context=20)
    assert [f.name for f in figures] == ["engine decode b1 eager", "engine prefill 40"]
    assert all(f.seconds > 0 for f in figures)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 on CPU
    weights = engine.runner.model.weight_bytes_per_step()
    assert figures[0].work == weights + 20 * kv_per_token
    params = sum(p.numel() for p in hf_model.model.layers.parameters())
    params += sum(p.numel() for p in hf_model.model.norm.parameters())
    params += hf_model.lm_head.weight.numel()
    attention = gl.attention_flops(cfg.num_heads, cfg.head_dim, 40, 40) * cfg.num_layers
    assert figures[1].work == 2 * params * 40 + attention
