// Sparse MLA attention with Ampere's mma.sync, for sm80/86/89, in two builds of one kernel:
// - the decode (sparse_mla_decode_sm80) over the fp8_ds_mla paged cache, the CUDA
//   counterpart of sparse_mla_decode.py's Triton kernel;
// - the prefill (sparse_mla_prefill_sm80, SPARSE_MLA_BF16_ROWS=1) over the bf16 rows the
//   K gather dequantized (FlashMLA's flash_mla_sparse_fwd; sparse_mla_prefill.py's Triton
//   kernel): a row's 512 dims are loaded as they are, there are no splits, and the block
//   writes the final output with the sink applied, max_logits and the natural lse.
//
// Why CUDA: the Triton kernel spends a 32-key step in 12 barrier-separated phases with 8
// warps an SM (docs/kernels-history.md), and dequantizes every K value twice (once for
// QK^T, once for PV). Here each fp8 value is dequantized once, into registers, and used by
// both products; a step of 16 keys has one barrier.
//
// One block = 16 heads (one mma M tile) of one token, one split of its slot lists; four
// warps, warp w owns latent dims 128w..128w+127 for both products. Per step of 16 keys:
//   1. cp.async has staged the 16 rows' bytes (fp8 NoPE, bf16 RoPE, UE8M0 scales) a few
//      steps ahead; rows of padding slots are zero-filled and get a -inf score bias.
//   2. Each warp dequantizes its 128 dims of the 16 keys into QK^T's B fragments (32
//      registers a thread) and multiplies them with q: partial scores over its dims. The
//      reduction order of the dims is free, so a thread's 16-byte load (16 consecutive dims
//      of one key) feeds four k16 chunks; q's A fragments are read in the same order.
//   3. Partial scores go to shared memory; after the step's one barrier every warp adds
//      all four (in the same order, so every warp gets the same scores) and runs the same
//      online softmax. P stays in registers: QK^T's accumulator layout is PV's A layout.
//   4. movmatrix.trans turns each 8x8 (keys x dims) block of the dequantized K into an
//      (dims x keys) block: PV's B fragments for the same dims. So PV needs no loads, and
//      its output dims come out in the permuted order, 16 consecutive dims a thread.
//   With 2 blocks an SM (the launcher's build; sm86/89's shared memory holds no more),
//   the next step's 2 and 3 up to the barrier overlap this step's softmax
//   (kOverlapNextStep), and q's fragments stay in registers (kQInRegisters); the 3- and
//   4-block builds stage q in shared memory and run their steps one after another.
// fp8 -> bf16 without fp8 instructions: prmt sign-extends a byte per 16-bit half, a shift
// and mask leave sign, exponent and mantissa in bf16's fields (value * 2^-120), and one
// bf16x2 fma by 2^(120 + exponent) applies the power-of-two scale; exact (as
// fp8_e4m3.e4m3_dequantize_bf16).
//
// Output of the decode: normalized partials [T, splits, H, 512] (fp32, or bf16 when the
// launch asks: half the bytes a block writes at its end and the combine reads) and base-2
// lse [T, splits, H] fp32 (-inf for no key); sparse_mla_combine merges them and applies the
// attention sink. The prefill's one split is its output [T, H, 512] bf16, sink applied.

#include "ampere_shared.cuh"

