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
//
// Past one pass of rows (AVX-512: 12, AVX2: 6) the kernel is compute-bound from L2, and the
// first pass over a group used to wait on memory alone: the passes now split the rows evenly
// and prefetch the next group into L2 behind them. At one or two rows the AVX2 build, too,
// keeps two tiles (two weight streams) in flight. Measured against the previous kernel (1
// thread, CPU time, SmolLM2's 120 projections + LM head, load 4-8; docs/results/isa_variants.md):
// 32 rows 21% faster (AVX2) and 7% (AVX-512); 1 row AVX2 6-16% faster, AVX-512 unchanged.
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
// At a row or two a step is a weight stream: two tiles a pass on both instruction sets, two
// streams in flight per thread (AVX2: 2 rows x 4 registers + 4 weights within 16 registers).
constexpr int64_t kNarrowGroup = 2;
constexpr int64_t kNarrowRows = simd::kRegisters >= 32 ? kMaxPass : 2;
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

// While a pass runs, the next group's weights are prefetched into L2 a line every `every`
// steps of K: from [pf, pf_end) (empty: nothing to fetch).
struct Lookahead {
  const float* pf;
  const float* pf_end;
  int64_t every;
};

// Rows [m0, m0 + MR) of x against NT consecutive tiles starting at output n0; xt is x
// transposed, [K, M]; w is the first tile, the next one K * 16 floats on. Ahead: prefetch
// `ahead` (compiled out of single-pass calls, where the step is a plain weight stream).
template <int NT, int MR, bool Ahead>
void tile_pass(const float* xt, int64_t M, int64_t m0, const float* w, int64_t K, int64_t n0,
               const Epilogue& e, Lookahead ahead) {
  constexpr int R = NT * kRegsPerTile;  // weight registers per step of K
  simd::vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < R; ++j) acc[m][j] = simd::zero();
  const float* x = xt + m0;
  const int64_t stride = K * kTile;
  int64_t countdown = ahead.every;
#pragma GCC unroll 2  // measured: 5% (AVX2) and 3% (AVX-512) faster at 32 rows
  for (int64_t k = 0; k < K; ++k) {
    simd::vec wk[R];
    for (int t = 0; t < NT; ++t) {
      const float* tile = w + t * stride + k * kTile;
      for (int r = 0; r < kRegsPerTile; ++r)
        wk[t * kRegsPerTile + r] = simd::load(tile + r * simd::kWidth);
      simd::prefetch(tile + kPrefetchSteps * kTile);  // a tile's step is one 64-byte line
    }
    if (Ahead && --countdown == 0) {
      countdown = ahead.every;
      if (ahead.pf < ahead.pf_end) {
        simd::prefetch_l2(ahead.pf);
        ahead.pf += kTile;
      }
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
                        const Epilogue&, Lookahead);

template <int NT, bool Ahead, int... MR>
constexpr std::array<PassFn, sizeof...(MR)> make_passes(std::integer_sequence<int, MR...>) {
  return {tile_pass<NT, MR + 1, Ahead>...};
}

using MaxRows = std::make_integer_sequence<int, kMaxPass>;
// [0]: one pass (no lookahead), [1]: several passes, the next group fetched behind them.
const std::array<std::array<PassFn, kMaxPass>, 2> kGroupPasses = {
    make_passes<kGroup, false>(MaxRows{}), make_passes<kGroup, true>(MaxRows{})};
const std::array<std::array<PassFn, kMaxPass>, 2> kSinglePasses = {
    make_passes<1, false>(MaxRows{}), make_passes<1, true>(MaxRows{})};
// Always one pass (kNarrowRows rows at most).
const auto kNarrowPasses =
    make_passes<kNarrowGroup, false>(std::make_integer_sequence<int, kNarrowRows>{});

// Tiles per group (a pass's tiles) for M rows: two concurrent weight streams at the few rows
// where the step is memory-bound, else what the register file allows.
int64_t group_tiles(int64_t M) { return M <= kNarrowRows ? kNarrowGroup : kGroup; }

// Every row of x against tiles [first, first + count), count 1 or group_tiles(M), in passes of
// near-equal rows (32 rows: 6+6+5+5+5+5 on AVX2, not 6+6+6+6+6+2: a short pass reads the
// whole tile for little arithmetic). With more than one pass, the group is compute-bound
// from L2 after the first, so the `next_count` tiles after it (the next group) are prefetched
// into L2 across the passes: its stream from memory overlaps this group's arithmetic instead
// of stalling the next group's first pass.
void run_tiles(const float* xt, int64_t M, const float* w, int64_t K, int64_t first,
               int64_t count, int64_t next_count, const Epilogue& e) {
  const bool narrow = count == kNarrowGroup && M <= kNarrowRows;
  const int64_t max_rows = narrow ? kNarrowRows : kMaxPass;
  const int64_t n_passes = (M + max_rows - 1) / max_rows;
  const PassFn* passes = narrow       ? kNarrowPasses.data()
                         : count == 1 ? kSinglePasses[n_passes > 1].data()
                                      : kGroupPasses[n_passes > 1].data();
  const float* tiles = w + first * K * kTile;
  const float* next = tiles + count * K * kTile;
  const int64_t next_lines = n_passes > 1 ? next_count * K : 0;
  const int64_t lines_per_pass = (next_lines + n_passes - 1) / n_passes;
  const int64_t every = lines_per_pass ? std::max<int64_t>(1, K / lines_per_pass) : K + 1;
  for (int64_t p = 0, m0 = 0; p < n_passes; ++p) {
    const int64_t rows = M / n_passes + (p < M % n_passes ? 1 : 0);
    const float* pf = next + std::min(p * lines_per_pass, next_lines) * kTile;
    const float* pf_end = next + std::min((p + 1) * lines_per_pass, next_lines) * kTile;
    passes[rows - 1](xt, M, m0, tiles, K, first * kTile, e, Lookahead{pf, pf_end, every});
    m0 += rows;
  }
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
  const int64_t group = group_tiles(M), groups = (tiles + group - 1) / group;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * group, count = std::min(group, tiles - first);
      const int64_t next_count = g + 1 < end ? std::min(group, tiles - first - count) : 0;
      run_tiles(xp, M, wp, K, first, count, next_count, e);
    }
  });
  return out;
}
