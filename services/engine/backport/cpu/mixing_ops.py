"""Torch versions of DeepSeek-V4's hyper-connection (mHC) and MoE routing kernels
that the AVX2 build lacks (vLLM `mhc.cpp` and `topk.cpp` contracts).

The mHC pre/post maths are vLLM's own torch references; only the op
signatures differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def hc_pre_fused(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from vllm.model_executor.kernels.mhc.torch import mhc_pre_torch

    # The fused CPU kernel fixes the post-mix multiplier at 2 and shares one eps.
    post, comb, layer_input = mhc_pre_torch(
        x, hc_fn, hc_scale, hc_base, rms_eps, hc_eps, hc_eps, 2.0, sinkhorn_iters
    )
    return layer_input, post.view(x.shape[0], hc_mult), comb


def hc_post_fused(
    x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    from vllm.model_executor.kernels.mhc.torch import mhc_post_torch

    return mhc_post_torch(x, residual, post.unsqueeze(-1), comb)


def hc_head_fused(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Collapse the hc streams: sigmoid gates from the RMS-normed flat residual."""
    flat = x.flatten(1).to(torch.float32)
    normed = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
    gates = torch.sigmoid(F.linear(normed, hc_fn) * hc_scale + hc_base) + hc_eps
    return (gates.unsqueeze(-1) * x.to(torch.float32)).sum(dim=1).to(x.dtype)


def _scores(gating_output: torch.Tensor, scoring_func: str) -> torch.Tensor:
    logits = gating_output.to(torch.float32)
    if scoring_func == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unsupported scoring function: {scoring_func}")


def biased_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select by score + bias; weigh by the unbiased score ("noaux_tc")."""
    if num_fused_shared_experts:
        raise NotImplementedError("fused shared experts are not routed on CPU")
    scores = _scores(gating_output, scoring_func)
    ids = torch.topk(scores + correction_bias.to(torch.float32), k=topk, dim=-1).indices
    weights = scores.gather(1, ids)
    return _finish(weights, ids, renormalize, routed_scaling_factor, apply_routed_scaling_factor_on_output)


def hash_topk(
    gating_output: torch.Tensor,
    tid2eid: torch.Tensor,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts fixed per token id by the hash table; weights from the scores."""
    if num_fused_shared_experts:
        raise NotImplementedError("fused shared experts are not routed on CPU")
    ids = tid2eid[:, :topk].to(torch.int64)
    weights = _scores(gating_output, scoring_func).gather(1, ids)
    return _finish(weights, ids, True, routed_scaling_factor, True)


def _finish(
    weights: torch.Tensor,
    ids: torch.Tensor,
    renormalize: bool,
    routed_scaling_factor: float | None,
    scale_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale_output and routed_scaling_factor is not None:
        weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()
