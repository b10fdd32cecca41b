"""Launcher of the CUDA paged indexer logits (`paged_mqa_logits_sm80.cu`, the row grid, and
`paged_mqa_logits_balanced_sm80.cu`, the balanced grid: one kernel a file, their steps in
`paged_mqa_logits_steps.cuh`).

Same interface and semantics as `paged_mqa_logits.paged_mqa_logits` (the Triton kernel,
which runs everywhere else, the interpreter included), with keys a program of its own
(`keys_per_program_for_rows`): DeepGEMM's fp8 paged MQA logits as DeepSeek-V4's indexer
calls them on decode steps, built with fp16 mma for sm80/86 and fp8 mma for sm89. Two
kernels of the same steps: the balanced grid (one round of resident blocks sharing the batch's
steps evenly) for steps of up to `BALANCED_MAX_ROWS` rows, the row grid (blocks a row) for
more. The CUDA kernel takes 128-dim heads, at most 64 of them, pages of a power of two of
at least 16 tokens at 16-byte-aligned strides (`takes`); it needs a CUDA card and a CUDA
compiler (NVRTC from torch's wheels, or nvcc).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from services.engine.backport.kernels.card_limits import ARCHS_WITHOUT_FP8
from services.engine.backport.kernels.cuda_module import (
    CudaKernel,
    compile_ptx,
    context_sm_count,
    cuda_device_index,
    device_arch,
)
from services.engine.backport.kernels.paged_mqa_logits import KEYS_PER_PROGRAM, paged_operands

KERNEL_NAME = "paged_mqa_logits_sm80"
# The same logits from one round of resident blocks sharing the batch's steps evenly.
BALANCED_KERNEL_NAME = "paged_mqa_logits_balanced_sm80"
# Each kernel's source, by whether it is the balanced one; both include their steps'
# header beside them.
SOURCES = {balanced: Path(__file__).with_name(f"{name}.cu")
           for balanced, name in ((False, KERNEL_NAME), (True, BALANCED_KERNEL_NAME))}
THREADS = 128
KEYS_PER_STEP = 128  # the kernel's kKeys
HEAD_DIM = 128
MAX_HEADS = 64
MIN_BLOCK_SIZE = 16
# The archs whose cards the kernel was timed for (in emulation on the H200, 112 SMs in sm80
# mode, 88 in sm86 mode and 128 in sm89 mode, 1 to 64 rows of 4k and 32k keys, 262,144
# columns), each kernel with its own keys a program: against the Triton kernel 1.37-1.88x
# at 64 rows, 1.10-1.39x at 8, 0.93-1.39x at one, 1.21-1.75x at 16 and 32. In sm89 mode
# the Triton kernel takes fp8 dots and the CUDA build fp8 mma, which the H200 runs as fp16
# mma on unpacked bytes (docs/kernels.md).
CUDA_LOGITS_ARCHS = ("sm80", "sm86", "sm89")
# A second stage (a step's rows load during the one before) fits two blocks on every
# target (50,176 B; 41,984 with sm89's fp8 q); a third stage held 1.00-1.02x on 132 and 112
# SMs in sm80 mode and left sm86 one block (0.69-0.95x).
DEFAULT_STAGES = 2
DEFAULT_MIN_BLOCKS = 2
# Blocks an SM the build fits in registers where the card's shared memory holds more than
# two: an A100's 164 KB holds three (168 registers a thread, against 191): 1.10-1.16x the
# 2-block build at 64 rows, 0.95-1.16x at 8, on 132 and 112 SMs in sm80 mode (a block a
# chunk). sm86/89 hold two.
MIN_BLOCKS_BY_ARCH = {"sm80": 3}
# Blocks a launch gives a row: at most this many rounds of the blocks the card keeps
# resident, however wide the rows (see the kernel's comment on chunks). Against a block a
# chunk, in the runs above: 64 rows 1.09-2.01x, 8 rows 1.04-1.67x, one row 1.00-1.03x.
WAVES = 4
# Rows a launch takes: the kernels find a row's request by a multiply exact below 2^16.
MAX_ROWS = 1 << 16
# Rows the balanced kernel takes: it counts every row's steps into shared memory (the
# kernel's kBalancedMaxRows). More rows take the row kernel.
BALANCED_MAX_ROWS = 8192


def keys_per_program_for_rows(num_rows: int) -> int:
    """The row kernel's keys a chunk for a step of `num_rows` rows (the route takes that
    kernel only past `BALANCED_MAX_ROWS` rows). A block's 128-key steps run one after
    another (1.5-1.7 us each on the H200 when its SM has no other block), so a step of few
    rows is as slow as its longest chain of them unless rows are cut finer, and the grid
    cap lets long rows take short chunks at little cost. Timed at 1 to 64 rows of 4k and 32k
    keys in sm80, sm86 and sm89 mode (H200 on 112, 88 and 128 SMs; tests/kernels/data/
    paged_logits_cuda_keys_per_program_h200.json, the thirtieth session's kernel): 0.92x
    the time of the Triton kernel's rule (geometric mean), down to 0.69x (2 to 32 rows of
    4k keys), at worst 14% more (one row of 32k keys, sm86). The best cut of few rows
    follows their length: 128 keys for 4k-key rows, 256 or 512 for 32k. More rows were
    not timed: 1,024, as for Triton."""
    if num_rows <= 1:
        return 128
    if num_rows <= 4:
        return 256
    if num_rows <= 64:
        return 512
    return KEYS_PER_PROGRAM


def balanced_for_rows(num_rows: int) -> bool:
    """Whether a step of `num_rows` rows takes the balanced kernel: rows of uneven lengths
    run on every SM there, where the row kernel gives each row the same blocks. One row
    too: on 112/88/128 SMs in sm80/86/89 mode the balanced kernel took 0.93-0.98x the row
    kernel's speed at 2k to 16k keys (0.1-0.3 us more) and 1.16-1.37x at 32k (sm86/89) or
    64k (sm80) to 128k keys (up to 4 us less; docs/kernels.md)."""
    return 1 <= num_rows <= BALANCED_MAX_ROWS


def default_min_blocks(arch: str) -> int:
    """The blocks an SM the build for `arch` is made to fit (`MIN_BLOCKS_BY_ARCH`)."""
    return MIN_BLOCKS_BY_ARCH.get(arch, DEFAULT_MIN_BLOCKS)


class LogitsParams(ctypes.Structure):
    """The kernel's `LogitsParams`, field for field."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("cache", ctypes.c_void_p),
        ("weights", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("block_table", ctypes.c_void_p),
        ("logits", ctypes.c_void_p),
        ("q_request_stride", ctypes.c_int64),
        ("q_draft_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("weights_stride", ctypes.c_int64),
        ("lengths_request_stride", ctypes.c_int64),
        ("lengths_draft_stride", ctypes.c_int64),
        ("block_table_stride", ctypes.c_int64),
        ("logits_stride", ctypes.c_int64),
        ("next_n_reciprocal", ctypes.c_uint64),
        ("num_heads", ctypes.c_int32),
        ("next_n", ctypes.c_int32),
        ("logits_width", ctypes.c_int32),
        ("keys_per_program", ctypes.c_int32),
        ("length_per_row", ctypes.c_int32),
        ("clean", ctypes.c_int32),
        ("num_rows", ctypes.c_int32),
    ]


def takes(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the CUDA kernel takes these operands: 128-dim heads, at most 64 of them, and
    pages of a power of two of at least 16 tokens, 16-byte aligned."""
    block_size = kv_cache.shape[1] if kv_cache.dim() == 4 else 0
    return (q.dim() == 4 and q.shape[-1] == HEAD_DIM and q.shape[2] <= MAX_HEADS
            and block_size >= MIN_BLOCK_SIZE and block_size & (block_size - 1) == 0
            and kv_cache.stride(0) % 16 == 0 and kv_cache.data_ptr() % 16 == 0)


def logits_ptx(arch: str, block_size: int, stages: int = DEFAULT_STAGES,
               min_blocks: int = DEFAULT_MIN_BLOCKS, balanced: bool = False) -> bytes:
    """The PTX of the row kernel (the balanced one with `balanced`) for `arch`'s instruction
    set and `block_size`-token pages (cached on disk by `compile_ptx`): fp8 mma where the
    arch has it (sm89 on), fp16 before."""
    return compile_ptx(SOURCES[balanced], arch, {"PAGED_MQA_LOGITS_BLOCK_SIZE": block_size,
                                      "PAGED_MQA_LOGITS_STAGES": stages,
                                      "PAGED_MQA_LOGITS_MIN_BLOCKS": min_blocks,
                                      "PAGED_MQA_LOGITS_FP8_MMA": int(arch not in
                                                                      ARCHS_WITHOUT_FP8)})


@dataclass(frozen=True)
class LoadedLogits:
    """The kernel on one GPU, with what its launches need."""

    kernel: CudaKernel
    shared_bytes: int  # dynamic shared memory a block uses (the source's own constant)
    launch_shared_bytes: int  # what launches ask for: more on a card with more per SM
    blocks_per_sm: int  # resident at once: the target card's figure, where it is known
    sm_count: int  # SMs of the context it was loaded in (a green context's share)

    def blocks_per_row(self, num_rows: int, chunks: int) -> int:
        """Blocks a row for `num_rows` rows of `chunks` chunks: each takes every so many of
        its row's chunks, so that the grid is at most `WAVES` rounds of resident blocks."""
        return max(1, min(chunks, triton.cdiv(WAVES * self.resident_blocks, max(1, num_rows))))

    @property
    def resident_blocks(self) -> int:
        """Blocks the card (held to the target) runs at once: the balanced kernel's grid."""
        return self.blocks_per_sm * self.sm_count


def load_logits(arch: str, device_index: int, block_size: int, stages: int = DEFAULT_STAGES,
                min_blocks: int = DEFAULT_MIN_BLOCKS, balanced: bool = False) -> LoadedLogits:
    """The kernel built for `arch`'s instruction set (the balanced one with `balanced`),
    loaded on GPU `device_index`, its launches held to the blocks an SM of `arch` holds
    (`card_limits`) when the card present holds more. Load before capturing a CUDA graph:
    loading reads a constant back. Loaded once per build and GPU, however the arguments
    are spelled."""
    return _load_logits(arch, device_index, block_size, stages, min_blocks, balanced)


@functools.cache  # keyed by position only, so a defaulted argument finds the same build
def _load_logits(arch: str, device_index: int, block_size: int, stages: int,
                 min_blocks: int, balanced: bool) -> LoadedLogits:
    device = torch.device("cuda", device_index)
    kernel = CudaKernel(logits_ptx(arch, block_size, stages, min_blocks, balanced),
                        BALANCED_KERNEL_NAME if balanced else KERNEL_NAME, device)
    shared = kernel.read_int_global("kPagedMqaLogitsSharedBytes")
    launch_shared = kernel.target_shared_bytes(arch, THREADS, shared)
    with torch.cuda.device(device):
        sm_count = context_sm_count(device_index)
    return LoadedLogits(kernel, shared, launch_shared,
                        kernel.blocks_per_sm(THREADS, launch_shared), sm_count)


@dataclass(frozen=True)
class LogitsLaunch:
    """One launch of the kernel: its grid and argument, and the logits it fills."""

    grid: tuple[int, int, int]
    params: LogitsParams
    block_size: int
    logits: torch.Tensor
    operands: tuple[torch.Tensor, ...]  # what params point into, kept alive


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied where its rows do not start at 16-byte boundaries."""
    if tensor.data_ptr() % 16 or any(stride % 16 for stride in tensor.stride()[:-1]):
        return tensor.contiguous()
    return tensor


def logits_launch(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                  context_lens: torch.Tensor, block_tables: torch.Tensor, max_model_len: int,
                  clean_logits: bool, keys_per_program: int | None,
                  blocks_per_row: Callable[[int, int], int] | int | None = None,
                  balanced_blocks: Callable[[], int] | int | None = None) -> LogitsLaunch:
    """Checks the operands and lays out the launch. For the row kernel: a grid of rows x
    blocks a row, which is a count or, given the rows and each row's chunks of
    `keys_per_program` keys, picks one (default: a block a chunk). Given
    `balanced_blocks` (a count, or what gives one), for the balanced kernel: that many
    blocks, but no more than the rows have 128-key steps at their widest."""
    operands = paged_operands(q, kv_cache, weights, context_lens, block_tables)
    if operands.num_rows >= MAX_ROWS:
        raise ValueError(f"the CUDA paged logits take fewer than {MAX_ROWS} rows "
                         f"(B * next_n), got {operands.num_rows}")
    q = _aligned(operands.q)
    if not takes(q, kv_cache):
        raise ValueError(
            f"the CUDA paged logits take {HEAD_DIM}-dim heads, at most {MAX_HEADS}, and pages "
            f"of a power of two of at least {MIN_BLOCK_SIZE} tokens at 16-byte-aligned "
            f"strides; got q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)} stride "
            f"{kv_cache.stride(0)}")
    if keys_per_program is None:
        keys_per_program = keys_per_program_for_rows(operands.num_rows)
    if keys_per_program <= 0 or keys_per_program % KEYS_PER_STEP:
        raise ValueError(f"keys_per_program must be a positive multiple of {KEYS_PER_STEP}, "
                         f"got {keys_per_program}")
    weights = weights.to(torch.float32)
    context_lens = context_lens.to(torch.int32)
    block_tables = operands.block_tables.to(torch.int32)
    logits = torch.empty((operands.num_rows, max_model_len), dtype=torch.float32,
                         device=q.device)
    params = LogitsParams(
        q=q.data_ptr(),
        cache=kv_cache.data_ptr(),
        weights=weights.data_ptr(),
        lengths=context_lens.data_ptr(),
        block_table=block_tables.data_ptr(),
        logits=logits.data_ptr(),
        q_request_stride=q.stride(0),
        q_draft_stride=q.stride(1),
        q_head_stride=q.stride(2),
        block_stride=kv_cache.stride(0),
        weights_stride=weights.stride(0),
        lengths_request_stride=context_lens.stride(0),
        lengths_draft_stride=context_lens.stride(1) if context_lens.dim() == 2 else 0,
        block_table_stride=block_tables.stride(0),
        logits_stride=logits.stride(0),
        next_n_reciprocal=-(-(1 << 32) // q.shape[1]),
        num_heads=q.shape[2],
        next_n=q.shape[1],
        logits_width=max_model_len,
        keys_per_program=keys_per_program,
        length_per_row=int(operands.length_per_row),
        clean=int(clean_logits),
        num_rows=operands.num_rows,
    )
    if balanced_blocks is not None:
        if operands.num_rows > BALANCED_MAX_ROWS:
            raise ValueError(f"the balanced CUDA paged logits take at most {BALANCED_MAX_ROWS} "
                             f"rows (B * next_n), got {operands.num_rows}")
        if callable(balanced_blocks):
            balanced_blocks = balanced_blocks()
        most_steps = operands.num_rows * triton.cdiv(max_model_len, KEYS_PER_STEP)
        grid = (max(1, min(balanced_blocks, most_steps)), 1, 1)
        return LogitsLaunch(grid, params, operands.block_size, logits,
                            (q, kv_cache, weights, context_lens, block_tables))
    chunks = triton.cdiv(max_model_len, keys_per_program)
    if callable(blocks_per_row):
        blocks_per_row = blocks_per_row(operands.num_rows, chunks)
    grid = (operands.num_rows, min(chunks, blocks_per_row or chunks), 1)
    return LogitsLaunch(grid, params, operands.block_size, logits,
                        (q, kv_cache, weights, context_lens, block_tables))


def paged_mqa_logits_cuda(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
    clean_logits: bool = False,
    keys_per_program: int | None = None,
    arch: str | None = None,
    stages: int = DEFAULT_STAGES,
    min_blocks: int = DEFAULT_MIN_BLOCKS,
    blocks_per_row: int | None = None,
    balanced: bool | None = None,
) -> torch.Tensor:
    """Indexer logits [B * next_n, max_model_len] fp32, as `paged_mqa_logits`. `arch` picks
    the instruction set the kernel is built for (default: the card's own), `stages` how
    many 128-key steps shared memory holds, `min_blocks` the blocks an SM the build must
    fit, `balanced` the kernel (default: `balanced_for_rows`), `blocks_per_row` the row
    kernel's blocks a row (default: `LoadedLogits.blocks_per_row`)."""
    rows = q.shape[0] * q.shape[1] if q.dim() == 4 else 0
    if balanced is None:
        balanced = balanced_for_rows(rows)

    def loaded() -> LoadedLogits:  # after the operands' checks, which need no GPU
        return load_logits(arch or device_arch(q.device), cuda_device_index(q.device),
                           kv_cache.shape[1], stages, min_blocks, balanced)

    launch = logits_launch(q, kv_cache, weights, context_lens, block_tables, max_model_len,
                           clean_logits, keys_per_program,
                           blocks_per_row if blocks_per_row is not None
                           else lambda *shape: loaded().blocks_per_row(*shape),
                           (lambda: loaded().resident_blocks) if balanced else None)
    if launch.logits.numel() == 0:
        return launch.logits
    built = loaded()
    built.kernel.launch(launch.grid, THREADS, built.launch_shared_bytes, launch.params)
    return launch.logits
