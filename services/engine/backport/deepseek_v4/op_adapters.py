"""The signatures vLLM's DeepSeek-V4 CUDA path calls (FlashMLA's, DeepGEMM's, its own
ops'), over the backport's kernels.

vLLM's `DeepseekV4FlashMLAAttention` (`vllm/models/deepseek_v4/nvidia/flashmla.py`) calls
FlashMLA's sparse fp8 decode and sparse prefill, and DeepSeek-V4's K gather; its indexer
calls `fused_indexer_q_rope_quant` and DeepGEMM's two logits ops; its KV compressors call
a CuTe-DSL kernel (attention cache) and a Triton launcher (indexer cache); its output
projection (`deep_gemm_fp8_o_proj`) calls the inverse-RoPE fp8 quant and DeepGEMM's
`fp8_einsum` on wo_a's fp8 weight, which `keep_fp8_wo_a` keeps as loaded; with
speculative decoding the indexer pads its fp8 queries with vLLM's `pack_seq_triton`,
which writes fp8 through sm89's conversion. FlashMLA,
DeepGEMM and those CuTe-DSL kernels run on sm90/sm100 only, and the upstream Triton ops
use fp8 instructions that sm80/86 lack. The K gather and the two quants need no adapter
(`k_cache_gather`, `indexer_q_quant`, `inv_rope_fp8_quant` take the same arguments); the
others are below.
"""

from __future__ import annotations

import functools
import logging

import torch

from services.engine.backport.kernels import ds_mla_cache as layout
from services.engine.backport.kernels import fp8_einsum as einsum_kernel
from services.engine.backport.kernels.cuda_module import cuda_device_index, device_arch
from services.engine.backport.kernels.fp8_e4m3 import E4M3_MAX
from services.engine.backport.kernels.indexer_k_compress import indexer_k_compress_insert
from services.engine.backport.kernels.kv_compress_insert import kv_compress_insert
from services.engine.backport.kernels.mqa_logits import mqa_logits
from services.engine.backport.kernels.paged_mqa_logits import paged_mqa_logits
from services.engine.backport.kernels.paged_mqa_logits_cuda import (
    CUDA_LOGITS_ARCHS,
    default_min_blocks,
    load_logits,
    paged_mqa_logits_cuda,
    takes,
)
from services.engine.backport.kernels.sparse_mla_decode import sparse_mla_decode
from services.engine.backport.kernels.sparse_mla_decode_cuda import (
    load_decode,
    sparse_mla_decode_cuda,
)
from services.engine.backport.kernels.sparse_mla_prefill import sparse_mla_prefill
from services.engine.backport.kernels.sparse_mla_prefill_cuda import (
    load_prefill,
    sparse_mla_prefill_cuda,
)
from services.engine.backport.kernels.sparse_mla_prefill_cuda import takes as cuda_prefill_takes

logger = logging.getLogger(__name__)

# GPU index -> the arch its CUDA decode and prefill were built for: the adapters run them
# there, the Triton ones elsewhere (the CUDA decode took 0.044 ms where the Triton one took
# 0.079, B=64 H=16 top-k 2048; the CUDA prefill 1.16-1.19x the Triton one's speed on a
# 4k-token chunk; H200 in sm80 mode).
_cuda_attention_archs: dict[int, str] = {}
# (GPU index, page size) -> the arch the CUDA paged logits for those pages were built for
# (their speed against the Triton kernel's: docs/kernels.md, "The CUDA paged logits").
_cuda_logits_archs: dict[tuple[int, int], str] = {}
# The indexer cache's tokens a page, which the CUDA paged logits are built for ahead of use.
INDEXER_BLOCK_SIZE = 64


def prepare_cuda_kernels(device: torch.device, arch: str | None = None) -> bool:
    """Builds the CUDA decode and prefill and, for sm80/86/89, the CUDA paged logits for
    `arch` (default: the card's own) and loads them on `device`, so the adapters use them
    there from now on. Must run before CUDA-graph capture: loading reads a constant back
    from the GPU. Returns whether they loaded (without a CUDA compiler the Triton kernels
    serve)."""
    index = cuda_device_index(device)
    arch = arch or device_arch(torch.device("cuda", index))
    try:
        load_decode(arch, index)
        load_prefill(arch, index)
        if arch in CUDA_LOGITS_ARCHS:
            for balanced in (False, True):
                load_logits(arch, index, INDEXER_BLOCK_SIZE, min_blocks=default_min_blocks(arch),
                            balanced=balanced)
    except Exception:  # the Triton kernels still serve; say why once
        logger.exception("backport: CUDA kernels unavailable on cuda:%d", index)
        return False
    _cuda_attention_archs[index] = arch
    if arch in CUDA_LOGITS_ARCHS:
        _cuda_logits_archs[index, INDEXER_BLOCK_SIZE] = arch
    return True


