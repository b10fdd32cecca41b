"""The CPU emulation that runs the CUDA kernels' own source in their tests: its threads
exchange values through warp shuffles and shared memory across barriers as CUDA's do, and
a barrier some threads never reach is reported rather than waited on for ever."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from tests.kernels.cuda_host_emulation import EmulatedKernel

# Each block's threads sum their indices twice over: across each warp through shuffles,
# then across the warps through shared memory after a barrier. Every thread writes the
# block's total, plus the block's index, so a lane that read a stale value shows.
BLOCK_SUM = """
struct BlockSumParams {
  int* out;
  int warps;
};

__global__ void block_sum(const BlockSumParams p) {
  int* per_warp = reinterpret_cast<int*>(shared);
  int value = static_cast<int>(threadIdx.x);
  for (int mask = 16; mask > 0; mask /= 2) value += __shfl_xor_sync(0xffffffffu, value, mask);
  if (threadIdx.x % 32 == 0) per_warp[threadIdx.x / 32] = value;
  __syncthreads();
  int total = 0;
  for (int warp = 0; warp < p.warps; ++warp) total += per_warp[warp];
  p.out[blockIdx.x * p.warps * 32 + threadIdx.x] = total + static_cast<int>(blockIdx.x);
}
"""

# The threads from `first_to_leave` on return before the barrier the others wait at.
STRANDED = """
struct StrandedParams {
  unsigned first_to_leave;
};

__global__ void stranded(const StrandedParams p) {
  if (threadIdx.x >= p.first_to_leave) return;
  __syncthreads();
}
"""


class BlockSumParams(ctypes.Structure):
    _fields_ = [("out", ctypes.POINTER(ctypes.c_int)), ("warps", ctypes.c_int)]


class StrandedParams(ctypes.Structure):
    _fields_ = [("first_to_leave", ctypes.c_uint)]


def build(tmp_path: Path, name: str, source: str, params: str) -> EmulatedKernel:
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    return EmulatedKernel(path, name, params, {}, tmp_path)


def test_threads_exchange_through_shuffles_and_shared_memory(tmp_path: Path) -> None:
    kernel = build(tmp_path, "block_sum", BLOCK_SUM, "BlockSumParams")
    warps, blocks = 4, 3
    threads = warps * 32
    out = (ctypes.c_int * (blocks * threads))()
    kernel.launch((blocks, 1, 1), threads, BlockSumParams(out, warps))
    block_total = threads * (threads - 1) // 2
    assert list(out) == [block_total + block for block in range(blocks) for _ in range(threads)]
    assert kernel.block_barriers() == [1] * blocks


def test_a_barrier_some_threads_never_reach_is_a_fault(tmp_path: Path) -> None:
    kernel = build(tmp_path, "stranded", STRANDED, "StrandedParams")
    with pytest.raises(AssertionError, match="never reach"):
        kernel.launch((2, 1, 1), 64, StrandedParams(32))
    kernel.launch((2, 1, 1), 64, StrandedParams(64))
