// y = x @ W^T (+ bias) (+ residual) for the few rows of a decode step, from weights stored in
// fewer bytes than fp32 (bf16, int8 per output channel, 4-bit in groups), dequantized in
// registers; x and the sums stay fp32. AVX-512 or AVX2, one build each (simd.h).
//
// A decode step reads every weight once; at 1-32 rows its time is the weight stream and the
// instructions that turn bytes into fp32 weights. The kernel keeps the fp32 skinny kernel's
// shape (outputs in 16-wide tiles, x broadcast from a transposed copy, rows register-blocked);
// a pass covers a few vector registers of outputs (`NR`, kWidth outputs each) for a few rows.
//
// q4, w = q * scale + min per group of G along K. Two ways to sum a group:
// - factored (few rows): sum_k x_k w_k = scale * sum_k x_k q_k + min * sum_k x_k. The codes go
//   straight from integers into the FMA with x, the per-group sums of x are computed once per
//   call, and each group ends with two FMAs per row: one FMA less per weight and row. On
//   AVX-512 a 16-entry table lookup (vpermps) turns the codes into floats.
// - dequantized (more rows): w = q * scale + min once per weight, shared by the pass's rows.
// On AVX2 both nibbles of a byte are masked in place (lo = b & 15, hi = b & 0xF0 = 16 q), no
// shift: x at odd k is divided by 16 in the transposed copy (exact, a power of two) and the
// dequantized high nibble adds 16 * min.
// At one or two rows a pass is latency-bound on its accumulators (FMA latency 4, two ports: 8
// chains in flight needed): the factored sums keep the even and odd k apart there. AVX2 runs
// 1-2 rows on two tiles (two weight streams) and 3-12 rows on half tiles in one pass (one
// conversion of each weight for all the rows, instead of two passes of 6).
//
// Measured against the previous kernel (1 thread, best of 20, SmolLM2's qkv / o / gate_up /
// down; previous at load 5.5-8, this one at load 1-1.3, so +-15%): AVX2 q4 1 row 1.30-1.45x,
// 8 rows 1.0-1.13x, 32 rows 0.95-1.05x; AVX2 int8 1 row 1.7x, 8 rows 1.15x; AVX-512 q4 1 row
// 1.2-1.36x, int8 1-32 rows 1.05-1.2x, but AVX-512 q4 at 8 rows 0.87-1.02x and 32 rows
// 0.75-0.94x: the dequantized q4 passes there are slower than before, cause not found yet.
//
// Packed layouts (kernels/quant.py builds them; one stream per tile, scales inline):
//   bf16: [tiles, K, 16] bf16.
//   int8: [tiles, K * 16 + 64] int8: K steps of 16 int8 weights, then 16 fp32 scales.
//   q4:   [tiles, K / G, G * 8 + 64] uint8: per group, G / 2 steps of 16 bytes (byte j holds
//         output j's weight at k = 2p in its low nibble and at k = 2p + 1 in its high one),
//         then 16 fp16 scales and 16 fp16 minimums: w = q * scale + min, q in 0..15.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace {

constexpr int64_t kTile = 16;
constexpr int kRegs = kTile / simd::kWidth;  // registers per tile: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t kPrefetchBytes = 1024;

enum class Format { kBF16, kInt8, kQ4 };