def _is_power_of_two_page(cache: torch.Tensor | None) -> bool:
    return cache is None or (cache.dim() >= 3 and cache.shape[1] & (cache.shape[1] - 1) == 0)


def runs_cuda_decode(q: torch.Tensor, k_cache: torch.Tensor,
                     extra_k_cache: torch.Tensor | None) -> bool:
    """Whether the CUDA decode is loaded for q's GPU and takes these operands (bf16 q,
    power-of-two pages)."""
    return (q.is_cuda and q.device.index in _cuda_attention_archs and q.dtype == torch.bfloat16
            and _is_power_of_two_page(k_cache) and _is_power_of_two_page(extra_k_cache))


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse fp8 decode: (out shaped as q, lse [T, H, 1], natural log, +inf
    for a token with no valid key, as FlashMLA gives, and as the decodes write it).

    Only the sparse fp8 form DeepSeek-V4 uses: `block_table` and `cache_seqlens` are unused
    there, and FlashMLA's tile-scheduler plan is replaced by the decode's own split rule.
    The CUDA decode runs where `prepare_cuda_kernels` loaded it, the Triton one elsewhere.
    """
    if indices is None or not is_fp8_kvcache:
        raise NotImplementedError("only FlashMLA's sparse fp8 decode is backported "
                                  "(indices and is_fp8_kvcache=True)")
    if causal:
        raise ValueError("causal must be False with sparse indices")
    if head_dim_v != layout.HEAD_DIM:
        raise ValueError(f"head_dim_v must be {layout.HEAD_DIM}, got {head_dim_v}")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    operands = (q, k_cache, indices, softmax_scale, topk_length, attn_sink, extra_k_cache,
                extra_indices_in_kvcache, extra_topk_length)
    if runs_cuda_decode(q, k_cache, extra_k_cache):
        decoded, lse = sparse_mla_decode_cuda(*operands, out=out,
                                              arch=_cuda_attention_archs[q.device.index])
    else:
        decoded, lse = sparse_mla_decode(*operands, out=out)
    return (out if out is not None else decoded.view(q.shape)), lse.unsqueeze(-1)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = layout.HEAD_DIM,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's sparse prefill over the gathered bf16 rows: (out, max_logits, lse). The
    CUDA prefill runs where `prepare_cuda_kernels` loaded it and it takes the operands
    (bf16, 16-byte aligned rows), the Triton one elsewhere."""
    arguments = dict(d_v=d_v, attn_sink=attn_sink, topk_length=topk_length, out=out)
    arch = _cuda_attention_archs.get(q.device.index) if q.is_cuda else None
    if arch is not None and cuda_prefill_takes(q, kv):
        return sparse_mla_prefill_cuda(q, kv, indices, sm_scale, **arguments, arch=arch)
    return sparse_mla_prefill(q, kv, indices, sm_scale, **arguments)


def _fp8_q(q: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    values, scales = q
    if scales is not None:
        raise NotImplementedError("the MXFP4 indexer (q with block scales) is not backported")
    return values


def fp8_fp4_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool,
) -> torch.Tensor:
    """DeepGEMM's fp8 indexer logits over a contiguous K: logits [M, N] fp32."""
    k, k_scale = kv
    return mqa_logits(_fp8_q(q), k, k_scale.reshape(-1), weights, cu_seqlen_ks, cu_seqlen_ke,
                      clean_logits)


