"""The fp8 KV cache (float8_e4m3fn codes, a scale per token and head inside the cache row) on
the torch paths: rows round-trip within e4m3's rounding, attention over it is within tolerance
of attention over the fp32 cache and equals the reference op, a model decodes on it, and its
blocks cross a KV transfer frame and a block copy byte for byte. The Triton kernels on fp8
caches: tests/test_triton_quant.py."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import build_engine
from engine.loader import load_config, load_model
from engine.model_runner import ModelRunner
from engine.request import SamplingParams
from engine.settings import EngineSettings
from kernels import kv_fp8
from kernels.kv_blocks import gather_kv_blocks
from kernels.metadata import AttentionMetadata
from kernels.ops import paged_attention, store_kv
from kernels.reference import paged_attention_ref
from kv_transfer.frame import decode_frame, encode_commit_frame, encode_kv_frame
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from tests.conftest import tiny_llama_dir
from tests.cpu_variants import cpu_variant  # noqa: F401  (fixture)
from tests.test_disagg import (
    NEW_TOKENS,
    mixed_prompts,
    run_cluster,
    tiny_model,  # noqa: F401  (fixture)
)
from tests.test_engine_greedy_tiny import random_prompts
from tests.test_kv_int8 import _decode_logits

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 24, 16, 2, 6, 64


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # no torch.equal for fp8


def test_rows_round_trip_within_e4m3_rounding():
    torch.manual_seed(0)
    x = torch.randn(50, KV_HEADS, HEAD_DIM) * torch.rand(50, KV_HEADS, 1) * 10
    x[0, 0] = 0.0  # an all-zero head: scale clamps, codes stay 0
    rows = kv_fp8.quantize(x)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (50, KV_HEADS, HEAD_DIM + 4)
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 448
    # 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 (subnormals) the step is
    # 2^-9 of the scale.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * 1.001
    err = (kv_fp8.dequantize(rows) - x).abs()
    assert bool((err <= bound).all()), f"worst {(err / bound).max()}"
    assert bool((kv_fp8.dequantize(rows[0, 0]) == 0).all())
    # The scale's bytes sit at the row's end, readable in place as the Triton kernels do.
    assert torch.equal(kv_fp8.scales(rows.unsqueeze(0))[0], scale[..., 0])


def _caches(dtype_name: str):
    width = kv_fp8.row_width(HEAD_DIM) if dtype_name == "fp8" else HEAD_DIM
    dtype = kv_fp8.DTYPE if dtype_name == "fp8" else torch.float32
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, width)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _filled(seq_lens, tables, dtype_name, seed=0):
    """Caches holding the same random K/V (as fp32 or fp8) for each sequence."""
    torch.manual_seed(seed)
    k_cache, v_cache = _caches(dtype_name)
    for n, table in zip(seq_lens, tables):
        meta = AttentionMetadata.build([n], [n], [table], BLOCK_SIZE)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return k_cache, v_cache


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 40]])  # decode; mixed prefill
def test_fp8_kv_attention_is_close_to_fp32_kv_and_equals_the_reference(
    query_lens,
    cpu_variant,  # noqa: F811  (fp8 caches take the torch path with every build)
):
    seq_lens = [37, 100, 64]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    fp32 = paged_attention(query, *_filled(seq_lens, tables, "fp32"), meta, scale)
    fp8_caches = _filled(seq_lens, tables, "fp8")
    fp8 = paged_attention(query, *fp8_caches, meta, scale)
    torch.testing.assert_close(fp8, paged_attention_ref(query, *fp8_caches, meta, scale))
    err = (fp8 - fp32).abs().max().item()
    # V entries are ~N(0, 1); e4m3 rounds each K and V entry by up to 2^-4 of itself.
    assert 0 < err < 0.08, f"fp8 KV attention off by {err}"


def test_model_with_fp8_kv_decodes_close_to_fp32_kv(tmp_path):
    d, _ = tiny_llama_dir(tmp_path)
    cfg = load_config(d)
    model = load_model(d, cfg, 128)
    fp32 = ModelRunner(model, 8, BLOCK_SIZE)
    fp8 = ModelRunner(model, 8, BLOCK_SIZE, kv_dtype="fp8")
    assert fp8.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.kv_caches[0][0].shape[-1] == cfg.head_dim + 4
    ids = [1, 5, 9, 33, 2, 7, 100, 4, 12, 40, 41, 3]
    a, b = _decode_logits(fp32, ids), _decode_logits(fp8, ids)
    # e4m3 rounds each K/V entry by up to 2^-4 of itself, int8 by 1/254 of its head's max: on
    # this random model the logits move ~4x int8's ~2% (5-7% of their range, measured); the
    # greedy choice stays.
    assert 0 < (b - a).abs().max() < 0.12 * a.abs().max()
    assert torch.equal(b.argmax(-1), a.argmax(-1))
    assert cfg.kv_bytes_per_token_as("fp8") == cfg.kv_bytes_per_token_as("int8")
    # A forked sequence's partial block is copied in every layer, scales included.
    fp8.copy_block(0, 5)
    for k_cache, v_cache in fp8.kv_caches:
        assert _same_bytes(k_cache[5], k_cache[0]) and _same_bytes(v_cache[5], v_cache[0])


def test_engine_with_fp8_kv_on_cpu_attends_over_fp8_rounded_kv(tmp_path, monkeypatch):
    """kv_dtype fp8 is accepted on the CPU (the torch path reads it). Its greedy output equals
    an fp32-cache engine's whose K and V are rounded through fp8 before they are stored: the
    fp8 cache changes nothing but that rounding, over prefill, decode and mixed steps; every
    block comes back. (Against plain fp32 KV a random tiny model's near-ties flip: fed fp32's
    continuations, fp8 predicted 36 of 48 tokens, int8 47.)"""
    import engine.model as model_module

    path, hf = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2, seed=2)
    prompts = random_prompts([6, 17, 33], hf.config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=16, ignore_eos=True)

    def run(kv_dtype):
        e = build_engine(EngineSettings(str(path), num_blocks=32, device="cpu", kv_dtype=kv_dtype))
        e.runner.model.cpu_stack = None  # the Python layers, whose store_kv is patched below
        out = [r.output_token_ids for r in e.generate(prompts, params)]
        assert e.blocks.num_free == e.blocks.num_total
        return e, out

    fp8, fp8_out = run("fp8")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    store = model_module.store_kv

    def rounded(key, value, *caches_and_slots):
        key, value = (kv_fp8.dequantize(kv_fp8.quantize(t)) for t in (key, value))
        store(key, value, *caches_and_slots)

    monkeypatch.setattr(model_module, "store_kv", rounded)
    ref, ref_out = run("fp32")
    assert ref.runner.kv_caches[0][0].dtype == torch.float32
    assert fp8_out == ref_out


def test_fp8_kv_cache_end_to_end_matches_the_fp8_engine(tiny_model):  # noqa: F811
    """``kv_dtype: fp8`` from the cluster config: the prefill worker's fp8 blocks (codes and
    scales) cross the gRPC transfer into the decode worker's fp8 cache, and the greedy output
    equals a colocated engine on an fp8 cache."""
    from pdserve.cluster.local import ClusterSpec

    prompts = mixed_prompts(6, seed=5)
    settings = EngineSettings(str(tiny_model), num_blocks=1024, device="cpu", kv_dtype="fp8")
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    ref = [r.output_token_ids for r in build_engine(settings).generate(prompts, params)]
    spec = ClusterSpec(
        model=str(tiny_model), kv_transport="grpc", num_blocks=512, kv_dtype="fp8", device="cpu"
    )
    outs, _ = run_cluster(spec, prompts)
    assert [o.token_ids for o in outs] == ref
    assert all(o.timings.kv_bytes > 0 for o in outs if len(o.token_ids) > 0)


def test_fp8_kv_needs_a_head_dim_divisible_by_4():
    cfg = ModelConfig("llama", 128, 36, 64, 2, 2, 2, 18, 1e-5, 1e4, 128, False)
    with pytest.raises(ValueError, match="kv_dtype fp8"):
        EngineConfig(cfg, kv_dtype="fp8")
    EngineConfig(cfg, kv_dtype="int8")  # int8 reads its scale through a copy: any head_dim
    with pytest.raises(ValueError, match="kv_dtype 'fp4'"):
        EngineConfig(cfg, kv_dtype="fp4")


def test_fp8_blocks_and_scales_cross_a_transfer_frame(
    cpu_variant,  # noqa: F811  (the extension's block copies, then torch's)
):
    src = _filled([40], [[4, 5, 6]], "fp8")
    payload, crc = gather_kv_blocks(*src, [4, 5, 6])
    header, body = encode_kv_frame("req", "lease", 0, [0, 1, 2], payload, crc)
    h, _ = decode_frame(header, bytes(body))
    assert h.dtype == "float8_e4m3fn" and h.shape[-1] == HEAD_DIM + 4
    dst = _caches("fp8")
    leases = LeaseTable()
    rx = KVReceiver([dst], leases)
    lease = leases.open("req", [9, 2, 17], lease_id="lease")
    rx.accept(header, bytes(body))
    rx.accept(*encode_commit_frame("req", "lease", 1))
    assert lease.committed.is_set()
    for s, t in zip([4, 5, 6], [9, 2, 17]):
        assert _same_bytes(dst[0][t], src[0][s]) and _same_bytes(dst[1][t], src[1][s])
    assert bool(kv_fp8.dequantize(dst[0][9]).abs().sum() > 0)  # real K arrived, not zeros
    untouched = [b for b in range(BLOCKS) if b not in (9, 2, 17)]
    assert not dst[0].view(torch.uint8)[untouched].any()
