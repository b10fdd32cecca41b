"""Dequantize and gather fp8_ds_mla cache rows back to bf16 (the prefill K gather).

Replaces upstream's `dequantize_and_gather_k_cache` (deepseek_v4/common/ops/
cache_utils.py), which reads the fp8 bytes through `tl.float8e4nv`. Same inputs and
outputs: for request b, the last gather_lens[b] tokens (all seq_lens[b] tokens when
gather_lens is None) of its paged sequence, in order, are written dequantized to
out[b, offset : offset + gather_len]. Rows of `out` past that are left as they were.

Tiling: a program dequantizes BLOCK_TOKENS consecutive tokens of one request, using the
same row decoder as the decode kernel (`load_k_block`); the grid covers the widest
possible gather (out.shape[1] - offset) and programs past a request's length exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.sparse_mla_decode import HEAD_DIM, load_k_block

BLOCK_TOKENS = 32  # rows per program: 32 x 584 B in, 32 x 1 KiB out


@triton.jit
def _gather_kernel(
    out_ptr,
    cache_ptr,
    seq_lens_ptr,
    gather_lens_ptr,
    block_table_ptr,
    offset,
    block_stride,
    stride_out_req,
    stride_out_token,
    stride_table_req,
    BLOCK_SIZE: tl.constexpr,
    HAS_GATHER_LENS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    token_block = tl.program_id(0)
    request = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + request)
    gather_len = seq_len
    if HAS_GATHER_LENS:
        gather_len = tl.load(gather_lens_ptr + request)
    if token_block * BLOCK_TOKENS >= gather_len:
        return

    # Token i of the gather is sequence position seq_len - gather_len + i.
    i = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    in_range = i < gather_len
    position = seq_len - gather_len + i
    physical_block = tl.load(
        block_table_ptr + request * stride_table_req + position // BLOCK_SIZE,
        mask=in_range,
        other=0,
    )
    slots = physical_block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE
    rows = load_k_block(
        cache_ptr, slots, in_range, block_stride, BLOCK_SIZE, BLOCK_TOKENS, tl.bfloat16,
        FAST_DEQUANT,
    )

    dims = tl.arange(0, HEAD_DIM)
    out_ptrs = (
        out_ptr
        + request * stride_out_req
        + (offset + i)[:, None] * stride_out_token
        + dims[None, :]
    )
    tl.store(out_ptrs, rows, mask=in_range[:, None])


def dequantize_and_gather_k_cache(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """out [R, M, 512] bf16 <- rows of each request's paged sequence (see module doc)."""
    if out.dim() != 3 or out.shape[-1] != layout.HEAD_DIM or out.stride(-1) != 1:
        raise ValueError(f"out must be [R, M, 512] with contiguous rows, got {tuple(out.shape)}")
    if block_table.stride(-1) != 1:
        raise ValueError("block_table rows must be contiguous")
    geometry = layout.cache_geometry(k_cache, block_size)
    num_requests = seq_lens.shape[0]
    max_gather = out.shape[1] - offset
    if num_requests == 0 or max_gather <= 0:
        return
    grid = (triton.cdiv(max_gather, BLOCK_TOKENS), num_requests)
    _gather_kernel[grid](
        out,
        k_cache,
        seq_lens,
        gather_lens if gather_lens is not None else seq_lens,
        block_table,
        offset,
        geometry.block_stride,
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        BLOCK_SIZE=geometry.block_size,
        HAS_GATHER_LENS=gather_lens is not None,
        BLOCK_TOKENS=BLOCK_TOKENS,
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=4,
    )


def dequantize_and_gather_k_cache_reference(
    out: torch.Tensor,
    k_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    offset: int,
) -> None:
    """torch reference of `dequantize_and_gather_k_cache` (writes bf16 into `out`)."""
    for request in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[request])
        gather_len = seq_len if gather_lens is None else int(gather_lens[request])
        positions = torch.arange(seq_len - gather_len, seq_len, device=k_cache.device)
        slots = (
            block_table[request, positions // block_size].to(torch.int64) * block_size
            + positions % block_size
        )
        rows = layout.read_rows_reference(k_cache, slots, block_size)
        out[request, offset : offset + gather_len] = rows.to(out.dtype)
