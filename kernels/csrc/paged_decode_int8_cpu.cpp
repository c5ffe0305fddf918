// Decode attention over an int8 paged KV cache on CPU (kernels/kv_int8.py's layout): each
// cache row of a KV head is head_dim int8 codes followed by that row's fp32 scale, so a row is
// dequantized in registers as it is read (codes widened to fp32, the scale folded into the
// score or the value weight) and no fp32 copy of the cache is ever made. A quarter of the fp32
// kernel's KV bytes (plus 4 per row). AVX-512 or AVX2, one build each (simd.h).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

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
  const int8_t* row(const int8_t* cache, const int32_t* table, int64_t pos, int64_t h) const {
    return cache + ((table[pos / BS] * BS + pos % BS) * KVH + h) * row_bytes();
  }
};

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);  // the scale follows the codes, unaligned
  return s;
}

// sum_d q[d] * codes[d]; D a multiple of the register width, or a scalar tail.
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

// The G query heads of KV head h of sequence b over its whole context.
void attend_head(const Int8Decode& a, int64_t b, int64_t h, std::vector<float>& scores) {
  const int64_t L = a.lens[b], G = a.G, D = a.D;
  const int32_t* table = a.tables + b * a.MAXB;
  const float* q = a.q + (b * a.H + h * G) * D;
  float* o = a.o + (b * a.H + h * G) * D;
  scores.resize(G * L);
  for (int64_t pos = 0; pos < L; ++pos) {
    const int8_t* k = a.row(a.kc, table, pos, h);
    const float ks = row_scale(k, D) * a.scale;
    for (int64_t g = 0; g < G; ++g) scores[g * L + pos] = dot_codes(q + g * D, k, D) * ks;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * L;
    const float m = *std::max_element(s, s + L);
    const float inv = 1.f / exp_shifted_sum(s, L, m);
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  std::fill(o, o + G * D, 0.f);
  for (int64_t pos = 0; pos < L; ++pos) {
    const int8_t* v = a.row(a.vc, table, pos, h);
    const float vs = row_scale(v, D);
    for (int64_t g = 0; g < G; ++g) axpy_codes(scores[g * L + pos] * vs, v, o + g * D, D);
  }
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
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) attend_head(a, i / KVH, i % KVH, scores);
  });
  return out;
}
