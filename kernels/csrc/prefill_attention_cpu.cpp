// Causal prefill attention of one sequence over a paged KV cache on CPU (fp32 queries; an fp32
// or int8 cache).
//
// torch's CPU flash attention runs each query head on its own and at head size 64 reaches
// about half of the machine's GEMM rate here (its inner products are short). This kernel
// works per KV head and query tile instead: the tile's rows of every query head in the GQA
// group are stacked into one matrix, so one GEMM against the head's whole visible key prefix
// makes the scores (the group shares each key read), one fused pass takes the causal softmax
// (masked tail, vectorised exp), and one GEMM against the values makes the output. A tile sees
// every key up to its last row, so there is no online rescaling; what the causal limit leaves
// over is half a tile per row.
//
// With `bf16`, both GEMMs take bf16 operands (the scaled queries, K, V, and the unnormalised
// probabilities) and write bf16, as a bf16 prefill's linears do: the softmax reads the bf16
// scores and writes the bf16 probabilities in one pass, in fp32 registers, with fp32 max and
// sum. On AVX-512 BF16 that is 3-4x the fp32 GEMM rate (issue 22: attention was 40% of a
// 1,200-token bf16 prefill).
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t kTileRows = 64;  // query tokens per tile (times the group's heads as rows)

// K or V of one sequence as [KVH, S, D], contiguous per head: the GEMMs read plain matrices.
// An int8 cache ([N, BS, KVH, D + 4]: codes, then the row's fp32 scale; kernels/kv_int8.py) is
// dequantized here, once per key, as kv_int8.dequantize does (code * scale in fp32).
at::Tensor gather_heads(const at::Tensor& cache, const int32_t* table, int64_t seq_len,
                        int64_t D, bool bf16) {
  const int64_t BS = cache.size(1), KVH = cache.size(2), W = cache.size(3);
  auto out = at::empty({KVH, seq_len, D}, cache.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  if (cache.scalar_type() == at::kChar) {
    const int8_t* src = cache.data_ptr<int8_t>();
    at::parallel_for(0, seq_len, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int8_t* row = src + (table[t / BS] * BS + t % BS) * KVH * W;
        for (int64_t h = 0; h < KVH; ++h) {
          const int8_t* codes = row + h * W;
          float scale;
          std::memcpy(&scale, codes + D, sizeof(float));
          float* o = dst + (h * seq_len + t) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = float(codes[d]) * scale;
        }
      }
    });
  } else {
    const float* src = cache.data_ptr<float>();
    at::parallel_for(0, seq_len, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* row = src + (table[t / BS] * BS + t % BS) * KVH * D;
        for (int64_t h = 0; h < KVH; ++h)
          std::copy(row + h * D, row + (h + 1) * D, dst + (h * seq_len + t) * D);
      }
    });
  }
  return bf16 ? out.to(at::kBFloat16) : out;
}

// A row's elements as fp32 registers and back: fp32 as they are, bf16 widened and rounded to
// nearest even (simd.h).
inline simd::vec load_row(const float* p) { return simd::load(p); }
inline simd::vec load_row(const at::BFloat16* p) {
  return simd::load_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline void store_row(float* p, simd::vec x) { simd::store(p, x); }
inline void store_row(at::BFloat16* p, simd::vec x) {
  simd::store_bf16(reinterpret_cast<uint16_t*>(p), x);
}

// Row r of `scores` keeps its first `len` entries: exp(s - max) there, zeros after; returns
// the sum of the kept exponentials. The max and the sum are fp32 for a bf16 row too.
template <typename T>
float exp_row(T* s, int64_t len, int64_t width) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
  simd::vec vmax = simd::set1(m);
  for (; t + simd::kWidth <= len; t += simd::kWidth) vmax = simd::max(vmax, load_row(s + t));
  m = simd::reduce_max(vmax);
  for (; t < len; ++t) m = std::max(m, float(s[t]));
  const simd::vec vm = simd::set1(m);
  simd::vec vsum = simd::zero();
  for (t = 0; t + simd::kWidth <= len; t += simd::kWidth) {
    const simd::vec e = simd::exp(simd::sub(load_row(s + t), vm));
    store_row(s + t, e);
    vsum = simd::add(vsum, e);
  }
  float sum = simd::reduce_add(vsum);
  for (; t < len; ++t) {
    const float e = std::exp(float(s[t]) - m);
    s[t] = T(e);
    sum += e;
  }
  std::fill(s + len, s + width, T(0.f));
  return sum;
}

struct Problem {
  const float* q;  // [Q, H, D], the sequence's query rows
  float* out;      // [Q, H, D]
  int64_t Q, H, KVH, G, D, S;
  float scale;
};

