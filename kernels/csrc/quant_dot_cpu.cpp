// y = x @ W^T (+ bias) (+ residual) for the few rows of a decode step, from int8 or 4-bit
// weights, with x quantized to int8 per row in blocks of 32 (a scale each; 7-bit codes for
// int8 weights on the AVX2 build, see kSevenBit) on entry: the dot
// products run on bytes (pmaddubsw: 32 or 64 multiply-adds an instruction), as llama.cpp's
// Q4_1 x Q8_1 and Q8_0 x Q8_0 CPU paths do, instead of widening every weight to fp32
// (quant_gemm_cpu.cpp, which the fp32-activation setting keeps).
//
// Why: at 1-8 rows the fp32-activation kernel spends ~7 instructions on every 32 weights
// turning nibbles into floats; that, not the weight stream, bounds a decode step on AVX2.
// Here 64 weights of one output take 2-3 integer instructions per row.
//
// Packed layouts (kernels/quant.py, pack with activations="int8"); a chunk is 64 bytes:
// 16 outputs x 4 bytes, output j's bytes at 4j..4j+3 (one int32 lane each):
//   q4:   int8-typed [tiles, K / G, G * 8 + 64]: per group G / 8 chunks, chunk c holding
//         k = 8c + b in the low nibble of byte 4j + b and k = 8c + 4 + b in its high nibble,
//         then 16 fp16 scales and 16 fp16 minimums (w = q * scale + min, q in 0..15).
//   int8: uint8 [tiles, K * 16 + 64]: K / 4 chunks, byte 4j + b = q(j, 4c + b) + 128, then 16
//         fp32 scales (w = q * scale, q in -127..127).
//
// Sums are exact in integers within a block of 32 (q4: |sum| <= 8 * 2 * 15 * 127 < 2^15 in
// 16 bits; int8: pairs <= 2 * 127 * 127 < 2^15, then 32 bits); each block is then scaled in
// fp32. q4's minimum term multiplies the block's exact fp32 sum of x, not its codes.
//
// With AVX512-VNNI (the avx512vnni build: Zen 4/5, Ice Lake and later Xeons) one vpdpbusd
// does the multiply, the pairwise sum and the 32-bit accumulate of 4 bytes a lane: q4 takes
// 2 instructions per 8 weights a row where maddubs takes 4, and int8 multiplies its stored
// unsigned bytes (q + 128) directly, 1 instruction where the sign trick takes 4, then takes
// 128 x the block's code sum off once per block. The sums are the same integers either way.
#include "quant_tiles.h"

#include <ATen/Parallel.h>

#include <cstring>

