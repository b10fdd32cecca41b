// Sparse MLA decode over the fp8_ds_mla paged cache with Ampere's mma.sync: the CUDA
// counterpart of sparse_mla_decode.py's Triton kernel, for sm80/86/89.
//
// Why CUDA: the Triton kernel spends a 32-key step in 12 barrier-separated phases with 8
// warps an SM (docs/kernels.md). Here a step has 3 barriers, the dequantized K never
// goes through shared memory, and a block uses 55 KB and under 128 registers a thread, so
// four blocks (16 warps) share an H200 SM (two on sm80, one on sm86/89).
//
// One block = 16 heads (one mma M tile) of one token, one split of its slot lists; four
// warps. Per step of 32 keys:
//   1. cp.async has staged the 32 rows' bytes (fp8 NoPE, bf16 RoPE, UE8M0 scales) a
//      step ahead; rows of padding slots are zero-filled.
//   2. QK^T, keys split across warps: warp w owns keys 8w..8w+7 (one n8 tile) over all
//      512 dims. Its B fragments are dequantized from the staged bytes straight into
//      registers. The reduction order of the 512 dims is free, so a thread's 16-byte
//      load (16 consecutive dims of one key) feeds four k16 chunks; q is staged in
//      shared memory in the same permuted order once per block.
//   3. Each warp's row maxima go to shared memory; after a barrier every warp takes the
//      step's maximum from them (so m agrees across warps), exponentiates its own 8 keys'
//      scores and writes them as bf16 to the step's P tile; after another barrier every
//      warp loads P's A fragments with ldmatrix. Row sums stay per thread until the end.
//   4. PV, dims split across warps: warp w owns output dims 128w..128w+127. Its B
//      fragments (pairs of keys for one dim) are dequantized from the staged bytes again,
//      with output dims permuted so a thread reads 4 consecutive bytes of a row.
// fp8 -> bf16 without fp8 instructions: prmt sign-extends a byte per 16-bit half, a shift
// and mask leave sign, exponent and mantissa in bf16's fields (value * 2^-120), and one
// bf16x2 fma by 2^(120 + exponent) applies the power-of-two scale; exact (as
// fp8_e4m3.e4m3_dequantize_bf16).
//
// Output: normalized partials [T, splits, H, 512] fp32 and base-2 lse [T, splits, H]
// (-inf for no key); sparse_mla_combine merges them and applies the attention sink.

#ifdef __CUDACC_RTC__  // NVRTC has no C++ standard library headers
using int32_t = int;
using int64_t = long long;
using uint8_t = unsigned char;
using uint16_t = unsigned short;
using uint32_t = unsigned int;
#else
#include <cstdint>
#endif

namespace {

constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;
constexpr int kDataBytes = 576;   // 448 fp8 + 64 bf16 RoPE values
constexpr int kScaleBytes = 8;    // 7 UE8M0 exponents + a pad byte
constexpr int kHeads = 16;        // mma.m16n8k16's M
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 32;         // keys a step: one n8 tile per warp for QK^T
#ifndef SPARSE_MLA_DECODE_STAGES
#define SPARSE_MLA_DECODE_STAGES 2
#endif
// Steps of rows in shared memory: the rows of the next kStages - 1 steps load while a
// step computes.
constexpr int kStages = SPARSE_MLA_DECODE_STAGES;
// 592 = 576 + 16: makes the PV loads (4 keys x 8 dims a quarter-warp) conflict-free;
// the QK^T 16-byte loads then see one 2-way conflict in 8.
constexpr int kRowStride = 592;
constexpr int kQStride = 520;     // bf16 per staged q row: +8 spreads ldmatrix rows over banks
constexpr int kPStride = 40;  // bf16 per row of the step's P tile: +8 spreads ldmatrix rows
constexpr int kDimsPerWarp = kHeadDim / kWarps;  // 128 output dims a warp in PV

constexpr int kQBytes = kHeads * kQStride * 2;
constexpr int kRowsBytes = kStages * kKeys * kRowStride;
constexpr int kScalesBytes = kStages * kKeys * kScaleBytes;
constexpr int kValidBytes = kStages * kKeys;
constexpr int kStepMaxBytes = kHeads * kWarps * 4;  // each warp's row maxima of a step
constexpr int kPBytes = kHeads * kPStride * 2;
constexpr int kSharedBytes =
    kQBytes + kRowsBytes + kScalesBytes + kValidBytes + kStepMaxBytes + kPBytes;

}  // namespace

