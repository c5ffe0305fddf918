"""The C++ decoder layers (engine/cpu_stack.py) against the Python layers of engine/model.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.model import LlamaModel
from kernels import kv_int8
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


def run_both(model_args: dict, prompt_lens, steps, kv_dtype="fp32"):
    """Prefill every prompt, then ``steps`` (query_lens) batches, through the C++ layers and
    the Python layers of the same weights, on ``kv_dtype`` caches; returns the hidden states of
    every batch and the final caches of both."""
    model, twin = tiny_model(**model_args), tiny_model(**model_args, fused=False)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompt_lens))]
    n = 8 * len(prompt_lens)
    caches = [model.allocate_kv_cache(n, BLOCK, kv_dtype=kv_dtype) for _ in range(2)]
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


# ---- int8 KV cache (kernels/kv_int8.py): the C++ layers write and read the int8 rows ---------


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 2, 32), (4, 4, 16), (2, 1, 40)])
def test_int8_kv_steps_match_python_layers_on_int8_kv(heads, kv_heads, head_dim):
    """Decode-only steps (one C++ call: int8 rows attended in registers) and mixed steps (C++
    halves around the Python attention) on int8 caches = the Python layers on int8 caches."""
    args = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "qkv_bias": True}
    steps = [[1, 1, 1], [1, 1, 1], [5, 1, 1], [1, 9, 1], [1, 1, 1]]
    (ours, theirs), (our_cache, their_cache) = run_both(args, [7, 16, 33], steps, "int8")
    assert our_cache[0][0].dtype == torch.int8
    flips = 0
    for (k1, v1), (k2, v2) in zip(our_cache, their_cache):
        for ours_rows, theirs_rows in ((k1, k2), (v1, v2)):
            # The C++ and torch layers differ by float rounding (RMSNorm sums, RoPE's FMAs): a
            # code can differ by one where x / scale sits on a rounding boundary, never more.
            codes = (ours_rows[..., :-4].int() - theirs_rows[..., :-4].int()).abs()
            assert codes.max() <= 1 and codes.float().mean() < 1e-3
            flips += int(codes.sum())
            scales = [
                r[..., -4:].contiguous().view(torch.float32) for r in (ours_rows, theirs_rows)
            ]
            torch.testing.assert_close(*scales, rtol=2e-4, atol=0)
    # Without a flipped code the two agree as closely as on fp32 caches; a flipped code moves
    # one key or value by a quantization step (~1/127 of its head's range): ~1e-4 downstream.
    tol = 1e-5 if flips == 0 else 1e-3
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _layer_inputs(model, n_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_tokens, model.cfg.hidden_size, generator=g)
    cos, sin = model.rope.tables(torch.arange(3, 3 + n_tokens))
    return h, cos, sin


def test_int8_rows_written_are_the_bytes_of_kv_int8_quantize():
    """Every layer's int8 cache rows = kv_int8.quantize of the fp32 rows the same layer writes
    into an fp32 cache (the store of the Python path, and what a KV frame carries)."""
    model = tiny_model(layers=3)
    h, cos, sin = _layer_inputs(model, 20)
    slots = torch.tensor([*range(10), -1, *range(12, 21)])
    written = slots[slots >= 0]
    for i in range(3):
        fp32 = model.allocate_kv_cache(2, BLOCK)[i]
        int8 = model.allocate_kv_cache(2, BLOCK, kv_dtype="int8")[i]
        q32 = model.cpu_stack.attention_input(i, h, cos, sin, *fp32, slots)
        q8 = model.cpu_stack.attention_input(i, h, cos, sin, *int8, slots)
        assert torch.equal(q32, q8)
        for c32, c8 in zip(fp32, int8):
            rows8 = c8.view(2 * BLOCK, *c8.shape[2:])
            rows32 = c32.view(2 * BLOCK, *c32.shape[2:])
            assert torch.equal(rows8[written], kv_int8.quantize(rows32[written]))
            unwritten = torch.ones(2 * BLOCK, dtype=torch.bool)
            unwritten[written] = False
            assert not rows8[unwritten].any()  # slot -1 and the rest stay untouched


def test_int8_rows_round_half_to_even_and_keep_zero_heads_as_kv_int8_does():
    """Values the qkv bias sets exactly (zero V weights): ties x / scale = k + 0.5 round to the
    even code, an all-zero head gets kv_int8's smallest scale, byte for byte its quantize."""
    model = tiny_model(heads=4, kv_heads=2, head_dim=16, qkv_bias=True)
    cfg = model.cfg
    ties = torch.tensor(
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 0, 1, 2, 3, 4, 5]
    )
    values = torch.stack([ties, torch.zeros(16)])  # [kv_heads, head_dim]
    qkv = model.layers[0].self_attn.qkv_proj
    v_rows = slice(cfg.q_size + cfg.kv_size, cfg.q_size + 2 * cfg.kv_size)
    with torch.no_grad():
        qkv.weight[v_rows] = 0
        qkv.bias[v_rows] = values.flatten()
    model.pack_weights_for_cpu()  # the skinny / oneDNN copies of the changed weight
    h, cos, sin = _layer_inputs(model, 3)
    k_cache, v_cache = model.allocate_kv_cache(1, BLOCK, kv_dtype="int8")[0]
    model.cpu_stack.attention_input(0, h, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2]))
    expected = kv_int8.quantize(values)
    for slot in range(3):
        assert torch.equal(v_cache[0, slot], expected)
    codes = v_cache[0, 0, 0, :10].tolist()
    assert codes == [127, 0, 2, 2, 0, -2, -2, 4, 126, -126]
    assert kv_int8.dequantize(v_cache[0, 0, 1]).abs().max() == 0


