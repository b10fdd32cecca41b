"""Points vLLM's DeepSeek-V4 CUDA path at the backport's kernels on cards below sm90.

The seams are the names vLLM's DeepSeek-V4 modules call at run time (`routes`), the
attention backend's compute-capability check, which admits only sm90/sm100, two members
of the attention layer and the model's constructor. The layer's constructor also loads
the CUDA decode on the layer's GPU (models are built before CUDA graphs are captured) and
keeps wo_a's fp8 weight as loaded, for the output projection's routed einsum
(`op_adapters.keep_fp8_wo_a`). The layer's q head padding is dropped: FlashMLA needs 64
or 128 heads, so upstream pads TP4's 16 heads to 64; the backport's kernels take any
count, and at 16 heads the decode of a B=64 top-k 2048 step takes 0.044 ms instead of 0.148 (H200,
sm80 mode). The model's constructor turns vLLM's JIT kernel warmup off
(`_without_jit_warmup` says why), and the hyper-connections' pre-norm GEMM stays in its
TileLang fallback (`tilelang_prenorm_gemm`). Each is replaced when vLLM imports its
module, so other models never load this code.

The attention compressor is one name in vLLM's CuTe-DSL module, which the compressor
imports when it runs. Where CuTe-DSL (`cutlass`) is not installed that module cannot
import, so once the compressor's module loads, the backport puts a module with just that
name in its place.

Not routed: the MoE experts and the other fp8 linears, which vLLM runs on its Marlin
kernels below sm90 (by a reading of its sources; no forward pass has run on these cards).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from services.engine.backport.module_patch import (
    PatchOnImport,
    patch_when_imported,
    stop_patching,
)

logger = logging.getLogger(__name__)

# "0" leaves vLLM's DeepSeek-V4 path as it is (it then fails below sm90, as upstream does).
ROUTES_ENV = "BACKPORT_DEEPSEEK_V4_ROUTES"

FLASHMLA_LAYER_MODULE = "vllm.models.deepseek_v4.nvidia.flashmla"
ATTENTION_MODULE = "vllm.models.deepseek_v4.attention"
INDEXER_MODULE = "vllm.model_executor.layers.sparse_attn_indexer"
# The indexer's attention-metadata builder: it asks DeepGEMM for its logits schedule.
INDEXER_METADATA_MODULE = "vllm.v1.attention.backends.mla.indexer"
# The sliding-window attention's metadata builder: it asks FlashMLA for plan holders.
SWA_METADATA_MODULE = "vllm.v1.attention.backends.mla.sparse_swa"
COMPRESSOR_MODULE = "vllm.models.deepseek_v4.compressor"
# Imported by the compressor at call time on CUDA for head 512; it needs CuTe-DSL.
CUTEDSL_COMPRESSOR_MODULE = "vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl"
O_PROJ_MODULE = "vllm.models.deepseek_v4.nvidia.ops.o_proj"
BACKEND_MODULE = "vllm.models.deepseek_v4.sparse_mla"
BACKEND_CLASS = "DeepseekV4SparseMLABackend"
LAYER_CLASS = "DeepseekV4FlashMLAAttention"
MODEL_MODULE = "vllm.models.deepseek_v4.nvidia.model"
MODEL_CLASS = "DeepseekV4Model"
# The hyper-connection (mHC) mixes' TileLang wrappers, which reach DeepGEMM for one GEMM.
MHC_MODULE = "vllm.model_executor.kernels.mhc.tilelang"
MHC_PRENORM_GEMM = "_hc_prenorm_gemm_outputs"


def routes() -> dict[str, dict[str, Callable[..., object]]]:
    """Module -> {name vLLM calls: the backport's function} (imports the kernels)."""
    from services.engine.backport.deepseek_v4 import op_adapters
    from services.engine.backport.kernels.indexer_q_quant import fused_indexer_q_rope_quant
    from services.engine.backport.kernels.inv_rope_fp8_quant import fused_inv_rope_fp8_quant
    from services.engine.backport.kernels.k_cache_gather import dequantize_and_gather_k_cache

    return {
        FLASHMLA_LAYER_MODULE: {
            "flash_mla_with_kvcache": op_adapters.flash_mla_with_kvcache,
            "flash_mla_sparse_fwd": op_adapters.flash_mla_sparse_fwd,
            "dequantize_and_gather_k_cache": dequantize_and_gather_k_cache,
        },
        ATTENTION_MODULE: {
            "fused_indexer_q_rope_quant": fused_indexer_q_rope_quant,
        },
        INDEXER_MODULE: {
            "fp8_fp4_mqa_logits": op_adapters.fp8_fp4_mqa_logits,
            "fp8_fp4_paged_mqa_logits": op_adapters.fp8_fp4_paged_mqa_logits,
            "has_deep_gemm": op_adapters.indexer_logits_available,
            "pack_seq_triton": op_adapters.pack_seq,
        },
        INDEXER_METADATA_MODULE: {
            "get_paged_mqa_logits_metadata": op_adapters.paged_mqa_logits_schedule,
        },
        SWA_METADATA_MODULE: {
            "get_mla_metadata": op_adapters.flashmla_plan_holder,
        },
        COMPRESSOR_MODULE: {
            "compress_norm_rope_store_triton": op_adapters.compress_norm_rope_store,
        },
        CUTEDSL_COMPRESSOR_MODULE: {
            "_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL": op_adapters.compress_norm_rope_store,
        },
        O_PROJ_MODULE: {
            "fused_inv_rope_fp8_quant": fused_inv_rope_fp8_quant,
            "fp8_einsum": op_adapters.fp8_einsum,
        },
    }


ROUTED_MODULES = (FLASHMLA_LAYER_MODULE, ATTENTION_MODULE, INDEXER_MODULE,
                  INDEXER_METADATA_MODULE, SWA_METADATA_MODULE, COMPRESSOR_MODULE,
                  CUTEDSL_COMPRESSOR_MODULE, O_PROJ_MODULE)
_ABSENT = object()

_finder: PatchOnImport | None = None
_stock: dict[tuple[object, str], object] = {}  # (module or class, name) -> its own value
_stand_in_modules: list[str] = []


def needs_backport(capability: tuple[int, int] | None) -> bool:
    """Whether a CUDA card of this compute capability needs the backport's kernels: sm80
    to sm89 (FlashMLA and the fp8 Triton ops need sm90)."""
    return capability is not None and capability[0] == 8


def install(capability: tuple[int, int] | None) -> bool:
    """Turns the routing on for a card of `capability` (major, minor) that needs it,
    unless `BACKPORT_DEEPSEEK_V4_ROUTES=0`. Idempotent; returns whether it is active."""
    global _finder
    if _finder is not None:
        return True
    if not needs_backport(capability) or os.environ.get(ROUTES_ENV) == "0":
        return False
    patches: dict[str, Callable[[ModuleType], None]] = dict.fromkeys(
        ROUTED_MODULES, _route_names)
    patches[BACKEND_MODULE] = _admit_sm8x
    patches[MODEL_MODULE] = _skip_jit_warmup
    patches[MHC_MODULE] = _prenorm_gemm_in_tilelang
    _finder = patch_when_imported(patches)
    logger.info("DeepSeek-V4 attention on sm%d%d runs the backport's kernels", *capability)
    return True


def uninstall() -> None:
    """Puts vLLM's own functions back."""
    global _finder
    if _finder is not None:
        stop_patching(_finder)
    for (owner, name), value in _stock.items():
        if value is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    _stock.clear()
    for name in _stand_in_modules:
        sys.modules.pop(name, None)
    _stand_in_modules.clear()
    _finder = None


def _stand_in(module_name: str) -> None:
    """A module of just the routed names, for a vLLM module that cannot import here."""
    module = ModuleType(module_name, "backport stand-in: the routed names only")
    module.__dict__.update(routes()[module_name])
    sys.modules[module_name] = module
    _stand_in_modules.append(module_name)


def _replace(owner: object, name: str, value: object) -> None:
    # The owner's own entry (a classmethod stays a classmethod when put back).
    _stock.setdefault((owner, name), vars(owner).get(name, _ABSENT))
    setattr(owner, name, value)


def _route_names(module: ModuleType) -> None:
    for name, function in routes()[module.__name__].items():
        if hasattr(module, name):
            _replace(module, name, function)
        else:
            logger.warning("backport: %s has no %s to route; vLLM changed", module.__name__, name)
    if module.__name__ == COMPRESSOR_MODULE and importlib.util.find_spec("cutlass") is None:
        _stand_in(CUTEDSL_COMPRESSOR_MODULE)
    if module.__name__ == FLASHMLA_LAYER_MODULE:
        layer_class = getattr(module, LAYER_CLASS)
        _extend_layer_init(layer_class)
        _replace(layer_class, "get_padded_num_q_heads", classmethod(_unpadded_heads))


def _unpadded_heads(cls: type, num_heads: int) -> int:
    return num_heads


def _extend_layer_init(layer_class: type) -> None:
    import torch

    from services.engine.backport.deepseek_v4.op_adapters import (
        keep_fp8_wo_a,
        prepare_cuda_kernels,
    )

    stock_init = layer_class.__init__

    def __init__(self: object, *args: object, **kwargs: object) -> None:
        stock_init(self, *args, **kwargs)
        keep_fp8_wo_a(self)  # before the loader runs its quant method on the weights
        if torch.cuda.is_available():
            prepare_cuda_kernels(torch.device("cuda", torch.cuda.current_device()))

    _replace(layer_class, "__init__", __init__)


def _skip_jit_warmup(module: ModuleType) -> None:
    model_class = getattr(module, MODEL_CLASS)
    _replace(model_class, "__init__", _without_jit_warmup(model_class.__init__))


def _without_jit_warmup(stock_init: Callable[..., None]) -> Callable[..., None]:
    """The model's constructor with vLLM's JIT kernel warmup turned off first.

    With the warmup on, DeepSeek-V4's layers register upstream kernels at construction
    (Triton fp8 ones such as the inverse-RoPE quant, CuTe-DSL ones imported from the module
    the backport stands in for, where the import itself fails) and the worker compiles
    them before serving, a failure being fatal; they need sm89/sm90. The routed kernels
    compile on first use instead, in the dummy runs before graph capture."""

    def __init__(self: object, *, vllm_config: Any, prefix: str = "") -> None:
        kernel_config = vllm_config.kernel_config
        if kernel_config.enable_jit_warmup:
            logger.info("backport: JIT kernel warmup off for DeepSeek-V4 on sm8x: it would "
                        "compile upstream sm89/sm90 kernels the routes replace")
            kernel_config.enable_jit_warmup = False
        stock_init(self, vllm_config=vllm_config, prefix=prefix)

    return __init__


def _prenorm_gemm_in_tilelang(module: ModuleType) -> None:
    _replace(module, MHC_PRENORM_GEMM, tilelang_prenorm_gemm(getattr(module, MHC_PRENORM_GEMM)))


def tilelang_prenorm_gemm(stock: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's mHC pre-norm GEMM (x @ fn.T and each row's sum of squares) always in its
    TileLang fallback.

    The first layer's broadcast pre-mix asks for DeepGEMM's TF32 GEMM outright
    (`use_tilelang_fallback=False`), on every forward pass, and DeepGEMM runs on sm90/sm100
    only; every other caller already falls back below sm90. The broadcast caller's x is one
    copy of the residual, [T, H], where the fallback's kernel checks for hc_mult copies, so
    the kernel is told of one row of x.shape[1] values: it reads hidden_size and hc_mult
    only as their product, the row width."""

    def _hc_prenorm_gemm_outputs(x: Any, fn: Any, *, hidden_size: int, hc_mult: int,
                                 use_tilelang_fallback: bool = True) -> Any:
        return stock(x, fn, hidden_size=x.shape[1], hc_mult=1, use_tilelang_fallback=True)

    return _hc_prenorm_gemm_outputs


def _admit_sm8x(module: ModuleType) -> None:
    backend = getattr(module, BACKEND_CLASS)
    stock = backend.supports_compute_capability

    def supports_compute_capability(cls: type, capability: object) -> bool:
        return getattr(capability, "major", None) == 8 or stock(capability)

    _replace(backend, "supports_compute_capability", classmethod(supports_compute_capability))

