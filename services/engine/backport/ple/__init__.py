"""Qwen4Exp PLE lookups served by the PLE offload service instead of a per-process table.

`install()` is the whole public API; importing this package imports nothing heavy.
"""

from services.engine.backport.ple.activation import install

__all__ = ["install"]
