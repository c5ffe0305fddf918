"""The CPU torch paths of kernels.ops against the reference ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import ops
from kernels.metadata import AttentionMetadata
from kernels.reference import paged_attention_ref
from tests import cpu_variants
from tests.kernel_cases import KernelCase, build_inputs, check_case, make_cases, max_error

cpu_variant = cpu_variants.cpu_variant  # fixture: each build, then the torch path

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}

CPU_CASES = make_cases(head_dim=32, max_len=120) + [
    KernelCase("chunked-bs7-d40", (9, 50, 1), (60, 50, 13), 7, 6, 2, 40, seed=201),
    KernelCase("mixed-fp16", (1, 20, 9), (30, 45, 9), 16, 8, 2, 32, dtype="float16", seed=202),
    KernelCase("decode-bf16", (1, 1, 1), (33, 64, 5), 16, 8, 2, 32, dtype="bfloat16", seed=203),
    KernelCase("single-token-prompt", (1,), (1,), 16, 4, 4, 16, seed=204),
    # Several 64-row query tiles (the C++ prefill kernel's unit), whole and chunked.
    KernelCase("long-prefill-gqa3", (300,), (300,), 16, 6, 2, 32, seed=205),
    KernelCase("long-chunks-bs1-d64", (130, 1, 70), (450, 90, 70), 1, 9, 3, 64, seed=206),
    # Head size 128, groups of 4: the decode kernel's value pass takes a group in two chunks.
    KernelCase("decode-d128-gqa4", (1, 1, 1), (40, 70, 17), 16, 8, 2, 128, seed=207),
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_torch_ops_match_reference(case: KernelCase, cpu_variant) -> None:
    """Every variant (the AVX-512 and AVX2 builds, the torch path) against the reference."""
    errors = check_case(case, backend="torch")
    tolerance = TOLERANCE[case.dtype]
    bad = {op: err for op, err in errors.items() if not err <= tolerance}
    assert not bad, f"{case} exceeds {tolerance}: {bad}"


def test_auto_backend_is_torch_on_cpu() -> None:
    assert ops.kernel_backend("cpu") == "torch"
    assert ops.kernel_backend("cpu", "torch") == "torch"
    with pytest.raises(ValueError):
        ops.kernel_backend("cpu", "cuda-magic")


def test_store_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    ops.store_kv(key, 2 * key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    written = k_cache.view(8, 8).abs().sum(-1).nonzero().flatten().tolist()
    assert written == [0, 5]
    assert torch.equal(v_cache.view(8, 8)[5], torch.full((8,), 2.0))


def test_chunked_prefill_equals_whole_prompt_prefill() -> None:
    """Prefilling a prompt in two chunks gives the same outputs as one pass over it."""
    case = KernelCase("whole", (50,), (50,), 16, 6, 2, 32, seed=7)
    x = build_inputs(case)
    q, k, v, meta = x["query"], x["key"], x["value"], x["meta"]
    ops.store_kv(k, v, x["k_cache"], x["v_cache"], meta.slot_mapping)
    whole = ops.prefill_attention(q, x["k_cache"], x["v_cache"], meta, x["scale"])
    table = meta.block_tables[0].tolist()
    chunks = []
    for start, end in ((0, 20), (20, 50)):
        chunk_meta = AttentionMetadata.build([end - start], [end], [table], 16)
        chunks.append(
            ops.prefill_attention(q[start:end], x["k_cache"], x["v_cache"], chunk_meta, x["scale"])
        )
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=1e-5)


def test_decode_ignores_table_padding_and_other_sequences_blocks() -> None:
    """Garbage in blocks a sequence does not own must not change its output."""
    case = KernelCase("decode", (1, 1), (3, 40), 16, 4, 2, 16, seed=9)
    x = build_inputs(case)
    args = (x["query"], x["k_cache"], x["v_cache"], x["meta"], x["scale"])
    before = ops.decode_attention(*args)
    owned = set(x["meta"].block_tables.flatten().tolist())
    for block in range(x["k_cache"].shape[0]):
        if block not in owned:
            x["k_cache"][block] = 1e4
    torch.testing.assert_close(ops.decode_attention(*args), before)
    torch.testing.assert_close(before, paged_attention_ref(*args), atol=1e-5, rtol=1e-5)


def test_ops_import_and_run_without_triton() -> None:
    """Platforms without a Triton wheel still get the torch paths."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from kernels import ops\n"
        "assert not ops.TRITON_AVAILABLE and ops.kernel_backend('cuda') == 'torch'\n"
    )
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", [v.name for v in ops.cpu_extension.VARIANTS])
def test_cpp_decode_kernel_refuses_block_ids_outside_the_cache(name) -> None:
    ext = ops.cpu_extension.load(name)
    if ext is None:
        pytest.skip(f"no {name} build here (CPU without it, or no compiler)")
    cache = torch.zeros(4, 16, 2, 32)
    query = torch.zeros(1, 4, 32)
    lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ext.paged_decode_attention(
            query, cache, cache, torch.tensor([[4]], dtype=torch.int32), lens, 1.0
        )