// kWidth 8-bit / 16-bit integers widened to fp32; q4 codes: both nibbles of kWidth bytes.
#if defined(__AVX512F__)
inline simd::vec i8_to_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline simd::vec bf16_to_ps(const uint8_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
inline simd::vec f16_to_ps(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
// Both nibbles of 16 bytes as q (low: k even, high: k odd). Factored sums take them by a
// 16-entry table lookup (vpermps reads each lane's low 4 bits: no mask, no int -> float
// conversion); dequantized ones by the conversion (measured faster there, 8-32 rows).
constexpr float kHighNibble = 1.f;  // the high nibble comes out as q
template <bool Lookup>
inline void nibbles_to_ps(const uint8_t* p, simd::vec& lo, simd::vec& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  if constexpr (Lookup) {
    const __m512 values = _mm512_cvtepi32_ps(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    lo = _mm512_permutexvar_ps(v, values);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
}
#else
inline simd::vec i8_to_ps(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline simd::vec bf16_to_ps(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline simd::vec f16_to_ps(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
// Both nibbles of 8 bytes, masked in place: low = q (k even), high = 16 q (k odd; x at odd k
// is divided by 16 in the transposed copy, exact): a mask instead of a shift.
constexpr float kHighNibble = 16.f;
template <bool Lookup>
inline void nibbles_to_ps(const uint8_t* p, simd::vec& lo, simd::vec& hi16) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
  hi16 = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF0)));
}
#endif

// Row m's kWidth sums at output n (+ bias, + residual); lanes past N are dropped.
inline void store_reg(simd::vec acc, int64_t m, int64_t n, const Epilogue& e) {
  if (n >= e.N) return;  // a register of a tile's zero padding
  const int64_t at = m * e.N + n;
  if (n + simd::kWidth <= e.N) {
    if (e.bias) acc = simd::add(acc, simd::load(e.bias + n));
    if (e.residual) acc = simd::add(acc, simd::load(e.residual + at));
    simd::store(e.out + at, acc);
    return;
  }
  float lanes[simd::kWidth];
  simd::store(lanes, acc);
  for (int64_t j = 0; j < e.N - n; ++j) {
    const float y = lanes[j] + (e.bias ? e.bias[n + j] : 0.f);
    e.out[at + j] = e.residual ? y + e.residual[at + j] : y;
  }
}

// One call: x transposed ([K, M]; q4: odd k divided by 16), q4's per-group sums of x
// ([K / G, M]), and the packed weight's geometry.
struct Call {
  const float* xt;
  const float* xsum;
  int64_t M, K;
  const uint8_t* data;
  int64_t tile_bytes, group;  // group: q4 only
  Epilogue e;
};

// The first byte of output register v (kWidth outputs) in its tile, and its offset there.
inline const uint8_t* tile_of(const Call& c, int64_t v) { return c.data + (v / kRegs) * c.tile_bytes; }
inline int64_t lane0(int64_t v) { return (v % kRegs) * simd::kWidth; }

template <int NR, int MR>
inline void store_pass(simd::vec (&acc)[MR][NR], const Call& c, int64_t m0, int64_t v0) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) store_reg(acc[m][j], m0 + m, (v0 + j) * simd::kWidth, c.e);
}

// bf16 / int8: rows [m0, m0 + MR) against output registers [v0, v0 + NR).
template <Format F, int NR, int MR>
void plain_pass(const Call& c, int64_t m0, int64_t v0) {
  constexpr int64_t elt = F == Format::kBF16 ? 2 : 1;
  simd::vec acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = simd::zero();
  const uint8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = tile_of(c, v0 + j) + lane0(v0 + j) * elt;
  const float* x = c.xt + m0;
  const int64_t M = c.M;
  for (int64_t k = 0; k < c.K; ++k) {
    simd::vec wk[NR];
    for (int j = 0; j < NR; ++j) {
      const uint8_t* p = w[j] + k * kTile * elt;
      wk[j] = F == Format::kBF16 ? bf16_to_ps(p) : i8_to_ps(p);
      if ((NR < kRegs || j % kRegs == 0) && (k * kTile * elt) % 64 == 0)
        simd::prefetch(p + kPrefetchBytes);
    }
    for (int m = 0; m < MR; ++m) {  // one broadcast of x per row and step, for all registers
      const simd::vec xb = simd::set1(x[k * M + m]);
      for (int j = 0; j < NR; ++j) acc[m][j] = simd::fmadd(xb, wk[j], acc[m][j]);
    }
  }
  if constexpr (F == Format::kInt8) {  // per-channel scales: once, after the sum
    for (int j = 0; j < NR; ++j) {
      const simd::vec s = simd::load((const float*)(tile_of(c, v0 + j) + c.K * kTile) + lane0(v0 + j));
      for (int m = 0; m < MR; ++m) acc[m][j] = simd::mul(acc[m][j], s);
    }
  }
  store_pass<NR, MR>(acc, c, m0, v0);
}

// q4: rows [m0, m0 + MR) against output registers [v0, v0 + NR), factored or dequantized.
template <bool Factored, int NR, int MR>
void q4_pass(const Call& c, int64_t m0, int64_t v0) {
  // Few accumulators: keep the even and odd k's sums apart (twice the chains in flight), where
  // the three sets of accumulators fit the register file.
  constexpr bool kSplit = Factored && MR * NR < 8 && 3 * MR * NR + 4 <= simd::kRegisters;
  const int64_t G = c.group, group_bytes = G * 8 + 64, M = c.M;
  simd::vec acc[MR][NR], even[MR][NR], odd[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) acc[m][j] = simd::zero();
  const uint8_t* codes[NR];
  const uint8_t* scales[NR];  // per group: 16 fp16 scales, then 16 fp16 minimums
  for (int j = 0; j < NR; ++j) {
    codes[j] = tile_of(c, v0 + j) + lane0(v0 + j);
    scales[j] = tile_of(c, v0 + j) + G * 8 + lane0(v0 + j) * 2;
  }
  const float* x = c.xt + m0;
  for (int64_t g = 0; g < c.K / G; ++g) {
    simd::vec scale[NR], mins[NR], mins16[NR];
    if constexpr (Factored) {
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < NR; ++j) even[m][j] = odd[m][j] = simd::zero();
    } else {
      for (int j = 0; j < NR; ++j) {
        scale[j] = f16_to_ps(scales[j] + g * group_bytes);
        mins[j] = f16_to_ps(scales[j] + g * group_bytes + kTile * 2);
        // AVX-512's high nibble is q: the minimum as it is (no register more at 12 rows)
        mins16[j] = kHighNibble == 1.f ? mins[j] : simd::mul(mins[j], simd::set1(kHighNibble));
      }
    }
    auto& sum_even = Factored ? even : acc;
    auto& sum_odd = kSplit ? odd : sum_even;
    const float* xg = x + g * G * M;
    for (int64_t p = 0; p < G / 2; ++p) {
      if constexpr (Factored) {  // register by register: few registers to spare
        for (int j = 0; j < NR; ++j) {
          const uint8_t* b = codes[j] + g * group_bytes + p * kTile;
          simd::vec lo, hi;
          nibbles_to_ps<true>(b, lo, hi);
          if ((NR < kRegs || j % kRegs == 0) && p % 4 == 0) simd::prefetch(b + kPrefetchBytes);
          for (int m = 0; m < MR; ++m) {
            sum_even[m][j] = simd::fmadd(simd::set1(xg[2 * p * M + m]), lo, sum_even[m][j]);
            sum_odd[m][j] = simd::fmadd(simd::set1(xg[(2 * p + 1) * M + m]), hi, sum_odd[m][j]);
          }
        }
      } else {  // every register's weights first, then one broadcast of x per row for all
        simd::vec lo[NR], hi[NR];
        for (int j = 0; j < NR; ++j) {
          const uint8_t* b = codes[j] + g * group_bytes + p * kTile;
          nibbles_to_ps<false>(b, lo[j], hi[j]);
          lo[j] = simd::fmadd(lo[j], scale[j], mins[j]);
          hi[j] = simd::fmadd(hi[j], scale[j], mins16[j]);
          if ((NR < kRegs || j % kRegs == 0) && p % 4 == 0) simd::prefetch(b + kPrefetchBytes);
        }
        for (int m = 0; m < MR; ++m) {
          const simd::vec xe = simd::set1(xg[2 * p * M + m]);
          for (int j = 0; j < NR; ++j) acc[m][j] = simd::fmadd(xe, lo[j], acc[m][j]);
        }
        for (int m = 0; m < MR; ++m) {
          const simd::vec xo = simd::set1(xg[(2 * p + 1) * M + m]);
          for (int j = 0; j < NR; ++j) acc[m][j] = simd::fmadd(xo, hi[j], acc[m][j]);
        }
      }
    }
    if constexpr (Factored) {  // + scale * sum x q + min * sum x
      for (int j = 0; j < NR; ++j) {
        scale[j] = f16_to_ps(scales[j] + g * group_bytes);
        mins[j] = f16_to_ps(scales[j] + g * group_bytes + kTile * 2);
      }
      for (int m = 0; m < MR; ++m) {
        const simd::vec xs = simd::set1(c.xsum[g * M + m0 + m]);
        for (int j = 0; j < NR; ++j) {
          const simd::vec s = kSplit ? simd::add(even[m][j], odd[m][j]) : even[m][j];
          acc[m][j] = simd::fmadd(xs, mins[j], simd::fmadd(s, scale[j], acc[m][j]));
        }
      }
    }
  }
  store_pass<NR, MR>(acc, c, m0, v0);
}

