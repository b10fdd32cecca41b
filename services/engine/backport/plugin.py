"""vLLM general plugin entry point (`vllm.general_plugins` group, name `backport`).

vLLM calls `register` in every process it starts; it must be idempotent and must
not fail the engine when an optional piece cannot load.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
