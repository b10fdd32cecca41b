// DeepSeek-V4's indexer logits over the paged fp8 indexer cache with Ampere's mma.sync: the
// CUDA counterpart of paged_mqa_logits.py's Triton kernel (DeepGEMM's fp8_paged_mqa_logits),
// for sm80/86/89.
//
// Why CUDA: both operands of the Triton kernel's dot take the layout K's fp8 bytes give, so
// q's fragments are moved register by register every step (216 of its 1,061 instructions a
// 128-key step, sm_80 ptxas); keeping q in the layout ldmatrix gives costs it a K tile
// decoded through shared memory instead (docs/kernels-history.md, twenty-sixth session).
// Here K goes from its 16-byte loads to mma fragments in registers and q comes by ldmatrix.
//
// Two grids of the same steps. paged_mqa_logits_sm80: one block = one row (a request's token)
// and some chunks of keys_per_program of its keys. paged_mqa_logits_balanced_sm80: one round
// of resident blocks, each an even share of the batch's steps across rows (see there). A step
// is 128 keys of a row; four warps, warp w scores keys 32w..32w+31 against all 64 heads:
//   1. Once a row, q (64 heads x 128 dims) is staged into shared memory, its dims
//      permuted: a head's dot with a key may sum its dims in any order, so each mma chunk
//      of thread (group, quad) takes a word of the 32 consecutive bytes the thread loads of
//      a key (dims 32 quad .. +31): k16 chunk c word c, k32 chunk c words 2c and 2c + 1.
//      Rows are XOR-swizzled so that an ldmatrix's eight row addresses fall in distinct
//      banks.
//   2. cp.async stages each step's 128 rows of 128 bytes and their fp32 scales kStages - 1
//      steps ahead; rows past the row's length are zero-filled. Each row's 16-byte pieces
//      are swapped pairwise on odd keys, so a quarter-warp's two keys hit distinct banks.
//   3. A thread's four keys' 32 dims are its B fragments: decoded to fp16 (64 registers),
//      then for each 16-head M tile 8 ldmatrix and 32 mma.m16n8k16; or, on sm89, the fp8
//      bytes themselves, 4 ldmatrix and 16 mma.m16n8k32. Relu and each head's weight fold
//      the accumulators into 8 sums a thread (its 8 heads, its 8 keys).
//   4. The 8 lanes sharing a column of keys reduce-scatter their sums in 7 shuffles: each
//      lane ends with one key's logit, which takes the key's scale and is stored.
// fp8 -> fp16 without fp8 instructions (sm80/86): prmt sign-extends each byte to 16 bits, a
// shift by 7 puts exponent and mantissa in fp16's fields and the sign at bit 15, and a mask
// clears bit 14: the fp16 value is the fp8 value times 2^-8 exactly, subnormals included
// (fp8 NaN reads as 480 x 2^-8; the quantizers write none). The scale takes 2^16 once.
// sm89's tensor cores multiply the e4m3 bytes as they are, so that build decodes nothing.

#include "ampere_shared.cuh"

