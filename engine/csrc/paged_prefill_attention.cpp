// Prefill attention on a CPU over the paged KV cache: each chunk of a prompt attends, causally,
// its sequence's cached context and itself.
//
// Why not SDPA: a chunk with context needs an explicit mask there, so torch's CPU flash kernel
// computes the masked half too, and the context must first be gathered out of the blocks. On the
// SmolLM2-135M shape (float32, 2 threads) SDPA took 10.6 ms for 512 queries over 512 + 512 keys
// and 4.9 ms for 512 causal queries from position 0 (28% of a prefill step).
//
// How: flash attention in tiles. Per call, every (chunk, KV head) has its keys transposed into
// tiles of KT keys ([D][KT], so a score tile is a small matrix product with one key vector per
// FMA) and its values widened to float, once, in parallel. Then each task, a (chunk, KV head,
// QUERY_TILE queries) triple with the G query heads sharing that KV head as extra rows, walks the
// key tiles up to its last query (tiles past it are never computed), with an online softmax.
//
// On a bfloat16 cache where the CPU multiplies bfloat16 natively (avx512_bf16), the tiles stay
// bfloat16, in pairs ([D/2][KT][2] keys, [KT/2][D][2] values), and both products run on
// vdpbf16ps, which multiplies 32 pairs into 16 float32 sums per instruction, twice what a float32
// FMA does: queries are rounded to bfloat16 (exact: they come from bfloat16 projections) and the
// softmax weights too, before they weight the values, as flash attention does on GPUs; scores,
// the softmax and every sum stay float32. SmolLM2-135M shape, 2 threads, 512 queries over
// 512 + 512 keys: 6.2 ms on widened float32 tiles, 3.5 ms on bfloat16 pairs.
//
// Layout: key/value caches [num_blocks, block_size, kv_heads, head_dim] with any block, token and head strides;
// q and out [tokens, kv_heads, group, head_dim] float32, contiguous, each chunk's rows together;
// tables [chunks, width] int64. The chunk's own keys and values are in the cache already.
// window: under a sliding window, how many of the latest keys a query attends (0: all).
#include "simd.h"

#include <memory>
#include <tuple>
#include <utility>

namespace {

constexpr int KT = 2 * Vec::W;     // keys per tile: two vectors
constexpr int QUERY_TILE = 32;     // queries per task
constexpr int ROW_PAD = 12;        // a task's rows are padded to this multiple
constexpr int QK_ROWS = Vec::NREG == 32 ? 12 : 6;  // rows per score micro-kernel: 2 accumulators each
constexpr float MASKED = -1e30f;   // a finite "minus infinity": the kernel is built with -ffast-math

static_assert(ROW_PAD % QK_ROWS == 0, "score blocks must tile the padded rows");

// Rows per value micro-kernel: DV accumulators per row, DV value vectors and one weight must fit
// the register file, and the count must divide ROW_PAD.
constexpr int pv_rows(int dv) {
  for (int rows : {12, 6, 4, 3, 2, 1})
    if (rows * dv + dv + 1 <= Vec::NREG) return rows;
  return 1;
}

struct Span {  // one chunk's part of the call
  int64_t first_row, num_tokens, context_len;
  const int64_t* table;
  int64_t num_tiles;     // key tiles covering context + chunk
  int64_t tile_offset;   // first tile of this chunk's KV head 0 in the transposed buffers
};

struct Call {
  const float* q;
  const void* key_cache;
  const void* value_cache;
  Geometry geo;
  int64_t num_kv_heads, group;
  float* out;
  float scale;
  int num_threads;
  int64_t window;  // keys a query attends, itself included; 0: all
};

// The cached key and value rows of one position and KV head.
template <typename T>
inline std::pair<const T*, const T*> cache_rows(const Call& call, const Span& span, int64_t pos, int64_t head) {
  const Geometry& geo = call.geo;
  const int64_t block = span.table[pos / geo.block_size], offset = pos % geo.block_size;
  const T* key = static_cast<const T*>(call.key_cache) + block * geo.block_stride_k + offset * geo.token_stride_k +
                 head * geo.head_stride_k;
  const T* value = static_cast<const T*>(call.value_cache) + block * geo.block_stride_v + offset * geo.token_stride_v +
                   head * geo.head_stride_v;
  return {key, value};
}

// How a tile's products are computed: on widened float32 tiles with float32 FMAs (F32Math), or
// on bfloat16 pairs with vdpbf16ps (Bf16Math). Each says how its query rows and tiles are staged,
// how a score block and a value block are computed, and how softmax weights are stored for the
// values; attend_task is the same for both.

template <typename T, int DV>
struct F32Math {
  static constexpr int D = DV * Vec::W;
  using Elem = float;                     // what query rows and tiles hold
  static constexpr int64_t ROW = D;       // Elems per query row
  static constexpr int64_t TILE = D * KT;  // Elems per staged key (or value) tile
  static constexpr int PV_ROWS = pv_rows(DV);

