"""vLLM general plugin entry point (`vllm.general_plugins` group, name `backport`).

vLLM calls `register` in every process it starts; it must be idempotent and must
not fail the engine when an optional piece cannot load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

_registered = False


def _cpu_fixes() -> list[tuple[str, Callable[[], object]]]:
    from services.engine.backport.cpu.missing_kernels import register_missing_kernels
    from services.engine.backport.cpu.metadata_kernels import use_torch_metadata_kernels
    from services.engine.backport.cpu.tile_scheduler import fill_all_layer_types

    return [
        ("missing CPU kernels", register_missing_kernels),
        ("sparse-SWA tile scheduler layer types", fill_all_layer_types),
        ("torch attention-metadata kernels", use_torch_metadata_kernels),
    ]


def _apply(name: str, fix: Callable[[], object]) -> None:
    try:
        fix()
    except Exception:  # an optional fix must never take the engine down
        logger.exception("backport: could not apply %s", name)


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from vllm.platforms import current_platform

    from services.engine.backport import deepseek_v4, ple
    from services.engine.backport.engine_core_watch import watch_engine_service

    _apply("engine-service watch", watch_engine_service)
    # A no-op unless a PLE service is configured; it acts only once Qwen4Exp loads.
    _apply("PLE offload hook", ple.install)
    if current_platform.is_cuda():
        # A no-op from sm90 up; it acts only once the vLLM modules it routes load.
        capability = current_platform.get_device_capability()
        _apply("DeepSeek-V4 kernels for sm80/86/89",
               lambda: deepseek_v4.install(tuple(capability) if capability else None))
    if current_platform.is_cpu():
        try:
            fixes = _cpu_fixes()
        except Exception:
            logger.exception("backport: CPU fixes unavailable")
            return
        for name, fix in fixes:
            _apply(name, fix)
