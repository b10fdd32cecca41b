"""The online softmax both sparse MLA attentions (decode and prefill) run, in base 2.

`initial_state` is a block of heads' running max m (-inf), sum l (0) and output acc (0);
`attend_block` folds one block of keys into a block of heads' running max m, sum l and
output acc: scores q . k^T (already scaled by log2(e) * softmax scale), padding keys at
-inf, and the block's probabilities times the same K tile (K = V in MLA). `normalized`
finishes: out = acc / l and lse2 = m + log2(l), or -inf for a head that saw no valid key
(its acc, and so its out, stays 0). `natural_lse` is what the kernels return: lse in
natural log, +inf for a head with no valid key (FlashMLA's convention).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def initial_state(HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(m, l, acc) before any key: -inf, 0 and zeros [HEADS, HEAD_DIM], fp32."""
    m_i = tl.full((HEADS,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((HEADS,), dtype=tl.float32)
    acc = tl.zeros((HEADS, HEAD_DIM), dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def attend_block(q, k, valid, m_i, l_i, acc, qk_scale_log2, DOT_DTYPE: tl.constexpr):
    """(m, l, acc) after the keys of K tile `k` ([BLOCK_N, D]; `valid` [BLOCK_N])."""
    scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # All-padding so far: keep the reference point finite so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), k)
    return m_new, l_i, acc


@triton.jit
def normalized(acc, m_i, l_i):
    """(out, lse2, has_keys) of a finished loop."""
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return out, lse2, has_keys


@triton.jit
def natural_lse(lse2, has_keys):
    """A base-2 lse as the kernels return it: natural log, +inf where no key was valid."""
    return tl.where(has_keys, lse2 * 0.6931471805599453, float("inf"))