namespace {

constexpr int kHeadDim = 128;
constexpr int kHeads = 64;  // staged q rows: four mma M tiles, heads past num_heads zero
constexpr int kMTiles = kHeads / 16;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 128;  // a step
constexpr int kKeysPerWarp = kKeys / kWarps;
constexpr int kNTiles = kKeysPerWarp / 8;  // mma n8 tiles a warp
constexpr int kScaleBytes = 4;

#ifndef PAGED_MQA_LOGITS_FP8_MMA
#define PAGED_MQA_LOGITS_FP8_MMA 0
#endif
// sm89 and later: q and K go to mma.m16n8k32 as fp8 e4m3 bytes. Before: both as fp16.
constexpr bool kFp8Mma = PAGED_MQA_LOGITS_FP8_MMA;
constexpr int kChunkDims = kFp8Mma ? 32 : 16;  // an mma's K
constexpr int kChunks = kHeadDim / kChunkDims;
constexpr int kQRowBytes = kFp8Mma ? kHeadDim : kHeadDim * 2;
constexpr float kUnscale = kFp8Mma ? 1.f : 65536.f;  // undoes fp16's 2^-8 on both operands

#ifndef PAGED_MQA_LOGITS_BLOCK_SIZE
#define PAGED_MQA_LOGITS_BLOCK_SIZE 64
#endif
// Tokens a page: a build constant, so that a key's page and position are shifts and masks.
constexpr int kBlockSize = PAGED_MQA_LOGITS_BLOCK_SIZE;
static_assert(kBlockSize >= 16 && (kBlockSize & (kBlockSize - 1)) == 0,
              "pages hold a power of two of at least 16 tokens");
constexpr int kPagesPerStep = kKeys >= kBlockSize ? kKeys / kBlockSize : 1;

#ifndef PAGED_MQA_LOGITS_STAGES
#define PAGED_MQA_LOGITS_STAGES 2
#endif
constexpr int kStages = PAGED_MQA_LOGITS_STAGES;
static_assert(kStages >= 2, "a step's rows load while the one before is scored");
#ifndef PAGED_MQA_LOGITS_MIN_BLOCKS
#define PAGED_MQA_LOGITS_MIN_BLOCKS 2
#endif

constexpr int kQBytes = kHeads * kQRowBytes;
constexpr int kStageRowBytes = kKeys * kHeadDim;
constexpr int kStageScaleBytes = kKeys * kScaleBytes;
constexpr int kRowsBytes = kStages * kStageRowBytes;
constexpr int kSharedBytes = kQBytes + kRowsBytes + kStages * kStageScaleBytes;
constexpr int kRowPieces = kHeadDim / 16;
constexpr int kRowCopiesPerThread = kKeys * kRowPieces / kThreads;
// Rows the balanced kernel takes: each row's running count of steps sits in shared memory
// (with two sets of the warps' sums) until q is staged. Must match paged_mqa_logits_cuda.
constexpr int kBalancedMaxRows = 8192;
static_assert((kBalancedMaxRows + 2 * kWarps) * 4 <= kSharedBytes, "rows' counts must fit");

}  // namespace

// Must match paged_mqa_logits_cuda.LogitsParams field for field.
struct LogitsParams {
  const uint8_t* q;            // fp8 [B, next_n, H, 128]
  const uint8_t* cache;        // pages: [block_size x 128 fp8][block_size x fp32 scale][pad]
  const float* weights;        // [B * next_n, H]
  const int32_t* lengths;      // [B], or [B, next_n] (length_per_row)
  const int32_t* block_table;  // [B, pages a request]
  float* logits;               // [B * next_n, logits_width]
  int64_t q_request_stride;
  int64_t q_draft_stride;
  int64_t q_head_stride;
  int64_t block_stride;
  int64_t weights_stride;
  int64_t lengths_request_stride;
  int64_t lengths_draft_stride;
  int64_t block_table_stride;
  int64_t logits_stride;
  uint64_t next_n_reciprocal;  // ceil(2^32 / next_n): a row's request by a multiply
  int32_t num_heads;
  int32_t next_n;
  int32_t logits_width;
  int32_t keys_per_program;  // a chunk's keys, a multiple of 128
  int32_t length_per_row;
  int32_t clean;     // -inf from the row's length to the program's end
  int32_t num_rows;  // B * next_n
};
static_assert(sizeof(LogitsParams) == 160, "LogitsParams changed: update the Python struct");

extern "C" __constant__ int kPagedMqaLogitsSharedBytes = kSharedBytes;

