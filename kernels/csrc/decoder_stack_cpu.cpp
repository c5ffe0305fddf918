// The decoder layers of a Llama-family model as one C++ call (CPU, fp32 activations; the KV
// cache fp32 or int8 rows with a scale each, kernels/kv_int8.py).
//
// A decode step at small batch is a weight stream of ~540 MB; around its 120 matmuls, the
// Python of the layer (norms, splits, RoPE, cache writes, residuals: ~35 tensor ops a layer)
// cost ~12 ms a step on this machine, 20% of the step. Here the matmuls are the same ATen /
// oneDNN calls as engine/model.py's, and fused loops replace the small ops (RMSNorm; RoPE
// written straight into the cache slots; silu(gate) * up; residual adds inside the matmuls'
// output stage): hidden states agree with the Python layers to float rounding
// (tests/test_cpu_stack.py). The Python model keeps the reference forward.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>

namespace {

// Which matmul a projection of `rows` rows runs: the skinny kernel up to `max_skinny_rows`,
// oneDNN on the pre-packed weight from `min_packed_rows` on, else ATen (as engine/linear.py).
struct Rows {
  int64_t min_packed, max_skinny;
};

bool use_skinny(const at::Tensor& x, const StackLinear& w, const Rows& rows) {
  return w.skinny.defined() && x.size(0) <= rows.max_skinny;
}

bool use_packed(const at::Tensor& x, const StackLinear& w, const Rows& rows) {
  return w.packed.defined() && x.size(0) >= rows.min_packed;
}

at::Tensor linear(const at::Tensor& x, const StackLinear& w, const Rows& rows) {
  const auto bias = w.bias.defined() ? std::optional<at::Tensor>(w.bias) : std::nullopt;
  if (use_skinny(x, w, rows)) return skinny_linear(x, w.skinny, w.weight.size(0), bias, std::nullopt);
  if (use_packed(x, w, rows)) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x.contiguous(), w.packed, bias ? c10::IValue(*bias) : c10::IValue(),
                            c10::IValue(std::string("none")),
                            c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w.weight, bias);
}

// x * rsqrt(mean(x^2) + eps) * weight per row (transformers' order of the products).
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const auto x = input.contiguous();
  auto out = at::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      float* orow = op + r * n;
      float acc[16] = {0};
      int64_t j = 0;
      for (; j + 16 <= n; j += 16)
        for (int l = 0; l < 16; ++l) acc[l] += xr[j + l] * xr[j + l];
      float ss = 0.f;
      for (int l = 0; l < 16; ++l) ss += acc[l];
      for (; j < n; ++j) ss += xr[j] * xr[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
      for (j = 0; j < n; ++j) orow[j] = (xr[j] * inv) * wp[j];
    }
  });
  return out;
}

// residual + x @ W^T: the add rides in the matmul's output stage (the skinny kernel's store,
// oneDNN's binary post-op, or BLAS's beta = 1) instead of a second pass over the activations.
at::Tensor linear_add(const at::Tensor& x, const StackLinear& w, const at::Tensor& residual,
                      const Rows& rows) {
  TORCH_CHECK(!w.bias.defined(), "residual projections carry no bias");
  if (use_skinny(x, w, rows)) return skinny_linear(x, w.skinny, w.weight.size(0), std::nullopt, residual);
  if (use_packed(x, w, rows)) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "binary");
    torch::jit::Stack stack{x.contiguous(), residual.contiguous(), w.packed, c10::IValue(),
                            c10::IValue(std::string("add"))};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::addmm(residual, x, w.weight.t());
}

