// SIMD helpers shared by the CPU attention kernels: one vector type for AVX-512 or AVX2,
// the paged cache's geometry, and a row prefetch.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the CPU attention kernels need AVX2 and FMA"
#endif

// An fp8 e4m3fn cache element. Widened through float16: its 7 low bits shifted into a float16's
// exponent and mantissa give the value times 2^-8 (normal and subnormal alike; e4m3's exponent
// bias is 7, float16's 15), so a scale read for fp8 is multiplied by Quant<Fp8>::unit = 256.
struct Fp8 {
  uint8_t bits;
};

// Quantized element types carry a float scale per (block, KV head); float and bfloat16 do not.
template <typename T>
struct Quant {
  static constexpr bool scaled = false;
  static constexpr float unit = 1.f;
};
template <>
struct Quant<int8_t> {
  static constexpr bool scaled = true;
  static constexpr float unit = 1.f;
};
template <>
struct Quant<Fp8> {
  static constexpr bool scaled = true;
  static constexpr float unit = 256.f;
};

#if defined(__AVX512F__)
struct Vec {
  using Reg = __m512;
  static constexpr int W = 16;
  static constexpr int NREG = 32;  // vector registers
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float x) { return _mm512_set1_ps(x); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const uint16_t* p) {  // bfloat16 -> float: the top half of the float's bits
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Reg load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg load(const Fp8* p) {  // the value times 2^-8 (see Fp8)
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
  }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static float sum(Reg a) { return _mm512_reduce_add_ps(a); }
  static void store(float* p, Reg a) { _mm512_storeu_ps(p, a); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static float reduce_max(Reg a) { return _mm512_reduce_max_ps(a); }
  static Reg iota(float first) {
    return _mm512_add_ps(_mm512_set1_ps(first),
                         _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  // a where index <= limit, else fill.
  static Reg keep_upto(Reg a, Reg index, Reg limit, Reg fill) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(index, limit, _CMP_GT_OQ), a, fill);
  }
  static Reg round(Reg a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Reg times_pow2(Reg a, Reg n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, 0 on underflow
  static constexpr float EXP_FLOOR = -104.f;  // exp() of anything below is 0 after scalef
};
#else
struct Vec {
  using Reg = __m256;
  static constexpr int W = 8;
  static constexpr int NREG = 16;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float x) { return _mm256_set1_ps(x); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const uint16_t* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static Reg load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static Reg load(const Fp8* p) {  // the value times 2^-8 (see Fp8)
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
  }
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static float sum(Reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static void store(float* p, Reg a) { _mm256_storeu_ps(p, a); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static float reduce_max(Reg a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static Reg iota(float first) { return _mm256_add_ps(_mm256_set1_ps(first), _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)); }
  static Reg keep_upto(Reg a, Reg index, Reg limit, Reg fill) {
    return _mm256_blendv_ps(a, fill, _mm256_cmp_ps(index, limit, _CMP_GT_OQ));
  }
  static Reg round(Reg a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Reg times_pow2(Reg a, Reg n) {  // n in [-127, 128]; 2^-127 has a zero exponent field: 0
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(bits));
  }
  static constexpr float EXP_FLOOR = -88.f;
};
#endif

// How far ahead a block's rows are prefetched (1 measured best; 2 and 4 no better).
constexpr int64_t PREFETCH_BLOCKS = 1;

// One token's row of one head, a block ahead: blocks lie at random places, and the
// hardware prefetcher starts cold on each; spread over the current block's rows, the
// prefetches never flood the fill buffers. Into L2 (T1), not L1: an L1 prefetch holds one of
// the core's few L1 miss buffers until it lands, which capped a core at ~7 GB/s from DRAM;
// decode attention of the 135M shape, batch 32 at context 600 in a 4 GiB cache with blocks
// at random places, 1 thread: 62 -> 40 ms.
template <typename T, int D>
static inline void prefetch_row(const T* row) {
  for (int64_t offset = 0; offset < D * (int64_t)sizeof(T); offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + offset, _MM_HINT_T1);
}

struct Geometry {
  int64_t block_stride_k, block_stride_v, token_stride_k, token_stride_v, head_stride_k, head_stride_v, block_size;
  // Quantized caches: each block's per-KV-head scales (floats), block and head strides in floats.
  const float* key_scales = nullptr;
  const float* value_scales = nullptr;
  int64_t scale_stride_k = 0, scale_stride_v = 0, scale_head_stride = 1;

  template <typename T>
  float key_scale(int64_t block, int64_t head) const {
    if constexpr (Quant<T>::scaled) return key_scales[block * scale_stride_k + head * scale_head_stride] * Quant<T>::unit;
    return 1.f;
  }
  template <typename T>
  float value_scale(int64_t block, int64_t head) const {
    if constexpr (Quant<T>::scaled) return value_scales[block * scale_stride_v + head * scale_head_stride] * Quant<T>::unit;
    return 1.f;
  }
};

// One cached element as a float: float32 as it is, bfloat16 (stored as uint16) widened.
static inline float to_float(float x) { return x; }
static inline float to_float(int8_t x) { return static_cast<float>(x); }
static inline float to_float(Fp8 x) {  // times 2^-8, as Vec::load(const Fp8*)
  const int exponent = (x.bits >> 3) & 0xF, mantissa = x.bits & 0x7;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -17)
                                        : std::ldexp(1.f + mantissa / 8.f, exponent - 15);
  return (x.bits & 0x80) ? -magnitude : magnitude;
}
static inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof out);
  return out;
}

// exp(x) for a vector, inline: the softmax of the prefill kernel computes one per score, and a
// call into libmvec per 16 of them took 15% of its time. Cody-Waite reduction to |r| <= ln2/2,
// then a degree-7 Taylor polynomial (truncation below 1e-8 relative); inputs below EXP_FLOOR
// give 0.
static inline Vec::Reg vec_exp(Vec::Reg x) {
  using Reg = Vec::Reg;
  x = Vec::max(x, Vec::set1(Vec::EXP_FLOOR));
  const Reg n = Vec::round(Vec::mul(x, Vec::set1(1.44269504088896341f)));
  Reg r = Vec::fmadd(n, Vec::set1(-0.693145751953125f), x);  // ln 2, split so n * hi is exact
  r = Vec::fmadd(n, Vec::set1(-1.428606765330187045e-06f), r);
  Reg p = Vec::set1(1.f / 5040);
  p = Vec::fmadd(p, r, Vec::set1(1.f / 720));
  p = Vec::fmadd(p, r, Vec::set1(1.f / 120));
  p = Vec::fmadd(p, r, Vec::set1(1.f / 24));
  p = Vec::fmadd(p, r, Vec::set1(1.f / 6));
  p = Vec::fmadd(p, r, Vec::set1(0.5f));
  p = Vec::fmadd(p, r, Vec::set1(1.f));
  p = Vec::fmadd(p, r, Vec::set1(1.f));
  return Vec::times_pow2(p, n);
}