// One thread's scratch, reused across its tiles: fresh large buffers per tile would each be
// page-faulted in (measured: that doubled the kernel's time). `opts`: the GEMMs' dtype.
struct Scratch {
  at::Tensor q, scores, o;
  std::vector<float> inv_sum;  // 1 / softmax denominator per row
  Scratch(const Problem& p, const at::TensorOptions& opts)
      : q(at::empty({p.G * kTileRows, p.D}, opts)),
        scores(at::empty({p.G * kTileRows * p.S}, opts)),
        o(at::empty({p.G * kTileRows, p.D}, opts)),
        inv_sum(p.G * kTileRows) {}
};

// Query tokens [q0, q1) of KV head kh: every query head of its group, one GEMM each way. T is
// the GEMMs' element type (float, or at::BFloat16: converted with rounding to nearest even).
template <typename T>
void attend_tile(const Problem& p, const at::Tensor& k, const at::Tensor& v, int64_t kh,
                 int64_t q0, int64_t q1, Scratch& buf) {
  const int64_t rows = q1 - q0, R = p.G * rows, D = p.D;
  const int64_t visible = p.S - p.Q + q1;  // keys the tile's last row sees
  auto qt = buf.q.narrow(0, 0, R);
  T* qp = qt.data_ptr<T>();
  for (int64_t g = 0; g < p.G; ++g)  // rows g * rows + j: head kh * G + g, token q0 + j
    for (int64_t j = 0; j < rows; ++j) {
      const float* src = p.q + ((q0 + j) * p.H + kh * p.G + g) * D;
      T* dst = qp + (g * rows + j) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = T(src[d] * p.scale);
    }
  auto scores = buf.scores.narrow(0, 0, R * visible).view({R, visible});
  at::mm_out(scores, qt, k[kh].narrow(0, 0, visible).t());
  T* sp = scores.data_ptr<T>();
  std::vector<float>& inv = buf.inv_sum;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = p.S - p.Q + q0 + r % rows + 1;  // causal: keys up to the row's position
    inv[r] = 1.f / exp_row(sp + r * visible, len, visible);
  }
  auto o = buf.o.narrow(0, 0, R);
  at::mm_out(o, scores, v[kh].narrow(0, 0, visible));
  const T* op = o.data_ptr<T>();
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t r = g * rows + j;
      float* dst = p.out + ((q0 + j) * p.H + kh * p.G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = float(op[r * D + d]) * inv[r];
    }
}

}  // namespace

// query [Q, H, D] holds the last Q tokens of a sequence of seq_len tokens whose K/V are in the
// cache blocks of `block_table`; returns the attention output [Q, H, D].
torch::Tensor prefill_causal_attention(torch::Tensor query, torch::Tensor k_cache,
                                       torch::Tensor v_cache, torch::Tensor block_table,
                                       int64_t seq_len, double scale, bool bf16) {
  const bool int8_cache = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(query.scalar_type() == at::kFloat, "fp32 queries");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (int8_cache || k_cache.scalar_type() == at::kFloat),
              "fp32 or int8 caches");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(block_table.scalar_type() == at::kInt, "int32 block table");
  const auto q = query.contiguous();
  const auto table = block_table.contiguous();
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  const int64_t row = int8_cache ? D + static_cast<int64_t>(sizeof(float)) : D;
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == row && v_cache.sizes() == k_cache.sizes(),
              "head shapes");
  TORCH_CHECK(Q >= 1 && Q <= seq_len, "query rows must be the last of the sequence");
  TORCH_CHECK(table.numel() * k_cache.size(1) >= seq_len, "block table shorter than the sequence");
  c10::InferenceMode guard;
  const int32_t* tp = table.data_ptr<int32_t>();
  const auto k = gather_heads(k_cache, tp, seq_len, D, bf16);
  const auto v = gather_heads(v_cache, tp, seq_len, D, bf16);
  auto out = at::empty_like(q);
  const Problem p{q.data_ptr<float>(), out.data_ptr<float>(), Q, H, KVH, H / KVH, D, seq_len,
                  static_cast<float>(scale)};
  const int64_t tiles = (Q + kTileRows - 1) / kTileRows;
  // Later tiles see more keys. Threads take contiguous ranges of work items, so the items go
  // in pairs of equal total cost (the last tile, the first, the last but one, the second...)
  // and every range holds about the same work.
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t begin, int64_t end) {
    Scratch buf(p, k.options());
    for (int64_t w = begin; w < end; ++w) {
      const int64_t kh = w % KVH, u = w / KVH;
      const int64_t tile = u % 2 == 0 ? tiles - 1 - u / 2 : u / 2;
      const int64_t q0 = tile * kTileRows, q1 = std::min(Q, (tile + 1) * kTileRows);
      if (bf16)
        attend_tile<at::BFloat16>(p, k, v, kh, q0, q1, buf);
      else
        attend_tile<float>(p, k, v, kh, q0, q1, buf);
    }
  });
  return out;
}
