"""The int8 KV cache (a scale per token and head, inside the cache row): attention over it is
within tolerance of attention over the fp32 cache, it matches the reference op, and its blocks
(scales included) cross a KV transfer frame into another int8 cache byte for byte."""

from __future__ import annotations

import pytest
import torch

from engine.loader import load_config, load_model
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import ScheduledSequence
from kernels import kv_int8
from kernels.kv_blocks import gather_kv_blocks
from kernels.metadata import AttentionMetadata
from kernels.ops import paged_attention, store_kv
from kernels.reference import paged_attention_ref
from kv_transfer.frame import decode_frame, encode_commit_frame, encode_kv_frame
from kv_transfer.lease import LeaseTable
from kv_transfer.receiver import KVReceiver
from tests.conftest import tiny_llama_dir
from tests.cpu_variants import cpu_variant, ext  # noqa: F401  (fixtures)

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

BLOCKS, BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 24, 16, 2, 6, 64


def test_rows_round_trip_within_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(50, KV_HEADS, HEAD_DIM) * torch.rand(50, KV_HEADS, 1) * 10
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, KV_HEADS, HEAD_DIM + 4)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((kv_int8.dequantize(rows) - x).abs() <= step / 2 * 1.001 + 1e-7).all())


def _caches(dtype_name: str):
    width = kv_int8.row_width(HEAD_DIM) if dtype_name == "int8" else HEAD_DIM
    dtype = torch.int8 if dtype_name == "int8" else torch.float32
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, width)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _filled(seq_lens, tables, dtype_name, seed=0):
    """Caches holding the same random K/V (as fp32 or int8) for each sequence."""
    torch.manual_seed(seed)
    k_cache, v_cache = _caches(dtype_name)
    for n, table in zip(seq_lens, tables):
        meta = AttentionMetadata.build([n], [n], [table], BLOCK_SIZE)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return k_cache, v_cache


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 40]])  # decode; mixed prefill
def test_int8_kv_attention_is_close_to_fp32_kv_and_equals_the_reference(
    query_lens,
    cpu_variant,  # noqa: F811  (each build's int8 decode kernel, then the torch path)
):
    seq_lens = [37, 100, 64]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK_SIZE)
    query = torch.randn(
        sum(query_lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)
    )
    scale = HEAD_DIM**-0.5
    fp32 = paged_attention(query, *_filled(seq_lens, tables, "fp32"), meta, scale)
    int8_caches = _filled(seq_lens, tables, "int8")
    int8 = paged_attention(query, *int8_caches, meta, scale)
    torch.testing.assert_close(int8, paged_attention_ref(query, *int8_caches, meta, scale))
    err = (int8 - fp32).abs().max().item()
    assert err < 0.02, f"int8 KV attention off by {err}"  # V entries are ~N(0, 1)
    assert err > 0  # the int8 path really ran


def _decode_logits(runner: ModelRunner, ids: list[int]):
    req = Request("r", ids)
    req.block_table = list(range(4))
    prefill = runner.execute([ScheduledSequence(req, len(ids) - 1, False)])
    assert prefill.shape[0] == 0
    req.num_computed_tokens = len(ids) - 1
    return runner.execute([ScheduledSequence(req, 1, True)])


def test_model_with_int8_kv_decodes_close_to_fp32_kv(tmp_path):
    d, _ = tiny_llama_dir(tmp_path)
    cfg = load_config(d)
    model = load_model(d, cfg, 128)
    fp32 = ModelRunner(model, 8, BLOCK_SIZE)
    int8 = ModelRunner(model, 8, BLOCK_SIZE, kv_dtype="int8")
    assert int8.kv_caches[0][0].dtype == torch.int8
    assert int8.kv_caches[0][0].shape[-1] == cfg.head_dim + 4
    ids = [1, 5, 9, 33, 2, 7, 100, 4, 12, 40, 41, 3]
    a, b = _decode_logits(fp32, ids), _decode_logits(int8, ids)
    # A random tiny model's keys span +-8 over 16 dims: int8 steps of ~0.06 move its logits by
    # ~2% of their range; the greedy choice stays.
    assert (b - a).abs().max() < 0.03 * a.abs().max()
    assert torch.equal(b.argmax(-1), a.argmax(-1))
    assert cfg.kv_bytes_per_token_as("int8") * 3 < cfg.kv_bytes_per_token_as("fp32")


def test_int8_blocks_and_scales_cross_a_transfer_frame():
    src = _filled([40], [[4, 5, 6]], "int8")
    payload, crc = gather_kv_blocks(*src, [4, 5, 6])
    header, body = encode_kv_frame("req", "lease", 0, [0, 1, 2], payload, crc)
    h, _ = decode_frame(header, bytes(body))
    assert h.dtype == "int8" and h.shape[-1] == HEAD_DIM + 4
    dst = _caches("int8")
    leases = LeaseTable()
    rx = KVReceiver([dst], leases)
    lease = leases.open("req", [9, 2, 17], lease_id="lease")
    rx.accept(header, bytes(body))
    rx.accept(*encode_commit_frame("req", "lease", 1))
    assert lease.committed.is_set()
    for s, t in zip([4, 5, 6], [9, 2, 17]):
        assert torch.equal(dst[0][t], src[0][s]) and torch.equal(dst[1][t], src[1][s])
    # The scales came along: the received rows dequantize to the sender's values.
    assert torch.equal(kv_int8.dequantize(dst[0][9]), kv_int8.dequantize(src[0][4]))


