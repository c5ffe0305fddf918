// Decode attention over a paged KV cache on CPU: one query token per sequence, read straight
// from the cache blocks (no gather copy).
//
// A decode step streams every weight between two layers' attention, so the K/V it reads come
// from memory, not cache: a task reads whole cache rows (all its KV heads of a slot, contiguous)
// block after block, and every query head of a GQA group shares each K/V read. The head's key
// row stays in registers across the group (AVX-512 or AVX2, one build each: simd.h) and the
// exponentials are vectorised; the arithmetic is cheap enough that the kernel runs near memory
// speed.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int kLanes = 16;  // independent accumulators: lets the compiler vectorise the dot

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct Decode {
  const float *q, *kc, *vc;
  const int32_t *tables, *lens;
  float* o;
  int64_t H, D, BS, KVH, G, MAXB;
  float scale;
  int64_t slot_stride() const { return KVH * D; }
  int64_t block_stride() const { return BS * KVH * D; }
};

// Softmax of each of `rows` score rows of length L, in place.
void softmax_rows(float* scores, int64_t rows, int64_t L) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * L;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
    const float inv = 1.f / exp_shifted_sum(s, L, m);
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
}

// Where a row lies in the cache: block j of the table, slot t of the block, KV head h.
inline const float* cache_row(const Decode& a, const float* cache, const int32_t* table,
                              int64_t pos, int64_t h) {
  return cache + table[pos / a.BS] * a.block_stride() + (pos % a.BS) * a.slot_stride() + h * a.D;
}

// Blocks of one sequence lie anywhere in the cache, so at each block boundary the hardware
// prefetcher loses the stream: touching the first lines of the next block restarts it early
// (measured: ~10% faster from memory; prefetching whole blocks was slower).
inline void kick_next_block(const Decode& a, const float* cache, const int32_t* table,
                            int64_t pos, int64_t L, int64_t h) {
  if (pos % a.BS != 0 || pos + a.BS >= L) return;
  const float* next = cache_row(a, cache, table, pos + a.BS, h);
  for (int f = 0; f < 64; f += 16) __builtin_prefetch(next + f, 0, 3);
}

// The register-blocked path prefetches further ahead: keys a whole row (all KV heads of the task) 16
// positions on, values the whole next block when a block starts. At this kernel's arithmetic
// per byte the hardware prefetcher alone falls behind (measured, batch 16 x 512 positions,
// 30 layers: 5-8% faster than kick_next_block alone).
constexpr int64_t kKeyPrefetchRows = 16;

