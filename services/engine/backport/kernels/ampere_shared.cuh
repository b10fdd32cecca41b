// Ampere's instructions as the backport's CUDA kernels use them: async copies from global
// to shared memory (cp.async, with zero fill), ldmatrix, mma (bf16, fp16) and movmatrix, bf16x2
// arithmetic, byte permutes, ex2; sm89's fp8 mma, for builds that target it; and the integer
// types NVRTC lacks. Included by each
// kernel's source; compile_ptx finds it beside them. Under BACKPORT_HOST_EMULATION (the
// tests' CPU run of a kernel, tests/kernels/cuda_host_emulation.py) the emulator provides
// namespace ampere instead.
#pragma once

#ifdef __CUDACC_RTC__  // NVRTC has no C++ standard library headers
using int32_t = int;
using int64_t = long long;
using uint8_t = unsigned char;
using uint16_t = unsigned short;
using uint32_t = unsigned int;
using uint64_t = unsigned long long;
#else
#include <cstdint>
#endif

#ifndef BACKPORT_HOST_EMULATION
namespace ampere {

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// Copies kBytes from src to shared memory at dst (a shared-window address), or zeros when
// !valid (src must still be readable).
template <int kBytes>
__device__ __forceinline__ void copy_async(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 B");
  if constexpr (kBytes == 16) {  // .cg: 16-byte copies may skip L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
                 "n"(kBytes), "r"(valid ? kBytes : 0));
  }
}

template <int kBytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  copy_async<kBytes>(shared_address(dst), src, valid);
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n"); }

template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices, rows addressed by lanes 8i..8i+7 for matrix i: an mma A fragment.
__device__ __forceinline__ void load_matrix_x4(uint32_t (&a)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(address));
}

// c += a (16x16 bf16, row-major) * b (16x8 bf16, column-major), fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a (16x16 fp16, row-major) * b (16x8 fp16, column-major), fp32 accumulate.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a (16x32 fp8 e4m3, row-major) * b (32x8 fp8 e4m3, column-major), fp32 accumulate.
// sm89 and later only: a build for sm80/86 must not reach it (compile_ptx refuses the PTX).
__device__ __forceinline__ void mma_e4m3(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The transpose of an 8x8 b16 matrix held one row-pair a thread (thread t: row t / 4,
// columns 2(t % 4), +1), in the same layout.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// a * b + c on two bf16 pairs, rounded to nearest even.
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t value;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(value) : "r"(a), "r"(b), "r"(c));
  return value;
}

// Two floats as a bf16 pair (low in the low half), rounded to nearest even.
__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}

// 2^x, approximately (ex2.approx, subnormals flushed).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Byte i of the result is byte (selector nibble i & 7) of {y, x}, or that byte's sign bit
// spread over 8 bits when the nibble's bit 3 is set (prmt).
__device__ __forceinline__ uint32_t byte_permute(uint32_t x, uint32_t y, uint32_t selector) {
  uint32_t bits;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(bits) : "r"(x), "r"(y), "r"(selector));
  return bits;
}

// threadIdx.x, read again where this is called: offsets computed from it for code that runs
// rarely inside a loop are then not kept live (or spilled) across the loop.
__device__ __forceinline__ int thread_index_here() {
  int index;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(index));
  return index;
}

}  // namespace ampere
#endif
