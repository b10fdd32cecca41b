// CUDA's built-ins and the backport's Ampere instructions (ampere_shared.cuh) for a kernel
// compiled as host C++ (g++ -include this -DBACKPORT_HOST_EMULATION), run by
// cuda_host_emulation.py one block at a time, one fiber a CUDA thread. Warp-wide
// instructions (ldmatrix, mma, shuffles) exchange values through a warp's slots between
// two waits on the warp's barrier; cp.async copies land when a wait_group lets them (so a
// read before the wait sees the old bytes, as it may on the GPU).
//
// The fibers take turns on one OS thread and switch only at a barrier, so a thread runs
// from one barrier to the next without interruption: a race the kernel's barriers leave
// open shows as one fixed interleaving, not a varying one. (With an OS thread a CUDA
// thread, every warp-wide instruction woke 31 sleeping threads twice, and a 256-thread
// block spent most of its time in the OS scheduler.)
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

// As few standard headers as will do: they are most of each build's compile time.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __constant__
#define __shared__
#define __align__(n)

template <typename T>
inline T min(T a, T b) { return b < a ? b : a; }
template <typename T>
inline T max(T a, T b) { return a < b ? b : a; }

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct uint2 {
  uint32_t x, y;
};
struct uint4 {
  uint32_t x, y, z, w;
};
struct int4 {
  int32_t x, y, z, w;
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// The running fiber's: the scheduler sets them before it resumes one.
inline dim3 threadIdx;
inline dim3 blockIdx;
inline dim3 gridDim;

// The block's shared memory: blocks run one after another.
alignas(16) inline uint8_t shared[1 << 18];

namespace emulation {

constexpr int kWarpSize = 32;
// std::thread's default: a kernel's locals need what they would on an OS thread.
constexpr size_t kStackBytes = size_t{8} << 20;

// A thread's cp.async copies: the group being issued, then committed groups, oldest first.
struct Copy {
  uint32_t dst;
  std::vector<uint8_t> bytes;
};

// One CUDA thread of the running block.
struct Fiber {
  ucontext_t context;
  dim3 index;
  std::vector<std::vector<Copy>> copy_groups;
  std::vector<Copy> open_group;
  bool finished = false;
};

inline ucontext_t scheduler;
inline Fiber* running = nullptr;
// Arrivals at any barrier: a round of the scheduler with none, and no fiber finished, is a
// deadlock.
inline uint64_t arrivals = 0;

inline void yield() { swapcontext(&running->context, &scheduler); }

// A barrier of `expected` fibers. The arrival that completes it opens the next generation
// and goes on; the others return to the scheduler until their generation has passed.
struct Barrier {
  explicit Barrier(int expected) : expected(expected) {}
  void arrive_and_wait() {
    const uint64_t mine = generation;
    ++arrivals;
    if (++arrived == expected) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == mine) yield();
  }
  int expected;
  int arrived = 0;
  uint64_t generation = 0;
};

struct Block {
  explicit Block(int threads) : barrier(threads), warps(threads / kWarpSize) {}
  Barrier barrier;
  unsigned barriers = 0;  // __syncthreads the block has passed
  struct Warp {
    Barrier barrier{kWarpSize};
    uint32_t slots[kWarpSize][10];
  };
  std::vector<Warp> warps;
};

inline Block* block = nullptr;
// Barriers each block of the last grid passed, in launch order (x fastest): a count of its
// steps for kernels with one barrier a step.
inline std::vector<unsigned> block_barriers;

// The first fault a kernel made (the GPU would have stopped it there), for the launcher;
// empty while there is none.
inline char fault[256] = "";

inline void check(bool ok, const char* what, uint64_t address) {
  if (!ok && fault[0] == '\0') {
    std::snprintf(fault, sizeof fault, "%s at %llu", what,
                  static_cast<unsigned long long>(address));
  }
}

inline std::vector<std::vector<Copy>>& copy_groups() { return running->copy_groups; }
inline std::vector<Copy>& open_group() { return running->open_group; }

inline int lane() { return threadIdx.x % kWarpSize; }
inline Block::Warp& warp() { return block->warps[threadIdx.x / kWarpSize]; }

// Puts `count` words in this lane's slots and returns once every lane of the warp has, so
// the slots may be read; `done` must follow before they are written again.
inline void publish(const uint32_t* words, int count) {
  for (int i = 0; i < count; ++i) warp().slots[lane()][i] = words[i];
  warp().barrier.arrive_and_wait();
}
inline void done() { warp().barrier.arrive_and_wait(); }

// The fibers' stacks in one mapping, pages committed as they are touched, each with a page
// below it that faults an overflow.
class Stacks {
 public:
  explicit Stacks(int count)
      : guard_(sysconf(_SC_PAGESIZE)), stride_(guard_ + kStackBytes), count_(count) {
    void* mapping = mmap(nullptr, stride_ * count_, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = mapping == MAP_FAILED ? nullptr : static_cast<uint8_t*>(mapping);
    for (size_t i = 0; base_ != nullptr && i < count_; ++i)
      mprotect(base_ + i * stride_, guard_, PROT_NONE);
  }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;
  ~Stacks() {
    if (base_ != nullptr) munmap(base_, stride_ * count_);
  }
  bool mapped() const { return base_ != nullptr; }
  void* lowest_address(size_t fiber) const { return base_ + fiber * stride_ + guard_; }

 private:
  size_t guard_, stride_, count_;
  uint8_t* base_;
};

// The grid's kernel, called by every fiber (a function pointer: <functional> alone added a
// fifth to each build's compile time).
inline void (*block_kernel)(const void*) = nullptr;
inline const void* block_kernel_call = nullptr;

inline void run_fiber() {
  block_kernel(block_kernel_call);
  running->finished = true;
}  // returns to the scheduler through uc_link

// Runs every fiber of the block until all have finished; a round in which none arrives at
// a barrier or finishes leaves them waiting for good, reported as the block's fault.
inline void run_block(std::vector<Fiber>& fibers, const Stacks& stacks) {
  for (size_t t = 0; t < fibers.size(); ++t) {
    Fiber& fiber = fibers[t];
    fiber.index = {static_cast<unsigned>(t), 0, 0};
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = stacks.lowest_address(t);
    fiber.context.uc_stack.ss_size = kStackBytes;
    fiber.context.uc_link = &scheduler;
    makecontext(&fiber.context, run_fiber, 0);
  }
  for (size_t live = fibers.size(); live > 0;) {
    const uint64_t arrivals_before = arrivals;
    const size_t live_before = live;
    for (Fiber& fiber : fibers) {
      if (fiber.finished) continue;
      running = &fiber;
      threadIdx = fiber.index;
      swapcontext(&scheduler, &fiber.context);
      live -= fiber.finished;
    }
    if (live == live_before && arrivals == arrivals_before) {
      // The waiting fibers are abandoned, with what their stacks hold.
      check(false, "threads wait at a barrier the others never reach, block", blockIdx.x);
      break;
    }
  }
  running = nullptr;
}

template <typename Kernel>
void run_grid(dim3 grid, int threads, Kernel kernel) {
  block_barriers.clear();
  const Stacks stacks(threads);
  if (!stacks.mapped()) {
    check(false, "no memory for the fibers' stacks, threads", threads);
    return;
  }
  block_kernel = [](const void* call) { (*static_cast<const Kernel*>(call))(); };
  block_kernel_call = &kernel;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        Block state(threads);
        block = &state;
        blockIdx = {x, y, z};
        std::vector<Fiber> fibers(threads);
        run_block(fibers, stacks);
        block_barriers.push_back(state.barriers);
        block = nullptr;
      }
  block_kernel = nullptr;
  block_kernel_call = nullptr;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, 4);
  return value;
}