// silu(gate) * up over the fused gate/up output [T, 2 * inter]: one pass instead of three.
at::Tensor silu_mul(const at::Tensor& gate_up, int64_t inter) {
  const auto gu = gate_up.contiguous();
  const int64_t T = gu.size(0);
  auto out = at::empty({T, inter}, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = src + t * 2 * inter, *u = g + inter;
      float* o = dst + t * inter;
      int64_t i = 0;
      const simd::vec one = simd::set1(1.f);
      for (; i + simd::kWidth <= inter; i += simd::kWidth) {
        const simd::vec x = simd::load(g + i);
        const simd::vec s = simd::div(x, simd::add(one, simd::exp(simd::sub(simd::zero(), x))));
        simd::store(o + i, simd::mul(s, simd::load(u + i)));
      }
      for (; i < inter; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// y = x * cos + rotate_half(x) * sin for one head (rotate_half(x) = [-x2, x1]).
inline void rope_head(const float* x, float* y, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) y[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) y[i] = x[i] * c[i] + x[i - half] * s[i];
}

// Where rope_and_store puts a token's rotated keys and its values: fp32 cache rows as computed,
// or int8 rows (kernels/kv_int8.py's layout: quantize_kv_row, the bytes its store writes, so
// KV transfer frames and the Python layers read the same cache).
struct SlotWriter {
  void *k, *v;  // cache bases: [slots, KVH, row] fp32 or int8
  bool int8;
  int64_t KVH, D, row;  // row: D floats, or D codes + 4 scale bytes

  SlotWriter(at::Tensor& k_cache, at::Tensor& v_cache, int64_t kv_heads, int64_t head_dim)
      : k(k_cache.data_ptr()), v(v_cache.data_ptr()),
        int8(k_cache.scalar_type() == at::kChar), KVH(kv_heads), D(head_dim),
        row(int8 ? head_dim + 4 : head_dim) {
    const auto dtype = k_cache.scalar_type();
    TORCH_CHECK((dtype == at::kFloat || dtype == at::kChar) && v_cache.scalar_type() == dtype &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(),
                "contiguous fp32 or int8 caches");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                    k_cache.size(2) == KVH && k_cache.size(3) == row,
                "caches must be [blocks, block_size, kv_heads, ", row, "]");
  }

  // keys [KVH, D] un-rotated and values [KVH, D] of one token into cache slot `slot`;
  // `scratch` holds D floats (one rotated key head before it is quantized).
  void store(int64_t slot, const float* keys, const float* values, const float* c,
             const float* s, float* scratch) const {
    if (!int8) {
      float* kc = static_cast<float*>(k) + slot * KVH * D;
      for (int64_t h = 0; h < KVH; ++h) rope_head(keys + h * D, kc + h * D, c, s, D);
      std::copy(values, values + KVH * D, static_cast<float*>(v) + slot * KVH * D);
      return;
    }
    int8_t* kc = static_cast<int8_t*>(k) + slot * KVH * row;
    int8_t* vc = static_cast<int8_t*>(v) + slot * KVH * row;
    for (int64_t h = 0; h < KVH; ++h) {
      rope_head(keys + h * D, scratch, c, s, D);
      quantize_kv_row(scratch, kc + h * row, D);
      quantize_kv_row(values + h * D, vc + h * row, D);
    }
  }
};

}  // namespace

// RoPE on the query and key heads of a fused QKV output [T, q + 2 kv]; the rotated keys and the
// values go straight into their cache slots (-1 skips), as fp32 or int8 rows (SlotWriter);
// returns the rotated query [T, H, D].
at::Tensor DecoderStack::rope_and_store(const at::Tensor& qkv, const at::Tensor& cos,
                                        const at::Tensor& sin, at::Tensor& k_cache,
                                        at::Tensor& v_cache, const at::Tensor& slots) const {
  const int64_t T = qkv.size(0), H = num_heads_, KVH = num_kv_heads_, D = head_dim_;
  const SlotWriter writer(k_cache, v_cache, KVH, D);
  const int64_t width = qkv.size(1), q_size = H * D, kv_size = KVH * D;
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const auto src = qkv.contiguous();
  const auto c = cos.contiguous(), s = sin.contiguous();
  const auto slot_ids = slots.to(at::kLong).contiguous();
  auto q = at::empty({T, H, D}, qkv.options());
  const float *xp = src.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] < num_slots, "cache slot outside the cache");
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(D);
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      const float *ct = cp + t * D, *st = sp + t * D;
      for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, qp + (t * H + h) * D, ct, st, D);
      if (sl[t] >= 0)
        writer.store(sl[t], row + q_size, row + q_size + kv_size, ct, st, scratch.data());
    }
  });
  return q;
}

DecoderStack::DecoderStack(std::vector<StackLayer> layers, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double eps,
                           int64_t min_packed_rows, int64_t max_skinny_rows)
    : layers_(std::move(layers)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
      head_dim_(head_dim), eps_(eps), min_packed_rows_(min_packed_rows),
      max_skinny_rows_(max_skinny_rows) {}

at::Tensor DecoderStack::attention_input(int64_t i, const at::Tensor& h, const at::Tensor& cos,
                                         const at::Tensor& sin, at::Tensor k_cache,
                                         at::Tensor v_cache, const at::Tensor& slots) const {
  const StackLayer& L = layers_.at(i);
  const Rows rows{min_packed_rows_, max_skinny_rows_};
  const auto qkv = linear(rms_norm(h, L.input_norm, eps_), L.qkv, rows);
  return rope_and_store(qkv, cos, sin, k_cache, v_cache, slots);
}

at::Tensor DecoderStack::attention_output_and_mlp(int64_t i, const at::Tensor& attn,
                                                  const at::Tensor& h) const {
  const StackLayer& L = layers_.at(i);
  const int64_t inter = L.down.weight.size(1);
  const Rows rows{min_packed_rows_, max_skinny_rows_};
  const auto out = linear_add(attn.reshape({-1, num_heads_ * head_dim_}), L.o, h, rows);
  const auto gate_up = linear(rms_norm(out, L.post_norm, eps_), L.gate_up, rows);
  return linear_add(silu_mul(gate_up, inter), L.down, out, rows);
}

at::Tensor DecoderStack::decode(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                                const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches, const at::Tensor& slots,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                double scale) const {
  TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
              "one K and one V cache per layer");
  c10::InferenceMode guard;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto q = attention_input(i, h, cos, sin, k_caches[i], v_caches[i], slots);
    const bool int8 = k_caches[i].scalar_type() == at::kChar;  // rows dequantized in registers
    const auto attn = (int8 ? paged_decode_attention_int8 : paged_decode_attention)(
        q, k_caches[i], v_caches[i], block_tables, seq_lens, scale);
    h = attention_output_and_mlp(i, attn, h);
  }
  return h;
}
