"""vLLM's DeepSeek-V4 CUDA path on sm80/86/89: the backport's kernels in FlashMLA's place.

`install(capability)` turns it on below sm90, `uninstall()` off; importing this package
imports nothing heavy.
"""

from services.engine.backport.deepseek_v4.activation import install, uninstall

__all__ = ["install", "uninstall"]
