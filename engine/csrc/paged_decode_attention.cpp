// Decode attention on a CPU that reads the paged KV cache where it lies.
//
// Each decode sequence attends its one new query per head over its block table: scores
// against every cached key, a softmax, then the weighted sum of the values. The gather +
// SDPA path it replaces first copied every sequence's blocks out of the cache and padded a
// group to its longest member; on the SmolLM2-135M shape (float32, 2 threads, batch 32 of
// 64-1024 tokens) that was ~150 ms of a ~260 ms step, this is ~60 ms.
//
// Layout (see engine/kv_cache.py): key/value caches [num_blocks, block_size, kv_heads,
// head_dim] with any block, token and head strides; q and out [n, kv_heads, group, head_dim] float32,
// contiguous; tables [n, width] int64; lens [n] int64 (tokens to attend, the new one
// included); window: under a sliding window, how many of the latest keys a query attends
// (0: all). Built per machine with -march=native by engine/native_kernels.py and called
// through ctypes: plain C, no torch headers, so the build takes seconds, not a minute.
#include "simd.h"

// One sequence, all its KV heads, each with the G query heads that share it; D = DV * Vec::W.
// Two passes over the blocks (scores, then values) with the softmax between them: each key
// and value is read once, and every head of a block is read while that block is at hand.
template <typename T, int G, int DV>
static void attend_sequence(const float* __restrict q, int64_t KVH, const T* kp, const T* vp, const Geometry& geo,
                            const int64_t* table, int64_t len, int64_t first, float scale, float* __restrict scores,
                            float* __restrict out) {
  constexpr int D = DV * Vec::W;
  using Reg = typename Vec::Reg;
  const int64_t BS = geo.block_size;
  const Reg vscale = Vec::set1(scale);
  const int64_t num_blocks = (len + BS - 1) / BS;
  // Keys [first, len) are attended (first > 0 under a sliding window); blocks before first's
  // are never read, and first's block is scored whole, its keys before first weighted 0.
  const int64_t first_block = first / BS;
  for (int64_t j = first_block; j * BS < len; ++j) {
    const T* kb = kp + table[j] * geo.block_stride_k;
    const int64_t ntok = std::min(BS, len - j * BS);
    const T* kb_ahead = j + PREFETCH_BLOCKS < num_blocks ? kp + table[j + PREFETCH_BLOCKS] * geo.block_stride_k : nullptr;
    for (int64_t h = 0; h < KVH; ++h) {
      // A quantized block's key scale for this head folds into the score scale.
      const Reg hscale = Quant<T>::scaled ? Vec::set1(scale * geo.key_scale<T>(table[j], h)) : vscale;
      Reg qr[G][DV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DV; ++c) qr[g][c] = Vec::load(q + (h * G + g) * D + c * Vec::W);
      float* sh = scores + h * G * len + j * BS;
      const T* kh = kb + h * geo.head_stride_k;
      for (int64_t t = 0; t < ntok; ++t) {
        const T* kt = kh + t * geo.token_stride_k;
        if (kb_ahead != nullptr) prefetch_row<T, D>(kb_ahead + h * geo.head_stride_k + t * geo.token_stride_k);
        Reg acc[G];
        for (int g = 0; g < G; ++g) acc[g] = Vec::zero();
        for (int c = 0; c < DV; ++c) {
          Reg k = Vec::load(kt + c * Vec::W);
          for (int g = 0; g < G; ++g) acc[g] = Vec::fmadd(qr[g][c], k, acc[g]);
        }
        for (int g = 0; g < G; ++g) sh[g * len + t] = Vec::sum(Vec::mul(acc[g], hscale));
      }
    }
  }
  for (int64_t row = 0; row < KVH * G; ++row) {
    float* __restrict s = scores + row * len;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t t = first; t < len; ++t) m = std::max(m, s[t]);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = first; t < len; ++t) {
      s[t] = expf(s[t] - m);
      total += s[t];
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t t = first; t < len; ++t) s[t] *= inv;
    for (int64_t t = first_block * BS; t < first; ++t) s[t] = 0.f;
  }
  // The weighted values accumulate in ``out`` itself: this sequence's rows, nobody else's.
  std::fill(out, out + KVH * G * D, 0.f);
  for (int64_t j = first_block; j * BS < len; ++j) {
    const T* vb = vp + table[j] * geo.block_stride_v;
    const int64_t ntok = std::min(BS, len - j * BS);
    const T* vb_ahead = j + PREFETCH_BLOCKS < num_blocks ? vp + table[j + PREFETCH_BLOCKS] * geo.block_stride_v : nullptr;
    for (int64_t h = 0; h < KVH; ++h) {
      const float value_scale = geo.value_scale<T>(table[j], h);  // 1 unless quantized
      Reg acc[G][DV];
      float* ah = out + h * G * D;
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DV; ++c) acc[g][c] = Vec::load(ah + g * D + c * Vec::W);
      const float* sh = scores + h * G * len + j * BS;
      const T* vh = vb + h * geo.head_stride_v;
      for (int64_t t = 0; t < ntok; ++t) {
        const T* vt = vh + t * geo.token_stride_v;
        if (vb_ahead != nullptr) prefetch_row<T, D>(vb_ahead + h * geo.head_stride_v + t * geo.token_stride_v);
        Reg p[G];
        for (int g = 0; g < G; ++g) p[g] = Vec::set1(Quant<T>::scaled ? sh[g * len + t] * value_scale : sh[g * len + t]);
        for (int c = 0; c < DV; ++c) {
          Reg v = Vec::load(vt + c * Vec::W);
          for (int g = 0; g < G; ++g) acc[g][c] = Vec::fmadd(p[g], v, acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < DV; ++c) Vec::store(ah + g * D + c * Vec::W, acc[g][c]);
    }
  }
}