namespace {

#ifndef SPARSE_MLA_BF16_ROWS
#define SPARSE_MLA_BF16_ROWS 0
#endif
// The prefill's build: a slot is a row number into [rows, 512] bf16, its padding -1 or a
// row past the buffer; otherwise a slot of the paged fp8_ds_mla cache, padding -1.
constexpr bool kBf16Rows = SPARSE_MLA_BF16_ROWS != 0;

constexpr int kHeadDim = 512;
constexpr int kNopeDim = 448;
constexpr int kNopeTiles = kNopeDim / 64;  // 64-dim tiles with one UE8M0 scale each
// A row's bytes: 448 fp8 + 64 bf16 RoPE values, or 512 bf16 values.
constexpr int kDataBytes = kBf16Rows ? 2 * kHeadDim : 576;
constexpr int kScaleBytes = kBf16Rows ? 0 : 8;  // 7 UE8M0 exponents + a pad byte
constexpr int kHeads = 16;        // mma.m16n8k16's M
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 16;         // keys a step: two n8 tiles of QK^T, one k16 chunk of PV
constexpr int kDimsPerWarp = kHeadDim / kWarps;  // 128: two 64-dim tiles
constexpr int kTilesPerWarp = kDimsPerWarp / 64;
#ifndef SPARSE_MLA_DECODE_STAGES
#define SPARSE_MLA_DECODE_STAGES 2
#endif
// Steps of rows in shared memory: a step's rows are requested kStages steps ahead and
// must land within kStages - 1 steps (2 measured best: docs/kernels-history.md).
constexpr int kStages = SPARSE_MLA_DECODE_STAGES;
// 576 = 4.5 x 128 bytes: keys k and k + 1 start 16 banks apart, so a quarter-warp's
// 16-byte loads (two keys x 64 bytes) are conflict-free. A bf16 row (1,024 bytes, a
// quarter-warp's loads two keys x 128 bytes) is padded by 16 bytes for the same reason.
constexpr int kRowStride = kBf16Rows ? kDataBytes + 16 : kDataBytes;
constexpr int kQStride = 520;     // bf16 per staged q row: +8 spreads ldmatrix rows over banks
constexpr int kCopyThreadsPerKey = kThreads / kKeys;  // 8 threads copy a row
constexpr int kChunksPerRow = kDataBytes / 16;
// How far (log2) a score may pass the softmax reference before the reference moves:
// p = 2^(score - reference) <= 256 stays exact in bf16's exponent range.
constexpr float kMaxSlackLog2 = 8.f;
constexpr float kLog2E = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Blocks an SM the build must fit: 2 caps a thread at 255 registers (the launcher's
// choice, sparse_mla_decode_cuda.DEFAULT_MIN_BLOCKS), 3 at 168, 4 at 128.
#ifndef SPARSE_MLA_DECODE_MIN_BLOCKS
#define SPARSE_MLA_DECODE_MIN_BLOCKS 2
#endif
// With 2 blocks (8 warps) an SM a warp's own chains must hide its latencies: the next
// step's dequantization and QK^T then overlap this step's softmax, in 32 more registers
// (H200 in sm86 mode, B=64 H=16 top-k 2048: 0.0765 against 0.0929 ms, sixth session).
// With 3 or 4 blocks the register budget leaves that schedule no room, so steps run one
// after another.
constexpr bool kOverlapNextStep = SPARSE_MLA_DECODE_MIN_BLOCKS <= 2;
// The 2-block budget also holds this warp's q fragments (32 registers), loaded straight
// from global memory, so that build stages no q in shared memory and the loop reads none.
constexpr bool kQInRegisters = SPARSE_MLA_DECODE_MIN_BLOCKS <= 2;

constexpr int kQBytes = kQInRegisters ? 0 : kHeads * kQStride * 2;
constexpr int kRowsBytes = kStages * kKeys * kRowStride;
constexpr int kScalesBytes = kStages * kKeys * kScaleBytes;
// A score bias a key, 0 or -inf (padding): one fma applies it with the softmax scale.
constexpr int kBiasBytes = kStages * kKeys * 4;
// Partial scores: [step parity][warp][half][lane] of float4 (a thread's 8 scores).
constexpr int kPartialBytes = 2 * kWarps * 2 * 32 * 16;
constexpr int kSharedBytes = kQBytes + kRowsBytes + kScalesBytes + kBiasBytes + kPartialBytes;

}  // namespace

// Must match sparse_mla_decode_cuda.SparseMlaParams field for field. The prefill build
// reads a bf16 row `slot` at cache + slot * block_stride (block_size_log2 = 0), no extra
// list, one split, and writes bf16 `partial_out` as its output [T, H, 512].
struct SparseMlaParams {
  const uint16_t* q;  // bf16 [T, H, 512]
  const uint8_t* cache;
  const uint8_t* extra_cache;
  const int32_t* slots;
  const int32_t* extra_slots;
  const int32_t* lengths;        // null: the whole list
  const int32_t* extra_lengths;  // null: the whole list
  void* partial_out;             // [T, splits, H, 512] fp32, or bf16 (bf16_partials)
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
  int32_t bf16_partials;  // 0: fp32 partial outputs, else bf16
  float qk_scale_log2;
  const float* sink;   // prefill: [H] fp32 or null
  float* max_logits;   // prefill: [T, H], natural log units
  int32_t row_limit;   // prefill: rows in the buffer; slots from here on are padding
};
static_assert(sizeof(SparseMlaParams) == 184, "SparseMlaParams changed: update the Python struct");

extern "C" __constant__ int kSparseMlaSharedBytes = kSharedBytes;

namespace {

using namespace ampere;

// Two fp8 e4m3 bytes picked by `selector` (from x and y; each selector byte pair is
// "byte, its sign") -> two bf16 values times the multipliers in `scale_pair`.
__device__ __forceinline__ uint32_t dequantize_pair(uint32_t x, uint32_t y, uint32_t selector,
                                                    uint32_t scale_pair) {
  const uint32_t bits = (byte_permute(x, y, selector) << 4) & 0x87F087F0u;
  return fma_bf16x2(bits, scale_pair, 0x80008000u);  // -0.0 added keeps a zero's sign
}

// bf16 bits of 2^(120 + exponent) for a UE8M0 byte (exponent = byte - 127); bytes up to
// 134 (exponent 7) stay finite, as for the Triton path.
__device__ __forceinline__ uint32_t scale_bits(uint32_t ue8m0) { return (ue8m0 + 120u) << 7; }

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
    const int32_t* source = is_extra ? extra_slots + (position - count) : slots + position;
    int value = -1;
    if (position < total) value = *source;
    return value;
  }
};

}  // namespace

