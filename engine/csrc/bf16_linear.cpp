// Linear layers on bfloat16 pairs (vdpbf16ps) where the CPU has avx512_bf16: y = x W^T + b.
//
// The weight is repacked once, at load, into [N/16][K/2][16][2]: one 64-byte vector holds pair
// k of 16 consecutive outputs, so a decode step streams each weight byte once, in order, and
// spends one vdpbf16ps (32 multiplies) per vector per row. On the SmolLM2-135M shape (30
// layers and the LM head, 2 threads) against oneDNN with its own prepacked weight: 1 row 8.8
// vs 13.4 ms (the whole weight at ~30 GB/s, this machine's bandwidth), 3 rows 9.1 vs 12.0, 32
// rows 24.8 vs 27.7, 512 rows 267 vs 264: one kernel for decode and prefill.
//
// Every output sums its K pairs in order in one float32 accumulator, whatever the row count
// and the tiling: a row's result is bit-identical in any batch (oneDNN picks kernels by size).
// Products of bfloat16 pairs are exact in float32; sums round once per instruction; the output
// is rounded to bfloat16 to nearest even, as torch's bfloat16 matmul rounds it.
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__)
namespace {
constexpr int64_t LANES = 16;  // outputs per vector

// Rows [m0, m0 + MR) against output vectors [nb0, nb0 + NB): MR * NB accumulators in registers,
// each weight vector loaded once per row tile and used by MR rows.
template <int MR, int NB>
inline void tile(const uint32_t* x, int64_t pairs, const __m512bh* weight, const float* bias, int64_t N, int64_t nb0,
                 uint16_t* y, int64_t m0) {
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const __m512bh* w = weight + nb0 * pairs;
  const uint32_t* xr = x + m0 * pairs;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = w[j * pairs + kp];
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[m * pairs + kp]);  // row m's pair kp, broadcast
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) {
      __m512 v = acc[m][j];
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + (nb0 + j) * LANES));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + (nb0 + j) * LANES), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

// All M rows against NB output vectors: the NB vectors' weights (NB * K * 32 bytes) stay in L2
// while the row tiles go by, so the weight comes from memory once per call.
template <int NB>
inline void all_rows(const uint32_t* x, int64_t M, int64_t pairs, const __m512bh* weight, const float* bias, int64_t N,
                     int64_t nb0, uint16_t* y) {
  constexpr int MR = 6;  // 6 x 4 accumulators + 4 weight vectors + a broadcast: 29 of 32 registers
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<MR, NB>(x, pairs, weight, bias, N, nb0, y, m);
  switch (M - m) {
    case 1: tile<1, NB>(x, pairs, weight, bias, N, nb0, y, m); break;
    case 2: tile<2, NB>(x, pairs, weight, bias, N, nb0, y, m); break;
    case 3: tile<3, NB>(x, pairs, weight, bias, N, nb0, y, m); break;
    case 4: tile<4, NB>(x, pairs, weight, bias, N, nb0, y, m); break;
    case 5: tile<5, NB>(x, pairs, weight, bias, N, nb0, y, m); break;
  }
}
}  // namespace

extern "C" int pdserve_bf16_linear_available() { return 1; }

// weight [N, K] row-major -> packed [N/16][K/2][16][2]. Returns -1 unless N % 16 == 0 and K is even.
extern "C" int pdserve_bf16_pack(const uint16_t* weight, int64_t N, int64_t K, uint16_t* packed) {
  if (N % LANES != 0 || K % 2 != 0) return -1;
  const int64_t pairs = K / 2;
  for (int64_t nb = 0; nb < N / LANES; ++nb)
    for (int64_t kp = 0; kp < pairs; ++kp)
      for (int64_t lane = 0; lane < LANES; ++lane) {
        const uint16_t* src = weight + (nb * LANES + lane) * K + 2 * kp;
        uint16_t* dst = packed + ((nb * pairs + kp) * LANES + lane) * 2;
        dst[0] = src[0];
        dst[1] = src[1];
      }
  return 0;
}

// x [M, K] and y [M, N] bfloat16, contiguous; bias [N] float32 or null.
extern "C" int pdserve_bf16_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const float* bias,
                                   int64_t N, uint16_t* y, int num_threads) {
  if (N % LANES != 0 || K % 2 != 0) return -1;
  constexpr int64_t NB = 4;
  const int64_t pairs = K / 2, vectors = N / LANES, groups = (vectors + NB - 1) / NB;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const __m512bh* wp = reinterpret_cast<const __m512bh*>(packed);
  // torch's OpenMP pool, as the attention kernels use it (see paged_decode_attention.cpp).
#pragma omp parallel for schedule(static) num_threads(std::max<int64_t>(1, std::min<int64_t>(num_threads, groups)))
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t nb0 = g * NB;
    switch (std::min(NB, vectors - nb0)) {
      case 4: all_rows<4>(xp, M, pairs, wp, bias, N, nb0, y); break;
      case 3: all_rows<3>(xp, M, pairs, wp, bias, N, nb0, y); break;
      case 2: all_rows<2>(xp, M, pairs, wp, bias, N, nb0, y); break;
      case 1: all_rows<1>(xp, M, pairs, wp, bias, N, nb0, y); break;
    }
  }
  return 0;
}
#else
// Built without avx512_bf16: Python sees 0 here and keeps oneDNN.
extern "C" int pdserve_bf16_linear_available() { return 0; }
extern "C" int pdserve_bf16_pack(const uint16_t*, int64_t, int64_t, uint16_t*) { return -1; }
extern "C" int pdserve_bf16_linear(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, int64_t, uint16_t*, int) {
  return -1;
}
#endif