struct Call {
  const float* q;
  const void* key_cache;
  const void* value_cache;
  Geometry geo;
  int64_t n, num_kv_heads, table_width;
  const int64_t* tables;
  const int64_t* lens;
  float* out;
  float scale;
  int num_threads;
  int64_t window;  // keys a query attends, itself included; 0: all
};

template <typename T, int G, int DV>
static void run(const Call& call) {
  constexpr int D = DV * Vec::W;
  const int64_t n = call.n, KVH = call.num_kv_heads;
  const T* kp = static_cast<const T*>(call.key_cache);
  const T* vp = static_cast<const T*>(call.value_cache);
  // Longest first, handed out one at a time: sequences differ in length by 10x or more.
  std::vector<int64_t> order(n);
  for (int64_t b = 0; b < n; ++b) order[b] = b;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return call.lens[a] > call.lens[b]; });
  // OpenMP with torch's own runtime (the wheel's libgomp.so.1 is loaded first, so this
  // library binds to it): the same warm threads as the model's matmuls. Threads started per
  // call were 20% slower, contending with that pool's spinning workers.
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min<int64_t>(call.num_threads, n)))
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t b = order[i], len = call.lens[b];
      if ((int64_t)scores.size() < KVH * G * len) scores.resize(KVH * G * len);
      const int64_t first = call.window > 0 ? std::max<int64_t>(0, len - call.window) : 0;
      attend_sequence<T, G, DV>(call.q + b * KVH * G * D, KVH, kp, vp, call.geo, call.tables + b * call.table_width,
                                len, first, call.scale, scores.data(), call.out + b * KVH * G * D);
    }
  }
}

template <typename T, int DV>
static bool by_group(int64_t G, const Call& call) {
  switch (G) {
    case 1: run<T, 1, DV>(call); return true;
    case 2: run<T, 2, DV>(call); return true;
    case 3: run<T, 3, DV>(call); return true;
    case 4: run<T, 4, DV>(call); return true;
    case 5: run<T, 5, DV>(call); return true;
    case 6: run<T, 6, DV>(call); return true;
    case 7: run<T, 7, DV>(call); return true;
    case 8: run<T, 8, DV>(call); return true;
  }
  return false;
}

// The cache's element type: 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3fn (the last two scaled).
template <int DV>
static bool by_dtype(int kind, int64_t G, const Call& call) {
  switch (kind) {
    case 0: return by_group<float, DV>(G, call);
    case 1: return by_group<uint16_t, DV>(G, call);
    case 2: return by_group<int8_t, DV>(G, call);
    case 3: return by_group<Fp8, DV>(G, call);
  }
  return false;
}

// Strides in elements (scale strides in floats). Returns 0, or -1 for a head size, group or
// element type it was not built for.
extern "C" int pdserve_paged_decode(const float* q, const void* key_cache, const void* value_cache, int kind,
                                    int64_t n, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                                    int64_t block_size, int64_t block_stride_k, int64_t block_stride_v,
                                    int64_t token_stride_k, int64_t token_stride_v, int64_t head_stride_k,
                                    int64_t head_stride_v, const float* key_scales, const float* value_scales,
                                    int64_t scale_stride_k, int64_t scale_stride_v, int64_t scale_head_stride, const int64_t* tables,
                                    int64_t table_width, const int64_t* lens, float* out, float scale, int num_threads,
                                    int64_t window) {
  const Call call{q, key_cache, value_cache,
                  Geometry{block_stride_k, block_stride_v, token_stride_k, token_stride_v, head_stride_k,
                           head_stride_v, block_size, key_scales, value_scales, scale_stride_k, scale_stride_v, scale_head_stride},
                  n, num_kv_heads, table_width, tables, lens, out, scale, num_threads, window};
  if (head_dim % Vec::W != 0) return -1;
  bool done = false;
  switch (head_dim / Vec::W) {
    case 1: done = by_dtype<1>(kind, group, call); break;
    case 2: done = by_dtype<2>(kind, group, call); break;
    case 4: done = by_dtype<4>(kind, group, call); break;
    case 8: done = by_dtype<8>(kind, group, call); break;
    case 16: done = by_dtype<16>(kind, group, call); break;
  }
  return done ? 0 : -1;
}

// The vector width this build uses, in floats: Python checks head sizes against it.
extern "C" int pdserve_vector_width() { return Vec::W; }