using PassFn = void (*)(const Call&, int64_t, int64_t);

template <Format F, bool Factored, int NR, int MR>
constexpr PassFn pass_fn() {
  if constexpr (F == Format::kQ4) return q4_pass<Factored, NR, MR>;
  else return plain_pass<F, NR, MR>;
}

// How a call is cut: passes of `regs` output registers (the last outputs one register at a
// time) and at most `max_rows` rows; passes[rows - 1] and tail[rows - 1] run them.
struct Plan {
  const PassFn* passes;
  const PassFn* tail;
  int64_t regs, max_rows;
};

template <Format F, bool Factored, int NR, int... MR>
constexpr auto make_table(std::integer_sequence<int, MR...>) {
  return std::array<PassFn, sizeof...(MR)>{pass_fn<F, Factored, NR, MR + 1>()...};
}

template <Format F, bool Factored, int NR, int MaxRows>
Plan plan() {
  static const auto passes = make_table<F, Factored, NR>(std::make_integer_sequence<int, MaxRows>{});
  static const auto tail = make_table<F, Factored, 1>(std::make_integer_sequence<int, MaxRows>{});
  return {passes.data(), tail.data(), NR, MaxRows};
}

// Register budgets: accumulators (x3 when factored and split, x2 when factored) + the weight
// registers + a broadcast within 32 (AVX-512) or 16 (AVX2) registers.
template <Format F>
Plan choose_plan(int64_t M) {
#if defined(__AVX512F__)
  // Two registers (two tiles, two weight streams) a pass: halves a 576-wide projection evenly
  // between two threads.
  if constexpr (F == Format::kQ4) {
    if (M <= 6) return plan<F, true, 2, 6>();
  }
  return plan<F, false, 2, 12>();
#else
  if constexpr (F == Format::kQ4) {
    if (M == 1) return plan<F, true, 4, 1>();
    if (M == 2) return plan<F, true, 2, 2>();
    if (M <= 5) return plan<F, true, 1, 5>();
  } else {
    if (M <= 2) return plan<F, false, 4, 2>();
  }
  // Half a tile, up to 12 rows: one conversion of the weights for all of them (measured 7-20%
  // faster than two passes of a whole tile at 8 rows); past 12 rows whole tiles of 6 rows.
  if (M <= 12) return plan<F, false, 1, 12>();
  return plan<F, false, 2, 6>();
#endif
}