namespace {

using quant_tiles::f16_to_ps;
using quant_tiles::kRegs;
using quant_tiles::kTile;
using quant_tiles::store_tile;

constexpr int64_t kBlock = 32;  // activations per int8 scale
constexpr int64_t kChunk = 64;  // bytes of 16 outputs x 4
constexpr int kChunkRegs = kRegs;  // integer registers per chunk: 1 (AVX-512) or 2 (AVX2)
constexpr int64_t kRegBytes = kChunk / kChunkRegs;
// Tiles per pass: one, on both builds. AVX-512's 32 registers hold two tiles' sums, and a
// pass over two reuses each activation broadcast twice (faster with the weights in cache), but
// each thread then interleaves two weight streams, and a decode step reads its weights from
// memory: there two tiles a pass were slower at every batch measured (Zen 4, 2 threads,
// SmolLM2 decode steps, AVX-512 build, two -> one: b=1 q4 8.7 -> 5.0 ms; b=8 q4 18.5 -> 12.2,
// int8 21.6 -> 14.9; b=32 q4 56 -> 52, int8 63 -> 51).
constexpr int64_t kNT = 1;
// Rows per pass: 4 on both builds. On AVX2 a pass of 4 keeps its 8 integer sums, the 4
// unpacked weight registers and 2 broadcasts in 15 of the 16 ymm registers; only the fp32
// accumulators (touched once per block of 32) spill. Against 2 rows a pass, the unpacking is
// done half as often: 8 rows of SmolLM2 decode on a 2-vCPU Xeon, AVX2 build, a step's matmuls
// 9.17 -> 8.14 ms (q4) and 9.51 -> 9.16 ms (int8); decode tokens/s at b=8 464 -> 490 (q4),
// 391 -> 434 (int8).
#if defined(__AVX512VNNI__)
// 8 rows a pass with VNNI: no magnitude or sign registers to keep, so 8 rows' sums fit, and
// each 64 weight bytes are unpacked once for 8 rows. SmolLM2's 30 layers' matmuls on Zen 5
// (2 threads, best of 15 interleaved), 4 -> 8 rows: b=8 q4 4.00 -> 3.65 ms, int8 4.23 -> 3.74;
// b=16 within 5%; b=32 q4 10.2 -> 10.0, int8 10.3 -> 11.1.
constexpr int64_t kMaxPass = 8;
constexpr bool kVnni = true;
static_assert(kChunkRegs == 1, "VNNI passes index their sums by tile");
inline __m512i dot4(__m512i acc, __m512i u8, __m512i s8) { return _mm512_dpbusd_epi32(acc, u8, s8); }
#else
constexpr int64_t kMaxPass = 4;
constexpr bool kVnni = false;
#endif
constexpr int64_t kPrefetchBytes = 1024;
// The AVX2 build multiplies int8 weights by 7-bit activation codes (|code| <= 63): then
// maddubs takes the stored bytes q + 128 (0..255) as they are, since a pair of products,
// 2 x 255 x 63 < 2^15, cannot saturate, and 128 x the block's code sum comes off once per
// block, as with VNNI. With 8-bit codes it needs the sign trick (abs of the weights, their
// sign onto x) on every row: 10.5 instructions per 64 weights a row where this takes 7.5.
// SmolLM2's 30 layers' matmuls at 8 rows, Zen 4, 2 threads, AVX2 build, in cache
// 8.0 -> 6.6 ms, from memory 8.9 -> 7.8; decode tokens/s at b=8 545-555 -> 584-630. The cost
// is the activations' precision: decode-step perplexity of int8 weights 16.45 -> 16.53
// (fp32 weights 16.30). AVX-512 keeps 8 bits: VNNI needs no trick, and the plain build's
// masked sign is one instruction a row.
#if defined(__AVX512F__)
constexpr bool kSevenBit = false;
#else
constexpr bool kSevenBit = true;
#endif

#if defined(__AVX512F__)
using ivec = __m512i;
using sign_t = __mmask64;  // where a weight byte is negative
inline ivec load_i(const void* p) { return _mm512_loadu_si512(p); }
inline ivec set1_i8(char v) { return _mm512_set1_epi8(v); }
inline ivec set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
inline ivec zero_i() { return _mm512_setzero_si512(); }
inline ivec and_i(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec xor_i(ivec a, ivec b) { return _mm512_xor_si512(a, b); }
inline ivec srli16(ivec a, int n) { return _mm512_srli_epi16(a, n); }
inline ivec maddubs(ivec u8, ivec s8) { return _mm512_maddubs_epi16(u8, s8); }
inline ivec add16(ivec a, ivec b) { return _mm512_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec sub32(ivec a, ivec b) { return _mm512_sub_epi32(a, b); }
inline ivec pairs_to_i32(ivec a) { return _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
inline ivec abs8(ivec a) { return _mm512_abs_epi8(a); }
inline sign_t sign_of(ivec w) { return _mm512_movepi8_mask(w); }
inline ivec apply_sign(ivec x, sign_t neg) { return _mm512_mask_sub_epi8(x, neg, zero_i(), x); }
inline simd::vec to_ps(ivec a) { return _mm512_cvtepi32_ps(a); }
#else
using ivec = __m256i;
inline ivec load_i(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline ivec set1_i8(char v) { return _mm256_set1_epi8(v); }
inline ivec set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
inline ivec zero_i() { return _mm256_setzero_si256(); }
inline ivec and_i(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec srli16(ivec a, int n) { return _mm256_srli_epi16(a, n); }
inline ivec maddubs(ivec u8, ivec s8) { return _mm256_maddubs_epi16(u8, s8); }
inline ivec add16(ivec a, ivec b) { return _mm256_add_epi16(a, b); }
inline ivec add32(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec sub32(ivec a, ivec b) { return _mm256_sub_epi32(a, b); }
inline ivec pairs_to_i32(ivec a) { return _mm256_madd_epi16(a, _mm256_set1_epi16(1)); }
inline simd::vec to_ps(ivec a) { return _mm256_cvtepi32_ps(a); }
#endif

// Four consecutive int8 activations as one int32, in every lane.
inline ivec broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return set1_i32(v);
}

// x [M, K] as int8 codes with, per row and block of 32, a scale, the block's fp32 sum and
// the sum of its codes.
struct Int8Rows {
  at::Tensor codes, scales, sums, code_sums;  // [M, K] int8, [M, K / 32] fp32 x2, int32
  const int8_t* q;
  const float *scale, *sum;
  const int32_t* code_sum;
  int64_t K, blocks;
};

// One block of 32 activations: codes round(x * levels / max|x|) (levels 127, or 63 where
// kSevenBit), its scale and its sum.
inline void quantize_block(const float* x, int8_t* q, float* scale, float* sum, int32_t* code_sum,
                           float levels) {
  constexpr int V = kBlock / simd::kWidth;
  simd::vec v[V], amax = simd::zero(), total = simd::zero();
  for (int i = 0; i < V; ++i) {
    v[i] = simd::load(x + i * simd::kWidth);
    amax = simd::max(amax, simd::max(v[i], simd::sub(simd::zero(), v[i])));
    total = simd::add(total, v[i]);
  }
  const float top = simd::reduce_max(amax);
  *scale = top / levels;
  *sum = simd::reduce_add(total);
  const simd::vec inv = simd::set1(top > 0.f ? levels / top : 0.f);
  alignas(64) int32_t codes[kBlock];
  for (int i = 0; i < V; ++i) {
    const simd::vec r = simd::mul(v[i], inv);
#if defined(__AVX512F__)
    _mm512_store_si512(codes + i * simd::kWidth, _mm512_cvtps_epi32(r));
#else
    _mm256_store_si256((__m256i*)(codes + i * simd::kWidth), _mm256_cvtps_epi32(r));
#endif
  }
  int32_t total_codes = 0;
  for (int i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(codes[i]);  // |code| <= 127
    total_codes += codes[i];
  }
  *code_sum = total_codes;
}

Int8Rows quantize_rows(const at::Tensor& x, float levels) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  Int8Rows r{at::empty({M, K}, x.options().dtype(at::kChar)),
             at::empty({M, blocks}, x.options()), at::empty({M, blocks}, x.options()),
             at::empty({M, blocks}, x.options().dtype(at::kInt))};
  const float* xp = x.data_ptr<float>();
  int8_t* q = r.codes.data_ptr<int8_t>();
  float *scale = r.scales.data_ptr<float>(), *sum = r.sums.data_ptr<float>();
  int32_t* code_sum = r.code_sums.data_ptr<int32_t>();
  at::parallel_for(0, M * blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      quantize_block(xp + b * kBlock, q + b * kBlock, scale + b, sum + b, code_sum + b, levels);
  });
  r.q = q, r.scale = scale, r.sum = sum, r.code_sum = code_sum, r.K = K, r.blocks = blocks;
  return r;
}

struct Packed {
  const uint8_t* data;
  int64_t tile_bytes, group;  // group: q4 only
};

// Rows [m0, m0 + MR) against NT q4 tiles from tile t0.
template <int NT, int MR>
void q4_pass(const Int8Rows& x, int64_t m0, const Packed& w, int64_t t0, const Epilogue& e) {
  constexpr int R = NT * kChunkRegs;
  simd::vec acc[MR][R];
  for (auto& row : acc)
    for (auto& a : row) a = simd::zero();
  const int64_t G = w.group, group_bytes = G * 8 + 64;
  const uint8_t* tile0 = w.data + t0 * w.tile_bytes;
  const ivec low4 = set1_i8(0x0F);
  for (int64_t k0 = 0; k0 < x.K; k0 += kBlock) {
    const int64_t g = k0 / G, in_group = k0 % G;
    ivec sums[MR][R];
    for (auto& row : sums)
      for (auto& s : row) s = zero_i();
    for (int64_t c = 0; c < kBlock / 8; ++c) {
      ivec lo[R], hi[R];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile0 + t * w.tile_bytes + g * group_bytes + (in_group / 8 + c) * kChunk;
        for (int r = 0; r < kChunkRegs; ++r) {
          const ivec v = load_i(p + r * kRegBytes);
          lo[t * kChunkRegs + r] = and_i(v, low4);
          hi[t * kChunkRegs + r] = and_i(srli16(v, 4), low4);
        }
        simd::prefetch(p + kPrefetchBytes);
      }
      for (int m = 0; m < MR; ++m) {
        const int8_t* xq = x.q + (m0 + m) * x.K + k0 + c * 8;
        const ivec xl = broadcast4(xq), xh = broadcast4(xq + 4);
#if defined(__AVX512VNNI__)
        for (int j = 0; j < R; ++j) sums[m][j] = dot4(dot4(sums[m][j], lo[j], xl), hi[j], xh);
#else
        for (int j = 0; j < R; ++j)
          sums[m][j] = add16(sums[m][j], add16(maddubs(lo[j], xl), maddubs(hi[j], xh)));
#endif
      }
    }
    const int64_t blk = k0 / kBlock;
    for (int t = 0; t < NT; ++t) {
      const uint16_t* sm = (const uint16_t*)(tile0 + t * w.tile_bytes + g * group_bytes + G * 8);
      for (int r = 0; r < kChunkRegs; ++r) {
        const simd::vec scale = f16_to_ps(sm + r * simd::kWidth);
        const simd::vec mins = f16_to_ps(sm + kTile + r * simd::kWidth);
        const int j = t * kChunkRegs + r;
        for (int m = 0; m < MR; ++m) {
          const int64_t at = (m0 + m) * x.blocks + blk;
          const simd::vec with_min = simd::fmadd(mins, simd::set1(x.sum[at]), acc[m][j]);
          const simd::vec s = simd::mul(scale, simd::set1(x.scale[at]));
          const ivec block_sum = kVnni ? sums[m][j] : pairs_to_i32(sums[m][j]);  // 32 bits
          acc[m][j] = simd::fmadd(to_ps(block_sum), s, with_min);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MR; ++m) store_tile(acc[m] + t * kRegs, m0 + m, (t0 + t) * kTile, e);
}

// Rows [m0, m0 + MR) against NT int8 tiles from tile t0.
template <int NT, int MR>
void int8_pass(const Int8Rows& x, int64_t m0, const Packed& w, int64_t t0, const Epilogue& e) {
  constexpr int R = NT * kChunkRegs;
  simd::vec acc[MR][R];
  for (auto& row : acc)
    for (auto& a : row) a = simd::zero();
  const uint8_t* tile0 = w.data + t0 * w.tile_bytes;
  for (int64_t k0 = 0; k0 < x.K; k0 += kBlock) {
    ivec sums[MR][R];
    for (auto& row : sums)
      for (auto& s : row) s = zero_i();
    for (int64_t c = 0; c < kBlock / 4; ++c) {
#if defined(__AVX512VNNI__)
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile0 + t * w.tile_bytes + (k0 / 4 + c) * kChunk;
        const ivec stored = load_i(p);  // q + 128: the unsigned operand as it is
        simd::prefetch(p + kPrefetchBytes);
        for (int m = 0; m < MR; ++m)
          sums[m][t] = dot4(sums[m][t], stored, broadcast4(x.q + (m0 + m) * x.K + k0 + c * 4));
      }
#elif defined(__AVX512F__)  // no VNNI: the sign trick (|w| unsigned, w's sign onto x)
      ivec magnitude[R];
      sign_t sign[R];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile0 + t * w.tile_bytes + (k0 / 4 + c) * kChunk;
        const ivec q = xor_i(load_i(p), set1_i8(static_cast<char>(0x80)));  // the signed codes
        magnitude[t] = abs8(q);
        sign[t] = sign_of(q);
        simd::prefetch(p + kPrefetchBytes);
      }
      for (int m = 0; m < MR; ++m) {
        const ivec xv = broadcast4(x.q + (m0 + m) * x.K + k0 + c * 4);
        for (int j = 0; j < R; ++j)
          sums[m][j] = add32(sums[m][j], pairs_to_i32(maddubs(magnitude[j], apply_sign(xv, sign[j]))));
      }
#else  // AVX2, kSevenBit: the stored bytes are maddubs' unsigned operand as they are
      ivec stored[R];
      for (int t = 0; t < NT; ++t) {
        const uint8_t* p = tile0 + t * w.tile_bytes + (k0 / 4 + c) * kChunk;
        for (int r = 0; r < kChunkRegs; ++r) stored[t * kChunkRegs + r] = load_i(p + r * kRegBytes);
        simd::prefetch(p + kPrefetchBytes);
      }
      for (int m = 0; m < MR; ++m) {
        const ivec xv = broadcast4(x.q + (m0 + m) * x.K + k0 + c * 4);
        for (int j = 0; j < R; ++j) sums[m][j] = add32(sums[m][j], pairs_to_i32(maddubs(stored[j], xv)));
      }
#endif
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * x.blocks + k0 / kBlock;
      const simd::vec sx = simd::set1(x.scale[at]);
      if constexpr (kVnni || kSevenBit) {  // the sums are of (q + 128) * x
        const ivec offset = set1_i32(128 * x.code_sum[at]);
        for (int j = 0; j < R; ++j) sums[m][j] = sub32(sums[m][j], offset);
      }
      for (int j = 0; j < R; ++j) acc[m][j] = simd::fmadd(to_ps(sums[m][j]), sx, acc[m][j]);
    }
  }
  for (int t = 0; t < NT; ++t) {  // per-channel scales: once, after the sum
    const float* scale = (const float*)(tile0 + t * w.tile_bytes + x.K * kTile);
    for (int r = 0; r < kRegs; ++r) {
      const simd::vec s = simd::load(scale + r * simd::kWidth);
      for (int m = 0; m < MR; ++m) acc[m][t * kRegs + r] = simd::mul(acc[m][t * kRegs + r], s);
    }
    for (int m = 0; m < MR; ++m) store_tile(acc[m] + t * kRegs, m0 + m, (t0 + t) * kTile, e);
  }
}

using PassFn = void (*)(const Int8Rows&, int64_t, const Packed&, int64_t, const Epilogue&);

template <bool Q4, int NT, int... MR>
constexpr std::array<PassFn, sizeof...(MR)> make_passes(std::integer_sequence<int, MR...>) {
  if constexpr (Q4)
    return {q4_pass<NT, MR + 1>...};
  else
    return {int8_pass<NT, MR + 1>...};
}

template <bool Q4>
void run_all(const Int8Rows& x, int64_t M, const Packed& w, int64_t tiles, const Epilogue& e) {
  static const auto passes = make_passes<Q4, kNT>(std::make_integer_sequence<int, kMaxPass>{});
  quant_tiles::for_each_pass(tiles, kNT, M, kMaxPass, [&](int64_t t0, int64_t, int64_t m0,
                                                           int64_t rows) {
    passes[rows - 1](x, m0, w, t0, e);
  });
}

}  // namespace

int64_t int8_activation_levels(bool q4_weights) { return kSevenBit && !q4_weights ? 63 : 127; }

bool is_int8_activation_packing(const at::Tensor& packed) {
  return (packed.scalar_type() == at::kChar && packed.dim() == 3) ||
         (packed.scalar_type() == at::kByte && packed.dim() == 2);
}

at::Tensor quant_dot_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n_out,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be 2-d fp32");
  TORCH_CHECK(packed.is_contiguous() && !packed.is_cuda(), "packed weight: contiguous, CPU");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0);
  TORCH_CHECK(K % kBlock == 0, "int8 activations need K % 32 == 0, not ", K);
  TORCH_CHECK(tiles * kTile >= n_out && tiles * kTile < n_out + kTile,
              "packed weight does not match n_out");
  const bool q4 = packed.scalar_type() == at::kChar;
  Packed w{(const uint8_t*)packed.data_ptr(), 0, 0};
  if (q4) {
    TORCH_CHECK(packed.size(2) > 64 && (packed.size(2) - 64) % 8 == 0, "q4 packing: G * 8 + 64");
    w.group = (packed.size(2) - 64) / 8;
    TORCH_CHECK(w.group % kBlock == 0 && packed.size(1) * w.group == K, "q4 groups do not match K");
    w.tile_bytes = packed.size(1) * packed.size(2);
  } else {
    TORCH_CHECK(packed.size(1) == K * kTile + 64, "int8 packing must be [tiles, K * 16 + 64]");
    w.tile_bytes = K * kTile + 64;
  }
  auto out = at::empty({M, n_out}, x.options());
  if (M == 0) return out;
  std::array<at::Tensor, 2> keep;
  const Epilogue e = make_epilogue(bias, residual, out, keep);
  const Int8Rows rows = quantize_rows(x, static_cast<float>(int8_activation_levels(q4)));
  if (q4)
    run_all<true>(rows, M, w, tiles, e);
  else
    run_all<false>(rows, M, w, tiles, e);
  return out;
}
