"""The DeepSeek-V4 compressors' shared steps for one token's window of state rows.

Both compressors (the indexer's, head 128, and the attention's, head 512) merge the
window's rows per dim with softmax weights over their scores, RMS-normalize the result and
rotate its last dims with GPT-J RoPE. State rows are [kv | score], each `STATE_WIDTH` wide;
with overlap (compress ratio 4) each half holds two HEAD_DIM sets, the previous window's
(read by the window's first RATIO rows) and this window's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def load_window_rows(
    state_ptr,
    block_table_row_ptr,
    position,
    first_row,
    first_dim,
    state_block_size,
    stride_state_block,
    stride_state_row,
    ROWS: tl.constexpr,
    DIMS: tl.constexpr,
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
):
    """kv and score [ROWS, DIMS] of window rows first_row.. and dims first_dim.. of the
    window that ends at `position`; rows before the sequence start read as kv 0, score -inf."""
    rows = first_row + tl.arange(0, ROWS)
    dims = first_dim + tl.arange(0, DIMS)
    row_position = position - WINDOW + 1 + rows
    in_sequence = row_position >= 0
    safe_position = tl.where(in_sequence, row_position, 0)
    block = tl.load(
        block_table_row_ptr + safe_position // state_block_size, mask=in_sequence, other=0
    ).to(tl.int64)
    dim_set = (rows >= RATIO).to(tl.int32) * HEAD_DIM  # older window: set 0, this window: set 1
    row_ptrs = (
        state_ptr
        + block * stride_state_block
        + (safe_position % state_block_size) * stride_state_row
        + dim_set
    )[:, None] + dims[None, :]
    kv = tl.load(row_ptrs, mask=in_sequence[:, None], other=0.0)
    score = tl.load(row_ptrs + STATE_WIDTH, mask=in_sequence[:, None], other=float("-inf"))
    return kv, score


@triton.jit
def merge_window(
    state_ptr,
    block_table_row_ptr,
    position,
    first_dim,
    state_block_size,
    stride_state_block,
    stride_state_row,
    DIMS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STATE_WIDTH: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
):
    """The softmax-weighted merge over the window's rows of dims first_dim.. [DIMS], fp32
    (the softmax is per dim, so any slice of dims merges on its own). A window wider than
    ROW_CHUNK rows is walked ROW_CHUNK rows at a time with an online softmax (per dim:
    running maximum, weight sum and weighted sum), so a [128, 512] window never has to sit
    in registers at once."""
    WINDOW: tl.constexpr = (1 + OVERLAP) * RATIO
    if ROW_CHUNK >= WINDOW:
        kv, score = load_window_rows(state_ptr, block_table_row_ptr, position, 0, first_dim,
                                     state_block_size, stride_state_block, stride_state_row,
                                     WINDOW, DIMS, WINDOW, RATIO, HEAD_DIM, STATE_WIDTH)
        weights = tl.exp(score - tl.max(score, axis=0)[None, :])
        merged = tl.sum(kv * weights, axis=0) / tl.sum(weights, axis=0)
    else:
        running_max = tl.full((DIMS,), float("-inf"), tl.float32)
        weight_sum = tl.zeros((DIMS,), tl.float32)
        weighted = tl.zeros((DIMS,), tl.float32)
        for first_row in range(0, WINDOW, ROW_CHUNK):
            kv, score = load_window_rows(state_ptr, block_table_row_ptr, position, first_row,
                                         first_dim, state_block_size, stride_state_block,
                                         stride_state_row, ROW_CHUNK, DIMS, WINDOW, RATIO,
                                         HEAD_DIM, STATE_WIDTH)
            new_max = tl.maximum(running_max, tl.max(score, axis=0))
            # All rows so far before the sequence start: keep the sums at 0, not NaN.
            reference = tl.where(new_max == float("-inf"), 0.0, new_max)
            correction = tl.exp(running_max - reference)
            weights = tl.exp(score - reference[None, :])
            weight_sum = weight_sum * correction + tl.sum(weights, axis=0)
            weighted = weighted * correction + tl.sum(kv * weights, axis=0)
            running_max = new_max
        merged = weighted / weight_sum
    return merged


@triton.jit
def closing_token(positions_ptr, state_slots_ptr, cache_slots_ptr, token, RATIO: tl.constexpr):
    """(position, cache slot, whether `token` closes a window and writes a row): a token
    writes when it ends a window of RATIO positions and has a state and a cache slot."""
    position = tl.load(positions_ptr + token)
    state_slot = tl.load(state_slots_ptr + token)
    cache_slot = tl.load(cache_slots_ptr + token).to(tl.int64)
    closes = (state_slot >= 0) & ((position + 1) % RATIO == 0) & (cache_slot >= 0)
    return position, cache_slot, closes


@triton.jit
def closing_tokens(positions_ptr, state_slots_ptr, cache_slots_ptr, first_token, num_tokens,
                   SCAN: tl.constexpr, RATIO: tl.constexpr):
    """Tokens first_token.. [SCAN] and which of them write a row (`closing_token`), in one
    vector load each; tokens past the batch do not."""
    tokens = first_token + tl.arange(0, SCAN)
    in_batch = tokens < num_tokens
    _, _, closes = closing_token(positions_ptr, state_slots_ptr, cache_slots_ptr,
                                 tl.minimum(tokens, num_tokens - 1), RATIO)
    return tokens, closes & in_batch


@triton.jit
def next_closing(tokens, closes, num_tokens):
    """The first token still marked in `closes`, and `closes` without it."""
    token = tl.min(tl.where(closes, tokens, num_tokens))
    return token, closes & (tokens != token)


@triton.jit
def rms_normalize(x, weight_ptr, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of x [HEAD_DIM] in fp32 with the weights at `weight_ptr`."""
    variance = tl.sum(x * x, axis=0) / HEAD_DIM
    weight = tl.load(weight_ptr + tl.arange(0, HEAD_DIM)).to(tl.float32)
    return x * tl.rsqrt(variance + eps) * weight