def _int8_engine(path, make_engine):
    from engine.llm_engine import build_engine
    from engine.settings import EngineSettings

    engine = build_engine(EngineSettings(str(path), num_blocks=64, kv_dtype="int8"))
    make_engine.engines.append(engine)  # its leak check: every block free at the end
    return engine


def _count_calls(monkeypatch, module, name) -> list:
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


def test_int8_kv_engine_decodes_through_the_cpu_stack_with_the_python_paths_tokens(
    tmp_path, make_engine, monkeypatch
):
    """With kv_dtype int8 the engine's decode steps are DecoderStack.decode calls and no Python
    layer writes the cache; the greedy tokens equal the Python layers' on the same int8 cache
    format; every block comes back (make_engine's check)."""
    from engine import cpu_stack
    from engine import model as model_module
    from engine.request import SamplingParams
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    engine = _int8_engine(path, make_engine)
    model = engine.runner.model
    assert engine.runner.kv_caches[0][0].dtype == torch.int8 and model.cpu_stack is not None
    prompts = [[5, 6, 7], list(range(3, 40)), [9] * 20]
    sampling = SamplingParams(max_tokens=12, min_tokens=12)
    stack_runs = _count_calls(monkeypatch, cpu_stack, "run_layers")
    python_stores = _count_calls(monkeypatch, model_module, "store_kv")
    fused = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    decode_steps = [meta.is_decode_only for _, _, _, meta, *_ in stack_runs]
    assert decode_steps.count(True) >= 11 and not python_stores
    stack_runs.clear()
    monkeypatch.setattr(model, "cpu_stack", None)  # the Python layers around the int8 kernels
    python = [r.output_token_ids for r in engine.generate(prompts, sampling)]
    assert not stack_runs and python_stores
    assert fused == python and all(len(t) == 12 for t in fused)


def _greedy_logits(model, prompts, steps: int) -> list[torch.Tensor]:
    """Logits of a prefill of ``prompts`` and ``steps`` greedy decode steps on a fresh int8
    cache, through whichever layers ``model`` runs."""
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.scheduler import ScheduledSequence

    runner = ModelRunner(model, 8 * len(prompts), BLOCK, "int8")
    reqs = [Request(f"r{i}", ids) for i, ids in enumerate(prompts)]
    for i, req in enumerate(reqs):
        req.block_table = list(range(i * 8, i * 8 + 8))
    out = [runner.execute([ScheduledSequence(r, r.num_tokens, True) for r in reqs])]
    for _ in range(steps):
        for req, row in zip(reqs, out[-1]):
            req.num_computed_tokens = req.num_tokens
            req.output_token_ids.append(int(row.argmax()))
        out.append(runner.execute([ScheduledSequence(r, 1, True) for r in reqs]))
    return out


def test_int8_kv_logits_of_the_cpu_stack_equal_the_python_layers(tmp_path, monkeypatch):
    """Logits of a prefill and 8 decode steps (batch 3) on int8 caches: the C++ layers and the
    Python layers of the same weights agree to float rounding."""
    from engine.loader import load_config, load_model
    from tests.conftest import tiny_llama_dir

    path, _ = tiny_llama_dir(tmp_path, num_heads=6, num_kv_heads=2, head_dim=32)
    model = load_model(path, load_config(path), 128)
    assert model.cpu_stack is not None
    prompts = [list(range(3, 40)), [5, 6, 7], [11] * 17]
    ours = _greedy_logits(model, prompts, 8)
    monkeypatch.setattr(model, "cpu_stack", None)
    theirs = _greedy_logits(model, prompts, 8)
    errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, theirs)]
    # Float rounding (~1e-6 of the logits' range) in most steps; a step whose new key or value
    # lands on a rounding boundary of its int8 code in one path only stays within 1e-3.
    assert sorted(errors)[len(errors) // 2] < 1e-5 and max(errors) < 1e-3, errors
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(ours, theirs))
