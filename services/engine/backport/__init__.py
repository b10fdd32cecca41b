"""The backport: kernels and model wiring that run Hopper-only vLLM paths on sm80/86/89.

Importing this package imports nothing heavy; vLLM loads it through `plugin.register`.
"""