@pytest.mark.parametrize("head_dim", [16, 40, 128])  # 40: the kernel's generic (any size) path
@pytest.mark.parametrize("batch", [1, 4])  # a task per (sequence, KV head); whole sequences
def test_int8_decode_kernel_equals_the_reference_at_each_head_size(
    head_dim,
    batch,
    cpu_variant,  # noqa: F811  (each build's int8 decode kernel, then the torch path)
):
    """The register-blocked int8 decode (head sizes 16-128) and its generic path, on each build,
    against the reference op over the same int8 rows: GQA group 3, lengths across blocks."""
    g = torch.Generator().manual_seed(head_dim + batch)
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, kv_int8.row_width(head_dim))
    k_cache, v_cache = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    seq_lens = [1, 33, 70, 16][:batch]
    tables = [[5 * i + j for j in range(5)] for i in range(batch)]
    for n, table in zip(seq_lens, tables):
        meta = AttentionMetadata.build([n], [n], [table], BLOCK_SIZE)
        k, v = (torch.randn(n, KV_HEADS, head_dim, generator=g) * 3 for _ in range(2))
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    meta = AttentionMetadata.build([1] * batch, seq_lens, tables, BLOCK_SIZE)
    query = torch.randn(batch, HEADS, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_attention(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, paged_attention_ref(query, k_cache, v_cache, meta, scale))


def test_bench_engine_times_each_kv_dtype_on_the_same_engine(tmp_path, monkeypatch):
    """``bench engine --kv-dtypes fp32,int8``: a row per KV format and workload, the decode
    bytes counted in each format's own dtype."""
    from pdserve.bench.micro import engine as bench_engine

    path, _ = tiny_llama_dir(tmp_path, num_heads=4, num_kv_heads=2)
    monkeypatch.setattr(bench_engine, "gemm_peak", lambda: 1e11)
    monkeypatch.setattr(bench_engine, "read_bandwidth", lambda: 1e10)
    before = torch.get_num_threads()
    try:
        result = bench_engine.run(
            str(path), 1, (16,), (2,), (32,), baseline=False, reps=1, kv_dtypes=("fp32", "int8")
        )
    finally:
        torch.set_num_threads(before)
    decode = {r["kv_dtype"]: r for r in result["rows"] if r["kind"] == "decode"}
    cfg = load_config(path)
    weights = decode["fp32"]["bytes_read"] - 2 * 32 * cfg.kv_bytes_per_token_as("fp32")
    assert decode["int8"]["bytes_read"] == weights + 2 * 32 * cfg.kv_bytes_per_token_as("int8")
    assert [r["kv_dtype"] for r in result["rows"]] == ["fp32", "int8", "fp32", "int8"]
    assert result["kv_dtypes"] == ["fp32", "int8"]


@pytest.mark.parametrize("bf16", [False, True])
def test_prefill_kernel_reads_int8_rows_as_their_dequantized_values(bf16, ext):  # noqa: F811
    """The C++ prefill kernel over an int8 cache gives exactly what it gives over an fp32 cache
    holding the same rows dequantized (the gather dequantizes each key once; the GEMMs are the
    same), fp32 and bf16 GEMMs alike, on each build: a 150-token sequence in shuffled blocks,
    its last 70 tokens as the query (a chunk after a cached prefix), GQA group 3."""
    g = torch.Generator().manual_seed(11)
    n, q_len = 150, 70
    shape = (BLOCKS, BLOCK_SIZE, KV_HEADS, kv_int8.row_width(HEAD_DIM))
    k8, v8 = torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8)
    table = torch.randperm(BLOCKS, generator=g)[: -(-n // BLOCK_SIZE)].to(torch.int32)
    slots = (table.long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[:n]
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    store_kv(k, v, k8, v8, slots)
    k32, v32 = kv_int8.dequantize(k8), kv_int8.dequantize(v8)
    query = torch.randn(q_len, HEADS, HEAD_DIM, generator=g)
    scale = HEAD_DIM**-0.5
    got = ext.prefill_causal_attention(query, k8, v8, table, n, scale, bf16)
    want = ext.prefill_causal_attention(query, k32, v32, table, n, scale, bf16)
    assert torch.equal(got, want)
    # And within int8's tolerance of attention over the unquantized K/V (entries ~N(0, 1)).
    k_exact, v_exact = _unquantized(k, v, table, shape)
    exact = ext.prefill_causal_attention(query, k_exact, v_exact, table, n, scale, bf16)
    assert 0 < (got - exact).abs().max().item() < 0.03


def _unquantized(k, v, table, shape):
    caches = torch.zeros(shape[:-1] + (HEAD_DIM,)), torch.zeros(shape[:-1] + (HEAD_DIM,))
    slots = (table.long()[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()[: len(k)]
    store_kv(k, v, *caches, slots)
    return caches


def test_prefill_kernel_refuses_mixed_or_misshapen_caches(ext):  # noqa: F811
    k8 = torch.zeros(4, BLOCK_SIZE, KV_HEADS, kv_int8.row_width(HEAD_DIM), dtype=torch.int8)
    query, table = torch.zeros(3, HEADS, HEAD_DIM), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="fp32 or int8 caches"):
        ext.prefill_causal_attention(query, k8, k8.float(), table, 3, 1.0, False)
    with pytest.raises(RuntimeError, match="head shapes"):
        short = k8[..., :HEAD_DIM].contiguous()  # int8 rows without their scales
        ext.prefill_causal_attention(query, short, short, table, 3, 1.0)
