// Decode attention over a paged KV cache on CPU: one query token per sequence, read straight
// from the cache blocks (no gather copy), GQA heads of one KV head share each K/V read.
#include <torch/extension.h>
#include <ATen/Parallel.h>
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

}  // namespace

// query [B, H, D], caches [N, BS, KVH, D] (fp32, contiguous), block_tables [B, MAXB] int32,
// seq_lens [B] int32 -> out [B, H, D]
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "fp32 only");
  query = query.contiguous();
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MAXB = block_tables.size(1);
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "int32 block tables and lengths");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  // Raw pointer arithmetic below: refuse tables or lengths that would read outside the cache.
  if (B > 0) {
    TORCH_CHECK(block_tables.min().item<int32_t>() >= 0 &&
                    block_tables.max().item<int32_t>() < k_cache.size(0),
                "block id outside the cache");
    TORCH_CHECK(seq_lens.min().item<int32_t>() >= 1 && seq_lens.max().item<int32_t>() <= MAXB * BS,
                "sequence length outside its block table");
  }
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t slot_stride = KVH * D, block_stride = BS * KVH * D;

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, h = idx % KVH, L = lens[b];
      scores.assign(G * L, 0.f);
      const float* qh = q + (b * H + h * G) * D;
      for (int64_t t = 0; t < L; ++t) {  // pass 1: scores, reading each key once
        const int64_t block = tables[b * MAXB + t / BS];
        const float* k = kc + block * block_stride + (t % BS) * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qh + g * D, k, D) * scale;
      }
      std::vector<float> inv_sum(G);
      for (int64_t g = 0; g < G; ++g) {  // softmax per query head
        float* s = scores.data() + g * L;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv_sum[g] = 1.f / sum;
      }
      float* oh = o + (b * H + h * G) * D;
      std::fill(oh, oh + G * D, 0.f);
      for (int64_t t = 0; t < L; ++t) {  // pass 2: weighted values, reading each value once
        const int64_t block = tables[b * MAXB + t / BS];
        const float* v = vc + block * block_stride + (t % BS) * slot_stride + h * D;
        for (int64_t g = 0; g < G; ++g) axpy(scores[g * L + t] * inv_sum[g], v, oh + g * D, D);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released: RPC threads of the worker keep streaming while a step attends.
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (fp32, CPU)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
