"""Make the CPU sparse-SWA tile scheduler answer for every layer type.

The shared DeepSeek-V4 metadata builder reads five layer-type keys
(swaonly, c4a, c128a, c1a, c2a) from `build_tile_scheduler`; the CPU
builder returns three, so every step fails with `KeyError: 'c1a'`. The CPU
path never uses a tile schedule, so the missing types also map to None.
"""

from __future__ import annotations

import functools

_PATCHED_FLAG = "_backport_fills_all_layer_types"


def fill_all_layer_types() -> None:
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    builder = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    original = builder.build_tile_scheduler
    if getattr(original, _PATCHED_FLAG, False):
        return
    layer_types = [
        value for name, value in vars(sparse_swa).items() if name.startswith("_LAYER_TYPE_")
    ]

    @functools.wraps(original)
    def build_tile_scheduler(self, num_decode_tokens: int):
        schedule = original(self, num_decode_tokens)
        return {layer_type: schedule.get(layer_type) for layer_type in layer_types}

    setattr(build_tile_scheduler, _PATCHED_FLAG, True)
    builder.build_tile_scheduler = build_tile_scheduler
