"""DeepSeek-V4's indexer logits over a contiguous fp8 K, for sm80/86/89.

Replaces DeepGEMM's `fp8_mqa_logits` (vLLM's `fp8_fp4_mqa_logits` with fp8 q), which the
sparse-attention indexer calls on prefill chunks (`sparse_attn_indexer.py`); DeepGEMM
runs on sm90/sm100 only. Every query token scores every key in its range; a top-k over
the scores then picks the compressed rows the token attends to.

Semantics, the reference being `mqa_logits_reference`:
- q [M, H, D] fp8 e4m3 (its per-token scale is folded into `weights`), k [N, D] fp8
  e4m3 with one fp32 scale a row [N], weights [M, H] fp32;
- logits[m, n] = sum over h of weights[m, h] * relu(q[m, h] . k[n] * k_scale[n]) for
  ks[m] <= n < ke[m]; other columns are left unwritten, or -inf with `clean_logits`;
- returns logits [M, N] fp32.

Tiling:
- a program owns TOKENS query tokens with all their heads: TOKENS * H rows of q, decoded
  to bf16 once, then walks KEYS_PER_PROGRAM keys of their ranges BLOCK_N at a time;
- each K tile is loaded once for all those rows and decoded in the dot operand's layout
  (fp8 bytes to exact bf16, no fp8 instruction; on sm89 and later the fp8 bytes go to
  the tensor cores as they are) and one dot gives every row's scores; relu, the head
  weights and the sum over each token's heads follow in registers (as many instructions
  as the dot's mma.sync: one relu and one fma per score against 128 multiply-adds);
- a row's scale multiplies the summed logit: scales are positive and relu commutes with
  them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.fp8_e4m3 import (
    decode_e4m3_reference,
    dot_operand,
    hardware_fp8_encode,
)
from services.engine.backport.kernels.sparse_mla_decode import dot_dtype

# One token's 64 heads and 128 keys a step at 4 warps. On the H200 in sm80 mode (a 4k-token
# chunk over 32k keys) that ran 182 TFLOP/s; 4 tokens (256 rows sharing each K tile's
# decode) at 8 warps 143, 2 tokens at 4 warps 168: sharing the decode costs more in
# registers (250 a thread at 4 tokens) than it saves. In sm89 mode, with fp8 dots and no
# decode, the same tiling ran 300 TFLOP/s.
DEFAULT_TOKENS = 1
DEFAULT_BLOCK_N = 128
DEFAULT_NUM_WARPS = 4
# Keys a program walks: q is decoded once per 2,048 keys; a 4k-token chunk over 32k keys
# is 4,096 x 16 programs.
KEYS_PER_PROGRAM = 2048


@triton.jit
def load_q_rows(q_ptr, row_token, row_head, row_mask, stride_token, stride_head,
                HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_DOT: tl.constexpr,
                FAST_DEQUANT: tl.constexpr):
    """The fp8 q rows (token, head) as a [rows, HEAD_DIM] dot operand (`dot_operand`)."""
    dims = tl.arange(0, HEAD_DIM)
    raw = tl.load(q_ptr + row_token.to(tl.int64)[:, None] * stride_token
                  + row_head[:, None] * stride_head + dims[None, :],
                  mask=row_mask[:, None], other=0)
    return dot_operand(raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)


@triton.jit
def head_weighted_logits(q, k, weights, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """sum over each token's heads of weight * relu(q . k): [TOKENS, BLOCK_N] fp32, from q
    [TOKENS * HEADS, D], a K tile [BLOCK_N, D] and weights [TOKENS * HEADS]."""
    scores = tl.dot(q, tl.trans(k))
    weighted = tl.maximum(scores, 0.0) * weights[:, None]
    return tl.sum(tl.reshape(weighted, (TOKENS, HEADS, BLOCK_N)), axis=1)


@triton.jit
def _mqa_logits_kernel(
    q_ptr,
    k_ptr,
    k_scale_ptr,
    weights_ptr,
    ks_ptr,
    ke_ptr,
    logits_ptr,
    num_tokens,
    num_heads,
    num_keys,
    stride_q_token,
    stride_q_head,
    stride_k,
    stride_weights,
    stride_logits,
    HEAD_DIM: tl.constexpr,
    HEADS: tl.constexpr,
    TOKENS: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CLEAN: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FAST_DEQUANT: tl.constexpr,
):
    group = tl.program_id(0)
    chunk_start = tl.program_id(1) * KEYS_PER_PROGRAM
    chunk_stop = tl.minimum(chunk_start + KEYS_PER_PROGRAM, num_keys)
    tokens = group * TOKENS + tl.arange(0, TOKENS)
    token_mask = tokens < num_tokens
    # Padding tokens get an empty range.
    ks = tl.maximum(tl.load(ks_ptr + tokens, mask=token_mask, other=num_keys), 0)
    ke = tl.minimum(tl.load(ke_ptr + tokens, mask=token_mask, other=0), num_keys)
    start = tl.maximum(tl.min(ks, axis=0), chunk_start)
    stop = tl.minimum(tl.max(ke, axis=0), chunk_stop)
    if CLEAN:
        start = chunk_start
        stop = chunk_stop

    rows = tl.arange(0, TOKENS * HEADS)
    row_token = group * TOKENS + rows // HEADS
    row_head = rows % HEADS
    row_mask = (row_token < num_tokens) & (row_head < num_heads)
    q = load_q_rows(q_ptr, row_token, row_head, row_mask, stride_q_token, stride_q_head,
                    HEAD_DIM, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
    weights = tl.load(weights_ptr + row_token.to(tl.int64) * stride_weights + row_head,
                      mask=row_mask, other=0.0)

    dims = tl.arange(0, HEAD_DIM)
    logit_rows = logits_ptr + tokens.to(tl.int64)[:, None] * stride_logits
    for key_start in range(start, stop, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_mask = keys < stop
        raw = tl.load(k_ptr + keys.to(tl.int64)[:, None] * stride_k + dims[None, :],
                      mask=key_mask[:, None], other=0)
        k = dot_operand(raw, DOT_DTYPE, FP8_DOT, FAST_DEQUANT)
        k_scale = tl.load(k_scale_ptr + keys, mask=key_mask, other=0.0)
        logits = head_weighted_logits(q, k, weights, TOKENS, HEADS, BLOCK_N) * k_scale[None, :]
        in_range = (keys[None, :] >= ks[:, None]) & (keys[None, :] < ke[:, None])
        store_mask = token_mask[:, None] & key_mask[None, :]
        if CLEAN:
            logits = tl.where(in_range, logits, float("-inf"))
        else:
            store_mask = store_mask & in_range
        tl.store(logit_rows + keys[None, :], logits, mask=store_mask)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp8 e4m3 values (float8_e4m3fn or their uint8 bytes) as uint8."""
    if x.dtype == torch.float8_e4m3fn:
        return x.view(torch.uint8)
    if x.dtype != torch.uint8:
        raise TypeError(f"expected fp8 e4m3 (float8_e4m3fn or uint8 bytes), got {x.dtype}")
    return x


