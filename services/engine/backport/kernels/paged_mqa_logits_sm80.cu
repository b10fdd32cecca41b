// DeepSeek-V4's indexer logits over the paged fp8 indexer cache, the row grid: one block =
// one row (a request's token) and some chunks of keys_per_program of its keys. The steps,
// and why CUDA, are in paged_mqa_logits_steps.cuh. The launcher takes this grid for steps
// of more rows than the balanced grid (paged_mqa_logits_balanced_sm80.cu) holds counts for.

#include "paged_mqa_logits_steps.cuh"

namespace {

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

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads, PAGED_MQA_LOGITS_MIN_BLOCKS)
    paged_mqa_logits_sm80(const LogitsParams p) {
  extern __shared__ __align__(16) uint8_t shared[];
  const int row = blockIdx.x;
  const int thread = threadIdx.x;
  const int length = row_length(p, row);
  float* logit_row = row_logits(p, row);

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
             ChunkCursor{row, length, row_pages(p, row), logit_row,
                         first_chunk * p.keys_per_program, 0, p.keys_per_program,
                         chunk_stride * p.keys_per_program},
             steps, shared);
}
