// The decoder layer's elementwise work, fused: residual add + RMSNorm, the rotary embedding,
// and SiLU(gate) * up, one pass over memory and one call each instead of 6-8 torch ops.
//
// On the SmolLM2-135M shape a decode step ran ~40 torch ops per layer around its 4 matmuls and
// its attention; at 3 sequences those ops and their Python dispatch were a quarter of the step.
//
// Rounding follows the unfused torch code (and transformers) op by op: in bfloat16 every
// intermediate that torch stores in bfloat16 is rounded to it here too (the residual sum,
// the normalised row before the weight, SiLU before the product, each rotary product), so the
// two paths differ only by float32 summation order (the mean of squares) and expf's last bit.
// float32 runs the same formulas without rounding.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// float -> T, bfloat16 rounded to nearest even (as torch rounds; inputs here are finite).
template <typename T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline uint16_t narrow<uint16_t>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// x rounded to T and back: what torch holds after storing x in a T tensor.
template <typename T>
inline float rounded(float x) {
  return widen(narrow<T>(x));
}

constexpr int64_t kParallelElements = 1 << 16;  // below this one thread: waking others costs more

// residual += x (if x), then out = weight * (residual * rsqrt(mean(residual^2) + eps)).
template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t cols, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * cols >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* res = residual + r * cols;
    if (x != nullptr) {
      const T* xr = x + r * cols;
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) res[c] = narrow<T>(widen(res[c]) + widen(xr[c]));
    }
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t c = 0; c < cols; ++c) squares += widen(res[c]) * widen(res[c]);
    const float inv = 1.f / std::sqrt(squares / cols + eps);
    T* o = out + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) o[c] = narrow<T>(widen(weight[c]) * rounded<T>(widen(res[c]) * inv));
  }
}

// gate_up [rows, 2 * inter] (gate | up) -> out [rows, inter] = silu(gate) * up.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
#pragma omp simd
    for (int64_t c = 0; c < inter; ++c) {
      const float g = widen(gate[c]);
      o[c] = narrow<T>(rounded<T>(g / (1.f + std::exp(-g))) * widen(up[c]));
    }
  }
}

// Rotate, in place, the first ``heads`` heads of each row (q's heads then k's, as they lie in
// the fused qkv output): halves x1, x2 -> x1 cos - x2 sin, x2 cos + x1 sin; cos and sin
// [rows, head_dim / 2], this row's position's.
template <typename T>
void rotary(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const T* cos, const T* sin,
            int threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + r * half;
    const T* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      T* x1 = qkv + r * row_stride + h * head_dim;
      T* x2 = x1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = widen(x1[i]), b = widen(x2[i]), cv = widen(c[i]), sv = widen(s[i]);
        x1[i] = narrow<T>(rounded<T>(a * cv) - rounded<T>(b * sv));
        x2[i] = narrow<T>(rounded<T>(b * cv) + rounded<T>(a * sv));
      }
    }
  }
}

}  // namespace

// Tensors contiguous; bf16 != 0: bfloat16 (as uint16), else float32. x may be null (no add).
extern "C" void pdserve_add_rms_norm(const void* x, void* residual, const void* weight, void* out, int64_t rows, int64_t cols,
                                     float eps, int bf16, int threads) {
  if (bf16)
    add_rms_norm(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(residual), static_cast<const uint16_t*>(weight),
                 static_cast<uint16_t*>(out), rows, cols, eps, threads);
  else
    add_rms_norm(static_cast<const float*>(x), static_cast<float*>(residual), static_cast<const float*>(weight),
                 static_cast<float*>(out), rows, cols, eps, threads);
}

extern "C" void pdserve_silu_mul(const void* gate_up, void* out, int64_t rows, int64_t inter, int bf16, int threads) {
  if (bf16)
    silu_mul(static_cast<const uint16_t*>(gate_up), static_cast<uint16_t*>(out), rows, inter, threads);
  else
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), rows, inter, threads);
}

extern "C" void pdserve_rotary(void* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, const void* cos,
                               const void* sin, int bf16, int threads) {
  if (bf16)
    rotary(static_cast<uint16_t*>(qkv), rows, row_stride, heads, head_dim, static_cast<const uint16_t*>(cos),
           static_cast<const uint16_t*>(sin), threads);
  else
    rotary(static_cast<float*>(qkv), rows, row_stride, heads, head_dim, static_cast<const float*>(cos),
           static_cast<const float*>(sin), threads);
}