def fp8_fp4_paged_mqa_logits(
    q: tuple[torch.Tensor, torch.Tensor | None],
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    schedule_metadata: torch.Tensor | None,
    max_model_len: int,
    clean_logits: bool,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepGEMM's fp8 indexer logits over the paged cache: [B * next_n, max_model_len] fp32.
    DeepGEMM's SM schedule is not needed; its varlen rows (`indices`, Blackwell's) are not
    backported. The CUDA kernel runs where `prepare_cuda_kernels` loaded it for these
    pages, the Triton one elsewhere."""
    if indices is not None:
        raise NotImplementedError("varlen paged logits (indices) are not backported")
    values = _fp8_q(q)
    operands = (values, kv_cache, weights, context_lens, block_tables, max_model_len,
                clean_logits)
    arch = _cuda_logits_archs.get((values.device.index, kv_cache.shape[1]))
    if values.is_cuda and arch is not None and takes(values, kv_cache):
        return paged_mqa_logits_cuda(*operands, arch=arch, min_blocks=default_min_blocks(arch))
    return paged_mqa_logits(*operands)


def indexer_logits_available() -> bool:
    """vLLM's `has_deep_gemm()` where the sparse indexer asks it: the indexer refuses to
    build on CUDA without DeepGEMM, whose logits ops are the only ones it needs, and the
    backport routes those. True whether or not the `deep_gemm` package imports."""
    return True


def pack_seq(
    x: torch.Tensor,
    lengths: torch.Tensor,
    pad_value: float | int = -float("inf"),
    block_t: int = 64,
    block_d: int = 64,
) -> torch.Tensor:
    """vLLM's `pack_seq_triton` where the sparse indexer pads a decode step's queries to
    one length per request (speculative decoding): fp8 e4m3 queries are packed as their
    bytes, since vLLM's kernel writes an fp8 pad through sm89's conversion. The pad is
    the byte that conversion gives (it saturates: -inf pads with -448); the indexer masks
    padded slots by context length anyway. Other dtypes go to vLLM's kernel as they are."""
    from vllm.v1.attention.ops.common import pack_seq_triton

    if x.dtype != torch.float8_e4m3fn:
        return pack_seq_triton(x, lengths, pad_value, block_t, block_d)
    pad = torch.tensor(float(pad_value)).clamp(-E4M3_MAX, E4M3_MAX).to(x.dtype)
    packed = pack_seq_triton(x.view(torch.uint8), lengths, int(pad.view(torch.uint8)),
                             block_t, block_d)
    return packed.view(x.dtype)


def paged_mqa_logits_schedule(
    context_lens: torch.Tensor,
    block_size: int,
    num_sms: int,
    indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepGEMM's `get_paged_mqa_logits_metadata` as the indexer's metadata builder calls
    it every decode step: the SM schedule of DeepGEMM's paged logits kernel ([num_sms + 1,
    2] int32 below sm90), which DeepGEMM computes on sm90/sm100 only. The backport's
    paged logits need no schedule, so this is zeros of that shape."""
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)


def flashmla_plan_holder(*args: object, **kwargs: object) -> tuple[object, None]:
    """FlashMLA's `get_mla_metadata` as vLLM's sliding-window metadata builder calls it
    every decode step: an empty plan holder (`FlashMLASchedMeta`), which FlashMLA's decode
    fills on first use and the backport's decode never reads. A vLLM built without
    FlashMLA's extensions (a source build for sm8x only) has a stand-in that raises."""
    from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta

    return FlashMLASchedMeta(), None


def compress_norm_rope_store(
    state_cache: torch.Tensor,
    num_actual: int,
    token_to_req_indices: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    state_width: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    k_cache_metadata: object,
    pdl_kwargs: dict,
    head_dim: int,
    rope_head_dim: int,
    compress_ratio: int,
    overlap: bool,
    use_fp4_cache: bool,
    rms_norm_weight: torch.Tensor,
    rms_norm_eps: float,
    quant_block: int,
    token_stride: int,
    scale_dim: int,
    store_full_kv: bool = False,
    store_full_fp8: bool = False,
    fp8_scale: torch.Tensor | None = None,
) -> None:
    """A compressor step as `DeepseekCompressor.forward` calls it: the window merge,
    RMSNorm, RoPE, fp8 quant and insert of every window-closing token among the first
    `num_actual`, into the attention cache (head 512, `kv_compress_insert`) or the
    indexer's (head 128, `indexer_k_compress_insert`). The cache slots come from
    `k_cache_metadata.slot_mapping`; the state cache's geometry from its shape."""
    if use_fp4_cache:
        raise NotImplementedError("the MXFP4 indexer cache is not backported")
    if store_full_kv or store_full_fp8:
        raise NotImplementedError("plain-row (bf16 or per-tensor fp8) caches are not "
                                  "backported; the fp8_ds_mla cache is")
    if bool(overlap) != (compress_ratio == 4):
        raise ValueError(f"overlap={overlap} with compress ratio {compress_ratio}: DeepSeek-V4 "
                         "overlaps windows at ratio 4 only")
    actual = slice(0, num_actual)
    operands = (state_cache, token_to_req_indices[actual], positions[actual],
                slot_mapping[actual], block_table, cos_sin_cache, kv_cache,
                k_cache_metadata.slot_mapping[actual], rms_norm_weight, rms_norm_eps,
                compress_ratio)
    if head_dim == layout.HEAD_DIM:
        kv_compress_insert(*operands)
    else:
        indexer_k_compress_insert(*operands, head_dim=head_dim, rope_head_dim=rope_head_dim)