// Must match sparse_mla_decode_cuda.DecodeParams field for field.
struct DecodeParams {
  const uint16_t* q;  // bf16 [T, H, 512]
  const uint8_t* cache;
  const uint8_t* extra_cache;
  const int32_t* slots;
  const int32_t* extra_slots;
  const int32_t* lengths;        // null: the whole list
  const int32_t* extra_lengths;  // null: the whole list
  float* partial_out;            // [T, splits, H, 512]
  float* partial_lse;            // [T, splits, H]
  int64_t q_token_stride;
  int64_t q_head_stride;
  int64_t block_stride;
  int64_t extra_block_stride;
  int64_t slots_stride;
  int64_t extra_slots_stride;
  int32_t block_size_log2;  // pages hold a power of two of tokens (FlashMLA: 64)
  int32_t extra_block_size_log2;
  int32_t list_width;
  int32_t extra_list_width;
  int32_t split_len;
  int32_t extra_split_len;
  int32_t num_heads;
  int32_t num_splits;
  float qk_scale_log2;
};
static_assert(sizeof(DecodeParams) == 160, "DecodeParams changed: update the Python struct");

extern "C" __constant__ int kSparseMlaDecodeSharedBytes = kSharedBytes;

namespace {

__device__ __forceinline__ float negative_infinity() { return __int_as_float(0xff800000u); }

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_8(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 8 : 0));
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;\n"); }

template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void load_q_fragment(uint32_t (&a)[4], uint32_t address) {
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

// Two fp8 e4m3 bytes picked by `selector` (from x and y; each selector byte pair is
// "byte, its sign") -> two bf16 values times the multipliers in `scale_pair`.
__device__ __forceinline__ uint32_t dequantize_pair(uint32_t x, uint32_t y, uint32_t selector,
                                                    uint32_t scale_pair) {
  uint32_t bits;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(bits) : "r"(x), "r"(y), "r"(selector));
  bits = (bits << 4) & 0x87F087F0u;
  uint32_t value;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n"
      : "=r"(value)
      : "r"(bits), "r"(scale_pair), "r"(0x80008000u));
  return value;
}

// bf16 bits of 2^(120 + exponent) for a UE8M0 byte (exponent = byte - 127); bytes up to
// 134 (exponent 7) stay finite, as for the Triton path.
__device__ __forceinline__ uint32_t scale_bits(uint32_t ue8m0) { return (ue8m0 + 120u) << 7; }

// scale_bits of two exponent bytes at once, picked from x and y by a prmt selector that
// puts them in bytes 0 and 2 with zero bytes above each (halves stay below 2^16).
__device__ __forceinline__ uint32_t scale_bits_pair(uint32_t x, uint32_t y, uint32_t selector) {
  uint32_t bytes;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(bytes) : "r"(x), "r"(y), "r"(selector));
  return (bytes + 0x00780078u) << 7;
}

__device__ __forceinline__ uint32_t pack_bf16(float low, float high) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The slot lists of one (token, split): list-1 positions first, then extra-list ones,
// seen as one run of `total` keys.
struct SlotRun {
  const int32_t* slots;
  const int32_t* extra_slots;
  int count;
  int total;