#if SPARSE_MLA_BF16_ROWS
#define SPARSE_MLA_KERNEL sparse_mla_prefill_sm80
#else
#define SPARSE_MLA_KERNEL sparse_mla_decode_sm80
#endif

extern "C" __global__ void __launch_bounds__(kThreads, SPARSE_MLA_DECODE_MIN_BLOCKS)
    SPARSE_MLA_KERNEL(const SparseMlaParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  uint16_t* q_tile = reinterpret_cast<uint16_t*>(shared);
  uint8_t* rows = shared + kQBytes;
  uint8_t* scales = rows + kRowsBytes;
  float* key_biases = reinterpret_cast<float*>(scales + kScalesBytes);
  float4* partials = reinterpret_cast<float4*>(scales + kScalesBytes + kBiasBytes);

  const int head_block = blockIdx.x;
  const int split = blockIdx.y;
  const int64_t token = blockIdx.z;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int group = lane / 4;  // mma "groupID": A/C row, B column
  const int quad = lane % 4;   // mma "threadID_in_group"
  const int head0 = head_block * kHeads;

  // q's A fragments in registers (kQInRegisters), in the permuted k order K is read in
  // (below): fragment (j, t) holds dims 64G + 16c + 4t + {0, 1} (registers 0, 1) and
  // {2, 3} (registers 2, 3) of heads group and group + 8 (G = this warp's tile j, c = quad).
  // All 16 loads are in flight at once (B=8 H=16 top-k 2048: 0.0186 -> 0.0171 ms, B=64
  // 0.0550 -> 0.0518, against the tile staged in shared memory by a loop).
  uint32_t q_fragments[kTilesPerWarp][4][4];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = head0 + group + 8 * r;
      const uint16_t* q_row = p.q + token * p.q_token_stride + head * p.q_head_stride +
                              16 * quad;
#pragma unroll
      for (int j = 0; j < kTilesPerWarp; ++j)
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          uint2 values = make_uint2(0, 0);
          if (head < p.num_heads) {
            values = *reinterpret_cast<const uint2*>(
                q_row + 64 * (kTilesPerWarp * warp + j) + 4 * t);
          }
          q_fragments[j][t][r] = values.x;
          q_fragments[j][t][2 + r] = values.y;
        }
    }
  }
  // Otherwise q -> shared memory in the same order: physical dims 64g + 16c + 4t + {0..3}
  // (c = a thread's quad lane when it loads K) land in k chunk 4g + t at k = 2c, 2c + 1
  // (dims +0, +1) and k = 2c + 8, 2c + 9 (dims +2, +3). The RoPE dims are tile g = 7.
  // Every load is issued before the slot lists are read and stored after the first rows'
  // copies are (3-block build, B=64 H=16 top-k 2048: 0.0578 -> 0.0557 ms).
  constexpr int kQItems = kQInRegisters ? 0 : kHeads * (kHeadDim / 4) / kThreads;
  uint2 q_values[kQItems > 0 ? kQItems : 1];