  // A query row, scaled here so scores need no scaling.
  static void load_query(const float* src, float scale, Elem* row) {
    for (int d = 0; d < D; ++d) row[d] = src[d] * scale;
  }
  static void zero_query(Elem* row) {
    for (int d = 0; d < D; ++d) row[d] = 0.f;
  }

  // Keys transposed [D][KT], values widened [KT][D], zeros past the end.
  static void stage_tile(const Call& call, const Span& span, int64_t head, int64_t tile, Elem* __restrict kt,
                         Elem* __restrict vt) {
    const int64_t total = span.context_len + span.num_tokens;
    for (int j = 0; j < KT; ++j) {
      const int64_t pos = tile * KT + j;
      if (pos >= total) {
        for (int d = 0; d < D; ++d) kt[d * KT + j] = 0.f;
        for (int d = 0; d < D; ++d) vt[j * D + d] = 0.f;
        continue;
      }
      const auto [key, value] = cache_rows<T>(call, span, pos, head);
      if constexpr (Quant<T>::scaled) {  // dequantized here, once per call: the tiles are float32
        const int64_t block = span.table[pos / call.geo.block_size];
        const float ks = call.geo.key_scale<T>(block, head), vs = call.geo.value_scale<T>(block, head);
        for (int d = 0; d < D; ++d) kt[d * KT + j] = to_float(key[d]) * ks;
        for (int d = 0; d < D; ++d) vt[j * D + d] = to_float(value[d]) * vs;
      } else {
        for (int d = 0; d < D; ++d) kt[d * KT + j] = to_float(key[d]);
        for (int d = 0; d < D; ++d) vt[j * D + d] = to_float(value[d]);
      }
    }
  }

  // S[r][0:KT] = Q[r] . K^T for QK_ROWS rows (the queries carry the scale).
  static void score_rows(const Elem* __restrict qs, const Elem* __restrict kt, float* __restrict s, float) {
    using Reg = Vec::Reg;
    Reg lo[QK_ROWS], hi[QK_ROWS];
    for (int r = 0; r < QK_ROWS; ++r) lo[r] = hi[r] = Vec::zero();
    for (int d = 0; d < D; ++d) {
      const Reg k0 = Vec::load(kt + d * KT), k1 = Vec::load(kt + d * KT + Vec::W);
      for (int r = 0; r < QK_ROWS; ++r) {
        const Reg qv = Vec::set1(qs[r * D + d]);
        lo[r] = Vec::fmadd(qv, k0, lo[r]);
        hi[r] = Vec::fmadd(qv, k1, hi[r]);
      }
    }
    for (int r = 0; r < QK_ROWS; ++r) {
      Vec::store(s + r * KT, lo[r]);
      Vec::store(s + r * KT + Vec::W, hi[r]);
    }
  }

  // A row's softmax weights, kept in its score row; returns their sum.
  static float store_weights(float* __restrict sr, Vec::Reg lo, Vec::Reg hi) {
    Vec::store(sr, lo);
    Vec::store(sr + Vec::W, hi);
    return Vec::sum(Vec::add(lo, hi));
  }

