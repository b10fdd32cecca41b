"""Qwen4Exp PLE lookups served by the PLE offload service instead of a per-process table.

`install()` turns it on (when configured), `uninstall()` off; importing this package imports nothing heavy.
"""

from services.engine.backport.ple.activation import install, uninstall

__all__ = ["install", "uninstall"]
