"""The ratio-128 window merge that runs before the attention KV compressor.

A ratio-128 window is 128 state rows of 512 dims: merged in one program it leaves most
SMs idle in a prefill chunk (one window in 128 tokens) and keeps [rows, 512] fp32 values in
registers. Its softmax runs per dim, so `kv_compress_insert` has it merged here first,
HEAD_DIM // MERGE_SLICE programs a window, each over its own dims, into an fp32 scratch
row [tokens, 512]; the compressor then normalizes, rotates, quantizes and inserts.

Tiling: program (s, p) takes dims s * MERGE_SLICE.. of the windows that tokens p * SCAN..
close (`compressor_window.closing_tokens`), in turn; slices on the grid's first axis, so
that neighbouring programs read the same state rows (0-10% faster than on the second).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.compressor_window import (
    closing_token,
    closing_tokens,
    merge_window,
    next_closing,
)

# A program's share of a window: 32 dims, on 2 warps. One token a program (decode steps)
# takes 64 rows a step, which finishes a lone window soonest (H200 sm80 mode, 112 SMs:
# 7.1 us against 8.7 at 32 rows); scanning programs (prefill) take 32, in fewer
# registers, so more of them stay resident (an 8k-token chunk on 112 sm80 / 88 sm86 SMs:
# 19.3 -> 16.3 / 20.1 -> 17.4 us; a 32k one 54.8 -> 53.5 / 62.9 -> 58.4).
MERGE_SLICE = 32
MERGE_ROWS_ONE_TOKEN = 64
MERGE_ROWS_SCANNING = 32
MERGE_WARPS = 2
# CUDA takes at most this many programs on a grid's second axis, the tokens' axis here.
MAX_GRID_Y = 65535
HEAD_DIM = tl.constexpr(layout.HEAD_DIM)
# Ratio 128 has no overlap: a state row holds one set of kv and score dims.
RATIO = tl.constexpr(128)
OVERLAP = tl.constexpr(0)
STATE_WIDTH = tl.constexpr(layout.HEAD_DIM)


@triton.jit
def merge_slice(token, position, first_dim, state_ptr, token_to_req_ptr, block_table_ptr,
                merged_ptr, state_block_size, stride_state_block, stride_state_row,
                stride_table_req, SLICE: tl.constexpr, ROW_CHUNK: tl.constexpr):
    """Merge dims first_dim.. [SLICE] of the token's window into merged[token]."""
    request = tl.load(token_to_req_ptr + token).to(tl.int64)
    merged = merge_window(state_ptr, block_table_ptr + request * stride_table_req, position,
                          first_dim, state_block_size, stride_state_block, stride_state_row,
                          SLICE, HEAD_DIM, STATE_WIDTH, RATIO, OVERLAP, ROW_CHUNK)
    tl.store(merged_ptr + token * HEAD_DIM + first_dim + tl.arange(0, SLICE), merged)


@triton.jit
def _merge_slices_kernel(
    state_ptr,
    token_to_req_ptr,
    positions_ptr,
    state_slots_ptr,
    block_table_ptr,
    cache_slots_ptr,
    merged_ptr,
    num_tokens,
    state_block_size,
    stride_state_block,
    stride_state_row,
    stride_table_req,
    SLICE: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
):
    """Program (s, p) merges dims s * SLICE.. of the windows that tokens p * SCAN.. close."""
    first_dim = tl.program_id(0) * SLICE
    first_token = tl.program_id(1).to(tl.int64) * SCAN
    if SCAN == 1:  # straight-line code, as in _kv_compress_kernel
        position, _, closes = closing_token(positions_ptr, state_slots_ptr, cache_slots_ptr,
                                            first_token, RATIO)
        if closes:
            merge_slice(first_token, position, first_dim, state_ptr, token_to_req_ptr,
                        block_table_ptr, merged_ptr, state_block_size, stride_state_block,
                        stride_state_row, stride_table_req, SLICE, ROW_CHUNK)
    else:
        tokens, closes = closing_tokens(positions_ptr, state_slots_ptr, cache_slots_ptr,
                                        first_token, num_tokens, SCAN, RATIO)
        for _ in range(tl.sum(closes.to(tl.int32))):
            token, closes = next_closing(tokens, closes, num_tokens)
            merge_slice(token, tl.load(positions_ptr + token), first_dim, state_ptr,
                        token_to_req_ptr, block_table_ptr, merged_ptr, state_block_size,
                        stride_state_block, stride_state_row, stride_table_req, SLICE,
                        ROW_CHUNK)


def merge_windows(
    state_cache: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    scan: int,
) -> torch.Tensor:
    """Merged rows [tokens, 512] fp32 of the ratio-128 windows the tokens close; the rows
    of tokens that close none are left unwritten. Arguments as `kv_compress_insert`'s."""
    num_tokens = positions.shape[0]
    merged = torch.empty(num_tokens, layout.HEAD_DIM, device=state_cache.device)
    _merge_slices_kernel[(layout.HEAD_DIM // MERGE_SLICE, triton.cdiv(num_tokens, scan))](
        state_cache,
        token_to_req_indices,
        positions,
        slot_mapping,
        block_table,
        kv_slot_mapping,
        merged,
        num_tokens,
        state_cache.shape[1],
        state_cache.stride(0),
        state_cache.stride(1),
        block_table.stride(0),
        SLICE=MERGE_SLICE,
        ROW_CHUNK=MERGE_ROWS_ONE_TOKEN if scan == 1 else MERGE_ROWS_SCANNING,
        SCAN=scan,
        num_warps=MERGE_WARPS,
    )
    return merged