  // O[r] = O[r] * alpha[r] + sum_j P[r][j] V[j] for PV_ROWS rows, keys [0, n) of the tile.
  static void accumulate_rows(const float* __restrict p, const Elem* __restrict v, const float* __restrict alpha,
                              float* __restrict o, int n) {
    using Reg = Vec::Reg;
    Reg acc[PV_ROWS][DV];
    for (int r = 0; r < PV_ROWS; ++r) {
      const Reg scale = Vec::set1(alpha[r]);
      for (int c = 0; c < DV; ++c) acc[r][c] = Vec::mul(Vec::load(o + r * D + c * Vec::W), scale);
    }
    for (int j = 0; j < n; ++j) {
      Reg vj[DV];
      for (int c = 0; c < DV; ++c) vj[c] = Vec::load(v + j * D + c * Vec::W);
      for (int r = 0; r < PV_ROWS; ++r) {
        const Reg weight = Vec::set1(p[r * KT + j]);
        for (int c = 0; c < DV; ++c) acc[r][c] = Vec::fmadd(weight, vj[c], acc[r][c]);
      }
    }
    for (int r = 0; r < PV_ROWS; ++r)
      for (int c = 0; c < DV; ++c) Vec::store(o + r * D + c * Vec::W, acc[r][c]);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// A word holds two bfloat16 values, the first in its low half: the operand layout of vdpbf16ps.
// T: the cache's element type. bfloat16 rows are paired as they lie; quantized rows (int8, fp8)
// are dequantized with their block's scale and rounded to bfloat16 first (a bfloat16 model only:
// its queries are bfloat16 already, and the rounding is far below the quantization step).
template <typename T, int DV>
struct Bf16Math {
  static constexpr int D = DV * Vec::W;
  using Elem = uint32_t;
  static constexpr int64_t ROW = D / 2;
  static constexpr int64_t TILE = D / 2 * KT;
  static constexpr int PV_ROWS = pv_rows(DV);
  static_assert(Vec::W == 16, "bfloat16 pairs fill 512-bit vectors");

  static __m512 dot(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
  }
  // D quantized elements times their scale, rounded to bfloat16.
  static void to_bf16_row(const T* src, float scale, uint16_t* dst) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int c = 0; c < D; c += Vec::W)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(Vec::load(src + c), vscale))));
  }
  static __m512i pairs(const uint16_t* first, const uint16_t* second) {  // 16 (first[i], second[i]) words
    const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first)));
    const __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)));
    return _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
  }

  // Rounded to bfloat16 pairs, unscaled: the scale is applied to the float32 scores.
  static void load_query(const float* src, float, Elem* row) {
    for (int c = 0; c + 2 * Vec::W <= D; c += 2 * Vec::W) {
      const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + c + Vec::W), _mm512_loadu_ps(src + c));
      _mm512_storeu_si512(row + c / 2, reinterpret_cast<__m512i>(packed));
    }
    if (D % (2 * Vec::W) != 0) {  // a 16-wide head: one half vector
      const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + D - Vec::W));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + (D - Vec::W) / 2), reinterpret_cast<__m256i>(packed));
    }
  }
  static void zero_query(Elem* row) {
    for (int w = 0; w < ROW; ++w) row[w] = 0;
  }

  // Keys as [D/2][KT] words (word p of key j: its elements 2p, 2p+1), values as [KT/2][D]
  // words (word d of pair t: element d of keys 2t, 2t+1); zeros past the end.
  static void stage_tile(const Call& call, const Span& span, int64_t head, int64_t tile, Elem* __restrict kt,
                         Elem* __restrict vt) {
    const int64_t total = span.context_len + span.num_tokens;
    static const uint16_t zeros[D] = {};
    const uint16_t* values[KT];
    alignas(64) uint16_t dequantized[Quant<T>::scaled ? 2 * KT * D : 1];  // rows of a quantized cache, as bfloat16
    for (int j = 0; j < KT; ++j) {
      const int64_t pos = tile * KT + j;
      if (pos >= total) {
        for (int w = 0; w < D / 2; ++w) kt[w * KT + j] = 0;
        values[j] = zeros;
        continue;
      }
      const uint16_t *key, *value;
      if constexpr (Quant<T>::scaled) {
        const auto [qkey, qvalue] = cache_rows<T>(call, span, pos, head);
        const int64_t block = span.table[pos / call.geo.block_size];
        uint16_t* krow = dequantized + j * D;
        uint16_t* vrow = dequantized + (KT + j) * D;
        to_bf16_row(qkey, call.geo.key_scale<T>(block, head), krow);
        to_bf16_row(qvalue, call.geo.value_scale<T>(block, head), vrow);
        key = krow;
        value = vrow;
      } else {
        std::tie(key, value) = cache_rows<uint16_t>(call, span, pos, head);
      }
      const uint32_t* key_words = reinterpret_cast<const uint32_t*>(key);
      for (int w = 0; w < D / 2; ++w) kt[w * KT + j] = key_words[w];
      values[j] = value;
    }
    for (int t = 0; t < KT / 2; ++t)
      for (int c = 0; c < DV; ++c)
        _mm512_storeu_si512(vt + t * D + c * Vec::W, pairs(values[2 * t] + c * Vec::W, values[2 * t + 1] + c * Vec::W));
  }

  static void score_rows(const Elem* __restrict qs, const Elem* __restrict kt, float* __restrict s, float scale) {
    __m512 lo[QK_ROWS], hi[QK_ROWS];
    for (int r = 0; r < QK_ROWS; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int w = 0; w < D / 2; ++w) {
      const __m512i k0 = _mm512_loadu_si512(kt + w * KT), k1 = _mm512_loadu_si512(kt + w * KT + Vec::W);
      for (int r = 0; r < QK_ROWS; ++r) {
        const __m512i qv = _mm512_set1_epi32(static_cast<int>(qs[r * ROW + w]));
        lo[r] = dot(lo[r], qv, k0);
        hi[r] = dot(hi[r], qv, k1);
      }
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < QK_ROWS; ++r) {
      _mm512_storeu_ps(s + r * KT, _mm512_mul_ps(lo[r], vscale));
      _mm512_storeu_ps(s + r * KT + Vec::W, _mm512_mul_ps(hi[r], vscale));
    }
  }

  // The weights rounded to bfloat16, KT/2 words at the start of the row's score row; their sum
  // is of the rounded weights, so the output is a true weighted mean of the values.
  static float store_weights(float* __restrict sr, __m512 lo, __m512 hi) {
    const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
    _mm512_storeu_si512(sr, packed);
    const __m512i ones = _mm512_set1_epi16(0x3f80);  // bfloat16 1.0
    return _mm512_reduce_add_ps(dot(_mm512_setzero_ps(), packed, ones));
  }

  static void accumulate_rows(const float* __restrict p, const Elem* __restrict v, const float* __restrict alpha,
                              float* __restrict o, int n) {
    __m512 acc[PV_ROWS][DV];
    for (int r = 0; r < PV_ROWS; ++r) {
      const __m512 scale = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < DV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * Vec::W), scale);
    }
    const int num_pairs = (n + 1) / 2;  // a lone last key pairs with one whose weight is 0
    for (int t = 0; t < num_pairs; ++t) {
      __m512i vt[DV];
      for (int c = 0; c < DV; ++c) vt[c] = _mm512_loadu_si512(v + t * D + c * Vec::W);
      for (int r = 0; r < PV_ROWS; ++r) {
        const __m512i weight = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(p + r * KT)[t]);
        for (int c = 0; c < DV; ++c) acc[r][c] = dot(acc[r][c], weight, vt[c]);
      }
    }
    for (int r = 0; r < PV_ROWS; ++r)
      for (int c = 0; c < DV; ++c) _mm512_storeu_ps(o + r * D + c * Vec::W, acc[r][c]);
  }
};
#endif

