// Pieces both quantized skinny kernels share (quant_gemm_cpu.cpp: fp32 activations;
// quant_dot_cpu.cpp: int8 activations): the tile of 16 outputs, fp16 scales widened, and the
// store of a finished tile through the epilogue (bias, residual).
#pragma once

#include "cpu_kernels.h"

#include <algorithm>

namespace quant_tiles {

constexpr int64_t kTile = 16;
constexpr int kRegs = kTile / simd::kWidth;  // fp32 registers per tile: 1 (AVX-512) or 2 (AVX2)

// 16 (AVX-512) or 8 (AVX2) fp16 values widened to fp32.
inline simd::vec f16_to_ps(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#endif
}

// Row m, outputs [n, n + 16) of the result from a tile's kRegs accumulators.
inline void store_tile(const simd::vec* acc, int64_t m, int64_t n, const Epilogue& e) {
  const int64_t at = m * e.N + n, width = std::min(kTile, e.N - n);
  float lanes[kTile];
  for (int r = 0; r < kRegs; ++r) simd::store(lanes + r * simd::kWidth, acc[r]);
  for (int64_t j = 0; j < width; ++j) {
    const float y = lanes[j] + (e.bias ? e.bias[n + j] : 0.f);
    e.out[at + j] = e.residual ? y + e.residual[at + j] : y;
  }
}

}  // namespace quant_tiles