template <Format F>
void run_all(const Call& c, int64_t tiles) {
  const Plan plan = choose_plan<F>(c.M);
  const int64_t regs = tiles * kRegs, units = (regs + plan.regs - 1) / plan.regs;
  const int64_t n_passes = (c.M + plan.max_rows - 1) / plan.max_rows;
  at::parallel_for(0, units, 4, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t v0 = u * plan.regs, count = std::min(plan.regs, regs - v0);
      for (int64_t p = 0, m0 = 0; p < n_passes; ++p) {
        const int64_t rows = std::min(plan.max_rows, c.M - m0);
        if (count == plan.regs) {
          plan.passes[rows - 1](c, m0, v0);
        } else {
          for (int64_t v = v0; v < v0 + count; ++v) plan.tail[rows - 1](c, m0, v);
        }
        m0 += rows;
      }
    }
  });
}

// x transposed to [K, M] (q4: odd k divided by 16, and the sums of x per group, [K / G, M]).
void prepare_x(const at::Tensor& x, bool q4, int64_t group, std::vector<float>& xt,
               std::vector<float>& xsum) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  xt.resize(K * M);
  for (int64_t k = 0; k < K; ++k) {  // contiguous writes; the M rows' lines stay in L1
    const float f = q4 && (k & 1) ? 1.f / kHighNibble : 1.f;
    for (int64_t m = 0; m < M; ++m) xt[k * M + m] = xp[m * K + k] * f;
  }
  if (!q4) return;
  xsum.assign(K / group * M, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[k / group * M + m] += xp[m * K + k];
}