  __device__ __forceinline__ int slot(int position, bool& is_extra) const {
    is_extra = position >= count;
    if (position >= total) return -1;
    return is_extra ? extra_slots[position - count] : slots[position];
  }
};

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, 4)
    sparse_mla_decode_sm80(const DecodeParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared);
  uint8_t* rows = shared + kQBytes;
  uint8_t* scales = rows + kRowsBytes;
  uint8_t* valid_keys = scales + kScalesBytes;
  float* step_max = reinterpret_cast<float*>(valid_keys + kValidBytes);
  uint16_t* p_tile = reinterpret_cast<uint16_t*>(valid_keys + kValidBytes + kStepMaxBytes);

  const int head_block = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t token = blockIdx.z;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int group = lane / 4;  // mma "groupID": A/C row, B column
  const int quad = lane % 4;   // mma "threadID_in_group"
  const int head0 = head_block * kHeads;

  // q -> shared memory in the permuted k order: physical dims 64g + 16c + 4t + {0..3}
  // (c = a thread's quad lane when it loads K) land in k chunk 4g + t at k = 2c, 2c + 1
  // (dims +0, +1) and k = 2c + 8, 2c + 9 (dims +2, +3).
  for (int item = thread; item < kHeads * (kHeadDim / 4); item += kThreads) {
    const int head = item / (kHeadDim / 4);
    const int dim = (item % (kHeadDim / 4)) * 4;
    uint2 values = make_uint2(0, 0);
    if (head0 + head < p.num_heads) {
      values = *reinterpret_cast<const uint2*>(p.q + token * p.q_token_stride +
                                              (head0 + head) * p.q_head_stride + dim);
    }
    const int g = dim / 64, c = (dim % 64) / 16, t = (dim % 16) / 4;
    uint32_t* row = reinterpret_cast<uint32_t*>(q_tile + head * kQStride + (4 * g + t) * 16);
    row[c] = values.x;
    row[4 + c] = values.y;
  }

  // This split's keys: positions [start, start + split_len) of each list, cut to its length.
  const int start = split * p.split_len;
  const int extra_start = split * p.extra_split_len;
  int length = p.list_width;
  if (p.lengths != nullptr) length = min(length, p.lengths[token]);
  int extra_length = p.extra_list_width;
  if (p.extra_lengths != nullptr) extra_length = min(extra_length, p.extra_lengths[token]);
  SlotRun run;
  run.slots = p.slots + token * p.slots_stride + start;
  run.extra_slots = p.extra_slots + token * p.extra_slots_stride + extra_start;
  run.count = max(0, min(start + p.split_len, length) - start);
  run.total = run.count + max(0, min(extra_start + p.extra_split_len, extra_length) - extra_start);
  const int num_steps = (run.total + kKeys - 1) / kKeys;

  // Copy duty: 4 threads a key, 9 of its 36 16-byte chunks each; quad lane 0 also copies
  // the key's 8 scale bytes and records whether it is a real key.
  const int copy_key = thread / 4;
  const int copy_part = thread % 4;
  auto stage_rows = [&](int step, int slot, bool is_extra) {
    const int stage = step % kStages;
    const bool valid = slot >= 0;
    // A padding slot still needs a readable address; zero bytes are copied from it.
    const uint8_t* data = p.cache;
    const uint8_t* scale = p.cache;
    if (valid) {
      const int shift = is_extra ? p.extra_block_size_log2 : p.block_size_log2;
      const uint8_t* page = (is_extra ? p.extra_cache : p.cache) +
                            static_cast<int64_t>(slot >> shift) *
                                (is_extra ? p.extra_block_stride : p.block_stride);
      const int position = slot & ((1 << shift) - 1);
      data = page + position * kDataBytes + copy_part * 16;
      scale = page + (kDataBytes << shift) + position * kScaleBytes;
    }
    uint8_t* row = rows + (stage * kKeys + copy_key) * kRowStride + copy_part * 16;
#pragma unroll
    for (int chunk = 0; chunk < kDataBytes / 64; ++chunk) {
      copy_async_16(row + chunk * 64, data + chunk * 64, valid);
    }
    if (copy_part == 0) {
      copy_async_8(scales + (stage * kKeys + copy_key) * kScaleBytes, scale, valid);
      valid_keys[stage * kKeys + copy_key] = valid;
    }
  };

  bool next_is_extra = false;
  int next_slot = 0;