BF16_CASES = [c for c in CPU_CASES if c.dtype == "float32" and not c.is_decode_only]


def _bf16_emulated_attention(query, k, v, scale):
    """The bf16 kernel's arithmetic in torch for one fresh prompt [T, h, d] with K/V [T, kvh, d]:
    bf16 scaled queries, keys and values; bf16 scores; fp32 max and sum; bf16 exponentials; a
    bf16 output divided by the fp32 sum."""
    group = query.shape[1] // k.shape[1]
    bf = torch.bfloat16
    q = (query * scale).to(bf).transpose(0, 1).float()  # [h, T, d]
    kk = k.repeat_interleave(group, 1).to(bf).transpose(0, 1).float()
    vv = v.repeat_interleave(group, 1).to(bf).transpose(0, 1).float()
    scores = (q @ kk.transpose(1, 2)).to(bf).float()
    mask = torch.ones(scores.shape[1:], dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    e = torch.exp(scores - scores.amax(-1, keepdim=True))
    out = (e.to(bf).float() @ vv).to(bf).float() / e.sum(-1, keepdim=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("case", BF16_CASES, ids=lambda c: c.name)
def test_bf16_prefill_attention_stays_within_bf16_of_the_reference(case, cpu_variant) -> None:
    """``bf16=True`` (a bf16 prefill's batch): the C++ kernel's GEMMs on bf16 operands, within
    bf16's tolerance of the fp32 reference on every variant (the torch path ignores it)."""
    x = build_inputs(case)
    k, v = x["k_cache"].clone(), x["v_cache"].clone()
    ops.store_kv(x["key"], x["value"], k, v, x["meta"].slot_mapping)
    args = (x["query"], k, v, x["meta"], x["scale"])
    err = max_error(
        ops.prefill_attention(*args, backend="torch", bf16=True), paged_attention_ref(*args)
    )
    assert err <= TOLERANCE["bfloat16"], err


@pytest.mark.parametrize("variant", cpu_variants.BUILDS)
def test_bf16_prefill_kernel_computes_in_bf16_as_specified(variant) -> None:
    """A 300-token prompt, GQA groups of 3: the bf16 kernel equals its torch emulation (to the
    GEMMs' accumulation order) and is not the fp32 kernel's result."""
    from kernels import cpu_extension

    ext = cpu_extension.load(variant)
    if ext is None:
        pytest.skip(f"the {variant} build failed")
    gen = torch.Generator().manual_seed(7)
    n, heads, kv_heads, d, bs = 300, 9, 3, 64, 16
    query = torch.randn(n, heads, d, generator=gen) * 2
    k = torch.randn(n, kv_heads, d, generator=gen)
    v = torch.randn(n, kv_heads, d, generator=gen)
    blocks = -(-n // bs)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)
    k_cache, v_cache = torch.zeros(blocks, bs, kv_heads, d), torch.zeros(blocks, bs, kv_heads, d)
    slots = (table.long()[:, None] * bs + torch.arange(bs)).flatten()[:n]
    ops.store_kv(k, v, k_cache, v_cache, slots)
    got = ext.prefill_causal_attention(query, k_cache, v_cache, table, n, 0.125, True)
    fp32 = ext.prefill_causal_attention(query, k_cache, v_cache, table, n, 0.125, False)
    emulated = _bf16_emulated_attention(query, k, v, 0.125)
    err = {"bf16": (got - emulated).norm().item(), "fp32": (fp32 - emulated).norm().item()}
    # Closer to the bf16 arithmetic than the fp32 kernel is: it really multiplies in bf16.
    assert err["bf16"] < err["fp32"] / 2, err
    assert (got - emulated).abs().max() <= 2e-2, err
