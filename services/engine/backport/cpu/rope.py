"""GPT-J (interleaved pair) rotary embedding over a `[cos | sin]` fp32 cache."""

from __future__ import annotations

import torch


def rotate_gptj(
    x: torch.Tensor, cos_sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of the last dim by the angles in `cos_sin`.

    x: [..., rope_dim] fp32; cos_sin: broadcastable [..., rope_dim] rows holding
    rope_dim/2 cosines then rope_dim/2 sines. `inverse` rotates by the negative angle.
    """
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[..., :half], cos_sin[..., half:]
    if inverse:
        sin = -sin
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out
