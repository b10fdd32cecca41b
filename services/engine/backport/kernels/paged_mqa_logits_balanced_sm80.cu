// DeepSeek-V4's indexer logits over the paged fp8 indexer cache, the balanced grid: one
// round of resident blocks, each an even share of the batch's 128-key steps across rows.
// The steps, and why CUDA, are in paged_mqa_logits_steps.cuh; the row grid, which the
// launcher takes past kBalancedMaxRows rows, in paged_mqa_logits_sm80.cu.

#include "paged_mqa_logits_steps.cuh"

namespace {

// Rows the balanced kernel takes: each row's running count of steps sits in shared memory
// (with two sets of the warps' sums) until q is staged. Must match paged_mqa_logits_cuda.
constexpr int kBalancedMaxRows = 8192;
static_assert((kBalancedMaxRows + 2 * kWarps) * 4 <= kSharedBytes, "rows' counts must fit");

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
    table = row_pages(p, row);
    logits = row_logits(p, row);
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
    float* logit_row = row_logits(p, row);
    for (int n = written + blockIdx.x * 32 + lane; n < p.logits_width; n += gridDim.x * 32) {
      logit_row[n] = negative_infinity();
    }
  }
}

}  // namespace

// The logits from a grid of one round of resident blocks that share the batch's 128-key
// steps evenly, in row order: block b takes `total / blocks` steps (one more for the first
// `total % blocks`) from where the blocks before it stop, across rows, each block counting
// the rows' steps itself (at most kBalancedMaxRows rows). The row grid gives each row the
// same blocks, so one long row among short ones runs on few SMs (3x slower than the
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