namespace {

using namespace ampere;

// Bytes 0, 1 (kLowBytes) or 2, 3 (kHighBytes) of x, each sign-extended to 16 bits.
constexpr uint32_t kLowBytes = 0x9180u;
constexpr uint32_t kHighBytes = 0xB3A2u;

// Two fp8 e4m3 bytes of x -> two fp16 values, each 2^-8 times the byte's value.
__device__ __forceinline__ uint32_t fp16_pair(uint32_t x, uint32_t selector) {
  return (byte_permute(x, 0u, selector) << 7) & 0xBF80BF80u;
}

// Byte offset of 16-byte piece `piece` of staged q row `head`.
__device__ __forceinline__ int q_offset(int head, int piece) {
  return head * kQRowBytes + ((piece ^ (head & 7)) << 4);
}

// Byte offset of 16-byte piece `piece` of staged key row `key`.
__device__ __forceinline__ int row_offset(int key, int piece) {
  return key * kHeadDim + ((piece ^ (key & 1)) << 4);
}

// The pages a step starting at key `start` reads: the row's table entries, 0 past `end`.
__device__ __forceinline__ void load_pages(int (&pages)[kPagesPerStep], const int32_t* table,
                                           int start, int end) {
#pragma unroll
  for (int i = 0; i < kPagesPerStep; ++i) {
    const int first = start + i * kBlockSize;
    pages[i] = first < end ? table[static_cast<unsigned>(first) / kBlockSize] : 0;
  }
}

// The row grid's steps of a block: in its one row, the key at which each step starts, step
// after step: chunks of keys_per_program keys, gridDim.y chunks apart. Counted forward: from
// the step's number it takes an integer division, about 25 instructions, where issuing a
// step's copies takes about 75.
struct ChunkCursor {
  static constexpr bool kCrossesRows = false;
  int row;
  int length;  // the row's keys
  const int32_t* table;  // the row's pages
  float* logits;         // the row's logits
  int chunk_start;  // the current chunk's first key
  int offset;       // the step's first key within it
  int chunk_keys;   // keys_per_program
  int chunk_gap;    // keys from one of the block's chunks to the next

