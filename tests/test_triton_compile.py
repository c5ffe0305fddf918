"""The attention kernels compiled for an H100 (sm_90) on a machine without a GPU: Triton's
frontend, its GPU passes and ptxas (bundled with the wheel) run without a device, so a
kernel the interpreter accepts but the compiler refuses (a non-constexpr global, a construct
the code generator lacks) fails here and not in a short GPU session. Each compiled kernel's
shared memory must fit an H100's 227 KiB per block."""

from __future__ import annotations

import pytest

from kernels import ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ops.TRITON_AVAILABLE, reason="Triton is not installed"),
]

H100_SHARED_BYTES = 227 * 1024
SCALE_OR_PARTIALS = ("k_scale_ptr", "v_scale_ptr", "m_ptr", "l_ptr", "acc_ptr")


def _arg_type(name: str, dtype: str, cache: str) -> str:
    if name in ("q_ptr", "out_ptr"):
        return "*" + dtype
    if name in ("k_cache_ptr", "v_cache_ptr"):
        return "*" + cache
    if name in SCALE_OR_PARTIALS:
        return "*fp32"
    if name.endswith("_ptr"):
        return "*i32"
    return "fp32" if name == "qk_scale" else "i32"


def _compile_sm90(kernel, constexprs: dict, dtype: str, cache: str, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # the autotuner wraps the JITFunction
        kernel = kernel.fn
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else _arg_type(n, dtype, cache) for n in names}
    fixed = {(names.index(n),): v for n, v in constexprs.items()}
    source = ASTSource(kernel, signature, fixed)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _gpu_configs():
    import os

    from kernels.triton_kernels import _prefill_configs

    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return _prefill_configs()
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.parametrize("dtype,cache", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")])
def test_prefill_kernel_compiles_for_sm90_in_every_config(dtype: str, cache: str) -> None:
    from kernels.triton_kernels import _prefill_attention_kernel

    for config in _gpu_configs():
        constexprs = dict(
            GROUP=4,
            HEAD_DIM=128,
            BLOCK_D=128,
            PRECISION="ieee" if dtype == "fp32" else "tf32",
            KV_FP8=cache == "fp8e4nv",
            **config.kwargs,
        )
        kernel = _compile_sm90(
            _prefill_attention_kernel,
            constexprs,
            dtype,
            cache,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        # fp32's wide tiles may not fit; the autotuner skips those (OutOfResources), as long
        # as one config does. bf16's must all fit.
        if dtype != "fp32":
            assert kernel.metadata.shared <= H100_SHARED_BYTES, (config, kernel.metadata.shared)


@pytest.mark.parametrize("dtype,cache", [("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")])
def test_split_k_decode_kernels_compile_for_sm90(dtype: str, cache: str) -> None:
    from kernels.triton_decode_splitk import _decode_partial_kernel, _decode_reduce_kernel

    partial = {
        "NUM_HEADS": 32,
        "GROUP": 4,
        "HEAD_DIM": 128,
        "BLOCK_D": 128,
        "BLOCK_G": 16,
        "BLOCK_N": 64 if dtype == "bf16" else 32,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "KV_FP8": cache == "fp8e4nv",
    }
    kernel = _compile_sm90(_decode_partial_kernel, partial, dtype, cache)
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    reduce = {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_S": 64, "BLOCK_D": 128}
    _compile_sm90(_decode_reduce_kernel, reduce, dtype, cache)