struct Task {
  int64_t chunk, head, first_query, num_queries, cost;
};

template <typename Elem>
struct Scratch {
  std::unique_ptr<Elem[]> q;
  std::unique_ptr<float[]> o, s, m, l, alpha;
  std::unique_ptr<int64_t[]> pos;
  explicit Scratch(int64_t rows, int64_t row_elems, int64_t D)
      : q(new Elem[rows * row_elems]), o(new float[rows * D]), s(new float[rows * KT]), m(new float[rows]),
        l(new float[rows]), alpha(new float[rows]), pos(new int64_t[rows]) {}
};

// Phase 2, one task: its queries' rows against the key tiles up to its last query.
template <typename Math>
void attend_task(const Call& call, const Span& span, const Task& task, const typename Math::Elem* kt_all,
                 const typename Math::Elem* vt_all, Scratch<typename Math::Elem>& scratch) {
  constexpr int D = Math::D;
  constexpr int PV_ROWS = Math::PV_ROWS;
  using Reg = Vec::Reg;
  using Elem = typename Math::Elem;
  static_assert(ROW_PAD % PV_ROWS == 0, "value blocks must tile the padded rows");
  const int64_t G = call.group, KVH = call.num_kv_heads;
  const int64_t rows = task.num_queries * G;
  const int64_t padded = (rows + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  const int64_t first_pos = span.context_len + task.first_query;
  const int64_t end = first_pos + task.num_queries;  // keys [0, end) are attended by some row
  Elem* __restrict qs = scratch.q.get();
  float* __restrict o = scratch.o.get();
  float* __restrict s = scratch.s.get();
  float* __restrict m = scratch.m.get();
  float* __restrict l = scratch.l.get();
  float* __restrict alpha = scratch.alpha.get();
  int64_t* __restrict pos = scratch.pos.get();
  for (int64_t r = 0; r < padded; ++r) {
    Elem* row = qs + r * Math::ROW;
    if (r < rows) {
      const int64_t query = task.first_query + r / G, g = r % G;
      Math::load_query(call.q + ((span.first_row + query) * KVH + task.head) * G * D + g * D, call.scale, row);
      pos[r] = first_pos + r / G;
    } else {
      Math::zero_query(row);
      pos[r] = end - 1;
    }
    for (int d = 0; d < D; ++d) o[r * D + d] = 0.f;
    m[r] = MASKED;
    l[r] = 0.f;
  }
  const int64_t num_tiles = (end + KT - 1) / KT;
  const int64_t head_tiles = span.tile_offset + task.head * span.num_tiles;
  // Under a sliding window a row attends keys (pos - window, pos]: tiles before the first
  // row's window are skipped, and tiles before the last row's window start are masked below.
  const int64_t window = call.window;
  const int64_t first_tile = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) / KT : 0;
  for (int64_t tile = first_tile; tile < num_tiles; ++tile) {
    const Elem* kt = kt_all + (head_tiles + tile) * Math::TILE;
    const Elem* vt = vt_all + (head_tiles + tile) * Math::TILE;
    const int64_t j0 = tile * KT;
    for (int64_t r = 0; r < padded; r += QK_ROWS) Math::score_rows(qs + r * Math::ROW, kt, s + r * KT, call.scale);
    const bool diagonal = j0 + KT - 1 > first_pos;  // some key here lies after some query
    const bool behind = window > 0 && j0 < end - window;  // some key here lies before some query's window
    // Online softmax, a row (two vectors of scores) at a time.
    const Reg index_lo = Vec::iota(static_cast<float>(j0)), index_hi = Vec::iota(static_cast<float>(j0 + Vec::W));
    const Reg masked = Vec::set1(MASKED);
    const Reg back_lo = Vec::sub(Vec::zero(), index_lo), back_hi = Vec::sub(Vec::zero(), index_hi);
    for (int64_t r = 0; r < padded; ++r) {
      float* __restrict sr = s + r * KT;
      Reg lo = Vec::load(sr), hi = Vec::load(sr + Vec::W);
      if (diagonal) {
        const Reg limit = Vec::set1(static_cast<float>(pos[r]));
        lo = Vec::keep_upto(lo, index_lo, limit, masked);
        hi = Vec::keep_upto(hi, index_hi, limit, masked);
      }
      if (behind) {  // keep index >= pos - window + 1, as -index <= -(pos - window + 1)
        const Reg low = Vec::set1(static_cast<float>(window - 1 - pos[r]));
        lo = Vec::keep_upto(lo, back_lo, low, masked);
        hi = Vec::keep_upto(hi, back_hi, low, masked);
      }
      const float m_new = std::max(m[r], Vec::reduce_max(Vec::max(lo, hi)));
      if (m_new == MASKED) {  // no key of this row yet (its window starts later): nothing to add
        Math::store_weights(sr, Vec::zero(), Vec::zero());
        alpha[r] = 1.f;
        continue;
      }
      const Reg shift = Vec::set1(m_new);
      const float weight_sum = Math::store_weights(sr, vec_exp(Vec::sub(lo, shift)), vec_exp(Vec::sub(hi, shift)));
      // The row's running maximum rarely moves after its first tiles: no exp then.
      alpha[r] = m_new == m[r] ? 1.f : m[r] == MASKED ? 0.f : expf(m[r] - m_new);
      l[r] = l[r] * alpha[r] + weight_sum;
      m[r] = m_new;
    }
    const int n = static_cast<int>(std::min<int64_t>(KT, end - j0));
    for (int64_t r = 0; r < padded; r += PV_ROWS) Math::accumulate_rows(s + r * KT, vt, alpha + r, o + r * D, n);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t query = task.first_query + r / G, g = r % G;
    float* dst = call.out + ((span.first_row + query) * KVH + task.head) * G * D + g * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
}

template <typename Math>
void run(const Call& call, std::vector<Span>& spans) {
  using Elem = typename Math::Elem;
  const int64_t KVH = call.num_kv_heads;
  int64_t tiles = 0;
  std::vector<std::pair<int64_t, int64_t>> staging;  // (span, tile of every head)
  std::vector<Task> tasks;
  for (int64_t c = 0; c < (int64_t)spans.size(); ++c) {
    Span& span = spans[c];
    span.num_tiles = (span.context_len + span.num_tokens + KT - 1) / KT;
    span.tile_offset = tiles;
    tiles += KVH * span.num_tiles;
    for (int64_t t = 0; t < KVH * span.num_tiles; ++t) staging.emplace_back(c, t);
    for (int64_t first = 0; first < span.num_tokens; first += QUERY_TILE) {
      const int64_t count = std::min<int64_t>(QUERY_TILE, span.num_tokens - first);
      for (int64_t h = 0; h < KVH; ++h)
        tasks.push_back(Task{c, h, first, count, (span.context_len + first + count) * count});
    }
  }
  // Costliest first, handed out one at a time: the last tasks are the cheap ones.
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  std::unique_ptr<Elem[]> kt(new Elem[tiles * Math::TILE]), vt(new Elem[tiles * Math::TILE]);
  const int64_t max_rows = (QUERY_TILE * call.group + ROW_PAD - 1) / ROW_PAD * ROW_PAD;
  // torch's own OpenMP pool, as in the decode kernel.
#pragma omp parallel num_threads(std::max(1, call.num_threads))
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < (int64_t)staging.size(); ++i) {
      const Span& span = spans[staging[i].first];
      const int64_t head = staging[i].second / span.num_tiles, tile = staging[i].second % span.num_tiles;
      const int64_t index = span.tile_offset + staging[i].second;
      Math::stage_tile(call, span, head, tile, kt.get() + index * Math::TILE, vt.get() + index * Math::TILE);
    }
    Scratch<Elem> scratch(max_rows, Math::ROW, Math::D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < (int64_t)tasks.size(); ++i)
      attend_task<Math>(call, spans[tasks[i].chunk], tasks[i], kt.get(), vt.get(), scratch);
  }
}