inline void prefetch_bytes(const float* p, int64_t nbytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// Generic path (any head size): scores of `rows` query heads over the context, then the
// softmax-weighted values.
void attend_generic(const Decode& a, const int32_t* table, const float* qb, float* ob,
                    int64_t h0, int64_t nh, int64_t L, float* scores) {
  const int64_t rows = nh * a.G, D = a.D;
  for (int64_t pos = 0; pos < L; ++pos) {
    kick_next_block(a, a.kc, table, pos, L, h0);
    const float* row = cache_row(a, a.kc, table, pos, h0);
    for (int64_t r = 0; r < rows; ++r)
      scores[r * L + pos] = dot(qb + r * D, row + (r / a.G) * D, D) * a.scale;
  }
  softmax_rows(scores, rows, L);
  std::fill(ob, ob + rows * D, 0.f);
  for (int64_t pos = 0; pos < L; ++pos) {
    kick_next_block(a, a.vc, table, pos, L, h0);
    const float* row = cache_row(a, a.vc, table, pos, h0);
    for (int64_t r = 0; r < rows; ++r) axpy(scores[r * L + pos], row + (r / a.G) * D, ob + r * D, D);
  }
}

// out[g] += sum over the block's n positions of p[g][t] * V[start + t] of KV head h, for the
// gc (<= GC) query rows of one group; p rows are L apart, out rows D = W * DV apart.
template <int DV, int64_t GC>
void values_of_block(const Decode& a, const int32_t* table, const float* p, int64_t L, float* out,
                     int64_t gc, int64_t start, int64_t n, int64_t h) {
  constexpr int64_t W = simd::kWidth, D = W * DV;
  simd::vec acc[GC][DV];
  for (int64_t g = 0; g < GC; ++g)
    if (g < gc)
      for (int v = 0; v < DV; ++v) acc[g][v] = simd::load(out + g * D + W * v);
  for (int64_t t = 0; t < n; ++t) {
    const float* row = cache_row(a, a.vc, table, start + t, h);
    simd::vec vr[DV];
    for (int v = 0; v < DV; ++v) vr[v] = simd::load(row + W * v);
    for (int64_t g = 0; g < GC; ++g) {
      if (g >= gc) break;
      const simd::vec pg = simd::set1(p[g * L + t]);
      for (int v = 0; v < DV; ++v) acc[g][v] = simd::fmadd(pg, vr[v], acc[g][v]);
    }
  }
  for (int64_t g = 0; g < GC; ++g)
    if (g < gc)
      for (int v = 0; v < DV; ++v) simd::store(out + g * D + W * v, acc[g][v]);
}

// Head size D = W * DV (W floats a register): one key row of a KV head sits in DV registers
// while every query head of its group takes its dot product; then the values, block by block
// (values_of_block).
template <int D>
void attend_simd(const Decode& a, const int32_t* table, const float* qb, float* ob,
                 int64_t h0, int64_t nh, int64_t L, float* scores) {
  constexpr int W = simd::kWidth, DV = D / W;
  static_assert(D % W == 0, "head size a multiple of the register width");
  const int64_t G = a.G, rows = nh * G;
  for (int64_t pos = 0; pos < L; ++pos) {
    if (pos + kKeyPrefetchRows < L)
      prefetch_bytes(cache_row(a, a.kc, table, pos + kKeyPrefetchRows, h0), nh * D * 4);
    const float* row = cache_row(a, a.kc, table, pos, h0);
    for (int64_t hh = 0; hh < nh; ++hh) {
      simd::vec k[DV];
      for (int v = 0; v < DV; ++v) k[v] = simd::load(row + hh * D + W * v);
      for (int64_t g = 0; g < G; ++g) {
        const float* qr = qb + (hh * G + g) * D;
        simd::vec acc = simd::mul(simd::load(qr), k[0]);
        for (int v = 1; v < DV; ++v) acc = simd::fmadd(simd::load(qr + W * v), k[v], acc);
        scores[(hh * G + g) * L + pos] = simd::reduce_add(acc) * a.scale;
      }
    }
  }
  softmax_rows(scores, rows, L);
  // Values block by block and KV head by KV head: a value row is loaded once per position and
  // feeds every query head of its group, whose output rows stay in registers across the block
  // (groups in chunks of GC, sized to the register file: 24 / DV with AVX-512's 32 registers,
  // 8 / DV with AVX2's 16); each output row still sums its positions in order. The block's
  // rows (contiguous, 12 KiB for SmolLM2) come from memory once. Measured against one output
  // row at a time: ~8% faster at batch 16 x 512 positions (AVX-512), identical results.
  constexpr int64_t GC = (simd::kRegisters - 8) / DV > 0 ? (simd::kRegisters - 8) / DV : 1;
  std::fill(ob, ob + rows * D, 0.f);
  for (int64_t start = 0; start < L; start += a.BS) {
    const int64_t n = std::min(a.BS, L - start);
    if (start + a.BS < L)  // the next block's rows of these heads (whole rows: contiguous)
      prefetch_bytes(cache_row(a, a.vc, table, start + a.BS, h0),
                     std::min(a.BS, L - start - a.BS) * a.slot_stride() * 4);
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t g0 = 0; g0 < G; g0 += GC)
        values_of_block<DV, GC>(a, table, scores + (hh * G + g0) * L + start, L,
                                ob + (hh * G + g0) * D, std::min(GC, G - g0), start, n, h0 + hh);
  }
}

using AttendFn = void (*)(const Decode&, const int32_t*, const float*, float*, int64_t, int64_t,
                          int64_t, float*);

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

// KV heads [h0, h0 + nh) of sequence b: the query heads of those groups, over the whole context.
void attend(const Decode& a, AttendFn fn, int64_t b, int64_t h0, int64_t nh,
            std::vector<float>& scores) {
  const int64_t L = a.lens[b];
  scores.resize(nh * a.G * L);
  const int64_t first_row = (b * a.H + h0 * a.G) * a.D;
  fn(a, a.tables + b * a.MAXB, a.q + first_row, a.o + first_row, h0, nh, L, scores.data());
}

}  // namespace

// query [B, H, D], caches [N, BS, KVH, D] (fp32, contiguous), block_tables [B, MAXB] int32,
// seq_lens [B] int32 -> out [B, H, D]
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "fp32 only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches only");
  query = query.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t MAXB = block_tables.size(1);
  check_block_tables(block_tables, seq_lens, k_cache.size(0), BS);
  auto out = torch::empty_like(query);
  const Decode a{query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                 out.data_ptr<float>(), H, D, BS, KVH, H / KVH, MAXB,
                 static_cast<float>(scale)};
  // Whole sequences per task (contiguous rows of every KV head) when there are enough of them
  // to keep every thread busy; otherwise one task per (sequence, KV head).
  const bool per_sequence = B >= at::get_num_threads();
  const int64_t tasks = per_sequence ? B : B * KVH;
  const AttendFn fn = pick_attend(D);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      if (per_sequence)
        attend(a, fn, i, 0, KVH, scores);
      else
        attend(a, fn, i / KVH, i % KVH, 1, scores);
    }
  });
  return out;
}