#pragma unroll
  for (int i = 0; i < kQItems; ++i) {
    const int item = thread + i * kThreads;
    const int head = item / (kHeadDim / 4);
    const int dim = (item % (kHeadDim / 4)) * 4;
    q_values[i] = make_uint2(0, 0);
    if (head0 + head < p.num_heads) {
      q_values[i] = *reinterpret_cast<const uint2*>(p.q + token * p.q_token_stride +
                                                   (head0 + head) * p.q_head_stride + dim);
    }
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

  // Copy duty: 8 threads a key, every 8th of its 36 16-byte chunks each; the first also
  // copies the key's 8 scale bytes and writes its score bias (-inf for a padding slot).
  // Selects and predicated loads rather than branches: the step keeps fewer basic blocks
  // for the scheduler to interleave (B=64 H=16 top-k 2048: 0.0519 -> 0.0506 ms).
  const int copy_key = thread / kCopyThreadsPerKey;
  const int copy_part = thread % kCopyThreadsPerKey;
  auto stage_rows = [&](int step, int slot, bool is_extra) {
    const int stage = step % kStages;
    const bool valid = slot >= 0 && (!kBf16Rows || slot < p.row_limit);
    // A padding slot still needs a readable address (slot 0); zero bytes are copied from it.
    const int readable_slot = valid ? slot : 0;
    const int shift = is_extra ? p.extra_block_size_log2 : p.block_size_log2;
    const uint8_t* page = (is_extra ? p.extra_cache : p.cache) +
                          static_cast<int64_t>(readable_slot >> shift) *
                              (is_extra ? p.extra_block_stride : p.block_stride);
    const int position = readable_slot & ((1 << shift) - 1);
    const uint8_t* data = page + position * kDataBytes + copy_part * 16;
    const uint8_t* scale = page + (kDataBytes << shift) + position * kScaleBytes;
    uint8_t* row = rows + (stage * kKeys + copy_key) * kRowStride + copy_part * 16;
#pragma unroll
    for (int chunk = 0; chunk < kChunksPerRow; chunk += kCopyThreadsPerKey) {
      if (chunk + copy_part < kChunksPerRow) {
        copy_async<16>(row + chunk * 16, data + chunk * 16, valid);
      }
    }
    if (copy_part == 0) {
      if constexpr (!kBf16Rows) {
        copy_async<8>(scales + (stage * kKeys + copy_key) * kScaleBytes, scale, valid);
      }
      key_biases[stage * kKeys + copy_key] = valid ? 0.f : negative_infinity();
    }
  };

  bool next_is_extra = false;
  int next_slot = 0;
#pragma unroll
  for (int step = 0; step < kStages; ++step) {
    bool is_extra;
    const int slot = run.slot(step * kKeys + copy_key, is_extra);
    if (step < num_steps) stage_rows(step, slot, is_extra);
    commit_copies();
  }
  next_slot = run.slot(kStages * kKeys + copy_key, next_is_extra);

#pragma unroll
  for (int i = 0; i < kQItems; ++i) {
    const int item = thread + i * kThreads;
    const int head = item / (kHeadDim / 4);
    const int dim = (item % (kHeadDim / 4)) * 4;
    const int g = dim / 64, c = (dim % 64) / 16, t = (dim % 16) / 4;
    uint32_t* row = reinterpret_cast<uint32_t*>(q_tile + head * kQStride + (4 * g + t) * 16);
    row[c] = q_values[i].x;
    row[4 + c] = q_values[i].y;
  }

  wait_copies<kStages - 1>();
  __syncthreads();  // step 0's rows and q are in

  // Softmax reference per row (group, group + 8; base 2): within kMaxSlackLog2 of the max.
  float row_max[2] = {negative_infinity(), negative_infinity()};
  float row_sum[2] = {0.f, 0.f};   // this thread's key columns only, until the end
  // The largest score (base 2), which the prefill returns as max_logits: the reference
  // lags it by up to kMaxSlackLog2.
  float score_max[2] = {negative_infinity(), negative_infinity()};
  // PV accumulators: tile j (64 dims), chunk t, half h hold at column 2c + e output dim
  // 128w + 64j + 16c + 4t + 2h + e (c = quad): 16 consecutive dims a thread and row.
  float acc[kTilesPerWarp][4][2][4];
#pragma unroll
  for (int j = 0; j < kTilesPerWarp; ++j)
#pragma unroll
    for (int t = 0; t < 4; ++t)
#pragma unroll
      for (int h = 0; h < 2; ++h) acc[j][t][h][0] = acc[j][t][h][1] = acc[j][t][h][2] =
                                      acc[j][t][h][3] = 0.f;

  // ldmatrix.x4 row addresses of q's A fragments: lane l gives row l % 8 of 8x8 matrix
  // l / 8 (rows 0-7 / 8-15, then k 0-7 / 8-15 of a k16 chunk).
  const int fragment_row = (lane % 8) + 8 * ((lane / 8) % 2);
  const uint32_t q_address = shared_address(q_tile + fragment_row * kQStride + 8 * (lane / 16));
  // q's A fragment for this warp's tile j, k16 chunk t.
  auto load_q = [&](uint32_t (&a)[4], int j, int t) {
    load_matrix_x4(a, q_address + (4 * (kTilesPerWarp * warp + j) + t) * 32);
  };
  // bf16 dims 16c + 4t + {0..3} of a 64-dim tile (c = quad; 32 bytes at `dims`) as the
  // B fragments of its four k16 chunks for n8 tile n.
  auto bf16_fragments = [&](const uint8_t* dims, uint32_t (&k)[kTilesPerWarp][4][2][2],
                            int j, int n) {
    const uint4 low = *reinterpret_cast<const uint4*>(dims);
    const uint4 high = *reinterpret_cast<const uint4*>(dims + 16);
    k[j][0][n][0] = low.x;
    k[j][0][n][1] = low.y;
    k[j][1][n][0] = low.z;
    k[j][1][n][1] = low.w;
    k[j][2][n][0] = high.x;
    k[j][2][n][1] = high.y;
    k[j][3][n][0] = high.z;
    k[j][3][n][1] = high.w;
  };
  // K of this warp's dims for one step's 16 keys, as QK^T's B fragments (fp8 dims
  // dequantized, bf16 ones as they are):
  // k[j][t][n] = {b0, b1} of tile j, k16 chunk t, n8 tile n (keys 8n..8n+7).
  auto load_k_step = [&](int step, uint32_t (&k)[kTilesPerWarp][4][2][2]) {
    const int stage = step % kStages;
    const uint8_t* stage_rows_base = rows + stage * kKeys * kRowStride;
    const uint8_t* stage_scales = scales + stage * kKeys * kScaleBytes;
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      const int tile = kTilesPerWarp * warp + j;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int key = 8 * n + group;
        const uint8_t* row = stage_rows_base + key * kRowStride;
        if constexpr (kBf16Rows) {
          bf16_fragments(row + 2 * (64 * tile + 16 * quad), k, j, n);
        } else if (tile < kNopeTiles) {
          const uint4 bytes = *reinterpret_cast<const uint4*>(row + 64 * tile + 16 * quad);
          const uint32_t multiplier =
              scale_bits(stage_scales[key * kScaleBytes + tile]) * 0x10001u;
          const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            k[j][t][n][0] = dequantize_pair(words[t], 0, 0x9180, multiplier);
            k[j][t][n][1] = dequantize_pair(words[t], 0, 0xB3A2, multiplier);
          }
        } else {
          // RoPE dims 448..511 are bf16 already, after the 448 fp8 bytes.
          bf16_fragments(row + kNopeDim + 32 * quad, k, j, n);
        }
      }
    }
  };
  // QK^T over this warp's dims into the step's partial-score slot; returns the keys' score
  // biases (columns 2c, 2c + 1 of each n8 tile), read before the stage is reused.
  auto partial_scores = [&](int step, const uint32_t (&k)[kTilesPerWarp][4][2][2],
                            float2 (&bias)[2]) {
    // An accumulator per 64-dim tile and n8 tile: chains of 4 dependent mmas, not 8 (B=64
    // H=64 top-k 2048, 2-block build: 0.1631 -> 0.1598 ms). The 4-block build's 128
    // registers keep one chain a tile.
    constexpr int kChains = SPARSE_MLA_DECODE_MIN_BLOCKS >= 4 ? 1 : kTilesPerWarp;
    float chains[kChains][2][4] = {};
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        uint32_t a[4];
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[i] = q_fragments[j][t][i];
        } else {
          load_q(a, j, t);
        }
        mma_bf16(chains[j % kChains][0], a, k[j][t][0][0], k[j][t][0][1]);
        mma_bf16(chains[j % kChains][1], a, k[j][t][1][0], k[j][t][1][1]);
      }
    }
    float partial[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        partial[n][i] = chains[0][n][i];
#pragma unroll
        for (int c = 1; c < kChains; ++c) partial[n][i] += chains[c][n][i];
      }
    const float2* stage_biases =
        reinterpret_cast<const float2*>(key_biases + (step % kStages) * kKeys);
    bias[0] = stage_biases[quad];
    bias[1] = stage_biases[4 + quad];
    float4* step_partials = partials + (step % 2) * (kWarps * 2 * 32);
    step_partials[(warp * 2 + 0) * 32 + lane] =
        make_float4(partial[0][0], partial[0][1], partial[0][2], partial[0][3]);
    step_partials[(warp * 2 + 1) * 32 + lane] =
        make_float4(partial[1][0], partial[1][1], partial[1][2], partial[1][3]);
  };

  // Online softmax (base 2) of one step from the four warps' partial scores, added in a
  // fixed order; row r is head group + 8r. Returns the accumulators' rescale factors and
  // leaves P, PV's A fragment (rows group / group + 8, 16 keys), in `probabilities`.
  auto softmax_step = [&](int step, const float2 (&bias)[2], float (&alpha)[2],
                          uint32_t (&probabilities)[4]) {
    const float4* step_partials = partials + (step % 2) * (kWarps * 2 * 32);
    float scores[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float4 part[kWarps];  // loaded before any add: one shared-memory latency, not four
#pragma unroll
      for (int w = 0; w < kWarps; ++w) part[w] = step_partials[(w * 2 + n) * 32 + lane];
      float4 sum = part[0];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        sum.x += part[w].x;
        sum.y += part[w].y;
        sum.z += part[w].z;
        sum.w += part[w].w;
      }
      scores[n][0] = fmaf(sum.x, p.qk_scale_log2, bias[n].x);
      scores[n][1] = fmaf(sum.y, p.qk_scale_log2, bias[n].y);
      scores[n][2] = fmaf(sum.z, p.qk_scale_log2, bias[n].x);
      scores[n][3] = fmaf(sum.w, p.qk_scale_log2, bias[n].y);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float step_max = quad_max(fmaxf(fmaxf(scores[0][2 * r], scores[0][2 * r + 1]),
                                            fmaxf(scores[1][2 * r], scores[1][2 * r + 1])));
      // The reference moves only when a score passes it by more than kMaxSlackLog2, so
      // most steps skip the accumulator rescale; exact either way, p stays <= 2^slack.
      const bool moves = step_max > row_max[r] + kMaxSlackLog2;
      const float new_max = moves ? step_max : row_max[r];
      // No valid key yet: keep the reference finite so exp2 gives 0, not NaN.
      const float reference = new_max == negative_infinity() ? 0.f : new_max;
      alpha[r] = moves ? fast_exp2(row_max[r] - reference) : 1.f;
      row_max[r] = new_max;
      if constexpr (kBf16Rows) score_max[r] = fmaxf(score_max[r], step_max);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float p0 = fast_exp2(scores[n][2 * r] - reference);
        const float p1 = fast_exp2(scores[n][2 * r + 1] - reference);
        sum += p0 + p1;
        probabilities[2 * n + r] = pack_bf16(p0, p1);
      }
      row_sum[r] = row_sum[r] * alpha[r] + sum;
    }
  };
  // PV's B fragment of output dims (tile j, chunk t, half h) is the transpose of QK^T's
  // fragment half h for keys 0-7 (b0) and keys 8-15 (b1). The overlapped build transposes
  // K in place as soon as QK^T has used it (transpose_for_pv), so PV's mmas wait on no
  // movmatrix; the stepwise builds transpose at PV time (no registers for the overlap).
  auto pv_fragment = [](uint32_t x) { return kOverlapNextStep ? x : transpose_8x8(x); };
  // acc = acc * alpha + P V.
  auto accumulate = [&](const float (&alpha)[2], const uint32_t (&probabilities)[4],
                        const uint32_t (&k)[kTilesPerWarp][4][2][2]) {
    // Once the running maxima settle, most steps leave them unchanged (alpha = 1).
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int j = 0; j < kTilesPerWarp; ++j)
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc[j][t][h][0] *= alpha[0];
            acc[j][t][h][1] *= alpha[0];
            acc[j][t][h][2] *= alpha[1];
            acc[j][t][h][3] *= alpha[1];
          }
    }
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mma_bf16(acc[j][t][h], probabilities, pv_fragment(k[j][t][0][h]),
                   pv_fragment(k[j][t][1][h]));
        }
  };
  auto transpose_for_pv = [&](uint32_t (&k)[kTilesPerWarp][4][2][2]) {
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j)
#pragma unroll
      for (int t = 0; t < 4; ++t)
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
          for (int h = 0; h < 2; ++h) k[j][t][n][h] = transpose_8x8(k[j][t][n][h]);
  };

  float2 bias[2];
  // The one barrier of a step: every warp's partial scores of this step are in, every
  // warp is done with this stage's rows (dequantized before the barrier), and (each
  // thread having waited for its own copies) the next step's rows are in.
  auto end_of_step_barrier = [&](int step) {
    wait_copies<kStages - 2>();
    __syncthreads();
    const int ahead = step + kStages;
    stage_rows(ahead, next_slot, next_is_extra);  // past the run: padding, zero-filled
    commit_copies();
    next_slot = run.slot((ahead + 1) * kKeys + copy_key, next_is_extra);
  };
  if constexpr (kOverlapNextStep) {
    // The next step's K and partial scores in the same basic block as this step's
    // softmax, so the scheduler interleaves the two chains. After the last step the
    // stage holds stale rows: those results are never read. Two steps an iteration, with
    // the K fragments' roles swapped, so no register is copied from one step to the next.
    auto overlapped_step = [&](int step, const uint32_t (&k)[kTilesPerWarp][4][2][2],
                               uint32_t (&next_k)[kTilesPerWarp][4][2][2]) {
      end_of_step_barrier(step);
      float alpha[2];
      uint32_t probabilities[4];
      softmax_step(step, bias, alpha, probabilities);
      load_k_step(step + 1, next_k);
      partial_scores(step + 1, next_k, bias);
      transpose_for_pv(next_k);
      accumulate(alpha, probabilities, k);
    };
    uint32_t k_even[kTilesPerWarp][4][2][2];
    uint32_t k_odd[kTilesPerWarp][4][2][2];
    load_k_step(0, k_even);
    partial_scores(0, k_even, bias);
    transpose_for_pv(k_even);
    for (int step = 0; step < num_steps; step += 2) {
      overlapped_step(step, k_even, k_odd);
      if (step + 1 < num_steps) overlapped_step(step + 1, k_odd, k_even);
    }
  } else {
    uint32_t k_frag[kTilesPerWarp][4][2][2];
    for (int step = 0; step < num_steps; ++step) {
      load_k_step(step, k_frag);
      partial_scores(step, k_frag, bias);
      end_of_step_barrier(step);
      float alpha[2];
      uint32_t probabilities[4];
      softmax_step(step, bias, alpha, probabilities);
      accumulate(alpha, probabilities, k_frag);
    }
  }

  // Every warp ran the same softmax, so its row sums are already those of all keys.
