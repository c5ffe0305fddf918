"""The C++ decoder layers (engine/cpu_stack.py) against the Python layers of engine/model.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import LlamaModel
from kernels.metadata import AttentionMetadata
from tests import cpu_variants

ext = cpu_variants.ext  # fixture: each build in turn (AVX-512, AVX2)
# Every test here runs once per build: the C++ layers come from the build under test.
pytestmark = pytest.mark.usefixtures("ext")
BLOCK = 16


def tiny_model(
    heads=6, kv_heads=2, head_dim=32, layers=3, qkv_bias=False, seed=0, fused=True
) -> LlamaModel:
    cfg = ModelConfig(
        model_type="llama", vocab_size=100, hidden_size=heads * head_dim,
        intermediate_size=3 * heads * head_dim, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, qkv_bias=qkv_bias,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.pack_weights_for_cpu(fused_layers=fused)
    assert (model.cpu_stack is not None) == fused
    return model


def step(model, ids, query_lens, seq_lens, tables, caches, callback=None, slots=None):
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    if slots is not None:
        meta.slot_mapping = torch.tensor(slots)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    return model(torch.tensor(ids), positions, meta, caches, callback)


def run_both(model_args: dict, prompt_lens, steps):
    """Prefill every prompt, then ``steps`` (query_lens) batches, through the C++ layers and
    the Python layers of the same weights; returns the hidden states of every batch and the
    final caches of both."""
    model, twin = tiny_model(**model_args), tiny_model(**model_args, fused=False)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompt_lens))]
    caches = [model.allocate_kv_cache(8 * len(prompt_lens), BLOCK) for _ in range(2)]
    g = torch.Generator().manual_seed(1)
    lens = list(prompt_lens)
    ids = torch.randint(0, 100, (sum(lens),), generator=g).tolist()
    outs = [[step(m, ids, lens, lens, tables, c)] for m, c in zip((model, twin), caches)]
    for query_lens in steps:
        seq_lens = [n + q for n, q in zip(lens, query_lens)]
        ids = torch.randint(0, 100, (sum(query_lens),), generator=g).tolist()
        for out, m, c in zip(outs, (model, twin), caches):
            out.append(step(m, ids, query_lens, seq_lens, tables, c))
        lens = seq_lens
    return outs, caches


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (4, 4, 16), (2, 1, 40)])
def test_decode_and_mixed_steps_match_python_layers(heads, kv_heads, head_dim, qkv_bias):
    args = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "qkv_bias": qkv_bias}
    # Decode-only steps (one C++ call) at batch 3 and mixed steps (C++ halves per layer).
    steps = [[1, 1, 1], [1, 1, 1], [5, 1, 1], [1, 9, 1], [1, 1, 1]]
    (ours, theirs), (our_cache, their_cache) = run_both(args, [7, 16, 33], steps)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(our_cache, their_cache):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


def test_single_row_decode_matches_python_layers():
    """Batch 1 takes the unpacked (MKL) matmuls in both paths."""
    (ours, theirs), _ = run_both({}, [20], [[1]] * 4)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layer_callback_runs_after_each_layer_in_order():
    model = tiny_model(layers=4)
    caches = model.allocate_kv_cache(4, BLOCK)
    seen = []

    def callback(i):
        # Layer i's keys for this chunk are in the cache when the callback runs.
        seen.append((i, bool(caches[i][0][0, :5].abs().sum() > 0)))

    step(model, list(range(5)), [5], [5], [[0]], caches, callback)
    assert seen == [(0, True), (1, True), (2, True), (3, True)]


def test_negative_slots_are_not_written():
    model = tiny_model()
    caches = model.allocate_kv_cache(2, BLOCK)
    step(model, [3, 4, 5], [3], [3], [[0]], caches, slots=[0, -1, 2])
    written = caches[0][0].view(2 * BLOCK, -1).abs().sum(-1).nonzero().flatten().tolist()
    assert written == [0, 2]


def test_slot_outside_the_cache_is_refused():
    model = tiny_model()
    caches = model.allocate_kv_cache(2, BLOCK)
    with pytest.raises(RuntimeError, match="outside the cache"):
        step(model, [3], [1], [1], [[0]], caches, slots=[2 * BLOCK])


def test_loaded_models_run_through_the_cpu_stack(tmp_path, make_engine, monkeypatch):
    """The engine's CPU path is the C++ layers: a loaded model has them, and a decode step
    goes through ``DecoderStack.decode`` (one call for every layer)."""
    from engine import cpu_stack
    from engine.request import SamplingParams
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    engine = make_engine(path, block_size=16, num_blocks=64)
    model = engine.runner.model
    assert model.cpu_stack is not None
    calls = []
    real = cpu_stack.run_layers

    def spy(stack, h, rope_tables, meta, *args, **kwargs):
        calls.append(meta.is_decode_only)
        return real(stack, h, rope_tables, meta, *args, **kwargs)

    monkeypatch.setattr(cpu_stack, "run_layers", spy)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, min_tokens=3))
    assert calls == [False, True, True]  # the prefill, then two decode-only steps