EINSUM_EXPR = "bhr,hdr->bhd"
EINSUM_RECIPE = (1, 128, 128)  # sm90's: per-token 128-dim x scales, 128 x 128 w blocks


def fp8_einsum(
    expr: str,
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    d: torch.Tensor,
    c: torch.Tensor | None = None,
    recipe: tuple[int, int, int] = EINSUM_RECIPE,
) -> torch.Tensor:
    """DeepGEMM's `fp8_einsum` in the one form the output projection uses: "bhr,hdr->bhd"
    with recipe (1, 128, 128), a = (x [T, G, R] fp8, x scales [T, G, R / 128] fp32),
    b = (w, w scales), written into d [T, G, D] bf16 (also returned). w is the checkpoint's
    [G * D, R] or [G, D, R]; its scales [G * D / 128, R / 128] or [G, D / 128, R / 128],
    fp32 or e8m0. DeepGEMM's accumulate input `c` is not backported."""
    if expr != EINSUM_EXPR:
        raise ValueError(f"only the einsum {EINSUM_EXPR!r} is backported, got {expr!r}")
    if tuple(recipe) != EINSUM_RECIPE:
        raise ValueError(f"only the recipe {EINSUM_RECIPE} (sm90's) is backported, got "
                         f"{tuple(recipe)}")
    if c is not None:
        raise NotImplementedError("fp8_einsum's accumulate input (c) is not backported")
    x, x_scale = a
    w, w_scale = b
    num_groups, reduce_dim = x.shape[1], x.shape[2]
    num_scale_blocks = reduce_dim // einsum_kernel.SCALE_BLOCK
    if w.dim() == 2:
        w = w.view(num_groups, -1, reduce_dim)
    if w_scale.dim() == 2:
        # Row blocks of a [G * D, R] weight split by group only where D is whole blocks.
        if w.shape[1] % einsum_kernel.SCALE_BLOCK:
            raise ValueError(f"2-D weight scales need D a multiple of "
                             f"{einsum_kernel.SCALE_BLOCK}, got D={w.shape[1]}")
        w_scale = w_scale.view(num_groups, -1, num_scale_blocks)
    if w_scale.dtype == torch.float8_e8m0fnu:
        w_scale = w_scale.float()  # powers of two: exact
    return einsum_kernel.fp8_einsum(x, x_scale, w, w_scale, out=d)


def keep_fp8_wo_a(layer: torch.nn.Module) -> None:
    """Where the attention layer's wo_a holds an fp8 weight, has its quant method's
    `process_weights_after_loading` keep that weight as loaded ([G * D, R]) and only turn
    its block scales fp32 (same attribute), for the routed `fp8_einsum`. The stock method
    repacks the weight for its own GEMM (Marlin's int32 layout on sm80-89), which the
    output projection never runs: it reads the weight itself, and unrecognised it falls
    back to a bf16 matmul over the repacked bytes."""
    wo_a = layer.wo_a
    if wo_a.weight.dtype != torch.float8_e4m3fn:
        return
    stock_name = type(wo_a.quant_method).__name__

    def process_weights_after_loading(linear: torch.nn.Module) -> None:
        name = "weight_scale_inv" if hasattr(linear, "weight_scale_inv") else "weight_scale"
        scale = getattr(linear, name)
        _log_once(f"backport: wo_a keeps its fp8 weight for the routed fp8 einsum; its "
                  f"{scale.dtype} block scales ({name}) become fp32, and {stock_name}'s own "
                  f"weight processing (Marlin's repack on sm80-89) is skipped")
        setattr(linear, name, torch.nn.Parameter(scale.data.float(), requires_grad=False))

    wo_a.quant_method.process_weights_after_loading = process_weights_after_loading


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
