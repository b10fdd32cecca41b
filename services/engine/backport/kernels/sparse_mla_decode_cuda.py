"""Launcher of the CUDA sparse MLA decode (`sparse_mla_sm80.cu`'s decode build).

Same interface and semantics as `sparse_mla_decode.sparse_mla_decode` (the Triton
kernel, which also runs under the interpreter and stays the portable path): FlashMLA's
sparse fp8 decode as DeepSeek-V4 calls it. The CUDA kernel needs a CUDA card, a CUDA
compiler (NVRTC from torch's wheels, or nvcc), bf16 q and power-of-two page sizes; heads
go 16 to a block. It always writes split partials and lets the Triton `combine_splits`
merge them and apply the sink (one split included).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.cuda_module import (
    CudaKernel,
    compile_ptx,
    context_sm_count,
    cuda_device_index,
    device_arch,
)
from services.engine.backport.kernels.decode_splits import SplitCostModel
from services.engine.backport.kernels.sparse_mla_combine import LOG2E, combine_splits
from services.engine.backport.kernels.sparse_mla_decode import (
    MAX_SPLITS,
    as_token_major,
    decode_operands,
    int32_rows,
)

SOURCE = Path(__file__).with_name("sparse_mla_sm80.cu")
KERNEL_NAME = "sparse_mla_decode_sm80"
THREADS = 128
HEADS_PER_BLOCK = 16
DEFAULT_STAGES = 2
KEYS_PER_STEP = 16  # the kernel's kKeys
# The split rule's model, in 16-key steps. Fitted to CUDA-graph times of every split count
# (1..32 for grids of up to 16 blocks, 1..12 above) for 12 shapes on the H200 in sm80 mode,
# on green contexts of 132, 112 and 88 SMs (`bench/kernels.py --sms N --sweep-splits
# --decode-backend cuda`; tests/kernels/data). Over those 36 cases the pick is at most 4.5%
# slower than the fastest split count; the rule it replaced, which filled one wave, was up
# to 62% slower (88 SMs, B=64 H=16 top-k 2048: 0.113 ms, 1 split, against 0.070 ms). The
# combine's 64-split build costs more than the decode saves (bf16 partials, sm80 mode,
# B=1 H=16 top-k 2048 + 128: 32 splits 0.0103 ms, 34 0.0127, 64 0.0122), so 32 at most.
SPLIT_COST = SplitCostModel(
    keys_per_step=KEYS_PER_STEP,
    lists_share_steps=True,
    fixed_steps_per_block=5.0,
    shared_sm_speedup=1.4,
    combine_steps_per_split=0.08,
    max_splits=32,
)
# The blocks an SM every launch's build is for: 2 caps a thread at 255 registers, which
# lets the next step's QK^T overlap this step's softmax and keeps q in registers. In sm80
# mode (the A100's shared memory would hold 3 blocks) it beats the 3-block build (168
# registers, steps one after another) on every shape swept (top-k 2048 + 128: B=64 H=16
# 0.0503 against 0.0539 ms, B=64 H=64 0.1509 against 0.1758, B=8 H=16 0.0170 against
# 0.0186, B=1 0.0109 against 0.0117; docs/kernels-history.md). 3 and 4 stay selectable.
DEFAULT_MIN_BLOCKS = 2
# Split partials in bf16: a block's last act is writing 16 x 512 of them, all blocks of the
# wave at once, and the combine reads them back. Half the bytes: the decode kernel alone
# 46.8 -> 41.3 us at B=64 H=16 top-k 2048 + 128, 13.4 -> 10.3 at B=8; with the combine
# 0.0500 -> 0.0444 ms and 0.0166 -> 0.0129 (H200, sm80 mode). The output is bf16 anyway;
# the max error on the tests' cases goes 0.0167 -> 0.0184.
DEFAULT_PARTIAL_DTYPE = torch.bfloat16


class SparseMlaParams(ctypes.Structure):
    """The kernel's `SparseMlaParams`, field for field (the last three are the prefill's)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("extra_cache", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("extra_slots", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("extra_lengths", ctypes.c_void_p),
        ("partial_out", ctypes.c_void_p),
        ("partial_lse", ctypes.c_void_p),
        ("q_token_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("extra_block_stride", ctypes.c_int64),
        ("slots_stride", ctypes.c_int64),
        ("extra_slots_stride", ctypes.c_int64),
        ("block_size_log2", ctypes.c_int32),
        ("extra_block_size_log2", ctypes.c_int32),
        ("list_width", ctypes.c_int32),
        ("extra_list_width", ctypes.c_int32),
        ("split_len", ctypes.c_int32),
        ("extra_split_len", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("bf16_partials", ctypes.c_int32),
        ("qk_scale_log2", ctypes.c_float),
        ("sink", ctypes.c_void_p),
        ("max_logits", ctypes.c_void_p),
        ("row_limit", ctypes.c_int32),
    ]


@dataclass(frozen=True)
class LoadedSparseMla:
    """The kernel on one GPU, with what its launches need."""

    kernel: CudaKernel
    shared_bytes: int  # dynamic shared memory a block uses (the source's own constant)
    launch_shared_bytes: int  # what launches ask for: more on a card with more per SM
    blocks_per_sm: int  # resident at once: the target card's figure, where it is known
    sm_count: int  # SMs of the context it was loaded in (a green context's share)


def decode_ptx(arch: str, stages: int = DEFAULT_STAGES,
               min_blocks: int = DEFAULT_MIN_BLOCKS) -> bytes:
    """The kernel's PTX for `arch`'s instruction set (cached on disk by `compile_ptx`)."""
    return compile_ptx(
        SOURCE,
        arch,
        {"SPARSE_MLA_DECODE_STAGES": stages, "SPARSE_MLA_DECODE_MIN_BLOCKS": min_blocks},
    )


def load_decode(
    arch: str, device_index: int, stages: int = DEFAULT_STAGES,
    min_blocks: int = DEFAULT_MIN_BLOCKS,
) -> LoadedSparseMla:
    """The kernel built for `arch`'s instruction set, loaded on GPU `device_index`, its
    launches held to the blocks an SM of `arch` holds (`card_limits`) when the card present
    holds more. Load before capturing a CUDA graph: loading reads a constant back from the
    GPU. Loaded once per build and GPU, however the arguments are spelled."""
    return _load_decode(arch, device_index, stages, min_blocks)


@functools.cache  # keyed by position only, so a defaulted argument finds the same build
def _load_decode(arch: str, device_index: int, stages: int, min_blocks: int) -> LoadedSparseMla:
    return load_build(decode_ptx(arch, stages, min_blocks), KERNEL_NAME, arch, device_index)


def load_build(ptx: bytes, name: str, arch: str, device_index: int) -> LoadedSparseMla:
    """A build of `sparse_mla_sm80.cu` (decode or prefill) loaded on GPU `device_index`,
    its launches held to the blocks an SM of `arch`."""
    device = torch.device("cuda", device_index)
    kernel = CudaKernel(ptx, name, device)
    shared = kernel.read_int_global("kSparseMlaSharedBytes")
    launch_shared = kernel.target_shared_bytes(arch, THREADS, shared)
    blocks = kernel.blocks_per_sm(THREADS, launch_shared)
    with torch.cuda.device(device):
        sm_count = context_sm_count(device_index)
    return LoadedSparseMla(kernel, shared, launch_shared, blocks, sm_count)


def choose_num_splits(programs: int, list_width: int, extra_list_width: int,
                      loaded: LoadedSparseMla) -> int:
    """Splits of each token's two slot lists for `programs` (token, head block) pairs: the
    cheapest under `SPLIT_COST` on the SMs and blocks an SM the kernel was loaded for."""
    return SPLIT_COST.cheapest_splits(programs, list_width, extra_list_width, loaded.sm_count,
                                      loaded.blocks_per_sm)


def _log2_block_size(block_size: int) -> int:
    if block_size & (block_size - 1):
        raise ValueError(f"the CUDA decode needs a power-of-two block size, got {block_size}")
    return block_size.bit_length() - 1


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch of the kernel: its grid and argument, and the tensors it fills."""

    grid: tuple[int, int, int]
    params: SparseMlaParams
    q: torch.Tensor  # as the kernel reads it
    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    operands: tuple[torch.Tensor | None, ...]  # the rest params point into, kept alive

    def combine(self, attn_sink: torch.Tensor | None,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, H, 512], lse [T, H]) from the launch's split partials, with the sink."""
        if out is None:
            out = torch.empty_like(self.q)
        out = as_token_major(out, "q")
        lse = torch.empty(self.q.shape[:2], dtype=torch.float32, device=self.q.device)
        combine_splits(self.partial_out, self.partial_lse, attn_sink, out, lse)
        return out, lse


def decode_launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None,
    extra_k_cache: torch.Tensor | None,
    extra_indices: torch.Tensor | None,
    extra_topk_length: torch.Tensor | None,
    block_size: int | None,
    extra_block_size: int | None,
    num_splits: int | Callable[[int, int, int], int],
    partial_dtype: torch.dtype,
) -> DecodeLaunch:
    """Checks the operands and lays out the launch; `num_splits` is a count or, given the
    grid's (token, head block) programs and the two lists' widths, picks one."""
    operands = decode_operands(
        q, k_cache, indices, extra_k_cache, extra_indices, block_size, extra_block_size
    )
    q, geometry, extra_geometry = operands.q, operands.geometry, operands.extra_geometry
    indices, extra_indices = operands.indices, operands.extra_indices
    has_extra = extra_indices is not None
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16, got {q.dtype}")
    if partial_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"partial_dtype must be float32 or bfloat16, got {partial_dtype}")
    if q.stride(0) % 4 or q.stride(1) % 4:
        raise ValueError("q strides must be multiples of 4 elements (8-byte loads)")
    num_tokens, num_heads, _ = q.shape
    lengths = int32_rows(topk_length)
    extra_lengths = int32_rows(extra_topk_length) if has_extra else None
    num_head_blocks = triton.cdiv(num_heads, HEADS_PER_BLOCK)
    list_width = indices.shape[1]
    extra_list_width = extra_indices.shape[1] if has_extra else 0
    if callable(num_splits):
        # A split walks its piece of both lists as one run of keys.
        num_splits = num_splits(num_tokens * num_head_blocks, list_width, extra_list_width)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    partial_out = torch.empty(
        (num_tokens, num_splits, num_heads, layout.HEAD_DIM), dtype=partial_dtype,
        device=q.device)
    partial_lse = torch.empty((num_tokens, num_splits, num_heads), dtype=torch.float32,
                              device=q.device)
    params = SparseMlaParams(
        q=q.data_ptr(),
        cache=k_cache.data_ptr(),
        extra_cache=(extra_k_cache if has_extra else k_cache).data_ptr(),
        slots=indices.data_ptr(),
        extra_slots=(extra_indices if has_extra else indices).data_ptr(),
        lengths=lengths.data_ptr() if lengths is not None else None,
        extra_lengths=extra_lengths.data_ptr() if extra_lengths is not None else None,
        partial_out=partial_out.data_ptr(),
        partial_lse=partial_lse.data_ptr(),
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        block_stride=geometry.block_stride,
        extra_block_stride=extra_geometry.block_stride,
        slots_stride=indices.stride(0),
        extra_slots_stride=extra_indices.stride(0) if has_extra else 0,
        block_size_log2=_log2_block_size(geometry.block_size),
        extra_block_size_log2=_log2_block_size(extra_geometry.block_size),
        list_width=list_width,
        extra_list_width=extra_list_width,
        split_len=triton.cdiv(list_width, num_splits),
        extra_split_len=triton.cdiv(extra_list_width, num_splits),
        num_heads=num_heads,
        num_splits=num_splits,
        bf16_partials=int(partial_dtype == torch.bfloat16),
        qk_scale_log2=softmax_scale * LOG2E,
    )
    return DecodeLaunch((num_head_blocks, num_splits, num_tokens), params, q, partial_out,
                        partial_lse, (k_cache, extra_k_cache, indices, extra_indices,
                                      lengths, extra_lengths))


def sparse_mla_decode_cuda(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    block_size: int | None = None,
    extra_block_size: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    arch: str | None = None,
    stages: int = DEFAULT_STAGES,
    min_blocks: int = DEFAULT_MIN_BLOCKS,
    partial_dtype: torch.dtype = DEFAULT_PARTIAL_DTYPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode; returns (out [T, H, 512], lse [T, H] natural log).

    `arch` picks the instruction set the kernel is built for ("sm80", "sm86", ...;
    default: the card's own); `stages` how many steps of rows shared memory holds;
    `min_blocks` the blocks an SM the build must fit (2 to 4; default `DEFAULT_MIN_BLOCKS`);
    `partial_dtype` what the splits' partial outputs are stored in (bfloat16 or float32;
    default `DEFAULT_PARTIAL_DTYPE`).
    """
    def loaded() -> LoadedSparseMla:  # after the operands' checks, which need no GPU
        return load_decode(arch or device_arch(q.device), cuda_device_index(q.device), stages,
                           min_blocks)

    launch = decode_launch(
        q, k_cache, indices, softmax_scale, topk_length, extra_k_cache, extra_indices,
        extra_topk_length, block_size, extra_block_size,
        num_splits if num_splits is not None
        else lambda *lists: choose_num_splits(*lists, loaded()), partial_dtype)
    decode = loaded()
    decode.kernel.launch(launch.grid, THREADS, decode.launch_shared_bytes, launch.params)
    return launch.combine(attn_sink, out)
