"""Decides whether the PLE hook is on and swaps the embedding class when Qwen4Exp loads.

The seam is the one name Qwen4Exp's n-gram embedding looks up when it builds its table
(`Qwen4ExpPLEPinnedHostEmbedding` or `Qwen4ExpPLEDeviceEmbedding` in the module that
constructs it). The swap happens only when vLLM imports those modules, which it does only
for Qwen4Exp models, so other models never load this code.
"""

from __future__ import annotations

import logging
import os
import sys
from types import ModuleType

from services.engine.backport.module_patch import (
    PatchOnImport,
    patch_when_imported,
    stop_patching,
)

logger = logging.getLogger(__name__)

# The hook's switch; the rest of its settings are `hook_settings.PleHookSettings`.
ADDRESS_ENV = "BACKPORT_PLE_ADDRESS"

# Modules that pick the PLE embedding class by these names when a layer is built.
_EMBEDDING_CHOOSERS = (
    "vllm.models.qwen4_exp.nvidia.ngram_embedding",
    "vllm.models.qwen4_exp.amd.ple_layer",
)
_STOCK_CLASS_NAMES = ("Qwen4ExpPLEPinnedHostEmbedding", "Qwen4ExpPLEDeviceEmbedding")

_finder: PatchOnImport | None = None
_stock_classes: dict[tuple[str, str], type] = {}


def install() -> bool:
    """Turns the hook on when `BACKPORT_PLE_ADDRESS` names a PLE service. Idempotent;
    returns whether the hook is active."""
    global _finder
    if _finder is not None:
        return True
    if not os.environ.get(ADDRESS_ENV):
        return False
    _finder = patch_when_imported(dict.fromkeys(_EMBEDDING_CHOOSERS, _swap_embedding_class))
    logger.info("Qwen4Exp PLE lookups will be served by the PLE service at %s",
                os.environ[ADDRESS_ENV])
    return True


def uninstall() -> None:
    """Puts vLLM's own embedding classes back (for tests and for switching the hook off)."""
    global _finder
    if _finder is not None:
        stop_patching(_finder)
    for (module_name, name), cls in _stock_classes.items():
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, name, cls)
    _stock_classes.clear()
    _finder = None


def _swap_embedding_class(module: ModuleType) -> None:
    from services.engine.backport.ple.service_embedding import ServicePleEmbedding

    for name in _STOCK_CLASS_NAMES:
        if hasattr(module, name):
            _stock_classes.setdefault((module.__name__, name), getattr(module, name))
            setattr(module, name, ServicePleEmbedding)
