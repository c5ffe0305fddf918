// Pieces both quantized skinny kernels share (quant_gemm_cpu.cpp: fp32 activations;
// quant_dot_cpu.cpp: int8 activations): the tile of 16 outputs, fp16 scales widened, and the
// store of a finished tile through the epilogue (bias, residual).
#pragma once

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

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

// Every pass of an M-row matmul over `tiles` tiles, in parallel over groups of
// `tiles_per_pass` tiles: run(t0, tiles in this group, m0, rows in this pass).
template <class Run>
void for_each_pass(int64_t tiles, int64_t tiles_per_pass, int64_t M, int64_t rows_per_pass,
                   const Run& run) {
  const int64_t groups = (tiles + tiles_per_pass - 1) / tiles_per_pass;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * tiles_per_pass, count = std::min(tiles_per_pass, tiles - t0);
      for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass)
        run(t0, count, m0, std::min(rows_per_pass, M - m0));
    }
  });
}

}  // namespace quant_tiles