@triton.jit
def gptj_rotate(x, cos_sin_row_ptr, HEAD_DIM: tl.constexpr, HALF_ROPE: tl.constexpr):
    """x [HEAD_DIM] with its last 2 * HALF_ROPE dims rotated as GPT-J pairs by the angles
    at `cos_sin_row_ptr` (cos || sin); the other dims come back unchanged (cos 1, sin 0)."""
    NOPE_DIM: tl.constexpr = HEAD_DIM - 2 * HALF_ROPE
    even, odd = tl.split(tl.reshape(x, (HEAD_DIM // 2, 2)))
    pair = tl.arange(0, HEAD_DIM // 2)
    is_rope = pair >= NOPE_DIM // 2
    rope_index = tl.maximum(pair - NOPE_DIM // 2, 0)
    cos = tl.load(cos_sin_row_ptr + rope_index, mask=is_rope, other=1.0)
    sin = tl.load(cos_sin_row_ptr + HALF_ROPE + rope_index, mask=is_rope, other=0.0)
    return tl.interleave(even * cos - odd * sin, odd * cos + even * sin)


def merge_window_reference(
    state_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    position: int,
    compress_ratio: int,
    head_dim: int,
) -> torch.Tensor:
    """torch reference of `merge_window` for the window ending at `position` [head_dim]."""
    overlap = int(compress_ratio == 4)
    state_width = head_dim * (1 + overlap)
    window = (1 + overlap) * compress_ratio
    state_block_size = state_cache.shape[1]
    kv_rows, score_rows = [], []
    for row in range(window):
        row_position = position - window + 1 + row
        if row_position < 0:
            continue
        block = int(block_table_row[row_position // state_block_size])
        state = state_cache[block, row_position % state_block_size]
        dim_set = head_dim if row >= compress_ratio else 0
        kv_rows.append(state[dim_set : dim_set + head_dim])
        score_rows.append(state[state_width + dim_set : state_width + dim_set + head_dim])
    weights = torch.softmax(torch.stack(score_rows), dim=0)
    return (torch.stack(kv_rows) * weights).sum(dim=0)


def rms_normalize_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + eps) * weight.float()


def gptj_rotate_reference(
    x: torch.Tensor, cos_sin_row: torch.Tensor, rope_dim: int
) -> torch.Tensor:
    """x with its last rope_dim dims rotated as GPT-J pairs (cos_sin_row: cos || sin)."""
    half = rope_dim // 2
    cos, sin = cos_sin_row[:half], cos_sin_row[half:]
    even, odd = x[-rope_dim::2], x[-rope_dim + 1 :: 2]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten()
    return torch.cat([x[:-rope_dim], rotated])


def checked_state_width(state_cache: torch.Tensor, compress_ratio: int, head_dim: int) -> int:
    """The state width for `compress_ratio`, after checking the state cache's dtype and shape."""
    if state_cache.dtype != torch.float32 or state_cache.stride(-1) != 1:
        raise ValueError("state_cache must be fp32 with contiguous rows")
    state_width = head_dim * (1 + (compress_ratio == 4))
    if state_cache.shape[-1] != 2 * state_width:
        raise ValueError(
            f"state rows must hold {2 * state_width} values, got {state_cache.shape[-1]}"
        )
    return state_width


def tokens_per_request(num_tokens: int, num_requests: int) -> int:
    """The batch's tokens a request rounded down to a power of two (a decode step's 1, a
    prefill's many): a scan of that many consecutive tokens meets about one request, so
    windows that close in the same step (a decode step's all may) fall to other programs."""
    per_request = max(1, num_tokens // max(1, num_requests))
    return 1 << (per_request.bit_length() - 1)


def window_kernel_args(
    state_cache: torch.Tensor,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    rms_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_slot_mapping: torch.Tensor,
    rms_norm_eps: float,
) -> tuple:
    """The leading arguments both compressor kernels take, in their order."""
    return (
        state_cache,
        token_to_req_indices,
        positions,
        slot_mapping,
        block_table,
        rms_norm_weight,
        cos_sin_cache,
        kv_cache,
        kv_slot_mapping,
        rms_norm_eps,
        state_cache.shape[1],
        state_cache.stride(0),
        state_cache.stride(1),
        block_table.stride(0),
        cos_sin_cache.stride(0),
    )