  __device__ __forceinline__ int start() const { return chunk_start + offset; }
  __device__ __forceinline__ const int32_t* pages(const LogitsParams&) const { return table; }
  __device__ __forceinline__ float* logit_row(const LogitsParams&) const { return logits; }
  __device__ __forceinline__ void advance(const LogitsParams&) {
    offset += kKeys;
    if (offset == chunk_keys) {
      offset = 0;
      chunk_start += chunk_gap;
    }
  }
};

// page_bases[slot] for a slot known only at run time, by selects: an indexed register array
// would go to local memory.
__device__ __forceinline__ const uint8_t* page_at(const uint8_t* const (&page_bases)[kPagesPerStep],
                                                  int slot) {
  const uint8_t* page = page_bases[0];
#pragma unroll
  for (int i = 1; i < kPagesPerStep; ++i) page = slot == i ? page_bases[i] : page;
  return page;
}

// a + the same-position value of the lane `mask` away, keeping the half of `values` that
// lane bit `mask` selects and sending the other half.
template <int kCount>
__device__ __forceinline__ void reduce_scatter_step(float (&kept)[kCount / 2],
                                                    const float (&values)[kCount], int mask,
                                                    int lane) {
  const bool upper = lane & mask;
#pragma unroll
  for (int i = 0; i < kCount / 2; ++i) {
    const float send = upper ? values[i] : values[i + kCount / 2];
    const float keep = upper ? values[i + kCount / 2] : values[i];
    kept[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}

// The request of row `row` (B * next_n rows of fewer than 2^16): row / next_n, exact for
// dividends and divisors below 2^16 with the divisor's reciprocal rounded up.
__device__ __forceinline__ int row_request(const LogitsParams& p, int row) {
  return static_cast<int>(static_cast<uint64_t>(row) * p.next_n_reciprocal >> 32);
}

// The row's keys: its own length, or its request's less the drafts after it; at most the
// row's width.
__device__ __forceinline__ int row_length(const LogitsParams& p, int row) {
  const int request = row_request(p, row);
  const int draft = row - request * p.next_n;
  const int length =
      p.length_per_row
          ? p.lengths[request * p.lengths_request_stride + draft * p.lengths_draft_stride]
          : p.lengths[request * p.lengths_request_stride] - p.next_n + 1 + draft;
  return max(min(length, p.logits_width), 0);
}

// Copies into one stage (`stage_rows`, `stage_scales`) the rows and scales of the step whose
// keys start at `start` of a row of `length` keys and lie in `pages`. A source is a page's
// base plus offsets fixed for the thread: a step starts at a multiple of 128 keys, so where
// its keys lie in their pages is known but for pages of more than 128 tokens, where the
// step starts within its page. (Sources from each key's number took about 280 instructions
// a step; these, about 75.)
__device__ __forceinline__ void issue_step(uint8_t* stage_rows, uint8_t* stage_scales,
                                           const LogitsParams& p, int thread, int start,
                                           int length, const int (&pages)[kPagesPerStep]) {
  const int first_position = kBlockSize > kKeys ? static_cast<unsigned>(start) % kBlockSize : 0;
  const uint8_t* page_bases[kPagesPerStep];
  const uint8_t* thread_bases[kPagesPerStep];  // this thread's first row piece a page
  const int piece = thread % kRowPieces;
  const int thread_offset = (first_position + thread / kRowPieces) * kHeadDim + piece * 16;
#pragma unroll
  for (int i = 0; i < kPagesPerStep; ++i) {
    page_bases[i] = p.cache + static_cast<int64_t>(pages[i]) * p.block_stride;
    thread_bases[i] = page_bases[i] + thread_offset;
  }
  const int keys_with_data = length - start;  // keys from here on are zero-filled
#pragma unroll
  for (int i = 0; i < kRowCopiesPerThread; ++i) {
    // Keys i * 16 + 0..15: within one page (pages hold 16 or more), known at build time.
    constexpr int kKeysACopy = kThreads / kRowPieces;
    const int key = thread / kRowPieces + i * kKeysACopy;
    const int slot = i * kKeysACopy / kBlockSize % kPagesPerStep;
    copy_async<16>(stage_rows + row_offset(key, piece),
                   thread_bases[slot] + i * kKeysACopy % kBlockSize * kHeadDim,
                   key < keys_with_data);
  }
  if (thread < kKeys / 4) {  // scales: four keys a 16-byte piece, never across a page
    const int key = 4 * thread;
    const int position = first_position + key % kBlockSize;
    copy_async<16>(stage_scales + key * kScaleBytes,
                   page_at(page_bases, key / kBlockSize % kPagesPerStep) +
                       kBlockSize * kHeadDim + position * kScaleBytes,
                   key < keys_with_data);
  }
}

// Stages the row's q (64 heads x 128 dims, heads past num_heads zero) into `q_tile`, its
// dims permuted and its rows swizzled (see the top of the file).
__device__ __forceinline__ void stage_q(uint8_t* q_tile, const LogitsParams& p, int row,
                                        int thread) {
  const int request = row_request(p, row);
  const int draft = row - request * p.next_n;
  const uint8_t* q_row = p.q + request * p.q_request_stride + draft * p.q_draft_stride;
  for (int i = thread; i < kHeads * kRowPieces; i += kThreads) {
    const int head = i / kRowPieces;
    const int piece = i % kRowPieces;  // dims 16 piece .. +15
    uint4 bytes = make_uint4(0, 0, 0, 0);
    if (head < p.num_heads) {
      bytes = *reinterpret_cast<const uint4*>(q_row + head * p.q_head_stride + piece * 16);
    }
    const uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    // Word w holds dims 32 d + 4 j .. +3 (d = piece / 2, j = 4 (piece % 2) + w), quad d's
    // word j. fp16: k16 chunk j's k = 2d, 2d + 1 (its first 8-column half) and 8 + 2d,
    // 9 + 2d (its second). fp8: k32 chunk j / 2's k = 4d .. 4d + 3 of half j % 2.
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int j = 4 * (piece % 2) + w;
      const int column_bytes = 4 * (piece / 2);
      if constexpr (kFp8Mma) {
        *reinterpret_cast<uint32_t*>(q_tile + q_offset(head, j) + column_bytes) = words[w];
      } else {
        *reinterpret_cast<uint32_t*>(q_tile + q_offset(head, 2 * j) + column_bytes) =
            fp16_pair(words[w], kLowBytes);
        *reinterpret_cast<uint32_t*>(q_tile + q_offset(head, 2 * j + 1) + column_bytes) =
            fp16_pair(words[w], kHighBytes);
      }
    }
  }
}

// The row's weights of this thread's heads: tile m's rows group and group + 8.
__device__ __forceinline__ void load_weights(float (&weights)[kMTiles][2], const LogitsParams& p,
                                             int row, int group) {
  const float* weight_row = p.weights + row * p.weights_stride;
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int head = 16 * m + group + 8 * r;
      weights[m][r] = head < p.num_heads ? weight_row[head] : 0.f;
    }
  }
}

