"""Launcher of the CUDA sparse MLA prefill (`sparse_mla_sm80.cu`'s bf16-rows build).

Same interface and semantics as `sparse_mla_prefill.sparse_mla_prefill` (the Triton
kernel, which also runs under the interpreter and stays the portable path): FlashMLA's
`flash_mla_sparse_fwd` over the gathered bf16 rows. The kernel is the CUDA decode's,
reading bf16 rows instead of the fp8 cache: 16 heads of one token a block, 16 keys a
step, no splits (a prefill chunk's tokens fill the card). It needs a CUDA card, a CUDA
compiler (NVRTC from torch's wheels, or nvcc), bf16 q and kv, and a contiguous `out`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels.cuda_module import compile_ptx, cuda_device_index, device_arch
from services.engine.backport.kernels.sparse_mla_combine import LOG2E
from services.engine.backport.kernels.sparse_mla_decode_cuda import (
    DEFAULT_MIN_BLOCKS,
    HEADS_PER_BLOCK,
    SOURCE,
    THREADS,
    LoadedSparseMla,
    SparseMlaParams,
    load_build,
)
from services.engine.backport.kernels.sparse_mla_prefill import kv_rows, prefill_operands

KERNEL_NAME = "sparse_mla_prefill_sm80"
# Steps of rows in shared memory, 16,640 B each (41,600 B a block at 2). 3 and 4 ran
# 1.00-1.03x slower on a 4k-token chunk (H200, sm80 mode).
DEFAULT_STAGES = 2


def prefill_ptx(arch: str, stages: int = DEFAULT_STAGES,
                min_blocks: int = DEFAULT_MIN_BLOCKS) -> bytes:
    """The prefill build's PTX for `arch`'s instruction set (cached by `compile_ptx`)."""
    return compile_ptx(SOURCE, arch, {"SPARSE_MLA_BF16_ROWS": 1,
                                      "SPARSE_MLA_DECODE_STAGES": stages,
                                      "SPARSE_MLA_DECODE_MIN_BLOCKS": min_blocks})


def load_prefill(arch: str, device_index: int, stages: int = DEFAULT_STAGES,
                 min_blocks: int = DEFAULT_MIN_BLOCKS) -> LoadedSparseMla:
    """The prefill built for `arch`, loaded on GPU `device_index` (once per build and GPU),
    its launches held to the blocks an SM of `arch`."""
    return _load_prefill(arch, device_index, stages, min_blocks)


@functools.cache
def _load_prefill(arch: str, device_index: int, stages: int,
                  min_blocks: int) -> LoadedSparseMla:
    return load_build(prefill_ptx(arch, stages, min_blocks), KERNEL_NAME, arch, device_index)


@dataclass(frozen=True)
class PrefillLaunch:
    """One launch of the prefill: grid, argument, the tensors it fills and the rest its
    argument points into (kept alive)."""

    grid: tuple[int, int, int]
    params: SparseMlaParams
    out: torch.Tensor
    max_logits: torch.Tensor
    lse: torch.Tensor
    operands: tuple[torch.Tensor | None, ...]


def _refusal(q: torch.Tensor, rows: torch.Tensor) -> Exception | None:
    """Why the CUDA kernel cannot read q and the [S_kv, 512] rows, or None."""
    for name, tensor in (("q", q), ("kv", rows)):
        if tensor.dtype != torch.bfloat16:
            return TypeError(f"{name} must be bfloat16, got {tensor.dtype}")
    if q.stride(0) % 4 or q.stride(1) % 4:
        return ValueError("q strides must be multiples of 4 elements (8-byte loads)")
    if rows.stride(0) % 8 or rows.data_ptr() % 16:
        return ValueError("kv rows must start on 16-byte boundaries (16-byte copies)")
    return None


def takes(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the CUDA prefill takes these operands (else `prefill_launch` refuses them)."""
    try:
        rows = kv_rows(kv)
    except ValueError:
        return False
    return q.dim() == 3 and q.stride(-1) == 1 and _refusal(q, rows) is None


def prefill_launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> PrefillLaunch:
    """Checks the operands (as `sparse_mla_prefill` does, plus what the CUDA kernel needs)
    and lays out the launch."""
    kv, indices, lengths = prefill_operands(q, kv, indices, topk_length)
    refusal = _refusal(q, kv)
    if refusal is not None:
        raise refusal
    num_tokens, num_heads, _ = q.shape
    if attn_sink is not None:
        attn_sink = attn_sink.float().contiguous()
    if out is None:
        out = torch.empty_like(q)
    if out.shape != q.shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [S_q, H, 512], got {tuple(out.shape)}")
    max_logits = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(max_logits)
    list_width = indices.shape[1]
    params = SparseMlaParams(
        q=q.data_ptr(),
        cache=kv.data_ptr(),
        extra_cache=kv.data_ptr(),
        slots=indices.data_ptr(),
        extra_slots=indices.data_ptr(),
        lengths=lengths.data_ptr() if lengths is not None else None,
        partial_out=out.data_ptr(),
        partial_lse=lse.data_ptr(),
        q_token_stride=q.stride(0),
        q_head_stride=q.stride(1),
        block_stride=kv.stride(0) * kv.element_size(),  # a "page" of one row
        extra_block_stride=0,
        slots_stride=indices.stride(0),
        block_size_log2=0,
        list_width=list_width,
        split_len=list_width,
        num_heads=num_heads,
        num_splits=1,
        bf16_partials=1,
        qk_scale_log2=sm_scale * LOG2E,
        sink=attn_sink.data_ptr() if attn_sink is not None else None,
        max_logits=max_logits.data_ptr(),
        row_limit=kv.shape[0],
    )
    grid = (triton.cdiv(num_heads, HEADS_PER_BLOCK), 1, num_tokens)
    return PrefillLaunch(grid, params, out, max_logits, lse,
                         (q, kv, indices, lengths, attn_sink))


def sparse_mla_prefill_cuda(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    arch: str | None = None,
    stages: int = DEFAULT_STAGES,
    min_blocks: int = DEFAULT_MIN_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA prefill; returns (out [S_q, H, 512], max_logits [S_q, H], lse [S_q, H]).

    As `sparse_mla_prefill`; `arch` picks the instruction set the kernel is built for
    (default: the card's own), `stages` and `min_blocks` the build. A non-contiguous `out`
    gets the result copied in.
    """
    if d_v != layout.HEAD_DIM:
        raise ValueError(f"d_v must be {layout.HEAD_DIM}, got {d_v}")
    target = out
    if out is not None and not out.is_contiguous():
        out = None
    launch = prefill_launch(q, kv, indices, sm_scale, attn_sink, topk_length, out)
    prefill = load_prefill(arch or device_arch(q.device), cuda_device_index(q.device), stages,
                           min_blocks)
    if q.shape[0] and q.shape[1]:  # a grid of no blocks is an invalid launch
        prefill.kernel.launch(launch.grid, THREADS, prefill.launch_shared_bytes, launch.params)
    if target is not None and target.data_ptr() != launch.out.data_ptr():
        target.copy_(launch.out)
        return target, launch.max_logits, launch.lse
    return launch.out, launch.max_logits, launch.lse