def mqa_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = False,
    tokens_per_program: int = DEFAULT_TOKENS,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = DEFAULT_NUM_WARPS,
    keys_per_program: int = KEYS_PER_PROGRAM,
) -> torch.Tensor:
    """Indexer logits [M, N] fp32 (see module doc); q [M, H, D] and k [N, D] fp8 e4m3,
    k_scale [N] and weights [M, H] fp32, cu_seqlen_ks/ke [M] int32."""
    q, k = as_bytes(q), as_bytes(k)
    if q.dim() != 3 or q.stride(-1) != 1 or k.dim() != 2 or k.stride(-1) != 1:
        raise ValueError(f"q must be [M, H, D] and k [N, D] with contiguous rows, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    num_keys = k.shape[0]
    if k.shape[1] != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"q and k need the same power-of-two head dim, got {head_dim} and "
                         f"{k.shape[1]}")
    if weights.shape != (num_tokens, num_heads) or weights.stride(-1) != 1:
        raise ValueError(f"weights must be [M, H] = {(num_tokens, num_heads)} with contiguous "
                         f"rows, got {tuple(weights.shape)}")
    logits = torch.empty((num_tokens, num_keys), dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_keys == 0:
        return logits
    grid = (triton.cdiv(num_tokens, tokens_per_program), triton.cdiv(num_keys, keys_per_program))
    _mqa_logits_kernel[grid](
        q, k, k_scale.contiguous(), weights, cu_seqlen_ks.contiguous(),
        cu_seqlen_ke.contiguous(), logits,
        num_tokens, num_heads, num_keys,
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), logits.stride(0),
        HEAD_DIM=head_dim,
        HEADS=max(16, triton.next_power_of_2(num_heads)),
        TOKENS=tokens_per_program,
        KEYS_PER_PROGRAM=keys_per_program,
        BLOCK_N=block_n,
        CLEAN=clean_logits,
        DOT_DTYPE=dot_dtype(),
        FP8_DOT=hardware_fp8_encode(q.device),
        FAST_DEQUANT=not triton.knobs.runtime.interpret,
        num_warps=num_warps,
    )
    return logits


def mqa_logits_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch reference in fp32; -inf outside each token's range."""
    q_values = decode_e4m3_reference(as_bytes(q))  # [M, H, D]
    k_values = decode_e4m3_reference(as_bytes(k)) * k_scale.float().unsqueeze(-1)
    scores = torch.einsum("mhd,nd->mhn", q_values, k_values).relu()
    logits = (scores * weights.float().unsqueeze(-1)).sum(dim=1)
    keys = torch.arange(k.shape[0], device=logits.device)
    in_range = (keys >= cu_seqlen_ks.unsqueeze(1)) & (keys < cu_seqlen_ke.unsqueeze(1))
    return logits.masked_fill(~in_range, float("-inf"))
