// The int8 KV cache on CPU (kernels/kv_int8.py's layout): each cache row of a KV head is head_dim
// int8 codes followed by that row's fp32 scale. Here: the row writer the fused decoder stack
// stores keys and values with (bit for bit kernels/kv_int8.py's quantize, so a KV transfer
// frame or the Python path reads the same bytes), and decode attention that dequantizes rows in
// registers as it reads them (codes widened to fp32, the scale folded into the score or the
// value weight): no fp32 copy of the cache is ever made, and a step reads a quarter of the fp32
// kernel's KV bytes (plus 4 per row). AVX-512 or AVX2, one build each (simd.h).
//
// The attention has paged_decode_cpu.cpp's shape: a key row is widened once into registers and
// feeds every query head of its GQA group; values go block by block with the group's output
// rows held in registers; the next rows are prefetched (blocks lie anywhere in the cache, so
// the hardware prefetcher loses the stream at each block boundary).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

void quantize_kv_row(const float* x, int8_t* row, int64_t D) {
  // kv_int8.quantize: scale = max(max |x|, 1e-30) / 127; q = round-half-even(x / scale),
  // clamped to +-127. A true division (not a reciprocal multiply), as torch divides.
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = std::max(amax, 1e-30f) / 127.f;
  for (int64_t d = 0; d < D; ++d) {
    const float q = std::nearbyint(x[d] / scale);  // the default rounding: half to even
    row[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(row + D, &scale, sizeof scale);  // the scale follows the codes, unaligned
}

namespace {

#if defined(__AVX512F__)
inline simd::vec codes_to_ps(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#else
inline simd::vec codes_to_ps(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

struct Int8Decode {
  const float* q;
  const int8_t *kc, *vc;
  const int32_t *tables, *lens;
  float* o;
  int64_t H, D, BS, KVH, G, MAXB;
  float scale;
  int64_t row_bytes() const { return D + 4; }
  int64_t slot_bytes() const { return KVH * row_bytes(); }
  const int8_t* row(const int8_t* cache, const int32_t* table, int64_t pos, int64_t h) const {
    return cache + (table[pos / BS] * BS + pos % BS) * slot_bytes() + h * row_bytes();
  }
};

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

inline void prefetch_bytes(const int8_t* p, int64_t nbytes) {
  for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Keys this many positions ahead are prefetched (as paged_decode_cpu.cpp's kKeyPrefetchRows).
constexpr int64_t kKeyPrefetchRows = 16;

// Softmax of each of `rows` score rows of length L, in place.
void softmax_rows(float* scores, int64_t rows, int64_t L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * L;
    const float m = *std::max_element(s, s + L);
    const float inv = 1.f / exp_shifted_sum(s, L, m);
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
}

// sum_d q[d] * codes[d]; D any size (a scalar tail).
inline float dot_codes(const float* q, const int8_t* codes, int64_t D) {
  simd::vec acc = simd::zero();
  int64_t d = 0;
  for (; d + simd::kWidth <= D; d += simd::kWidth)
    acc = simd::fmadd(simd::load(q + d), codes_to_ps(codes + d), acc);
  float s = simd::reduce_add(acc);
  for (; d < D; ++d) s += q[d] * static_cast<float>(codes[d]);
  return s;
}

// out[d] += w * codes[d]
inline void axpy_codes(float w, const int8_t* codes, float* out, int64_t D) {
  const simd::vec vw = simd::set1(w);
  int64_t d = 0;
  for (; d + simd::kWidth <= D; d += simd::kWidth)
    simd::store(out + d, simd::fmadd(vw, codes_to_ps(codes + d), simd::load(out + d)));
  for (; d < D; ++d) out[d] += w * static_cast<float>(codes[d]);
}

// Generic path (any head size): the query heads of KV heads [h0, h0 + nh) over the context.
void attend_generic(const Int8Decode& a, const int32_t* table, const float* qb, float* ob,
                    int64_t h0, int64_t nh, int64_t L, float* scores) {
  const int64_t G = a.G, D = a.D, rows = nh * G;
  for (int64_t pos = 0; pos < L; ++pos)
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* k = a.row(a.kc, table, pos, h0 + r / G);
      scores[r * L + pos] = dot_codes(qb + r * D, k, D) * (row_scale(k, D) * a.scale);
    }
  softmax_rows(scores, rows, L);
  std::fill(ob, ob + rows * D, 0.f);
  for (int64_t pos = 0; pos < L; ++pos)
    for (int64_t r = 0; r < rows; ++r) {
      const int8_t* v = a.row(a.vc, table, pos, h0 + r / G);
      axpy_codes(scores[r * L + pos] * row_scale(v, D), v, ob + r * D, D);
    }
}

// Output rows of a group held in registers across a block of values, and columns of them taken
// at a time: acc[GC][DC] + DC widened value registers + the weight fit the register file, so a
// value row is widened once per column chunk for every query head of the group (AVX-512: 4
// rows x 64 columns; AVX2: 4 rows x 16 columns).
constexpr int64_t kGroupChunk = 4;
constexpr int value_columns(int DV) {
  int dc = 1;
  while (dc * 2 <= DV && (kGroupChunk + 1) * dc * 2 + 2 <= simd::kRegisters) dc *= 2;
  return dc;
}

// out[g][c0, c0 + DC * W) += sum over the block's n positions of p[g][t] * V[start + t] of KV
// head h, for the gc (<= kGroupChunk) query rows of one group; p rows are L apart, out rows D.
template <int DC>
void values_of_block(const Int8Decode& a, const int32_t* table, const float* p, int64_t L,
                     float* out, int64_t gc, int64_t start, int64_t n, int64_t h, int64_t c0) {
  constexpr int64_t W = simd::kWidth, GC = kGroupChunk;
  const int64_t D = a.D;
  simd::vec acc[GC][DC];
  for (int64_t g = 0; g < GC; ++g)
    if (g < gc)
      for (int v = 0; v < DC; ++v) acc[g][v] = simd::load(out + g * D + c0 + W * v);
  for (int64_t t = 0; t < n; ++t) {
    const int8_t* row = a.row(a.vc, table, start + t, h);
    const float vs = row_scale(row, D);
    simd::vec vr[DC];
    for (int v = 0; v < DC; ++v) vr[v] = codes_to_ps(row + c0 + W * v);
    for (int64_t g = 0; g < GC; ++g) {
      if (g >= gc) break;
      const simd::vec pg = simd::set1(p[g * L + t] * vs);
      for (int v = 0; v < DC; ++v) acc[g][v] = simd::fmadd(pg, vr[v], acc[g][v]);
    }
  }
  for (int64_t g = 0; g < GC; ++g)
    if (g < gc)
      for (int v = 0; v < DC; ++v) simd::store(out + g * D + c0 + W * v, acc[g][v]);
}

// Head size D = W * DV: a key row's codes, widened once, sit in DV registers while every query
// head of its group takes its dot product; then the values, block by block.
template <int D>
void attend_simd(const Int8Decode& a, const int32_t* table, const float* qb, float* ob,
                 int64_t h0, int64_t nh, int64_t L, float* scores) {
  constexpr int W = simd::kWidth, DV = D / W;
  static_assert(D % W == 0, "head size a multiple of the register width");
  const int64_t G = a.G, rows = nh * G, span = nh * a.row_bytes();
  for (int64_t pos = 0; pos < L; ++pos) {
    if (pos + kKeyPrefetchRows < L)
      prefetch_bytes(a.row(a.kc, table, pos + kKeyPrefetchRows, h0), span);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int8_t* row = a.row(a.kc, table, pos, h0 + hh);
      const float ks = row_scale(row, D) * a.scale;
      simd::vec k[DV];
      for (int v = 0; v < DV; ++v) k[v] = codes_to_ps(row + W * v);
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = qb + (hh * G + g) * D;
        simd::vec acc = simd::mul(simd::load(qr), k[0]);
        for (int v = 1; v < DV; ++v) acc = simd::fmadd(simd::load(qr + W * v), k[v], acc);
        scores[(hh * G + g) * L + pos] = simd::reduce_add(acc) * ks;
      }
    }
  }
  softmax_rows(scores, rows, L);
  constexpr int DC = value_columns(DV);
  constexpr int64_t GC = kGroupChunk;
  std::fill(ob, ob + rows * D, 0.f);
  for (int64_t start = 0; start < L; start += a.BS) {
    const int64_t n = std::min(a.BS, L - start);
    if (start + a.BS < L)  // the next block's rows of these heads (contiguous per slot)
      for (int64_t t = 0; t < std::min(a.BS, L - start - a.BS); ++t)
        prefetch_bytes(a.row(a.vc, table, start + a.BS + t, h0), span);
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t g0 = 0; g0 < G; g0 += GC)
        for (int64_t c0 = 0; c0 < D; c0 += DC * W)
          values_of_block<DC>(a, table, scores + (hh * G + g0) * L + start, L,
                              ob + (hh * G + g0) * D, std::min(GC, G - g0), start, n, h0 + hh,
                              c0);
  }
}

using AttendFn = void (*)(const Int8Decode&, const int32_t*, const float*, float*, int64_t,
                          int64_t, int64_t, float*);

// Head sizes 16-128 (multiples of both register widths) take the register-blocked kernel.
AttendFn pick_attend(int64_t D) {
  switch (D) {
    case 16: return attend_simd<16>;
    case 32: return attend_simd<32>;
    case 64: return attend_simd<64>;
    case 128: return attend_simd<128>;
  }
  return attend_generic;
}

}  // namespace

// query [B, H, D] fp32, caches [N, BS, KVH, D + 4] int8 (codes, then the fp32 scale),
// block_tables [B, MAXB] int32, seq_lens [B] int32 -> out [B, H, D]
torch::Tensor paged_decode_attention_int8(torch::Tensor query, torch::Tensor k_cache,
                                          torch::Tensor v_cache, torch::Tensor block_tables,
                                          torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32, "fp32 query");
  TORCH_CHECK(k_cache.scalar_type() == torch::kInt8 && v_cache.scalar_type() == torch::kInt8,
              "int8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches differ in shape");
  query = query.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MAXB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D + 4, "cache rows must be head_dim codes + a 4-byte scale");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  check_block_tables(block_tables, seq_lens, k_cache.size(0), BS);
  auto out = torch::empty_like(query);
  const Int8Decode a{query.data_ptr<float>(), k_cache.data_ptr<int8_t>(),
                     v_cache.data_ptr<int8_t>(), block_tables.data_ptr<int32_t>(),
                     seq_lens.data_ptr<int32_t>(), out.data_ptr<float>(), H, D, BS, KVH,
                     H / KVH, MAXB, static_cast<float>(scale)};
  // Whole sequences per task (every KV head of a slot: contiguous rows) when there are enough
  // of them to keep every thread busy; otherwise one task per (sequence, KV head).
  const bool per_sequence = B >= at::get_num_threads();
  const int64_t tasks = per_sequence ? B : B * KVH, heads = per_sequence ? KVH : 1;
  const AttendFn fn = pick_attend(D);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = per_sequence ? i : i / KVH, h0 = per_sequence ? 0 : i % KVH;
      const int64_t L = a.lens[b], first_row = (b * H + h0 * a.G) * D;
      scores.resize(heads * a.G * L);
      fn(a, a.tables + b * MAXB, a.q + first_row, a.o + first_row, h0, heads, L, scores.data());
    }
  });
  return out;
}
