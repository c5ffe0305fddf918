// y = x @ W^T (+ bias) (+ residual) for the few rows of a decode step (CPU, fp32; AVX-512 or
// AVX2, one build each, simd.h).
//
// At 1-32 rows a matmul is a weight stream: every weight is read once from memory and used
// `rows` times. oneDNN's packed kernels run these shapes at 8-11 GB/s and 40-100 GFLOP/s on
// this machine, neither limit (measured, SmolLM2's projections, 1 thread). Here the weight is
// packed once into tiles of 16 outputs, [N/16][K][16]: a tile is one contiguous stream,
// prefetched ahead; each step of K loads 16 weights of two tiles, and x's column, broadcast
// from a transposed copy, feeds up to 12 rows' accumulators of each. Sums run over K in order
// (fp32), like a dot product.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace {

constexpr int64_t kTile = 16;  // outputs per tile: one AVX-512 register, two AVX2 registers
constexpr int kRegsPerTile = kTile / simd::kWidth;
// Tiles per pass and rows per pass, within the register file: AVX-512 (32 registers) takes two
// tiles of 12 rows (24 accumulators + 2 weight registers: two weight loads feed each broadcast
// of x); AVX2 (16) one tile of 6 rows (12 accumulators + 2 weights + the broadcast), BLIS's
// 6 x 16 Haswell shape.
constexpr int64_t kGroup = simd::kRegisters >= 32 ? 2 : 1;
constexpr int64_t kMaxPass = simd::kRegisters >= 32 ? 12 : 6;
// Software prefetch this many steps of K ahead in each tile's stream (1 KiB): the hardware
// prefetcher alone left a 16-row pass at ~6 GB/s; with it and two tiles a pass, 13-30% faster
// than oneDNN at 8-32 rows, even with MKL's GEMV at one row (measured, AVX-512, 1 thread).
constexpr int64_t kPrefetchSteps = 16;

// Row m's 16 sums of the tile at output n (+ bias, + residual) into out; a partial last tile
// (N not a multiple of 16) goes through a buffer, lane by lane.
inline void store_tile(const simd::vec* acc, int64_t m, int64_t n, const Epilogue& e) {
  const int64_t at = m * e.N + n, width = std::min(kTile, e.N - n);
  if (width == kTile) {
    for (int r = 0; r < kRegsPerTile; ++r) {
      simd::vec y = acc[r];
      if (e.bias) y = simd::add(y, simd::load(e.bias + n + r * simd::kWidth));
      if (e.residual) y = simd::add(y, simd::load(e.residual + at + r * simd::kWidth));
      simd::store(e.out + at + r * simd::kWidth, y);
    }
    return;
  }
  float lanes[kTile];
  for (int r = 0; r < kRegsPerTile; ++r) simd::store(lanes + r * simd::kWidth, acc[r]);
  for (int64_t j = 0; j < width; ++j) {
    const float y = lanes[j] + (e.bias ? e.bias[n + j] : 0.f);
    e.out[at + j] = e.residual ? y + e.residual[at + j] : y;
  }
}

// Rows [m0, m0 + MR) of x against NT consecutive tiles starting at output n0; xt is x
// transposed, [K, M]; w is the first tile, the next one K * 16 floats on.
template <int NT, int MR>
void tile_pass(const float* xt, int64_t M, int64_t m0, const float* w, int64_t K, int64_t n0,
               const Epilogue& e) {
  constexpr int R = NT * kRegsPerTile;  // weight registers per step of K
  simd::vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = simd::zero();
  const float* x = xt + m0;
  const int64_t stride = K * kTile;
  for (int64_t k = 0; k < K; ++k) {
    simd::vec wk[R];
    for (int t = 0; t < NT; ++t) {
      const float* tile = w + t * stride + k * kTile;
      for (int r = 0; r < kRegsPerTile; ++r)
        wk[t * kRegsPerTile + r] = simd::load(tile + r * simd::kWidth);
      simd::prefetch(tile + kPrefetchSteps * kTile);  // a tile's step is one 64-byte line
    }
    for (int m = 0; m < MR; ++m) {
      const simd::vec xb = simd::set1(x[k * M + m]);
      for (int j = 0; j < R; ++j) acc[m][j] = simd::fmadd(xb, wk[j], acc[m][j]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) store_tile(acc[m] + t * kRegsPerTile, m0 + m, n0 + t * kTile, e);
}

using PassFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, int64_t,
                        const Epilogue&);

template <int NT, int... MR>
constexpr std::array<PassFn, sizeof...(MR)> make_passes(std::integer_sequence<int, MR...>) {
  return {tile_pass<NT, MR + 1>...};
}

const auto kGroupPasses = make_passes<kGroup>(std::make_integer_sequence<int, kMaxPass>{});
const auto kSinglePasses = make_passes<1>(std::make_integer_sequence<int, kMaxPass>{});

// Every row of x against tiles [first, first + count), count 1 or kGroup.
void run_tiles(const float* xt, int64_t M, const float* w, int64_t K, int64_t first,
               int64_t count, const Epilogue& e) {
  const auto& passes = count == kGroup ? kGroupPasses : kSinglePasses;
  for (int64_t m0 = 0; m0 < M; m0 += kMaxPass)
    passes[std::min(kMaxPass, M - m0) - 1](xt, M, m0, w + first * K * kTile, K, first * kTile, e);
}

}  // namespace

at::Tensor pack_skinny_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && !weight.is_cuda(),
              "a 2-d fp32 CPU weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + kTile - 1) / kTile;
  auto padded = at::zeros({tiles * kTile, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({tiles, kTile, K}).transpose(1, 2).contiguous();  // [tiles, K, 16]
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual) {
  // bf16 / int8 / q4 packings (quant_gemm_cpu.cpp): the same tiles from fewer bytes.
  if (packed.scalar_type() != at::kFloat) return quant_skinny_linear(x, packed, n_out, bias, residual);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be 2-d fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kTile && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(0) * kTile >= n_out &&
                  packed.size(0) * kTile < n_out + kTile,
              "packed weight does not match x or n_out");
  const int64_t M = x.size(0), K = x.size(1), N = n_out, tiles = packed.size(0);
  auto out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const auto xt = x.t().contiguous();  // [K, M]: one broadcast source per step of K
  std::array<at::Tensor, 2> keep;  // bias and residual, contiguous
  const Epilogue e = make_epilogue(bias, residual, out, keep);
  const float* xp = xt.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const int64_t groups = (tiles + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      run_tiles(xp, M, wp, K, g * kGroup, std::min(kGroup, tiles - g * kGroup), e);
  });
  return out;
}
