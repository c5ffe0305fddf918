"""Shared kernel test cases: random paged caches with permuted block tables, and a checker
that compares one backend of every op in ``kernels.ops`` with the reference ops.

Used in-process by tests/test_kernels.py and in a TRITON_INTERPRET=1 subprocess by
tests/triton_interpret_check.py.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.block_manager import blocks_for
from kernels import ops
from kernels.metadata import AttentionMetadata
from kernels.reference import paged_attention_ref, store_kv_ref


@dataclass(frozen=True)
class KernelCase:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    block_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    skip_some_slots: bool = False  # mark a few slots -1 (padding tokens) for store_kv
    dtype: str = "float32"
    seed: int = 0

    @property
    def is_decode_only(self) -> bool:
        return max(self.query_lens) == 1


def build_inputs(case: KernelCase, device: str = "cpu") -> dict:
    """Random query/key/value, caches filled with noise (the "earlier context"), metadata."""
    gen = torch.Generator().manual_seed(case.seed)
    bs = case.block_size
    needed = [blocks_for(s, bs) for s in case.seq_lens]
    num_blocks = sum(needed) + 3  # spare blocks nobody owns: reading one would be a bug
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(order[at : at + n])
        at += n
    meta = AttentionMetadata.build(list(case.query_lens), list(case.seq_lens), tables, bs, device)
    if case.skip_some_slots:
        meta.slot_mapping[::3] = -1
    total = sum(case.query_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, getattr(torch, case.dtype))

    # q, k, v are strided views of one fused projection output, as in the model's forward.
    h, kvh = case.num_heads, case.num_kv_heads
    qkv = rand(total, h + 2 * kvh, case.head_dim)
    cache_shape = (num_blocks, bs, kvh, case.head_dim)
    return {
        "query": qkv[:, :h],
        "key": qkv[:, h : h + kvh],
        "value": qkv[:, h + kvh :],
        "k_cache": rand(*cache_shape),
        "v_cache": rand(*cache_shape),
        "meta": meta,
        "scale": case.head_dim**-0.5,
    }


def check_case(case: KernelCase, backend: str, device: str = "cpu") -> dict[str, float]:
    """Max abs error against the references for store_kv and each attention op that applies."""
    x = build_inputs(case, device)
    meta, scale = x["meta"], x["scale"]
    k_ref, v_ref = x["k_cache"].clone(), x["v_cache"].clone()
    store_kv_ref(x["key"], x["value"], k_ref, v_ref, meta.slot_mapping)
    k_out, v_out = x["k_cache"].clone(), x["v_cache"].clone()
    ops.store_kv(x["key"], x["value"], k_out, v_out, meta.slot_mapping, backend=backend)
    errors = {"store_kv": max(max_error(k_out, k_ref), max_error(v_out, v_ref))}

    # Attention reads the reference-stored cache so a store bug cannot hide an attention bug.
    args = (x["query"], k_ref, v_ref, meta, scale)
    expected = paged_attention_ref(*args)
    errors["paged_attention"] = max_error(ops.paged_attention(*args, backend=backend), expected)
    errors["prefill_attention"] = max_error(ops.prefill_attention(*args, backend=backend), expected)
    if case.is_decode_only:
        errors["decode_attention"] = max_error(ops.decode_attention(*args, backend=backend), expected)
    return errors


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if not torch.isfinite(actual).all():
        return float("inf")
    return (actual.float() - expected.float()).abs().max().item()


def _batch_shapes(mode: str, rng: torch.Generator, max_len: int) -> tuple[list, list]:
    """query_lens and seq_lens of a 3-4 sequence batch in one of four modes."""
    num_seqs = 3 + int(torch.randint(0, 2, (1,), generator=rng))

    def draw(lo, hi):
        return [int(v) for v in torch.randint(lo, hi + 1, (num_seqs,), generator=rng)]

    if mode == "decode":
        return [1] * num_seqs, draw(1, max_len)
    query_lens = draw(1, max_len // 2)
    if mode == "prefill":  # fresh prompts: no cached context
        return query_lens, list(query_lens)
    context = draw(1, max_len // 2)
    if mode == "mixed":  # prefill chunks and decode tokens in one batch
        query_lens[::2] = [1] * len(query_lens[::2])
    return query_lens, [q + c for q, c in zip(query_lens, context)]


def make_cases(
    block_sizes=(1, 16, 32),
    groups=(1, 3, 4),
    modes=("prefill", "chunked", "mixed", "decode"),
    num_kv_heads: int = 2,
    head_dim: int = 32,
    max_len: int = 120,
    seed: int = 0,
) -> list[KernelCase]:
    rng = torch.Generator().manual_seed(seed)
    cases = []
    for i, (bs, group, mode) in enumerate(itertools.product(block_sizes, groups, modes)):
        query_lens, seq_lens = _batch_shapes(mode, rng, max_len)
        name = f"{mode}-bs{bs}-gqa{group}"
        cases.append(
            KernelCase(
                name,
                tuple(query_lens),
                tuple(seq_lens),
                bs,
                group * num_kv_heads,
                num_kv_heads,
                head_dim,
                skip_some_slots=(i % 4 == 1),
                seed=seed + i,
            )
        )
    return cases
