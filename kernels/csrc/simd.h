// One fp32 vector register of the instruction set this build of the extension targets.
//
// kernels/cpu_extension.py compiles the same sources once per instruction set ("avx512":
// -mavx512f/bw/vl/dq; "avx2": -mavx2 -mfma, no AVX-512) and picks a build at run time from the
// CPU's flags. The kernels are written against this header only, so each build gets its own
// register width and register count; an ARM build adds a NEON branch here (float32x4_t, kWidth
// 4, 32 registers, vld1q_f32 / vfmaq_f32 / vaddvq_f32) and a variant in cpu_extension.py.
// There is deliberately no scalar branch: where neither set is present the torch path runs,
// which is faster than a generic loop.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#else
#error "build per instruction set: AVX-512 (-mavx512f ...) or AVX2 + FMA (kernels/cpu_extension.py)"
#endif

// glibc's vector math library (libmvec): 16 or 8 expf at once, within 4 ulp like scalar expf.
#if defined(__GLIBC__) && defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);
#elif defined(__GLIBC__)
extern "C" __m256 _ZGVdN8v_expf(__m256);
#endif

namespace simd {

#if defined(__AVX512F__)
#if defined(__AVX512VNNI__)
constexpr const char* kName = "avx512vnni";  // + the int8 dot product (quant_dot_cpu.cpp)
#else
constexpr const char* kName = "avx512";
#endif
constexpr int kWidth = 16;      // floats per register
constexpr int kRegisters = 32;  // architectural vector registers (register-blocking budgets)
using vec = __m512;
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec zero() { return _mm512_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline float reduce_add(vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vec v) { return _mm512_reduce_max_ps(v); }
#if defined(__GLIBC__)
inline vec exp(vec x) { return _ZGVeN16v_expf(x); }
#define PDSERVE_SIMD_EXP 1
#endif
#else
constexpr const char* kName = "avx2";
constexpr int kWidth = 8;
constexpr int kRegisters = 16;
using vec = __m256;
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec zero() { return _mm256_setzero_ps(); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec div(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#if defined(__GLIBC__)
inline vec exp(vec x) { return _ZGVdN8v_expf(x); }
#define PDSERVE_SIMD_EXP 1
#endif
#endif

#if !defined(PDSERVE_SIMD_EXP)
// Without libmvec: the scalar expf lane by lane (same results, slower).
inline vec exp(vec x) {
  alignas(64) float lanes[kWidth];
  store(lanes, x);
  for (float& v : lanes) v = std::exp(v);
  return load(lanes);
}
#endif

// kWidth bf16 values widened to a register, and a register rounded to kWidth bf16 values
// (to nearest even; finite values: the prefill kernel's scores and probabilities).
#if defined(__AVX512F__)
inline vec load_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline void store_bf16(uint16_t* p, vec x) {
  __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
}
#else
inline vec load_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline void store_bf16(uint16_t* p, vec x) {
  __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // Per 128-bit lane packus gives [a0..a3 a0..a3 | a4..a7 a4..a7]: qwords 0 and 2 are a0..a7.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
// Into L2 only: data a later pass reads, too much of it to park in L1.
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

}  // namespace simd
