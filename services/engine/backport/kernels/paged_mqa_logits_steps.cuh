// The steps of DeepSeek-V4's indexer logits over the paged fp8 indexer cache with Ampere's
// mma.sync, shared by the CUDA counterparts of paged_mqa_logits.py's Triton kernel
// (DeepGEMM's fp8_paged_mqa_logits), for sm80/86/89: paged_mqa_logits_sm80.cu (the row
// grid) and paged_mqa_logits_balanced_sm80.cu (the balanced grid).
//
// Why CUDA: both operands of the Triton kernel's dot take the layout K's fp8 bytes give, so
// q's fragments are moved register by register every step (216 of its 1,061 instructions a
// 128-key step, sm_80 ptxas); keeping q in the layout ldmatrix gives costs it a K tile
// decoded through shared memory instead (docs/kernels-history.md, twenty-sixth session).
// Here K goes from its 16-byte loads to mma fragments in registers and q comes by ldmatrix.
//
// A step is 128 keys of a row; four warps, warp w scores keys 32w..32w+31 against all 64
// heads:
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
// A kernel walks its steps with walk_steps over a cursor of its own.

#pragma once

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

// The row's pages: its request's row of the block table.
__device__ __forceinline__ const int32_t* row_pages(const LogitsParams& p, int row) {
  return p.block_table + row_request(p, row) * p.block_table_stride;
}

// The row's logits.
__device__ __forceinline__ float* row_logits(const LogitsParams& p, int row) {
  return p.logits + row * p.logits_stride;
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
