"""Inverse RoPE + block-scaled fp8 quant of the attention output, before wo_a.

Replaces upstream's `fused_inv_rope_fp8_quant` (deepseek_v4/common/ops/
fused_inv_rope_fp8_quant.py) with `tma_aligned_scales=False` (the sm90 fp32-scale
format), whose kernel casts with `tl.float8e4nv`. Same inputs and outputs:
  o [T, H, 512] bf16 (448 NoPE dims, then 64 RoPE dims as interleaved pairs),
  positions [T], cos_sin_cache [max_pos, 64] fp32 (cos || sin), n_groups,
  heads_per_group (H = n_groups * heads_per_group)
-> output [T, G, heads_per_group * 512] float8_e4m3fn (a transposed view of a
  [G, T, D] buffer), scales [T, G, D / 128] fp32 powers of two (a transposed view of
  an MN-major [G, S, T_aligned] buffer, T_aligned = T rounded up to 4, as DeepGEMM
  wants them). With quantize=False: the rotated output in o's dtype, empty scales.

The RoPE pairs are rotated by -position (x_even' = x_even cos + x_odd sin, x_odd' =
x_odd cos - x_even sin): the attention output is a mix of rows at many positions, and
undoing the query's rotation gives what wo_a expects. Scale per 128 dims:
2**ceil(log2(max(amax, 1e-10) / 448)). Contraction off, as in `indexer_q_quant`.

Tiling: one program per token and HEADS_PER_PROGRAM heads of one group (each 512-dim
head row is four 128-dim quant groups), grid (tokens, groups, heads in a group / heads a
program); the grid also covers the scale buffer's padding rows, which get zeros. The
NoPE dims are bf16 in and out of the rotation, so they take the bf16 quantizer
(`e4m3_quantize_bf16`, under half the fp32 encode's instructions on sm80/86); the
rotated RoPE dims, fp32 values, take the fp32 encode.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.engine.backport.kernels.fp8_e4m3 import (
    E4M3_MAX,
    e4m3_quantize,
    e4m3_quantize_bf16,
    e4m3_scale_exponent,
    exp2_int,
    fp8_encoder,
)

AMAX_FLOOR = tl.constexpr(1e-10)  # upstream's eps before picking a scale
SCALE_ROW_ALIGNMENT = 4  # DeepGEMM's TMA alignment for fp32 scales: 16 B / 4 B
# Heads a program rotates and quantizes (fewer where a group has fewer): one head, 1 KB
# in and 512 B out, was too little work a program (23% of copy bandwidth on the H200);
# 8 ran 1.12x (sm80 mode, 132 SMs) and 1.27x (sm86 mode, 88 SMs) faster than 4.
HEADS_PER_PROGRAM = 8


@triton.jit
def _inv_rope_quant_kernel(
    o_ptr,
    positions_ptr,
    cos_sin_ptr,
    out_ptr,
    scale_ptr,
    num_tokens,
    heads_per_group,
    stride_o_token,
    stride_o_head,
    stride_cos_sin,
    stride_out_group,
    stride_out_token,
    stride_scale_group,
    stride_scale_block,
    HEADS: tl.constexpr,
    NOPE_DIM: tl.constexpr,
    HALF_ROPE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUPS_PER_HEAD: tl.constexpr,
    QUANTIZE: tl.constexpr,
    FP8_ENCODER: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    # The program's heads within its group come from the grid's third axis: dividing by
    # heads_per_group instead cost about 6% of a program's instructions.
    heads = tl.program_id(2) * HEADS + tl.arange(0, HEADS)
    # Scale blocks of these heads within the group's row: HEADS x GROUPS_PER_HEAD.
    quant_groups = tl.arange(0, GROUPS_PER_HEAD)
    blocks = heads[:, None] * GROUPS_PER_HEAD + quant_groups[None, :]
    scale_ptrs = scale_ptr + group * stride_scale_group + token + blocks * stride_scale_block
    if token >= num_tokens:
        # Padding rows of the aligned scale buffer.
        if QUANTIZE:
            tl.store(scale_ptrs, tl.zeros((HEADS, GROUPS_PER_HEAD), dtype=tl.float32))
        return

    # The NoPE dims stay bf16 (whole rows, the RoPE dims masked off and read apart).
    HEAD_DIM: tl.constexpr = GROUPS_PER_HEAD * GROUP_SIZE
    ROPE_DIM: tl.constexpr = 2 * HALF_ROPE
    dims = tl.arange(0, HEAD_DIM)[None, :]
    is_nope = dims < NOPE_DIM
    rows = (o_ptr + token * stride_o_token
            + (group * heads_per_group + heads)[:, None] * stride_o_head)
    x = tl.load(rows + dims, mask=is_nope, other=0.0)

    # Inverse RoPE on the interleaved pairs of the last ROPE_DIM dims, in fp32: each
    # value is read once, as (even, odd) pairs split in registers.
    rope_dims = tl.arange(0, ROPE_DIM)[None, :]
    rope = tl.load(rows + NOPE_DIM + rope_dims).to(tl.float32)
    even, odd = tl.split(tl.reshape(rope, (HEADS, HALF_ROPE, 2)))
    position = tl.load(positions_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cos_sin + tl.arange(0, HALF_ROPE))[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cos_sin + HALF_ROPE + tl.arange(0, HALF_ROPE))
    sin = sin[None, :]
    rotated = tl.reshape(tl.join(even * cos + odd * sin, odd * cos - even * sin),
                         (HEADS, ROPE_DIM))

    # The group's heads are consecutive in its output row.
    out = (
        out_ptr
        + group.to(tl.int64) * stride_out_group  # G x T x 4 KB passes 2**31 at 64k tokens
        + token * stride_out_token
        + heads[:, None] * HEAD_DIM
    )
    if QUANTIZE:
        # One power-of-two scale per 128 dims; the RoPE dims are in the head's last group.
        x_groups = tl.reshape(x, (HEADS, GROUPS_PER_HEAD, GROUP_SIZE))
        amax = tl.max(tl.abs(x_groups.to(tl.float32)), axis=2)
        has_rope = (quant_groups == GROUPS_PER_HEAD - 1)[None, :]
        amax = tl.where(has_rope, tl.maximum(amax, tl.max(tl.abs(rotated), axis=1)[:, None]), amax)
        exponent = e4m3_scale_exponent(tl.maximum(amax, AMAX_FLOOR))
        nope_bytes = e4m3_quantize_bf16(x_groups, exponent[:, :, None], FP8_ENCODER)
        tl.store(out + dims, tl.reshape(nope_bytes, (HEADS, HEAD_DIM)), mask=is_nope)
        rope_exponent = tl.max(tl.where(has_rope, exponent, -127), axis=1)[:, None]
        rope_bytes = e4m3_quantize(rotated, rope_exponent, FP8_ENCODER)
        tl.store(out + NOPE_DIM + rope_dims, rope_bytes)
        tl.store(scale_ptrs, exp2_int(exponent))
    else:
        tl.store(out + dims, x, mask=is_nope)
        tl.store(out + NOPE_DIM + rope_dims, rotated.to(out_ptr.dtype.element_ty))


def fused_inv_rope_fp8_quant(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    n_groups: int,
    heads_per_group: int,
    nope_dim: int = 448,
    rope_dim: int = 64,
    quant_group_size: int = 128,
    tma_aligned_scales: bool = False,
    quantize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [T, G, D], scales [T, G, D / 128]); see module doc. `tma_aligned_scales`
    (upstream's SM100 packed UE8M0 scales) is refused: this is sm90's fp32 layout."""
    if tma_aligned_scales:
        raise ValueError("tma_aligned_scales=True asks for SM100's packed UE8M0 scales; this "
                         "kernel writes sm90's fp32 scales (tma_aligned_scales=False)")
    num_tokens, num_heads, head_dim = o.shape
    if num_heads != n_groups * heads_per_group or head_dim != nope_dim + rope_dim:
        raise ValueError("o must be [T, n_groups * heads_per_group, nope_dim + rope_dim]")
    if head_dim % quant_group_size or o.stride(-1) != 1 or o.dtype != torch.bfloat16:
        raise ValueError("o must be bf16 with contiguous rows, head_dim a multiple of the "
                         "quant group")
    if rope_dim < 2 or rope_dim & (rope_dim - 1) or rope_dim > quant_group_size:
        raise ValueError("rope_dim must be a power of two within one quant group")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != rope_dim:
        raise ValueError("cos_sin_cache must be fp32 [max_pos, rope_dim]")
    group_dim = heads_per_group * head_dim
    num_scale_blocks = group_dim // quant_group_size
    aligned_tokens = (
        -(-num_tokens // SCALE_ROW_ALIGNMENT) * SCALE_ROW_ALIGNMENT if quantize else num_tokens
    )
    out_dtype = torch.uint8 if quantize else o.dtype
    out_buf = torch.empty((n_groups, num_tokens, group_dim), dtype=out_dtype, device=o.device)
    if quantize:
        scale_buf = torch.empty(
            n_groups * num_scale_blocks * aligned_tokens, dtype=torch.float32, device=o.device
        )
        scale_buf = scale_buf.as_strided(
            (n_groups, num_tokens, num_scale_blocks),
            (num_scale_blocks * aligned_tokens, 1, aligned_tokens),
        )
    else:
        scale_buf = torch.empty(0, dtype=torch.float32, device=o.device)
    heads = math.gcd(heads_per_group, HEADS_PER_PROGRAM)
    if aligned_tokens > 0:
        _inv_rope_quant_kernel[(aligned_tokens, n_groups, heads_per_group // heads)](
            o,
            positions,
            cos_sin_cache,
            out_buf,
            scale_buf,
            num_tokens,
            heads_per_group,
            o.stride(0),
            o.stride(1),
            cos_sin_cache.stride(0),
            out_buf.stride(0),
            out_buf.stride(1),
            num_scale_blocks * aligned_tokens if quantize else 0,
            aligned_tokens,
            HEADS=heads,
            NOPE_DIM=nope_dim,
            HALF_ROPE=rope_dim // 2,
            GROUP_SIZE=quant_group_size,
            GROUPS_PER_HEAD=head_dim // quant_group_size,
            QUANTIZE=quantize,
            FP8_ENCODER=fp8_encoder(o.device),
            num_warps=4,
            enable_fp_fusion=False,
        )
    output = out_buf.transpose(0, 1)
    if quantize:
        return output.view(torch.float8_e4m3fn), scale_buf.transpose(0, 1)
    return output, scale_buf


def fused_inv_rope_fp8_quant_reference(
    o: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    n_groups: int,
    heads_per_group: int,
    nope_dim: int = 448,
    rope_dim: int = 64,
    quant_group_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch reference: (fp8 output [T, G, D], fp32 scales [T, G, D / 128])."""
    num_tokens = o.shape[0]
    half = rope_dim // 2
    x = o.float()
    cos_sin = cos_sin_cache[positions.long()].unsqueeze(1)
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    x_even, x_odd = x[..., nope_dim::2], x[..., nope_dim + 1 :: 2]
    rotated = torch.stack([x_even * cos + x_odd * sin, x_odd * cos - x_even * sin], dim=-1).flatten(
        -2
    )
    y = torch.cat([x[..., :nope_dim], rotated], dim=-1).reshape(num_tokens, n_groups, -1)
    blocks = y.reshape(num_tokens, n_groups, -1, quant_group_size)
    amax = blocks.abs().amax(dim=-1).double().clamp(min=1e-10)
    scales = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX))).float()
    quantized = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.reshape(num_tokens, n_groups, -1), scales
