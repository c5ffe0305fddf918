// Declarations shared by the CPU extension's sources.
#pragma once
#include <torch/extension.h>

#include <vector>

#include "simd.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

// s[t] = exp(s[t] - m) for t < n, in place; returns their sum (the softmax's denominator).
inline float exp_shifted_sum(float* s, int64_t n, float m) {
  const simd::vec vm = simd::set1(m);
  simd::vec vsum = simd::zero();
  int64_t t = 0;
  for (; t + simd::kWidth <= n; t += simd::kWidth) {
    const simd::vec e = simd::exp(simd::sub(simd::load(s + t), vm));
    simd::store(s + t, e);
    vsum = simd::add(vsum, e);
  }
  float sum = simd::reduce_add(vsum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// Block tables [B, MAXB] and lengths [B] (int32) made contiguous, after refusing any that would
// read outside a cache of ``num_blocks`` blocks of ``block_size``: the kernels that follow use raw
// pointer arithmetic.
inline void check_block_tables(torch::Tensor& block_tables, torch::Tensor& seq_lens,
                               int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "int32 block tables and lengths");
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  if (block_tables.size(0) == 0) return;
  TORCH_CHECK(block_tables.min().item<int32_t>() >= 0 &&
                  block_tables.max().item<int32_t>() < num_blocks,
              "block id outside the cache");
  TORCH_CHECK(seq_lens.min().item<int32_t>() >= 1 &&
                  seq_lens.max().item<int32_t>() <= block_tables.size(1) * block_size,
              "sequence length outside its block table");
}

// What a skinny GEMM adds to its sums before it stores them: out = x W^T (+ bias) (+ residual).
struct Epilogue {
  const float* bias;      // [N] or nullptr
  const float* residual;  // [M, N] or nullptr
  float* out;             // [M, N]
  int64_t N;
};

// The epilogue over ``out`` [M, N], after checking bias [N] and residual [M, N] (fp32); ``keep``
// holds their contiguous copies alive while the GEMM runs.
inline Epilogue make_epilogue(const std::optional<at::Tensor>& bias,
                              const std::optional<at::Tensor>& residual, at::Tensor& out,
                              std::array<at::Tensor, 2>& keep) {
  const int64_t N = out.size(1);
  auto& [b, r] = keep;
  if (bias && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.numel() == N && b.scalar_type() == at::kFloat, "bias must be fp32 [n_out]");
  }
  if (residual && residual->defined()) {
    r = residual->contiguous();
    TORCH_CHECK(r.sizes() == out.sizes() && r.scalar_type() == at::kFloat,
                "residual must be fp32 [rows, n_out]");
  }
  return {b.defined() ? b.data_ptr<float>() : nullptr,
          r.defined() ? r.data_ptr<float>() : nullptr, out.data_ptr<float>(), N};
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale);

// paged_decode_attention over int8 caches [N, BS, KVH, D + 4] (codes + fp32 scale per row).
torch::Tensor paged_decode_attention_int8(torch::Tensor query, torch::Tensor k_cache,
                                          torch::Tensor v_cache, torch::Tensor block_tables,
                                          torch::Tensor seq_lens, double scale);

// One K or V head [D] fp32 -> an int8 cache row [D + 4]: codes, then the fp32 scale, bit for bit
// kernels/kv_int8.py's quantize.
void quantize_kv_row(const float* x, int8_t* row, int64_t D);

// bf16: both GEMMs on bf16 operands (a bf16 prefill's precision); else fp32 throughout.
torch::Tensor prefill_causal_attention(torch::Tensor query, torch::Tensor k_cache,
                                       torch::Tensor v_cache, torch::Tensor block_table,
                                       int64_t seq_len, double scale, bool bf16);

// Weights packed for skinny_linear: [ceil(N / 16), K, 16], zero-padded past N.
at::Tensor pack_skinny_weight(const at::Tensor& weight);
// x [M, K] @ W^T (+ bias [N]) (+ residual [M, N]) for small M, on a pack_skinny_weight weight.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& residual);

// skinny_linear on a bf16 / int8 / q4 packing (kernels/quant.py; layouts in quant_gemm_cpu.cpp);
// skinny_linear dispatches here on the packed weight's dtype.
at::Tensor quant_skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out,
                               const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& residual);

// The int8-activation packings (quant_dot_cpu.cpp: q4 int8-typed 3-d, int8 uint8 2-d) and
// their kernel; quant_skinny_linear hands them over.
bool is_int8_activation_packing(const at::Tensor& packed);
at::Tensor quant_dot_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n_out,
                            const std::optional<at::Tensor>& bias,
                            const std::optional<at::Tensor>& residual);
// The codes x takes in quant_dot_linear, on each side of zero: 127, or 63 for int8 weights
// on the AVX2 build (quant_dot_cpu.cpp says why).
int64_t int8_activation_levels(bool q4_weights);

struct StackLinear {
  // bias / packed (oneDNN) / skinny (pack_skinny_weight) undefined when absent
  at::Tensor weight, bias, packed, skinny;
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  StackLinear qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  DecoderStack(std::vector<StackLayer> layers, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, int64_t min_packed_rows, int64_t max_skinny_rows);

  // Norm, fused QKV, RoPE and the cache write of layer i; returns the query [T, H, D].
  at::Tensor attention_input(int64_t i, const at::Tensor& h, const at::Tensor& cos,
                             const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                             const at::Tensor& slots) const;
  // Output projection, residual, norm, MLP and residual of layer i; returns the new h.
  at::Tensor attention_output_and_mlp(int64_t i, const at::Tensor& attn, const at::Tensor& h) const;
  // Every layer of a decode-only step (one query token per sequence).
  at::Tensor decode(at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                    const at::Tensor& slots, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, double scale) const;

 private:
  at::Tensor rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                            at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) const;

  std::vector<StackLayer> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  int64_t min_packed_rows_, max_skinny_rows_;
};

// CRC-32C (Castagnoli) of p[0, n) continuing `crc` (0 to start): crc32c_extend(crc32c_extend(0,
// a), b) == CRC-32C of a then b, as the crc32c package computes it.
uint32_t crc32c_extend(uint32_t crc, const uint8_t* p, size_t n);
int64_t crc32c(const at::Tensor& data);
// KV blocks to and from a transfer payload [2, n, block...] (K then V, in block_ids order);
// the gather returns the payload's CRC-32C.
int64_t gather_kv_blocks(const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_ids, at::Tensor& out);
void scatter_kv_blocks(const at::Tensor& payload, at::Tensor& k_cache, at::Tensor& v_cache,
                       const at::Tensor& block_ids);