// The format and geometry of a packed weight from its dtype and shape (see the header).
Format describe(const at::Tensor& packed, int64_t K, Call& c) {
  TORCH_CHECK(packed.is_contiguous() && !packed.is_cuda(), "packed weight: contiguous, CPU");
  c.data = (const uint8_t*)packed.data_ptr();
  c.K = K;
  c.group = 0;
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kTile,
                  "bf16 packed weight must be [tiles, K, 16]");
      c.tile_bytes = K * kTile * 2;
      return Format::kBF16;
    case at::kChar:
      TORCH_CHECK(packed.dim() == 2 && packed.size(1) == K * kTile + 64,
                  "int8 packed weight must be [tiles, K * 16 + 64]");
      c.tile_bytes = K * kTile + 64;
      return Format::kInt8;
    case at::kByte:
      TORCH_CHECK(packed.dim() == 3 && packed.size(2) > 64 && (packed.size(2) - 64) % 8 == 0,
                  "q4 packed weight must be [tiles, K / G, G * 8 + 64]");
      c.group = (packed.size(2) - 64) / 8;
      TORCH_CHECK(c.group % 2 == 0 && packed.size(1) * c.group == K, "q4 groups do not match K");
      c.tile_bytes = packed.size(1) * packed.size(2);
      return Format::kQ4;
    default:
      TORCH_CHECK(false, "quantized weight: bf16, int8 or uint8 (q4) packing expected");
  }
}

}  // namespace

at::Tensor quant_skinny_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n_out,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be 2-d fp32");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = n_out, tiles = packed.size(0);
  TORCH_CHECK(tiles * kTile >= N && tiles * kTile < N + kTile, "packed weight does not match n_out");
  Call c;
  const Format format = describe(packed, K, c);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  thread_local std::vector<float> xt, xsum;  // reused: no allocation per call
  prepare_x(x, format == Format::kQ4, c.group, xt, xsum);
  std::array<at::Tensor, 2> keep;  // bias and residual, contiguous
  c.e = make_epilogue(bias, residual, out, keep);
  c.xt = xt.data();
  c.xsum = xsum.data();
  c.M = M;
  switch (format) {
    case Format::kBF16: run_all<Format::kBF16>(c, tiles); break;
    case Format::kInt8: run_all<Format::kInt8>(c, tiles); break;
    case Format::kQ4: run_all<Format::kQ4>(c, tiles); break;
  }
  return out;
}
