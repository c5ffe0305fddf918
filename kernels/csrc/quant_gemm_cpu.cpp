// y = x @ W^T (+ bias) (+ residual) for the few rows of a decode step, from weights stored in
// fewer bytes than fp32 (bf16, int8 per output channel, 4-bit in groups), dequantized in
// registers; x and the sums stay fp32. AVX-512 or AVX2, one build each (simd.h).
//
// A decode step reads every weight once; at 1-32 rows its time is the weight stream, so fewer
// bytes per weight is fewer milliseconds. torch's own weight-only kernels
// (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu) run fp32 activations 4-100x slower than
// the fp32 matmul on this machine (docs/results/quantized.md); this kernel keeps the fp32
// skinny kernel's shape (tiles of 16 outputs, x broadcast from a transposed copy, rows
// register-blocked) and only changes how a step of K turns bytes into 16 weights.
//
// Packed layouts (kernels/quant.py builds them; one stream per tile, scales inline):
//   bf16: [tiles, K, 16] bf16.
//   int8: [tiles, K * 16 + 64] int8: K steps of 16 int8 weights, then 16 fp32 scales.
//   q4:   [tiles, K / G, G * 8 + 64] uint8: per group, G / 2 steps of 16 bytes (byte j holds
//         output j's weight at k = 2p in its low nibble and at k = 2p + 1 in its high one),
//         then 16 fp16 scales and 16 fp16 minimums: w = q * scale + min, q in 0..15.
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

using quant_tiles::f16_to_ps;
using quant_tiles::kRegs;
using quant_tiles::kTile;
using quant_tiles::store_tile;

constexpr int64_t kGroup = simd::kRegisters >= 32 ? 2 : 1;  // tiles per pass
constexpr int64_t kMaxPass = simd::kRegisters >= 32 ? 12 : 6;  // rows per pass
constexpr int64_t kPrefetchBytes = 1024;

enum class Format { kBF16, kInt8, kQ4 };