inline uint16_t float_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

inline float decode_fp16(uint16_t bits) {
  const int exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  }
  return (bits & 0x8000) ? -magnitude : magnitude;
}

// `decode` of every bit pattern of `Bits`, worked out once: ldexp, a call an element, was
// most of an mma's time.
template <typename Bits, float (*decode)(Bits)>
inline float decoded(Bits bits) {
  static const std::vector<float> table = [] {
    std::vector<float> values(size_t{1} << (8 * sizeof(Bits)));
    for (size_t pattern = 0; pattern < values.size(); ++pattern)
      values[pattern] = decode(static_cast<Bits>(pattern));
    return values;
  }();
  return table[bits];
}

inline float fp16_to_float(uint16_t bits) { return decoded<uint16_t, decode_fp16>(bits); }

// This lane's C fragment (rows g, g + 8 at columns 2t, 2t + 1) += A B, in double.
template <int kK>
inline void accumulate_tile(float (&c)[4], const float (&A)[16][kK], const float (&B)[kK][8]) {
  const int g = lane() / 4, t = lane() % 4;
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r / 2), column = 2 * t + r % 2;
    double sum = c[r];
    for (int k = 0; k < kK; ++k) sum += static_cast<double>(A[row][k]) * B[k][column];
    c[r] = static_cast<float>(sum);
  }
}