// The cache's element type: 0 float32, 1 bfloat16, 2 int8, 3 fp8 e4m3fn (the last two scaled,
// dequantized into float32 tiles).
template <int DV>
bool by_dtype(int kind, bool bf16_model, const Call& call, std::vector<Span>& spans) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  switch (kind) {
    case 1: run<Bf16Math<uint16_t, DV>>(call, spans); return true;
    case 2: if (bf16_model) { run<Bf16Math<int8_t, DV>>(call, spans); return true; } break;
    case 3: if (bf16_model) { run<Bf16Math<Fp8, DV>>(call, spans); return true; } break;
  }
#else
  (void)bf16_model;
#endif
  switch (kind) {
    case 0: run<F32Math<float, DV>>(call, spans); return true;
    case 1: run<F32Math<uint16_t, DV>>(call, spans); return true;
    case 2: run<F32Math<int8_t, DV>>(call, spans); return true;
    case 3: run<F32Math<Fp8, DV>>(call, spans); return true;
  }
  return false;
}

}  // namespace

// Strides in elements. Returns 0, or -1 for a head size it was not built for.
extern "C" int pdserve_paged_prefill(const float* q, const void* key_cache, const void* value_cache, int kind,
                                     int64_t num_chunks, const int64_t* first_rows, const int64_t* num_tokens,
                                     const int64_t* context_lens, const int64_t* tables, int64_t table_width,
                                     int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size,
                                     int64_t block_stride_k, int64_t block_stride_v, int64_t token_stride_k,
                                     int64_t token_stride_v, int64_t head_stride_k, int64_t head_stride_v,
                                     const float* key_scales, const float* value_scales, int64_t scale_stride_k,
                                     int64_t scale_stride_v, int64_t scale_head_stride, float* out, float scale, int num_threads, int64_t window,
                                     int bf16_model) {
  if (head_dim % Vec::W != 0 || group < 1) return -1;
  const Call call{q, key_cache, value_cache,
                  Geometry{block_stride_k, block_stride_v, token_stride_k, token_stride_v, head_stride_k,
                           head_stride_v, block_size, key_scales, value_scales, scale_stride_k, scale_stride_v, scale_head_stride},
                  num_kv_heads, group, out, scale, num_threads, window};
  std::vector<Span> spans;
  for (int64_t c = 0; c < num_chunks; ++c)
    spans.push_back(Span{first_rows[c], num_tokens[c], context_lens[c], tables + c * table_width, 0, 0});
  switch (head_dim / Vec::W) {
    case 1: return by_dtype<1>(kind, bf16_model != 0, call, spans) ? 0 : -1;
    case 2: return by_dtype<2>(kind, bf16_model != 0, call, spans) ? 0 : -1;
    case 4: return by_dtype<4>(kind, bf16_model != 0, call, spans) ? 0 : -1;
    case 8: return by_dtype<8>(kind, bf16_model != 0, call, spans) ? 0 : -1;
    case 16: return by_dtype<16>(kind, bf16_model != 0, call, spans) ? 0 : -1;
  }
  return -1;
}
