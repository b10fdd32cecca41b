"""Fixes for gaps in vLLM's CPU build, applied by the plugin only on the CPU platform.

Each fix fills one seam: a missing kernel, or a metadata shape the shared
DeepSeek-V4 code expects. Nothing here runs at import time.
"""
