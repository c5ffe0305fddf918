"""The fp8 KV cache's pieces of the Triton kernels (kernels/triton_kernels.py): float8_e4m3fn
codes with a per-token, per-head fp32 scale (kernels/kv_fp8.py's format), written by the store
kernel and read by both attention kernels."""

import triton
import triton.language as tl

# A module constant a kernel reads must be a tl.constexpr instance (compiled Triton refuses
# plain globals; the interpreter does not check).
FP8_MAX = tl.constexpr(448.0)  # kernels.kv_fp8.FP8_MAX


@triton.jit
def fp8_codes(x, scale_ptrs, h_mask):
    """[BLOCK_H, BLOCK_D] values -> float8_e4m3fn codes; stores each head's scale, max|x| / 448,
    as kernels.kv_fp8.quantize does (IEEE division, round to nearest even: the torch path's
    codes bit for bit)."""
    x = x.to(tl.float32)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-30), FP8_MAX)
    tl.store(scale_ptrs, scale, mask=h_mask)
    codes = tl.math.div_rn(x, scale[:, None])
    codes = _round_to_e4m3(tl.minimum(tl.maximum(codes, -FP8_MAX), FP8_MAX))
    return codes.to(tl.float8e4nv)  # exact: the value is already an e4m3 one


@triton.jit
def _round_to_e4m3(v):
    """fp32 v (|v| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, still in
    fp32, as torch's cast rounds. Rounding before the cast keeps the codes identical
    everywhere: Triton 3.9's interpreter loses the carry when its cast rounds a mantissa up
    into the next power of two (-127.9 became -64, not -128)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    # Normal range (>= 2^-6): keep 3 of fp32's 23 mantissa bits; a carry moves the exponent.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576: 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    # Subnormals (< 2^-6): multiples of 2^-9, ties to the even multiple.
    t = a * 512.0
    n = tl.floor(t + 0.5)
    n = tl.where(((n - t) == 0.5) & ((n.to(tl.int32) & 1) == 1), n - 1.0, n)
    r = tl.where(a < 0.015625, n / 512.0, normal)
    return tl.where(v.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit: -0.0 stays -0.0


@triton.jit
def fp8_keys_and_values(q, k, v, k_scale_ptrs, v_scale_ptrs, n_mask):
    """A tile of fp8 key and value codes as the attention's dot products take them: keys stay
    codes (exact in q's dtype; each score is multiplied by its key's scale after the dot, the
    returned k_scale), values are dequantized, since p * scale could underflow fp16."""
    k_scale = tl.load(k_scale_ptrs, mask=n_mask, other=0.0)
    v_scale = tl.load(v_scale_ptrs, mask=n_mask, other=0.0)
    return k.to(q.dtype), (v.to(tl.float32) * v_scale[:, None]).to(q.dtype), k_scale