#pragma unroll
  for (int step = 0; step < kStages - 1; ++step) {
    bool is_extra;
    const int slot = run.slot(step * kKeys + copy_key, is_extra);
    if (step < num_steps) stage_rows(step, slot, is_extra);
    commit_copies();
  }
  next_slot = run.slot((kStages - 1) * kKeys + copy_key, next_is_extra);

  float row_max[2] = {negative_infinity(), negative_infinity()};  // rows group, group + 8 (base 2)
  float row_sum[2] = {0.f, 0.f};   // this thread's key columns only, until the end
  float acc[16][4];  // PV: 16 n8 tiles of this warp's 128 dims
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // ldmatrix.x4 row addresses of the A fragments (q, and P of a step): lane l gives row
  // l % 8 of 8x8 matrix l / 8 (rows 0-7 / 8-15, then k 0-7 / 8-15 of a k16 chunk).
  const int fragment_row = (lane % 8) + 8 * ((lane / 8) % 2);
  const uint32_t q_address = shared_address(q_tile + fragment_row * kQStride + 8 * (lane / 16));
  const uint32_t p_address = shared_address(p_tile + fragment_row * kPStride + 8 * (lane / 16));

  for (int step = 0; step < num_steps; ++step) {
    const int stage = step % kStages;
    wait_copies<kStages - 2>();
    __syncthreads();  // this step's rows are in; every warp is done with the last step
    {
      const int ahead = step + kStages - 1;
      if (ahead < num_steps) stage_rows(ahead, next_slot, next_is_extra);
      commit_copies();
      next_slot = run.slot((ahead + 1) * kKeys + copy_key, next_is_extra);
    }
    const uint8_t* stage_rows_base = rows + stage * kKeys * kRowStride;
    const uint8_t* stage_scales = scales + stage * kKeys * kScaleBytes;
    const uint8_t* stage_valid = valid_keys + stage * kKeys;

    // QK^T: this warp's 8 keys, all 16 heads.
    float scores[2][2];
    {
      const int key = warp * 8 + group;
      const uint8_t* row = stage_rows_base + key * kRowStride;
      const uint2 key_scales = *reinterpret_cast<const uint2*>(stage_scales + key * kScaleBytes);
      // Two accumulators (even and odd k chunks) halve the chain of dependent mmas.
      float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int g = 0; g < kNopeDim / 64; ++g) {
        const uint4 bytes = *reinterpret_cast<const uint4*>(row + 64 * g + 16 * quad);
        const uint32_t ue8m0 = ((g < 4 ? key_scales.x : key_scales.y) >> (8 * (g % 4))) & 0xFF;
        const uint32_t multiplier = scale_bits(ue8m0) * 0x10001u;
        const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          uint32_t a[4];
          load_q_fragment(a, q_address + (4 * g + t) * 32);
          mma_bf16(c[t % 2], a, dequantize_pair(words[t], 0, 0x9180, multiplier),
                   dequantize_pair(words[t], 0, 0xB3A2, multiplier));
        }
      }
      // RoPE dims 448..511 are bf16 already: dims 448 + 16c + 4t + {0..3} = 8 bytes.
      const uint4 rope_low = *reinterpret_cast<const uint4*>(row + kNopeDim + 32 * quad);
      const uint4 rope_high = *reinterpret_cast<const uint4*>(row + kNopeDim + 32 * quad + 16);
      const uint32_t rope[8] = {rope_low.x,  rope_low.y,  rope_low.z,  rope_low.w,
                                rope_high.x, rope_high.y, rope_high.z, rope_high.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t a[4];
        load_q_fragment(a, q_address + (28 + t) * 32);
        mma_bf16(c[t % 2], a, rope[2 * t], rope[2 * t + 1]);
      }
      const float qk[4] = {c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2],
                           c[0][3] + c[1][3]};
      const int column = warp * 8 + 2 * quad;
      const bool valid0 = stage_valid[column] != 0, valid1 = stage_valid[column + 1] != 0;
      // scores[r][h]: row group + 8r, key column + h (base 2, -inf for padding).
      scores[0][0] = valid0 ? qk[0] * p.qk_scale_log2 : negative_infinity();
      scores[0][1] = valid1 ? qk[1] * p.qk_scale_log2 : negative_infinity();
      scores[1][0] = valid0 ? qk[2] * p.qk_scale_log2 : negative_infinity();
      scores[1][1] = valid1 ? qk[3] * p.qk_scale_log2 : negative_infinity();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float warp_max = quad_max(fmaxf(scores[r][0], scores[r][1]));
        if (quad == 0) step_max[(group + 8 * r) * kWarps + warp] = warp_max;
      }
    }
    __syncthreads();  // every warp's row maxima of this step are in

    // Online softmax of this warp's 8 keys against the step's maximum over all 32, which
    // every warp reads, so m and alpha agree across warps; row_sum stays a per-thread
    // partial (its two key columns) until the end.
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float4 maxima = *reinterpret_cast<const float4*>(step_max + (group + 8 * r) * kWarps);
      const float new_max =
          fmaxf(row_max[r], fmaxf(fmaxf(maxima.x, maxima.y), fmaxf(maxima.z, maxima.w)));
      // No valid key yet: keep the reference finite so exp2 gives 0, not NaN.
      const float reference = new_max == negative_infinity() ? 0.f : new_max;
      alpha[r] = fast_exp2(row_max[r] - reference);
      row_max[r] = new_max;
      const float p0 = fast_exp2(scores[r][0] - reference);
      const float p1 = fast_exp2(scores[r][1] - reference);
      row_sum[r] = row_sum[r] * alpha[r] + (p0 + p1);
      *reinterpret_cast<uint32_t*>(p_tile + (group + 8 * r) * kPStride + warp * 8 + 2 * quad) =
          pack_bf16(p0, p1);
    }
    // Once the running maxima settle, most steps leave them unchanged (alpha = 1).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[j][0] *= alpha[0];
        acc[j][1] *= alpha[0];
        acc[j][2] *= alpha[1];
        acc[j][3] *= alpha[1];
      }
    }
    __syncthreads();  // P of all 32 keys is in

    uint32_t probabilities[2][4];  // A fragments of P for the two k16 chunks
    load_q_fragment(probabilities[0], p_address);
    load_q_fragment(probabilities[1], p_address + 32);

    // PV: n8 tile 4J + r of this warp holds, at column `group`, output dim
    // 128w + 32J + 4 * group + r, so a thread reads 4 consecutive bytes of a row for 4 tiles.