// Scores one stage's 128 keys (`start` on of a row of `length` keys) against the staged q
// and stores the logit of this thread's key into `logit_row`; with p.clean, -inf on the
// step's keys past the row's length within its width.
__device__ __forceinline__ void score_step(const uint8_t* stage_rows, const float* stage_scales,
                                           uint32_t q_base, const float (&weights)[kMTiles][2],
                                           int warp, int lane, float* logit_row, int start,
                                           int length, const LogitsParams& p) {
  const int group = lane / 4;  // mma "groupID": A/C row, B column
  const int quad = lane % 4;   // mma "threadID_in_group"
  // ldmatrix: lanes 8i..8i+7 give the rows of matrix i, which is rows +8 (i odd) and the
  // chunk's second 8 columns (i >= 2) of the A fragment.
  const int a_row = (lane % 8) + 8 * ((lane / 8) % 2);
  const int a_half = lane / 16;
  uint32_t words[kNTiles][8];  // word j: dims 32 quad + 4j .. +3 of key 8t + group
#pragma unroll
  for (int t = 0; t < kNTiles; ++t) {
    const int key = warp * kKeysPerWarp + 8 * t + group;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint4 bytes =
          *reinterpret_cast<const uint4*>(stage_rows + row_offset(key, 2 * quad + half));
      words[t][4 * half] = bytes.x;
      words[t][4 * half + 1] = bytes.y;
      words[t][4 * half + 2] = bytes.z;
      words[t][4 * half + 3] = bytes.w;
    }
  }
  float scores[kMTiles][kNTiles][4] = {};
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    uint32_t b[kNTiles][2];
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
      if constexpr (kFp8Mma) {
        b[t][0] = words[t][2 * c];
        b[t][1] = words[t][2 * c + 1];
      } else {
        b[t][0] = fp16_pair(words[t][c], kLowBytes);
        b[t][1] = fp16_pair(words[t][c], kHighBytes);
      }
    }
#pragma unroll
    for (int m = 0; m < kMTiles; ++m) {
      uint32_t a[4];
      load_matrix_x4(a, q_base + q_offset(16 * m + a_row, 2 * c + a_half));
#pragma unroll
      for (int t = 0; t < kNTiles; ++t) {
        if constexpr (kFp8Mma) {
          mma_e4m3(scores[m][t], a, b[t][0], b[t][1]);
        } else {
          mma_f16(scores[m][t], a, b[t][0], b[t][1]);
        }
      }
    }
  }
  float sums[kNTiles * 2] = {};  // key 8t + 2 quad + e at 2t + e
#pragma unroll
  for (int m = 0; m < kMTiles; ++m) {
#pragma unroll
    for (int t = 0; t < kNTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sums[2 * t + e] += weights[m][0] * fmaxf(scores[m][t][e], 0.f);
        sums[2 * t + e] += weights[m][1] * fmaxf(scores[m][t][2 + e], 0.f);
      }
    }
  }

  // Over the 8 lanes of this quad (lane bits 4, 3, 2): lane (group, quad) keeps sum
  // `group`, the logit of key 8 (group / 2) + 2 quad + group % 2.
  float half[4], quarter[2], logit[1];
  reduce_scatter_step<8>(half, sums, 16, lane);
  reduce_scatter_step<4>(quarter, half, 8, lane);
  reduce_scatter_step<2>(logit, quarter, 4, lane);
  const int key = warp * kKeysPerWarp + 8 * (group / 2) + 2 * quad + group % 2;
  const int n = start + key;
  if (n < length) {
    logit_row[n] = logit[0] * (stage_scales[key] * kUnscale);
  } else if (p.clean && n < p.logits_width) {
    logit_row[n] = negative_infinity();
  }
}

