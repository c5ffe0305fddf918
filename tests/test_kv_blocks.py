"""The KV transfer's block copies: the C++ gather (with its CRC-32C) and scatter, and the torch
path they replace, give the same bytes."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest
import torch

from kernels import cpu_extension, kv_blocks
from kv_transfer.frame import tensor_bytes
from tests import cpu_variants

ext = cpu_variants.ext  # fixture: each build in turn (AVX-512, AVX2)
cpu_variant = cpu_variants.cpu_variant  # fixture: each build, then the torch path

SHAPE = (12, 4, 3, 8)  # blocks, block_size, kv heads, head_dim


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 24575, 24576, 24577, 100003])
@pytest.mark.parametrize("offset", [0, 1, 5])
def test_crc32c_equals_the_crc32c_package(ext, n, offset):
    """Lengths around the three-stream runs (3 x 256, 3 x 8192) and unaligned starts."""
    data = np.random.default_rng(n).bytes(n + offset)
    t = torch.tensor(list(data), dtype=torch.uint8)[offset:]
    assert ext.crc32c(t) == crc32c.crc32c(data[offset:])


@pytest.fixture
def caches():
    torch.manual_seed(0)
    return torch.randn(SHAPE), torch.randn(SHAPE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ids", [[3], [11, 0, 5, 5, 2], list(range(12))[::-1]])
def test_gather_copies_k_then_v_of_the_blocks_and_hashes_the_payload(
    caches, ids, dtype, cpu_variant
):
    k, v = (c.to(dtype) for c in caches)
    kv, crc = kv_blocks.gather_kv_blocks(k, v, ids)
    assert kv.shape == (2, len(ids), *SHAPE[1:]) and kv.dtype == dtype
    assert torch.equal(kv[0], k[ids]) and torch.equal(kv[1], v[ids])
    # The builds hash in the same pass; the torch path leaves the CRC to the caller.
    if cpu_variant == cpu_extension.TORCH:
        assert crc is None
    else:
        assert crc == crc32c.crc32c(tensor_bytes(kv))


@pytest.mark.parametrize("ids", [[3], [11, 0, 5, 2], list(range(12))[::-1]])
def test_scatter_writes_exactly_the_named_blocks(caches, ids, cpu_variant):
    payload = torch.randn(2, len(ids), *SHAPE[1:])
    k, v = caches[0].clone(), caches[1].clone()
    kv_blocks.scatter_kv_blocks(payload, k, v, ids)
    assert torch.equal(k[ids], payload[0]) and torch.equal(v[ids], payload[1])
    others = [b for b in range(SHAPE[0]) if b not in ids]
    assert torch.equal(k[others], caches[0][others]) and torch.equal(v[others], caches[1][others])


def test_without_the_extension_torch_copies_the_same_bytes(caches, monkeypatch):
    ids = [4, 1, 9]
    fast = kv_blocks.gather_kv_blocks(*caches, ids)[0]
    monkeypatch.setattr(cpu_extension, "load", lambda: None)
    slow, crc = kv_blocks.gather_kv_blocks(*caches, ids)
    assert crc is None and torch.equal(slow, fast)
    k, v = torch.zeros(SHAPE), torch.zeros(SHAPE)
    kv_blocks.scatter_kv_blocks(slow, k, v, ids)
    assert torch.equal(k[ids], caches[0][ids]) and torch.equal(v[ids], caches[1][ids])


def test_bad_block_ids_and_payload_sizes_are_refused(ext, caches):
    k, v = caches
    out = torch.empty(2, 1, *SHAPE[1:])
    for bad in (12, -1):
        with pytest.raises(RuntimeError, match="outside the cache"):
            ext.gather_kv_blocks(k, v, torch.tensor([bad]), out)
        with pytest.raises(RuntimeError, match="outside the cache"):
            ext.scatter_kv_blocks(out, k, v, torch.tensor([bad]))
    with pytest.raises(RuntimeError, match="payload holds"):
        ext.gather_kv_blocks(k, v, torch.tensor([0, 1]), out)
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        ext.scatter_kv_blocks(out, k, v.half(), torch.tensor([0]))