#pragma unroll
    for (int kc = 0; kc < 2; ++kc) {
      const int key0 = 16 * kc + 2 * quad;  // b0: keys key0, key0 + 1; b1: key0 + 8, + 9
      const uint8_t* key_rows[4];
      uint32_t key_scales[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int key = key0 + (i % 2) + 8 * (i / 2);
        key_rows[i] = stage_rows_base + key * kRowStride;
        // Exponents of this warp's two 64-dim tiles (2w, 2w + 1) in one 16-bit load.
        key_scales[i] = *reinterpret_cast<const uint16_t*>(stage_scales + key * kScaleBytes +
                                                           2 * warp);
      }
      // bf16x2 multipliers for the key pairs (key0, key0 + 1) and (key0 + 8, key0 + 9), for
      // tile 2w (dims 0..63 of this warp) and 2w + 1: the two exponent bytes side by side
      // (bytes 2 and 3 of a 16-bit load are zero), then scale_bits on both halves at once.
      const uint32_t scale_pairs[2][2] = {
          {scale_bits_pair(key_scales[0], key_scales[1], 0x6420),
           scale_bits_pair(key_scales[2], key_scales[3], 0x6420)},
          {scale_bits_pair(key_scales[0], key_scales[1], 0x6521),
           scale_bits_pair(key_scales[2], key_scales[3], 0x6521)}};
#pragma unroll
      for (int big = 0; big < 4; ++big) {
        const int dim = warp * kDimsPerWarp + 32 * big + 4 * group;
        if (dim < kNopeDim) {
          const uint32_t pair01 = scale_pairs[big / 2][0];
          const uint32_t pair23 = scale_pairs[big / 2][1];
          const uint32_t w0 = *reinterpret_cast<const uint32_t*>(key_rows[0] + dim);
          const uint32_t w1 = *reinterpret_cast<const uint32_t*>(key_rows[1] + dim);
          const uint32_t w2 = *reinterpret_cast<const uint32_t*>(key_rows[2] + dim);
          const uint32_t w3 = *reinterpret_cast<const uint32_t*>(key_rows[3] + dim);
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            // Byte r of the first word and its sign, then byte r of the second word.
            const uint32_t selector = r | ((r | 8) << 4) | ((4 + r) << 8) | ((12 + r) << 12);
            mma_bf16(acc[4 * big + r], probabilities[kc],
                     dequantize_pair(w0, w1, selector, pair01),
                     dequantize_pair(w2, w3, selector, pair23));
          }
        } else {
          // RoPE dims: 4 bf16 values (8 bytes) of each key; pair key i's and key i+1's.
          const int offset = kNopeDim + 2 * (dim - kNopeDim);
          const uint2 v0 = *reinterpret_cast<const uint2*>(key_rows[0] + offset);
          const uint2 v1 = *reinterpret_cast<const uint2*>(key_rows[1] + offset);
          const uint2 v2 = *reinterpret_cast<const uint2*>(key_rows[2] + offset);
          const uint2 v3 = *reinterpret_cast<const uint2*>(key_rows[3] + offset);
          const uint32_t low01[2] = {v0.x, v0.y}, high01[2] = {v1.x, v1.y};
          const uint32_t low23[2] = {v2.x, v2.y}, high23[2] = {v3.x, v3.y};
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const uint32_t selector = r % 2 == 0 ? 0x5410 : 0x7632;
            uint32_t b0, b1;
            asm("prmt.b32 %0, %1, %2, %3;\n"
                : "=r"(b0)
                : "r"(low01[r / 2]), "r"(high01[r / 2]), "r"(selector));
            asm("prmt.b32 %0, %1, %2, %3;\n"
                : "=r"(b1)
                : "r"(low23[r / 2]), "r"(high23[r / 2]), "r"(selector));
            mma_bf16(acc[4 * big + r], probabilities[kc], b0, b1);
          }
        }
      }
    }
  }

  // Row sums: this thread's columns -> this warp's keys -> all keys (step_max is free: every
  // warp read it before the last step's final barrier).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float warp_sum = quad_sum(row_sum[r]);
    if (quad == 0) step_max[(group + 8 * r) * kWarps + warp] = warp_sum;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float4 sums = *reinterpret_cast<const float4*>(step_max + (group + 8 * r) * kWarps);
    row_sum[r] = (sums.x + sums.y) + (sums.z + sums.w);
  }

  // Normalized partial output and base-2 lse. C fragment: rows group / group + 8, columns
  // 2c, 2c + 1 of tile 4J + r = dims 128w + 32J + 8c + r (+4 for column 2c + 1).
  const int64_t partial_row = (token * p.num_splits + split) * p.num_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = head0 + group + 8 * r;
    if (head >= p.num_heads) continue;
    const float inverse = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    float* out = p.partial_out + (partial_row + head) * kHeadDim + warp * kDimsPerWarp;
#pragma unroll
    for (int big = 0; big < 4; ++big) {
      const float4 first =
          make_float4(acc[4 * big][2 * r] * inverse, acc[4 * big + 1][2 * r] * inverse,
                      acc[4 * big + 2][2 * r] * inverse, acc[4 * big + 3][2 * r] * inverse);
      const float4 second =
          make_float4(acc[4 * big][2 * r + 1] * inverse, acc[4 * big + 1][2 * r + 1] * inverse,
                      acc[4 * big + 2][2 * r + 1] * inverse, acc[4 * big + 3][2 * r + 1] * inverse);
      *reinterpret_cast<float4*>(out + 32 * big + 8 * quad) = first;
      *reinterpret_cast<float4*>(out + 32 * big + 8 * quad + 4) = second;
    }
    if (warp == 0 && quad == 0) {
      p.partial_lse[partial_row + head] =
          row_sum[r] > 0.f ? row_max[r] + log2f(row_sum[r]) : negative_infinity();
    }
  }
}