#pragma unroll
  for (int r = 0; r < 2; ++r) row_sum[r] = quad_sum(row_sum[r]);

  // Normalized partial output and base-2 lse: row group + 8r, dims 128w + 64j + 16c + {0..15}.
  // The prefill's one split is its output, with the sink applied.
  const int64_t partial_row = (token * p.num_splits + split) * p.num_heads;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int head = head0 + group + 8 * r;
    if (head >= p.num_heads) continue;
    const bool has_keys = row_sum[r] > 0.f;
    const float lse2 = has_keys ? row_max[r] + log2f(row_sum[r]) : negative_infinity();
    float inverse = has_keys ? 1.f / row_sum[r] : 0.f;
    if constexpr (kBf16Rows) {
      // out *= e^lse / (e^lse + e^sink): a sink of -inf keeps it, +inf zeroes it.
      if (p.sink != nullptr && has_keys) {
        inverse /= 1.f + exp2f(p.sink[head] * kLog2E - lse2);
      }
    }
    const int64_t out_row = (partial_row + head) * kHeadDim + warp * kDimsPerWarp;
#pragma unroll
    for (int j = 0; j < kTilesPerWarp; ++j) {
      float values[16];  // dims 128w + 64j + 16c + {0..15}
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        values[4 * t + 0] = acc[j][t][0][2 * r] * inverse;
        values[4 * t + 1] = acc[j][t][0][2 * r + 1] * inverse;
        values[4 * t + 2] = acc[j][t][1][2 * r] * inverse;
        values[4 * t + 3] = acc[j][t][1][2 * r + 1] * inverse;
      }
      const int64_t first = out_row + 64 * j + 16 * quad;
      if (p.bf16_partials) {
        uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(p.partial_out) + first);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float* v = values + 8 * half;
          out[half] = make_uint4(pack_bf16(v[0], v[1]), pack_bf16(v[2], v[3]),
                                 pack_bf16(v[4], v[5]), pack_bf16(v[6], v[7]));
        }
      } else {
        float4* out = reinterpret_cast<float4*>(static_cast<float*>(p.partial_out) + first);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          out[t] = make_float4(values[4 * t], values[4 * t + 1], values[4 * t + 2],
                               values[4 * t + 3]);
        }
      }
    }
    if (warp == 0 && quad == 0) {
      if constexpr (kBf16Rows) {
        // FlashMLA's prefill: natural log units, +inf lse for a token with no key.
        p.partial_lse[partial_row + head] = has_keys ? lse2 * kLn2 : -negative_infinity();
        p.max_logits[partial_row + head] = score_max[r] * kLn2;
      } else {
        p.partial_lse[partial_row + head] = lse2;
      }
    }
  }
}
