// All-reduce (sum) between the tensor-parallel ranks of one worker through shared memory.
//
// A worker's ranks share a node (its placement group packs them), and on a CPU gloo's
// all-reduce over loopback TCP took 860 us for a decode step's 2.3 KB row on a 2-core host:
// 60 of them, two per layer of the 135M shape, were 81% of a TP-2 decode step. Here each rank
// copies its tensor into its slot of a shared region, publishes a sequence number, waits for
// every other rank's, and sums all slots in rank order, so every rank gets the same bits.
//
// Region: a header of per-rank flags (two per rank, a cache line each), then two generations
// of slots [2][world][slot_bytes]. Operation seq uses generation seq & 1: a rank writes its
// slot of a generation again only at seq + 2, after every rank published seq + 1, i.e. after
// every rank finished reading the slots of seq.
//
// A rank that leaves its group for good (its step failed there alone, so the others wait in a
// collective it will never reach) sets its flags to ``kAborted``: the others stop waiting at
// once instead of after the timeout.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <sched.h>

namespace {

constexpr int64_t kLine = 64;
constexpr uint64_t kAborted = ~uint64_t{0};

inline std::atomic<uint64_t>* flag(void* region, int64_t rank, int64_t generation) {
  return reinterpret_cast<std::atomic<uint64_t>*>(static_cast<char*>(region) + (rank * 2 + generation) * kLine);
}

inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline uint16_t narrow(float x) {  // round to nearest even, as torch rounds
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// False if the other rank did not arrive within ``timeout_s`` (it died or hangs: a rank that
// is alive reaches each all-reduce of a step within milliseconds of the others) or aborted.
bool wait_for(std::atomic<uint64_t>* other, uint64_t seq, double timeout_s) {
  // Spin while the other rank is about to arrive (balanced shards arrive within microseconds);
  // yield the core after that, so a rank waiting for a descheduled one does not starve it.
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spins = 0;; ++spins) {
    const uint64_t seen = other->load(std::memory_order_acquire);
    if (seen == kAborted) return false;
    if (seen >= seq) return true;
    if (spins < 4096) {
      _mm_pause();
      continue;
    }
    sched_yield();
    if ((spins & 1023) == 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > timeout_s)
      return false;
  }
}

}  // namespace

extern "C" int64_t pdserve_shm_header_bytes(int64_t world) { return world * 2 * kLine; }

// Rank ``rank`` leaves the group: every wait for it, now or later, fails at once.
extern "C" void pdserve_shm_abort(void* region, int64_t rank) {
  for (int64_t generation = 0; generation < 2; ++generation) flag(region, rank, generation)->store(kAborted, std::memory_order_release);
}

// Sum ``n`` elements of ``data`` (float32, or bfloat16 when ``bf16``) over ``world`` ranks in
// place. ``seq`` starts at 1 and grows by one per call, the same on every rank. Returns 0, or
// -1 when another rank did not arrive within ``timeout_s`` (``data`` is then unchanged).
extern "C" int pdserve_shm_allreduce(void* region, int64_t rank, int64_t world, int64_t slot_bytes, void* data, int64_t n,
                                     int bf16, uint64_t seq, double timeout_s) {
  const int64_t generation = static_cast<int64_t>(seq & 1);
  const int64_t elem = bf16 ? 2 : 4;
  char* slots = static_cast<char*>(region) + pdserve_shm_header_bytes(world) + generation * world * slot_bytes;
  std::memcpy(slots + rank * slot_bytes, data, n * elem);
  flag(region, rank, generation)->store(seq, std::memory_order_release);
  for (int64_t other = 0; other < world; ++other)
    if (other != rank && !wait_for(flag(region, other, generation), seq, timeout_s)) return -1;
  if (bf16) {
    uint16_t* out = static_cast<uint16_t*>(data);
    for (int64_t i = 0; i < n; ++i) {
      float acc = 0.f;
      for (int64_t r = 0; r < world; ++r) acc += widen(reinterpret_cast<const uint16_t*>(slots + r * slot_bytes)[i]);
      out[i] = narrow(acc);
    }
    return 0;
  }
  float* out = static_cast<float*>(data);
  const float* first = reinterpret_cast<const float*>(slots);
  std::memcpy(out, first, n * sizeof(float));
  for (int64_t r = 1; r < world; ++r) {
    const float* part = reinterpret_cast<const float*>(slots + r * slot_bytes);
    for (int64_t i = 0; i < n; ++i) out[i] += part[i];
  }
  return 0;
}