// C += A B of mma.m16n8k16 on this lane's fragments, the operands' halves decoded by
// `to_float` (PTX ISA layout: thread (g, t) = (lane / 4, lane % 4) holds A's rows g, g + 8
// at k = 2t, 2t + 1 (a0, a1) and k = 2t + 8, 2t + 9 (a2, a3), B's column g at the same k
// (b0, b1), C's rows g, g + 8 at columns 2t, 2t + 1).
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                         float (*to_float)(uint16_t)) {
  const uint32_t words[6] = {a[0], a[1], a[2], a[3], b0, b1};
  publish(words, 6);
  float A[16][16], B[16][8];
  for (int other = 0; other < kWarpSize; ++other) {
    const uint32_t* w = block->warps[threadIdx.x / kWarpSize].slots[other];
    const int g = other / 4, t = other % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, ks[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int r = 0; r < 4; ++r) {
      A[rows[r]][ks[r]] = to_float(w[r] & 0xFFFF);
      A[rows[r]][ks[r] + 1] = to_float(w[r] >> 16);
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = to_float(w[4 + r] & 0xFFFF);
      B[2 * t + 8 * r + 1][g] = to_float(w[4 + r] >> 16);
    }
  }
  done();
  accumulate_tile(c, A, B);
}

inline float decode_e4m3(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF, mantissa = bits & 0x7;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else if (exponent == 15 && mantissa == 7) {
    magnitude = NAN;  // e4m3 has no infinity
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa | 0x8), exponent - 10);
  }
  return (bits & 0x80) ? -magnitude : magnitude;
}

inline float e4m3_to_float(uint8_t bits) { return decoded<uint8_t, decode_e4m3>(bits); }

// C += A B of mma.m16n8k32 on e4m3 fragments (PTX ISA layout: thread (g, t) holds A's rows
// g, g + 8 at k = 4t .. 4t + 3 (a0, a1) and k = 16 + 4t .. (a2, a3), a byte a k, and B's
// column g at the same k (b0, b1); C as for m16n8k16).
inline void mma_m16n8k32_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const uint32_t words[6] = {a[0], a[1], a[2], a[3], b0, b1};
  publish(words, 6);
  float A[16][32], B[32][8];
  for (int other = 0; other < kWarpSize; ++other) {
    const uint32_t* w = block->warps[threadIdx.x / kWarpSize].slots[other];
    const int g = other / 4, t = other % 4;
    const int rows[4] = {g, g + 8, g, g + 8}, ks[4] = {4 * t, 4 * t, 16 + 4 * t, 16 + 4 * t};
    for (int byte = 0; byte < 4; ++byte) {
      for (int r = 0; r < 4; ++r) A[rows[r]][ks[r] + byte] = e4m3_to_float(w[r] >> (8 * byte));
      for (int r = 0; r < 2; ++r) {
        B[4 * t + 16 * r + byte][g] = e4m3_to_float(w[4 + r] >> (8 * byte));
      }
    }
  }
  done();
  accumulate_tile(c, A, B);
}

}  // namespace emulation

inline void __syncthreads() {
  if (threadIdx.x == 0) ++emulation::block->barriers;
  emulation::block->barrier.arrive_and_wait();
}

inline float __int_as_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

inline float __shfl_xor_sync(unsigned, float value, int lane_mask) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  emulation::publish(&bits, 1);
  const uint32_t partner = emulation::warp().slots[emulation::lane() ^ lane_mask][0];
  emulation::done();
  return __int_as_float(partner);
}

inline int __shfl_xor_sync(unsigned, int value, int lane_mask) {
  const uint32_t bits = static_cast<uint32_t>(value);
  emulation::publish(&bits, 1);
  const uint32_t partner = emulation::warp().slots[emulation::lane() ^ lane_mask][0];
  emulation::done();
  return static_cast<int>(partner);
}

// The value of lane `source_lane` (0..31).
inline int __shfl_sync(unsigned, int value, int source_lane) {
  const uint32_t bits = static_cast<uint32_t>(value);
  emulation::publish(&bits, 1);
  const uint32_t source = emulation::warp().slots[source_lane % emulation::kWarpSize][0];
  emulation::done();
  return static_cast<int>(source);
}

// The value of the lane `delta` below; lanes below `delta` keep their own.
inline int __shfl_up_sync(unsigned, int value, unsigned delta) {
  const uint32_t bits = static_cast<uint32_t>(value);
  emulation::publish(&bits, 1);
  const int lane = emulation::lane();
  const uint32_t source =
      lane >= static_cast<int>(delta) ? emulation::warp().slots[lane - delta][0] : bits;
  emulation::done();
  return static_cast<int>(source);
}