// A row's steps: its 128-key runs, the last one partly past its length.
__device__ __forceinline__ int row_steps(const LogitsParams& p, int row) {
  return (row_length(p, row) + kKeys - 1) / kKeys;
}

// A row of the batch and the first key of one of its steps, moved a step at a time in row
// order past rows of no key. Where it enters a row it finds the row's pages and logits.
struct RowCursor {
  static constexpr bool kCrossesRows = true;
  int row;
  int length;  // the row's keys
  int first_key;
  const int32_t* table;  // the row's pages
  float* logits;         // the row's logits

  __device__ __forceinline__ RowCursor(const LogitsParams& p, int row_, int first_key_)
      : row(row_), length(row_length(p, row_)), first_key(first_key_) {
    enter_row(p);
  }
  __device__ __forceinline__ int start() const { return first_key; }
  __device__ __forceinline__ const int32_t* pages(const LogitsParams&) const { return table; }
  __device__ __forceinline__ float* logit_row(const LogitsParams&) const { return logits; }
  // Only while a step follows: past the batch's last row there is no length to read.
  __device__ __forceinline__ void advance(const LogitsParams& p) {
    first_key += kKeys;
    if (first_key < length) return;
    do {
      ++row;
      length = row_length(p, row);
    } while (length == 0);
    first_key = 0;
    enter_row(p);
  }

 private:
  __device__ __forceinline__ void enter_row(const LogitsParams& p) {
    table = p.block_table + row_request(p, row) * p.block_table_stride;
    logits = p.logits + row * p.logits_stride;
  }
};

// Each row's steps and those of the rows before it, into `through` (shared memory, a row
// an int), kThreads rows at a time; returns the batch's steps. Reads each row's length once.
// `warp_sums`: 2 kWarps ints, a pass's warps' sums, alternating so that one barrier a pass
// keeps a pass's writes from the reads of the pass before.
__device__ int count_steps_through(const LogitsParams& p, int* through, int* warp_sums,
                                   int warp, int lane) {
  int before_pass = 0;  // steps of the rows before this pass's
  for (int first = 0, pass = 0; first < p.num_rows; first += kThreads, ++pass) {
    const int row = first + warp * 32 + lane;
    const int steps = row < p.num_rows ? row_steps(p, row) : 0;
    int inclusive = steps;  // the warp's steps up to this row's
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const int below = __shfl_up_sync(0xffffffffu, inclusive, delta);
      if (lane >= delta) inclusive += below;
    }
    int* sums = warp_sums + pass % 2 * kWarps;
    if (lane == 31) sums[warp] = inclusive;
    __syncthreads();
    int before = before_pass;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) before += sums[w];
      before_pass += sums[w];
    }
    if (row < p.num_rows) through[row] = before + inclusive;
  }
  __syncthreads();
  return before_pass;
}

