"""DeepSeek-V4's indexer logits over the paged fp8 indexer cache, for sm80/86/89.

Replaces DeepGEMM's `fp8_paged_mqa_logits` (vLLM's `fp8_fp4_paged_mqa_logits` with fp8 q),
which the sparse-attention indexer calls on decode steps; DeepGEMM runs on sm90/sm100
only. The keys are the indexer cache `indexer_k_compress` writes: a page is [block_size
x D fp8 bytes][block_size x 4 B fp32 scales][padding], given as the view
[num_blocks, block_size, 1, D + 4] vLLM passes.

Semantics, the reference being `paged_mqa_logits_reference`:
- q [B, next_n, H, D] fp8 e4m3 (per-token scale folded into `weights` [B * next_n, H]);
- row r = b * next_n + j sees keys n < L, L = context_lens[b, j] when context_lens is
  [B, next_n], else context_lens[b] - next_n + 1 + j (the draft tokens' causal offset);
  key n of request b is position n % block_size of page block_tables[b, n // block_size];
- logits[r, n] = sum over h of weights[r, h] * relu(q[b, j, h] . k[n] * k_scale[n]) for
  n < L; columns from L to max_model_len are left unwritten, or -inf with clean_logits;
- returns logits [B * next_n, max_model_len] fp32.

Tiling: a program owns one row (its H heads of q decoded to bf16 once) and
KEYS_PER_PROGRAM keys (fewer when the step has few rows: `keys_per_program_for_rows`),
walked BLOCK_N at a time; each K tile is decoded once, and `head_weighted_logits` scores
it for all heads in one dot (see `mqa_logits`). On sm89 and later q and K go to the
tensor cores as fp8, undecoded (`dot_operand`). The next tile loads during this one's
dot where the card keeps as many programs an SM of that build (`pipeline_stages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.cuda_module import compiled_blocks_per_sm
from services.engine.backport.kernels.fp8_e4m3 import dot_operand, hardware_fp8_encode
from services.engine.backport.kernels.mqa_logits import (
    as_bytes,
    head_weighted_logits,
    load_q_rows,
    mqa_logits_reference,
)
from services.engine.backport.kernels.sparse_mla_decode import dot_dtype

SCALE_BYTES = 4  # one fp32 scale a cached row
# 128 keys a step at 4 warps: 154 TFLOP/s on the H200 in sm80 mode (B=64, 32k keys),
# 64 keys 119, 256 keys 97 (134 at 8 warps).
DEFAULT_BLOCK_N = 128
DEFAULT_NUM_WARPS = 4
# Keys a program walks in a step of more than 8 rows: a decode step has few rows, so a
# 32k-key context is cut into 32 programs a row; q is decoded once per 1,024 keys.
KEYS_PER_PROGRAM = 1024
# Triton's pipeliner gives the K tiles (an indirect load: page ids, then rows) one buffer
# at 3 stages, so each step waits for its own rows; at 5 stages it keeps two and loads the
# next step's rows during this one, in 50,688 B instead of 33,792 (Triton 3.6, 64 heads
# of 128 dims). In sm80 mode on 132 and 112 SMs (two programs an SM either way, as on an
# A100), steps of 8 and 64 rows of 32k keys ran 1.04-1.12x faster double-buffered, one
# row (2 steps a program) 3-4% slower. sm86's 100 KB holds one program of it instead of
# two (1.4x slower in sm86 mode), so a launch takes it only where it holds as many.
SINGLE_BUFFER_STAGES = 3
DOUBLE_BUFFER_STAGES = 5
DOUBLE_BUFFER_MIN_STEPS = 4


def keys_per_program_for_rows(num_rows: int) -> int:
    """Keys a program walks for a step of `num_rows` rows. A program's 128-key steps are a
    chain of dependent loads, so a step of few rows is as slow as its rows' longest chain
    of them unless rows are cut finer; with many rows, finer cuts only add programs. Timed
    at 1, 4, 8, 16, 32 and 64 rows of 4k to 64k keys (H200, sm80 mode, 132, 112 and 88
    SMs; tests/kernels/data): one row 256 keys (1.2-2.9x faster than 1,024), up to 8 rows
    512 (up to 1.7x faster, at worst 10% slower), more rows 1,024. The rows' lengths are
    on the GPU, so the pick cannot follow them."""
    if num_rows <= 1:
        return 256
    if num_rows <= 8:
        return 512
    return KEYS_PER_PROGRAM


def pipeline_stages(steps_per_program: int, single_buffered_programs_per_sm: int,
                    double_buffered_programs_per_sm: int) -> int:
    """Triton's num_stages for a launch whose programs walk `steps_per_program` K tiles,
    given how many programs of each build an SM keeps resident (see DOUBLE_BUFFER_STAGES)."""
    if (steps_per_program >= DOUBLE_BUFFER_MIN_STEPS
            and double_buffered_programs_per_sm >= single_buffered_programs_per_sm):
        return DOUBLE_BUFFER_STAGES
    return SINGLE_BUFFER_STAGES


_programs_per_sm: dict[tuple[object, ...], tuple[int, int]] = {}


def programs_per_sm(args: tuple[object, ...], constants: dict[str, object]) -> tuple[int, int]:
    """Resident programs an SM of the single- and the double-buffered build for a launch
    (the target's under emulation); each compiled once per build and arch."""
    key = (args[0].device, triton.knobs.runtime.override_arch, *sorted(constants.items()))
    if key not in _programs_per_sm:
        _programs_per_sm[key] = tuple(
            compiled_blocks_per_sm(_paged_mqa_logits_kernel, args,
                                   dict(constants, num_stages=stages))
            for stages in (SINGLE_BUFFER_STAGES, DOUBLE_BUFFER_STAGES))
    return _programs_per_sm[key]


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr,
    cache_ptr,
    weights_ptr,
    lengths_ptr,
    block_table_ptr,
    logits_ptr,
    num_heads,
    next_n,
    logits_width,
    block_stride,
    stride_q_row,
    stride_q_head,
    stride_weights,
    stride_lengths_request,
    stride_lengths_draft,
    stride_block_table,
    stride_logits,
    LENGTH_PER_ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CLEAN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    row = tl.program_id(0)
    chunk_start = tl.program_id(1) * KEYS_PER_PROGRAM
    request = row // next_n
    draft = row % next_n
    if LENGTH_PER_ROW:
        length = tl.load(lengths_ptr + request * stride_lengths_request
                         + draft * stride_lengths_draft)
    else:
        length = tl.load(lengths_ptr + request * stride_lengths_request) - next_n + 1 + draft
    length = tl.minimum(length, logits_width)
    stop = tl.minimum(chunk_start + KEYS_PER_PROGRAM, length)
    if CLEAN:
        stop = tl.minimum(chunk_start + KEYS_PER_PROGRAM, logits_width)
    logit_row = logits_ptr + row.to(tl.int64) * stride_logits
    # The grid spans logits_width, which vLLM sets to the longest context the model takes
    # (DeepSeek-V4: max_model_len / 4), so most programs of a short row have no key: they
    # skip q, and write -inf or nothing.
    if chunk_start >= length:
        if CLEAN:
            for key_start in range(chunk_start, stop, BLOCK_N):
                keys = key_start + tl.arange(0, BLOCK_N)
                tl.store(logit_row + keys, float("-inf"), mask=keys < stop)
        return

    heads = tl.arange(0, HEADS)
    head_mask = heads < num_heads
    rows = tl.zeros((HEADS,), dtype=tl.int32) + row
    q = load_q_rows(q_ptr, rows, heads, head_mask, stride_q_row, stride_q_head,
                    HEAD_DIM, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
    weights = tl.load(weights_ptr + row.to(tl.int64) * stride_weights + heads,
                      mask=head_mask, other=0.0)

    dims = tl.arange(0, HEAD_DIM)
    pages = block_table_ptr + request.to(tl.int64) * stride_block_table
    for key_start in range(chunk_start, stop, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        valid = keys < length
        page = tl.load(pages + keys // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        position = keys % BLOCK_SIZE
        data = page * block_stride + position * HEAD_DIM
        raw = tl.load(cache_ptr + data[:, None] + dims[None, :], mask=valid[:, None], other=0)
        k = dot_operand(raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
        scale_ptr = cache_ptr + page * block_stride + BLOCK_SIZE * HEAD_DIM + position * 4
        k_scale = tl.load(scale_ptr.to(tl.pointer_type(tl.float32)), mask=valid, other=0.0)
        logits = tl.reshape(head_weighted_logits(q, k, weights, 1, HEADS, BLOCK_N),
                            (BLOCK_N,)) * k_scale
        if CLEAN:
            logits = tl.where(valid, logits, float("-inf"))
        tl.store(logit_row + keys, logits, mask=keys < stop)


@dataclass(frozen=True)
class PagedOperands:
    """The paged logits' operands, checked (see `paged_operands`)."""

    q: torch.Tensor  # uint8 [B, next_n, H, D]
    block_tables: torch.Tensor  # unit stride along a request's pages
    block_size: int
    length_per_row: bool  # context_lens is [B, next_n]

    @property
    def num_rows(self) -> int:
        return self.q.shape[0] * self.q.shape[1]


def paged_operands(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                   context_lens: torch.Tensor, block_tables: torch.Tensor) -> PagedOperands:
    """Checks the shapes and layouts every paged logits kernel takes (see module doc);
    ValueError naming the operand otherwise."""
    q = as_bytes(q)
    if q.dim() != 4 or q.stride(-1) != 1 or q.stride(0) != q.shape[1] * q.stride(1):
        raise ValueError(f"q must be [B, next_n, H, D] with evenly spaced tokens, got "
                         f"{tuple(q.shape)}")
    batch, next_n, num_heads, head_dim = q.shape
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 4 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be uint8 [num_blocks, block_size, 1, D + 4], got "
                         f"{kv_cache.dtype} {tuple(kv_cache.shape)}")
    block_size = kv_cache.shape[1]
    if kv_cache.shape[-1] != head_dim + SCALE_BYTES:
        raise ValueError(f"kv_cache rows must be D + 4 = {head_dim + SCALE_BYTES} bytes")
    if kv_cache.stride(0) < block_size * (head_dim + SCALE_BYTES):
        raise ValueError(f"page stride {kv_cache.stride(0)} B too small for {block_size} rows")
    num_rows = batch * next_n
    if weights.shape != (num_rows, num_heads) or weights.stride(-1) != 1:
        raise ValueError(f"weights must be [B * next_n, H] = {(num_rows, num_heads)}, got "
                         f"{tuple(weights.shape)}")
    length_per_row = context_lens.dim() == 2 and context_lens.shape[1] == next_n
    if context_lens.shape[0] != batch or (context_lens.dim() == 2 and context_lens.shape[1]
                                          not in (1, next_n)):
        raise ValueError(f"context_lens must be [B], [B, 1] or [B, next_n], got "
                         f"{tuple(context_lens.shape)}")
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    return PagedOperands(q, block_tables, block_size, length_per_row)


def paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
    clean_logits: bool = False,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_NUM_WARPS,
    keys_per_program: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Indexer logits [B * next_n, max_model_len] fp32 (see module doc); `keys_per_program`
    by default from the row count (`keys_per_program_for_rows`), `num_stages` from the
    programs' steps and what the card holds (`pipeline_stages`)."""
    operands = paged_operands(q, kv_cache, weights, context_lens, block_tables)
    q, block_tables = operands.q, operands.block_tables
    num_rows, (_, next_n, num_heads, head_dim) = operands.num_rows, q.shape
    logits = torch.empty((num_rows, max_model_len), dtype=torch.float32, device=q.device)
    if num_rows == 0 or max_model_len == 0:
        return logits
    if keys_per_program is None:
        keys_per_program = keys_per_program_for_rows(num_rows)
    args = (q, kv_cache, weights, context_lens, block_tables, logits,
            num_heads, next_n, max_model_len, kv_cache.stride(0),
            q.stride(1), q.stride(2), weights.stride(0),
            context_lens.stride(0), context_lens.stride(1) if context_lens.dim() == 2 else 0,
            block_tables.stride(0), logits.stride(0))
    constants = dict(
        LENGTH_PER_ROW=operands.length_per_row,
        BLOCK_SIZE=operands.block_size,
        HEAD_DIM=head_dim,
        HEADS=max(16, triton.next_power_of_2(num_heads)),
        KEYS_PER_PROGRAM=keys_per_program,
        BLOCK_N=block_n,
        CLEAN=clean_logits,
        DOT_DTYPE=dot_dtype(),
        FP8_DOT=hardware_fp8_encode(q.device),
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=num_warps,
    )
    if num_stages is None:
        steps = triton.cdiv(keys_per_program, block_n)
        if q.device.type != "cuda" or steps < DOUBLE_BUFFER_MIN_STEPS:
            num_stages = SINGLE_BUFFER_STAGES
        else:
            num_stages = pipeline_stages(steps, *programs_per_sm(args, constants))
    grid = (num_rows, triton.cdiv(max_model_len, keys_per_program))
    _paged_mqa_logits_kernel[grid](*args, **constants, num_stages=num_stages)
    return logits


def row_lengths(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Keys each of the B * next_n rows sees (see module doc)."""
    if context_lens.dim() == 2 and context_lens.shape[1] == next_n:
        return context_lens.reshape(-1).to(torch.int64)
    draft = torch.arange(next_n, device=context_lens.device)
    return (context_lens.reshape(-1, 1).to(torch.int64) - next_n + 1 + draft).reshape(-1)


def paged_mqa_logits_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
) -> torch.Tensor:
    """Plain-torch reference in fp32: each row's keys read from its pages, then
    `mqa_logits_reference`; -inf from each row's length on."""
    batch, next_n, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[1]
    pages = kv_cache.as_strided((kv_cache.shape[0], kv_cache.stride(0)), (kv_cache.stride(0), 1))
    keys = torch.arange(min(max_model_len, block_tables.shape[1] * block_size), device=q.device)
    lengths = row_lengths(context_lens, next_n)
    rows = []
    for request in range(batch):
        page = pages[block_tables[request, keys // block_size].to(torch.int64)]
        position = (keys % block_size).unsqueeze(1)
        values = page.gather(1, position * head_dim + torch.arange(head_dim, device=q.device))
        scale_bytes = page.gather(
            1, block_size * head_dim + position * SCALE_BYTES
            + torch.arange(SCALE_BYTES, device=q.device))
        scales = scale_bytes.contiguous().view(torch.float32).squeeze(-1)
        request_rows = slice(request * next_n, (request + 1) * next_n)
        rows.append(mqa_logits_reference(
            q[request], values, scales, weights[request_rows],
            torch.zeros(next_n, dtype=torch.int64, device=q.device), lengths[request_rows]))
    logits = torch.full((batch * next_n, max_model_len), float("-inf"), device=q.device)
    logits[:, : keys.numel()] = torch.cat(rows)
    return logits