inline bool __any_sync(unsigned, bool predicate) {
  const uint32_t word = predicate;
  emulation::publish(&word, 1);
  bool any = false;
  for (int other = 0; other < emulation::kWarpSize; ++other)
    any = any || emulation::warp().slots[other][0];
  emulation::done();
  return any;
}

inline size_t __cvta_generic_to_shared(const void* pointer) {
  return static_cast<const uint8_t*>(pointer) - shared;
}

namespace ampere {

inline float negative_infinity() { return __int_as_float(0xff800000u); }

inline int thread_index_here() { return static_cast<int>(threadIdx.x); }

inline uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

template <int kBytes>
void copy_async(uint32_t dst, const void* src, bool valid) {
  emulation::check(dst % kBytes == 0, "cp.async to a misaligned shared address", dst);
  emulation::check(reinterpret_cast<uintptr_t>(src) % kBytes == 0,
                   "cp.async from a misaligned global address",
                   reinterpret_cast<uintptr_t>(src));
  emulation::check(dst + kBytes <= sizeof(shared), "cp.async past shared memory", dst);
  emulation::Copy copy{dst, std::vector<uint8_t>(kBytes, 0)};
  if (valid) std::memcpy(copy.bytes.data(), src, kBytes);
  emulation::open_group().push_back(std::move(copy));
}

template <int kBytes>
void copy_async(void* dst, const void* src, bool valid) {
  copy_async<kBytes>(shared_address(dst), src, valid);
}

inline void commit_copies() {
  emulation::copy_groups().push_back(std::move(emulation::open_group()));
  emulation::open_group().clear();
}

template <int kPending>
void wait_copies() {
  auto& groups = emulation::copy_groups();
  while (groups.size() > static_cast<size_t>(kPending)) {
    for (const auto& copy : groups.front())
      std::memcpy(shared + copy.dst, copy.bytes.data(), copy.bytes.size());
    groups.erase(groups.begin());
  }
}

inline void load_matrix_x4(uint32_t (&a)[4], uint32_t address) {
  emulation::check(address % 16 == 0, "ldmatrix row at a misaligned address", address);
  emulation::publish(&address, 1);
  const int group = emulation::lane() / 4, quad = emulation::lane() % 4;
  for (int i = 0; i < 4; ++i) {
    const uint32_t row = emulation::warp().slots[8 * i + group][0];
    std::memcpy(&a[i], shared + row + 4 * quad, 4);
  }
  emulation::done();
}

inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::mma_m16n8k16(c, a, b0, b1, emulation::bf16_to_float);
}

inline void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::mma_m16n8k16(c, a, b0, b1, emulation::fp16_to_float);
}

inline void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulation::mma_m16n8k32_e4m3(c, a, b0, b1);
}

// movmatrix.trans: thread t holds row t / 4, columns 2(t % 4), +1 of an 8x8 b16 matrix.
inline uint32_t transpose_8x8(uint32_t x) {
  emulation::publish(&x, 1);
  const int row = emulation::lane() / 4, column = 2 * (emulation::lane() % 4);
  uint32_t halves[2];
  for (int i = 0; i < 2; ++i) {  // element (row, column + i) of the transpose
    const uint32_t held = emulation::warp().slots[4 * (column + i) + row / 2][0];
    halves[i] = (held >> (16 * (row % 2))) & 0xFFFF;
  }
  emulation::done();
  return halves[0] | (halves[1] << 16);
}

inline uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t out = 0;
  for (int i = 0; i < 2; ++i) {
    auto half = [i](uint32_t pair) {
      return emulation::bf16_to_float((pair >> (16 * i)) & 0xFFFF);
    };
    const float value = static_cast<float>(static_cast<double>(half(a)) * half(b) + half(c));
    out |= static_cast<uint32_t>(emulation::float_to_bf16(value)) << (16 * i);
  }
  return out;
}

inline uint32_t pack_bf16(float low, float high) {
  return emulation::float_to_bf16(low) |
         (static_cast<uint32_t>(emulation::float_to_bf16(high)) << 16);
}

inline float fast_exp2(float x) { return std::exp2(x); }

inline uint32_t byte_permute(uint32_t x, uint32_t y, uint32_t selector) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xF;
    uint32_t byte = (bytes >> (8 * (nibble & 7))) & 0xFF;
    if (nibble & 8) byte = (byte & 0x80) ? 0xFF : 0;
    out |= byte << (8 * i);
  }
  return out;
}

}  // namespace ampere
