"""Indexer Q: GPT-J RoPE + per-(token, head) fp8 quant + folding the scale into weights.

Replaces the fp8 path of upstream's `fused_indexer_q_rope_quant` (deepseek_v4/common/
ops/fused_indexer_q.py), whose Triton kernel stores through `tl.float8e4nv`. Same
inputs and outputs:
  positions [T] int, index_q [T, H, D] bf16 (D = 128: 64 NoPE dims, then 64 RoPE dims,
  rotated as interleaved even/odd pairs), cos_sin_cache [max_pos, 64] fp32 (cos || sin),
  index_weights [T, H], two float scales
-> q_fp8 [T, H, D] float8_e4m3fn (written as bytes; no fp8 arithmetic), weights_out
  [T, H] fp32 = weights * q_scale * softmax_scale * head_scale.

Numerics follow upstream: RoPE in fp32, rounded to bf16 and back before the absmax;
q_scale = 2**ceil(log2(max(amax, 1e-4) / 448)) per (token, head). Floating-point
contraction is off so the products round exactly as the torch reference rounds them.

Tiling: one program per token holds all its heads, [H, 128] values: the token's cos/sin
row is loaded once and every store of a head row is one 128-byte line.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.fp8_e4m3 import (
    E4M3_MAX,
    e4m3_quantize_bf16,
    e4m3_scale_exponent,
    exp2_int,
    fp8_encoder,
    round_to_bf16,
)

AMAX_FLOOR = tl.constexpr(1e-4)  # upstream's floor before picking a scale


@triton.jit
def _indexer_q_kernel(
    positions_ptr,
    q_ptr,
    cos_sin_ptr,
    weights_ptr,
    q_fp8_ptr,
    weights_out_ptr,
    num_heads,
    softmax_scale,
    head_scale,
    stride_q_token,
    stride_q_head,
    stride_cos_sin,
    stride_w_token,
    stride_out_token,
    stride_out_head,
    HEAD_BLOCK: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEAD_BLOCK)
    head_mask = heads < num_heads
    nope = tl.arange(0, NOPE_DIM)
    pair = tl.arange(0, HALF_ROPE)
    rope = tl.arange(0, 2 * HALF_ROPE)

    # RoPE on the interleaved pairs of the last 2 * HALF_ROPE dims, fp32 then bf16. The
    # pairs are loaded and stored as whole rows and split/joined in registers: loads and
    # stores with a stride of 2 elements ran 8% of copy bandwidth.
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + pair)
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF_ROPE + pair)
    row = q_ptr + token * stride_q_token + heads[:, None] * stride_q_head
    x_nope = tl.load(row + nope[None, :], mask=head_mask[:, None], other=0.0).to(tl.float32)
    x_rope = tl.load(row + NOPE_DIM + rope[None, :], mask=head_mask[:, None], other=0.0)
    x_even, x_odd = tl.split(tl.reshape(x_rope.to(tl.float32), (HEAD_BLOCK, HALF_ROPE, 2)))
    r_even = round_to_bf16(x_even * cos[None, :] - x_odd * sin[None, :])
    r_odd = round_to_bf16(x_odd * cos[None, :] + x_even * sin[None, :])

    # One power-of-two scale per (token, head).
    amax = tl.maximum(
        tl.max(tl.abs(x_nope), axis=1),
        tl.maximum(tl.max(tl.abs(r_even), axis=1), tl.max(tl.abs(r_odd), axis=1)),
    )
    exponent = e4m3_scale_exponent(tl.maximum(amax, AMAX_FLOOR))

    # Write-back: fp8 bytes (pairs joined back interleaved) and the folded weights. Every
    # value is bf16 (the RoPE pairs rounded above), which the bf16 quantizer takes.
    out = q_fp8_ptr + token * stride_out_token + heads[:, None] * stride_out_head
    row_exponent = exponent[:, None]
    nope_bytes = e4m3_quantize_bf16(x_nope, row_exponent, FP8_ENCODER)
    tl.store(out + nope[None, :], nope_bytes, mask=head_mask[:, None])
    rotated = tl.join(e4m3_quantize_bf16(r_even, row_exponent, FP8_ENCODER),
                      e4m3_quantize_bf16(r_odd, row_exponent, FP8_ENCODER))
    tl.store(
        out + NOPE_DIM + rope[None, :],
        tl.reshape(rotated, (HEAD_BLOCK, 2 * HALF_ROPE)),
        mask=head_mask[:, None],
    )
    weights = tl.load(weights_ptr + token * stride_w_token + heads, mask=head_mask, other=0.0).to(
        tl.float32
    )
    weights = weights * exp2_int(exponent) * softmax_scale * head_scale
    tl.store(weights_out_ptr + token * num_heads + heads, weights, mask=head_mask)


def fused_indexer_q_rope_quant(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
    use_fp4: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_fp8 [T, H, D] float8_e4m3fn, weights_out [T, H] fp32); see module doc. Upstream's
    MXFP4 form (`use_fp4`, Blackwell's) is refused."""
    if use_fp4:
        raise NotImplementedError("the MXFP4 indexer cache is not backported")
    if index_q.dim() != 3 or index_q.stride(-1) != 1:
        raise ValueError(
            f"index_q must be [T, H, D] with contiguous rows, got {tuple(index_q.shape)}"
        )
    num_tokens, num_heads, head_dim = index_q.shape
    rope_dim = index_q_cos_sin_cache.shape[-1]
    if index_q_cos_sin_cache.dtype != torch.float32 or rope_dim > head_dim or rope_dim % 2:
        raise ValueError(
            "cos_sin_cache must be fp32 [max_pos, rope_dim] with an even rope_dim <= D"
        )
    q_fp8 = torch.empty((num_tokens, num_heads, head_dim), dtype=torch.uint8, device=index_q.device)
    weights_out = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=index_q.device)
    if num_tokens > 0:
        _indexer_q_kernel[(num_tokens,)](
            positions,
            index_q,
            index_q_cos_sin_cache,
            index_weights,
            q_fp8,
            weights_out,
            num_heads,
            index_weights_softmax_scale,
            index_weights_head_scale,
            index_q.stride(0),
            index_q.stride(1),
            index_q_cos_sin_cache.stride(0),
            index_weights.stride(0),
            q_fp8.stride(0),
            q_fp8.stride(1),
            HEAD_BLOCK=triton.next_power_of_2(num_heads),
            NOPE_DIM=head_dim - rope_dim,
            HALF_ROPE=rope_dim // 2,
            FP8_ENCODER=fp8_encoder(index_q.device),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return q_fp8.view(torch.float8_e4m3fn), weights_out


def fused_indexer_q_rope_quant_reference(
    positions: torch.Tensor,
    index_q: torch.Tensor,
    index_q_cos_sin_cache: torch.Tensor,
    index_weights: torch.Tensor,
    index_weights_softmax_scale: float,
    index_weights_head_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch reference of `fused_indexer_q_rope_quant`."""
    rope_dim = index_q_cos_sin_cache.shape[-1]
    half = rope_dim // 2
    x = index_q.float()
    cos_sin = index_q_cos_sin_cache[positions.long()].unsqueeze(1)  # [T, 1, rope_dim]
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x_even, x_odd = x[..., -rope_dim::2], x[..., -rope_dim + 1 :: 2]
    r_even = (x_even * cos - x_odd * sin).to(torch.bfloat16).float()
    r_odd = (x_odd * cos + x_even * sin).to(torch.bfloat16).float()
    rotated = torch.stack([r_even, r_odd], dim=-1).flatten(-2)
    y = torch.cat([x[..., :-rope_dim], rotated], dim=-1)
    amax = y.abs().amax(dim=-1).double().clamp(min=1e-4)
    exponent = torch.ceil(torch.log2(amax / E4M3_MAX))
    scale = torch.exp2(exponent).float()
    q_fp8 = (y / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    weights = index_weights.float() * scale * index_weights_softmax_scale * index_weights_head_scale
    return q_fp8, weights
