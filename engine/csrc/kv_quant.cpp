// A step's new keys (or values) written into a quantized paged KV cache: int8 or fp8 (e4m3fn),
// with one float32 scale per (block, KV head), kept inside the block (engine/kv_cache.py).
//
// A block fills over several steps (a prompt in chunks, then a token per decode step), so its
// scale can only grow: a new token larger than the block's range raises the scale, and the
// tokens already in the block are re-quantized to it (value * old / new, rounded again). A block
// whose first token (offset 0) is in this step starts afresh: whatever a freed block held before
// is forgotten. Per (block, head) the scale is amax / QMAX (127 for int8, 448 for e4m3), so
// nothing clips; a head of zeros keeps scale 0 and reads back as zeros.
//
// Layout: src [tokens, heads, head_dim] float32 or bfloat16, contiguous; cache elements are one
// byte, strides in bytes (= elements); scales [num_blocks] x heads floats, block and head strides in floats.
#include "simd.h"

#include <cstring>
#include <unordered_map>

namespace {

// float -> e4m3fn, round to nearest even, saturating at 448 (no NaN is ever produced).
inline uint8_t to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  const float a = std::fabs(x);
  if (!(a < 464.f)) return sign | 0x7E;  // 448 is the largest; halfway to the next (480) and beyond saturate
  if (a < 0.015625f) {                   // below 2^-6: subnormal steps of 2^-9
    const float steps = std::nearbyint(a * 512.f);  // ties to even (default rounding mode)
    return sign | static_cast<uint8_t>(steps);      // 8 steps = 2^-6, the smallest normal: 0x08
  }
  uint32_t abits;
  std::memcpy(&abits, &a, sizeof abits);
  // Keep 3 mantissa bits, rounding the other 20 to nearest even; a carry bumps the exponent.
  const uint32_t rounded = abits + 0x7FFFFu + ((abits >> 20) & 1u);
  const int exponent = static_cast<int>((rounded >> 23) & 0xFF) - 127 + 7;
  const uint32_t mantissa = (rounded >> 20) & 0x7u;
  const uint32_t code = (static_cast<uint32_t>(exponent) << 3) | mantissa;
  return sign | static_cast<uint8_t>(std::min<uint32_t>(code, 0x7E));
}

inline uint8_t quantize(float x, float inv_scale, bool fp8) {
  if (fp8) return to_e4m3(x * inv_scale);
  const float q = std::nearbyint(x * inv_scale);
  return static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.f, 127.f)));
}

// to_float(Fp8) gives the value times 2^-8 (simd.h), as the attention kernels read it.
inline float dequantize(uint8_t v, bool fp8) { return fp8 ? to_float(Fp8{v}) * 256.f : static_cast<float>(static_cast<int8_t>(v)); }

template <typename T>
void write(const T* src, int64_t num_tokens, int64_t heads, int64_t dim, const int64_t* slot_blocks,
           const int64_t* slot_offsets, uint8_t* cache, int64_t block_stride, int64_t token_stride, int64_t head_stride,
           float* scales, int64_t scale_block_stride, int64_t scale_head_stride, bool fp8) {
  const float qmax = fp8 ? 448.f : 127.f;
  // The blocks this step touches, each with its first new offset and per-head range.
  std::unordered_map<int64_t, int64_t> index;
  std::vector<int64_t> blocks, first_offset, token_block(num_tokens);  // token_block: index into blocks
  std::vector<float> amax;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t block = slot_blocks[t];
    auto [it, fresh] = index.emplace(block, (int64_t)blocks.size());
    if (fresh) {
      blocks.push_back(block);
      first_offset.push_back(slot_offsets[t]);
      amax.resize(amax.size() + heads, 0.f);
    }
    const int64_t i = token_block[t] = it->second;
    first_offset[i] = std::min(first_offset[i], slot_offsets[t]);
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = src + (t * heads + h) * dim;
      float m = amax[i * heads + h];
      for (int64_t d = 0; d < dim; ++d) m = std::max(m, std::fabs(to_float(row[d])));
      amax[i * heads + h] = m;
    }
  }
  // Each touched (block, head): its new scale, and its earlier tokens re-quantized if it grew.
  std::vector<float> inv_scale(amax.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    float* block_scales = scales + blocks[i] * scale_block_stride;
    uint8_t* block_data = cache + blocks[i] * block_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float old_scale = first_offset[i] == 0 ? 0.f : block_scales[h * scale_head_stride];
      const float scale = std::max(old_scale, amax[i * heads + h] / qmax);
      if (old_scale > 0.f && scale > old_scale) {
        const float ratio = old_scale / scale;
        for (int64_t offset = 0; offset < first_offset[i]; ++offset) {
          uint8_t* row = block_data + offset * token_stride + h * head_stride;
          for (int64_t d = 0; d < dim; ++d) row[d] = quantize(dequantize(row[d], fp8) * ratio, 1.f, fp8);
        }
      }
      block_scales[h * scale_head_stride] = scale;
      inv_scale[i * heads + h] = scale > 0.f ? 1.f / scale : 0.f;
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t i = token_block[t];
    uint8_t* token = cache + slot_blocks[t] * block_stride + slot_offsets[t] * token_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = src + (t * heads + h) * dim;
      uint8_t* out = token + h * head_stride;
      const float inv = inv_scale[i * heads + h];
      for (int64_t d = 0; d < dim; ++d) out[d] = quantize(to_float(row[d]), inv, fp8);
    }
  }
}

}  // namespace

extern "C" void pdserve_kv_quant_write(const void* src, int src_bf16, int64_t num_tokens, int64_t heads, int64_t dim,
                                       const int64_t* slot_blocks, const int64_t* slot_offsets, void* cache,
                                       int64_t block_stride, int64_t token_stride, int64_t head_stride, float* scales,
                                       int64_t scale_block_stride, int64_t scale_head_stride, int fp8) {
  uint8_t* data = static_cast<uint8_t*>(cache);
  if (src_bf16)
    write(static_cast<const uint16_t*>(src), num_tokens, heads, dim, slot_blocks, slot_offsets, data, block_stride,
          token_stride, head_stride, scales, scale_block_stride, scale_head_stride, fp8 != 0);
  else
    write(static_cast<const float*>(src), num_tokens, heads, dim, slot_blocks, slot_offsets, data, block_stride,
          token_stride, head_stride, scales, scale_block_stride, scale_head_stride, fp8 != 0);
}