// Where the batch's step `step` lies: the first row whose count in `through` passes it, by
// a binary search every thread makes alike.
__device__ __forceinline__ RowCursor locate_step(const LogitsParams& p, const int* through,
                                                 int step) {
  int low = 0;
  int high = p.num_rows - 1;  // through[num_rows - 1] is the total, past `step`
  while (low < high) {
    const int middle = (low + high) / 2;
    if (through[middle] > step) {
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  const int before = low > 0 ? through[low - 1] : 0;
  return RowCursor(p, low, (step - before) * kKeys);
}

// -inf on every row's columns past its last step (that step writes its own past the row's
// length), 32 columns at a time from block to block, a warp a row.
__device__ __forceinline__ void clean_past_steps(const LogitsParams& p, const int* through,
                                                 int warp, int lane) {
  for (int row = warp; row < p.num_rows; row += kWarps) {
    const int written = (through[row] - (row > 0 ? through[row - 1] : 0)) * kKeys;
    float* logit_row = p.logits + row * p.logits_stride;
    for (int n = written + blockIdx.x * 32 + lane; n < p.logits_width; n += gridDim.x * 32) {
      logit_row[n] = negative_infinity();
    }
  }
}

// A block's `steps` steps from `first` on (a ChunkCursor or a RowCursor): each step's copies
// issued kStages - 1 steps ahead of its scoring, the next step's pages read a step ahead of
// its copies; q and the weights staged for the first step's row, and again where a step
// enters a new row (a RowCursor's step at key 0 that is not the block's first). Shared
// memory: q_tile, then kStages stages of rows and of scales.
template <typename Cursor>
__device__ __forceinline__ void walk_steps(const LogitsParams& p, const Cursor first, int steps,
                                           uint8_t* shared) {
  uint8_t* q_tile = shared;
  uint8_t* rows = shared + kQBytes;
  uint8_t* scales = rows + kRowsBytes;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  // `fetched`: the next step whose copies are issued (its pages read ahead of it); `stored`:
  // the step being scored.
  Cursor fetched = first;
  Cursor stored = first;
  // Start the first steps' copies before staging q, so that they land meanwhile.
  int pages[kPagesPerStep];
#pragma unroll
  for (int step = 0; step < kStages - 1; ++step) {
    if (step < steps) {
      load_pages(pages, fetched.pages(p), fetched.start(), fetched.length);
      issue_step(rows + step * kStageRowBytes, scales + step * kStageScaleBytes, p, thread,
                 fetched.start(), fetched.length, pages);
      if (step + 1 < steps) fetched.advance(p);
    }
    commit_copies();
  }
  if (kStages - 1 < steps) load_pages(pages, fetched.pages(p), fetched.start(), fetched.length);
  stage_q(q_tile, p, stored.row, thread);
  float weights[kMTiles][2];
  load_weights(weights, p, stored.row, lane / 4);
  const uint32_t q_base = shared_address(q_tile);

  for (int step = 0; step < steps; ++step) {
    wait_copies<kStages - 2>();
    __syncthreads();  // this step's rows have landed; the buffer refilled below is free
    const int ahead = step + kStages - 1;
    if (ahead < steps) {
      issue_step(rows + ahead % kStages * kStageRowBytes,
                 scales + ahead % kStages * kStageScaleBytes, p, thread, fetched.start(),
                 fetched.length, pages);
      // A RowCursor moves only while a step follows: past a share's last step it would read
      // a row past the batch. A ChunkCursor's unguarded advance is 9 instructions shorter.
      if (!Cursor::kCrossesRows) fetched.advance(p);
      if (ahead + 1 < steps) {
        if (Cursor::kCrossesRows) fetched.advance(p);
        load_pages(pages, fetched.pages(p), fetched.start(), fetched.length);
      }
    }
    commit_copies();
    if constexpr (Cursor::kCrossesRows) {
      // Every warp is past the last step's reads of q. A fresh thread index keeps ptxas from
      // holding the staging's offsets across the loop for this rare branch.
      if (step > 0 && stored.start() == 0) {
        stage_q(q_tile, p, stored.row, thread_index_here());
        load_weights(weights, p, stored.row, thread_index_here() % 32 / 4);
        __syncthreads();
      }
    }
    score_step(rows + step % kStages * kStageRowBytes,
               reinterpret_cast<const float*>(scales + step % kStages * kStageScaleBytes), q_base,
               weights, warp, lane, stored.logit_row(p), stored.start(), stored.length, p);
    if (!Cursor::kCrossesRows || step + 1 < steps) stored.advance(p);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, PAGED_MQA_LOGITS_MIN_BLOCKS)
    paged_mqa_logits_sm80(const LogitsParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int row = blockIdx.x;
  const int thread = threadIdx.x;
  const int length = row_length(p, row);
  float* logit_row = p.logits + row * p.logits_stride;

  // The row's columns are cut into chunks of keys_per_program; this block takes chunks
  // blockIdx.y, + gridDim.y, + 2 gridDim.y, ... The launcher caps gridDim.y at a few
  // waves of blocks: vLLM asks for rows max_model_len / 4 wide whatever their lengths, and
  // a block a chunk would mostly be blocks that find no key, each holding its 50 KB of
  // shared memory while it looks. Its chunks with keys are all full but the last, so its
  // steps are a run of `steps` 128-key steps.
  const int first_chunk = blockIdx.y;
  const int chunk_stride = gridDim.y;
  const int steps_per_chunk = p.keys_per_program / kKeys;
  const int row_chunks = (length + p.keys_per_program - 1) / p.keys_per_program;
  const int data_chunks =
      first_chunk < row_chunks ? (row_chunks - first_chunk + chunk_stride - 1) / chunk_stride : 0;
  const int last_start = (first_chunk + (data_chunks - 1) * chunk_stride) * p.keys_per_program;
  const int last_steps = min((length - last_start + kKeys - 1) / kKeys, steps_per_chunk);
  const int steps = data_chunks > 0 ? (data_chunks - 1) * steps_per_chunk + last_steps : 0;
  if (p.clean) {  // -inf on the block's columns that no step writes
    for (int chunk = 0; first_chunk + chunk * chunk_stride <
                        (p.logits_width + p.keys_per_program - 1) / p.keys_per_program;
         ++chunk) {
      const int start = (first_chunk + chunk * chunk_stride) * p.keys_per_program;
      const int written = chunk < data_chunks - 1 ? p.keys_per_program
                          : chunk == data_chunks - 1 ? last_steps * kKeys
                                                     : 0;
      const int end = min(start + p.keys_per_program, p.logits_width);
      for (int n = start + written + thread; n < end; n += kThreads) {
        logit_row[n] = negative_infinity();
      }
    }
  }
  if (steps == 0) return;
  walk_steps(p,
             ChunkCursor{row, length, p.block_table + row_request(p, row) * p.block_table_stride,
                         logit_row, first_chunk * p.keys_per_program, 0, p.keys_per_program,
                         chunk_stride * p.keys_per_program},
             steps, shared);
}

// The same logits from a grid of one round of resident blocks that share the batch's 128-key
// steps evenly, in row order: block b takes `total / blocks` steps (one more for the first
// `total % blocks`) from where the blocks before it stop, across rows, each block counting
// the rows' steps itself (at most kBalancedMaxRows rows). The row grid above gives each row
// the same blocks, so one long row among short ones runs on few SMs (3x slower than the
// same keys spread evenly: docs/kernels.md); here every SM takes a share of it. Where a
// block's share moves on to the next row, it stages that row's q and weights. Shares of
// one step each beat shares of two on fewer blocks (2 rows of 4k keys: 0.0045 against
// 0.0058 ms on 112 SMs in sm80 mode), so no share has a floor.
extern "C" __global__ void __launch_bounds__(kThreads, PAGED_MQA_LOGITS_MIN_BLOCKS)
    paged_mqa_logits_balanced_sm80(const LogitsParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  // Until q is staged: each row's running count of steps, and the warps' sums at the end.
  int* through = reinterpret_cast<int*>(shared);
  int* warp_sums = through + kSharedBytes / 4 - 2 * kWarps;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int total = count_steps_through(p, through, warp_sums, warp, lane);
  if (p.clean) clean_past_steps(p, through, warp, lane);
  const int blocks = gridDim.x;
  const int block = blockIdx.x;
  const int steps = total / blocks + (block < total % blocks ? 1 : 0);
  if (steps == 0) return;
  const RowCursor first =
      locate_step(p, through, block * (total / blocks) + min(block, total % blocks));
  __syncthreads();  // the counts' room is q's and the rows'
  walk_steps(p, first, steps, shared);
}