// 16 (AVX-512) or 8 (AVX2) 8-bit / 16-bit integers widened to fp32.
#if defined(__AVX512F__)
inline simd::vec i8_to_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline simd::vec bf16_to_ps(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
// Both nibbles of 16 bytes: low -> k even, high -> k odd.
inline void nibbles_to_ps(const uint8_t* p, simd::vec& lo, simd::vec& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#else
inline simd::vec i8_to_ps(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline simd::vec bf16_to_ps(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
inline void nibbles_to_ps(const uint8_t* p, simd::vec& lo, simd::vec& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#endif

// The geometry of one packed weight: bytes per tile and, for q4, per group.
struct Packed {
  const uint8_t* data;
  int64_t K, tile_bytes, group;  // group: q4 only
};

template <int NT, int MR>
inline void accumulate(simd::vec (&acc)[MR][NT * kRegs], const simd::vec* wk, const float* x,
                       int64_t M) {
  for (int m = 0; m < MR; ++m) {
    const simd::vec xb = simd::set1(x[m]);
    for (int j = 0; j < NT * kRegs; ++j) acc[m][j] = simd::fmadd(xb, wk[j], acc[m][j]);
  }
}

// Rows [m0, m0 + MR) against NT tiles starting at tile t0 (output n0 = t0 * 16); xt: x^T [K, M].
template <Format F, int NT, int MR>
void quant_pass(const float* xt, int64_t M, int64_t m0, const Packed& w, int64_t t0,
                const Epilogue& e) {
  constexpr int R = NT * kRegs;
  simd::vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = simd::zero();
  const float* x = xt + m0;
  const int64_t K = w.K;
  const uint8_t* tile0 = w.data + t0 * w.tile_bytes;
  simd::vec wk[R];
  if constexpr (F == Format::kBF16 || F == Format::kInt8) {
    constexpr int64_t elt = F == Format::kBF16 ? 2 : 1;
    for (int64_t k = 0; k < K; ++k) {
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile0 + t * w.tile_bytes + k * kTile * elt;
        for (int r = 0; r < kRegs; ++r) {
          if constexpr (F == Format::kBF16)
            wk[t * kRegs + r] = bf16_to_ps((const uint16_t*)p + r * simd::kWidth);
          else
            wk[t * kRegs + r] = i8_to_ps((const int8_t*)p + r * simd::kWidth);
        }
        if ((k * kTile * elt) % 64 == 0) simd::prefetch(p + kPrefetchBytes);
      }
      accumulate<NT, MR>(acc, wk, x + k * M, M);
    }
    if constexpr (F == Format::kInt8) {  // per-channel scales: once, after the sum
      for (int t = 0; t < NT; ++t) {
        const float* scale = (const float*)(tile0 + t * w.tile_bytes + K * kTile);
        for (int r = 0; r < kRegs; ++r) {
          const simd::vec s = simd::load(scale + r * simd::kWidth);
          for (int m = 0; m < MR; ++m) acc[m][t * kRegs + r] = simd::mul(acc[m][t * kRegs + r], s);
        }
      }
    }
  } else {
    const int64_t G = w.group, group_bytes = G * 8 + 64;
    for (int64_t g = 0; g < K / G; ++g) {
      simd::vec scale[R], mins[R];
      for (int t = 0; t < NT; ++t) {
        const uint16_t* sm = (const uint16_t*)(tile0 + t * w.tile_bytes + g * group_bytes + G * 8);
        for (int r = 0; r < kRegs; ++r) {
          scale[t * kRegs + r] = f16_to_ps(sm + r * simd::kWidth);
          mins[t * kRegs + r] = f16_to_ps(sm + kTile + r * simd::kWidth);
        }
      }
      for (int64_t p = 0; p < G / 2; ++p) {
        simd::vec hi[R];
        for (int t = 0; t < NT; ++t) {
          const uint8_t* b = tile0 + t * w.tile_bytes + g * group_bytes + p * kTile;
          for (int r = 0; r < kRegs; ++r) {
            const int j = t * kRegs + r;
            nibbles_to_ps(b + r * simd::kWidth, wk[j], hi[j]);
            wk[j] = simd::fmadd(wk[j], scale[j], mins[j]);
            hi[j] = simd::fmadd(hi[j], scale[j], mins[j]);
          }
          if (p % 4 == 0) simd::prefetch(b + kPrefetchBytes);
        }
        const int64_t k = g * G + 2 * p;
        accumulate<NT, MR>(acc, wk, x + k * M, M);
        accumulate<NT, MR>(acc, hi, x + (k + 1) * M, M);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) store_tile(acc[m] + t * kRegs, m0 + m, (t0 + t) * kTile, e);
}

using PassFn = void (*)(const float*, int64_t, int64_t, const Packed&, int64_t, const Epilogue&);

template <Format F, int NT, int... MR>
constexpr std::array<PassFn, sizeof...(MR)> make_passes(std::integer_sequence<int, MR...>) {
  return {quant_pass<F, NT, MR + 1>...};
}

template <Format F>
void run_all(const float* xt, int64_t M, const Packed& w, int64_t tiles, const Epilogue& e) {
  static const auto group = make_passes<F, kGroup>(std::make_integer_sequence<int, kMaxPass>{});
  static const auto single = make_passes<F, 1>(std::make_integer_sequence<int, kMaxPass>{});
  quant_tiles::for_each_pass(tiles, kGroup, M, kMaxPass, [&](int64_t t0, int64_t count,
                                                              int64_t m0, int64_t rows) {
    (count == kGroup ? group : single)[rows - 1](xt, M, m0, w, t0, e);
  });
}

// The format and geometry of a packed weight from its dtype and shape (see the header).
Format describe(const at::Tensor& packed, int64_t K, Packed& w) {
  TORCH_CHECK(packed.is_contiguous() && !packed.is_cuda(), "packed weight: contiguous, CPU");
  w.data = (const uint8_t*)packed.data_ptr();
  w.K = K;
  w.group = 0;
  switch (packed.scalar_type()) {
    case at::kBFloat16:
      TORCH_CHECK(packed.dim() == 3 && packed.size(1) == K && packed.size(2) == kTile,
                  "bf16 packed weight must be [tiles, K, 16]");
      w.tile_bytes = K * kTile * 2;
      return Format::kBF16;
    case at::kChar:
      TORCH_CHECK(packed.dim() == 2 && packed.size(1) == K * kTile + 64,
                  "int8 packed weight must be [tiles, K * 16 + 64]");
      w.tile_bytes = K * kTile + 64;
      return Format::kInt8;
    case at::kByte:
      TORCH_CHECK(packed.dim() == 3 && packed.size(2) > 64 && (packed.size(2) - 64) % 8 == 0,
                  "q4 packed weight must be [tiles, K / G, G * 8 + 64]");
      w.group = (packed.size(2) - 64) / 8;
      TORCH_CHECK(w.group % 2 == 0 && packed.size(1) * w.group == K, "q4 groups do not match K");
      w.tile_bytes = packed.size(1) * packed.size(2);
      return Format::kQ4;
    default:
      TORCH_CHECK(false, "quantized weight: bf16, int8 or uint8 (q4) packing expected");
  }
}

}  // namespace

at::Tensor quant_skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual) {
  if (is_int8_activation_packing(packed)) return quant_dot_linear(x, packed, n_out, bias, residual);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be 2-d fp32");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, tiles = packed.size(0);
  TORCH_CHECK(tiles * kTile >= N && tiles * kTile < N + kTile, "packed weight does not match n_out");
  Packed w;
  const Format format = describe(packed, K, w);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto xt = x.t().contiguous();
  std::array<at::Tensor, 2> keep;  // bias and residual, contiguous
  const Epilogue e = make_epilogue(bias, residual, out, keep);
  const float* xp = xt.data_ptr<float>();
  switch (format) {
    case Format::kBF16: run_all<Format::kBF16>(xp, M, w, tiles, e); break;
    case Format::kInt8: run_all<Format::kInt8>(xp, M, w, tiles, e); break;
    case Format::kQ4: run_all<Format::kQ4>(xp, M, w, tiles, e); break;
  }
  return out;
}
