"""Merge two attentions over disjoint key sets by their log-sum-exp: a shared prefix and each
sequence's own suffix (cascade attention), a context split across devices (context parallelism),
or chunks of a long context, give the attention over the union.

For one row, an attention over keys ``K`` is ``out = sum_k p_k v_k / S`` with ``S = sum_k p_k``,
``p_k = exp(s_k)``, and ``lse = ln S``. Over ``K_a ∪ K_b`` the weights of each part scale by
``S_a / (S_a + S_b)`` and ``S_b / (S_a + S_b)``; in log space, with ``m = max(lse_a, lse_b)``:
``w_a = exp(lse_a - m)``, ``w_b = exp(lse_b - m)``, ``out = (w_a out_a + w_b out_b) / (w_a + w_b)``,
``lse = m + ln(w_a + w_b)``. This is flash-decoding's combine step, the one pa_tile's split-K
reduce does on the device for its own partitions.
"""

from __future__ import annotations

import torch

__all__ = ["merge_states"]


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """``(out, lse)`` of the attention over the union of two disjoint key sets.

    ``out_*`` [rows, heads, head_dim] (float16, bfloat16 or float32), ``lse_*`` float32 [rows, heads],
    natural log of each row's softmax denominator over its keys (``-inf``: no key). ``out`` has
    ``out_a``'s dtype; the arithmetic is float32. NaN-safe: a side with no key (``lse = -inf``)
    contributes nothing, whatever its ``out`` holds (an empty partial may hold 0, garbage or NaN);
    a row empty on both sides gives ``out = 0`` and ``lse = -inf``. A torch function: it runs on
    any device and compiles with ``torch.compile``.
    """
    for name, o in (("out_a", out_a), ("out_b", out_b)):
        if not isinstance(o, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(o).__name__}")
        if o.dtype not in (torch.float16, torch.bfloat16, torch.float32) or o.dim() != 3:
            raise ValueError(f"{name}: expected a float16/bfloat16/float32 [rows, heads, head_dim] tensor, "
                             f"got {o.dtype} {tuple(o.shape)}")
    if out_b.shape != out_a.shape or out_b.device != out_a.device:
        raise ValueError(f"out_b: expected {tuple(out_a.shape)} on {out_a.device} like out_a, got "
                         f"{tuple(out_b.shape)} on {out_b.device}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not isinstance(lse, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(lse).__name__}")
        if lse.dtype != torch.float32 or lse.shape != out_a.shape[:2] or lse.device != out_a.device:
            raise ValueError(f"{name}: expected float32 {tuple(out_a.shape[:2])} on {out_a.device}, got "
                             f"{lse.dtype} {tuple(lse.shape)} on {lse.device}")
    m = torch.maximum(lse_a, lse_b)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)  # -inf - -inf would be NaN
    w_a, w_b = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)  # exp(-inf) = 0 for an empty side
    total = w_a + w_b
    # select, not multiply: an empty side's weight is 0, and 0 * NaN would still be NaN
    part_a = torch.where((w_a > 0)[..., None], w_a[..., None] * out_a.float(), 0.0)
    part_b = torch.where((w_b > 0)[..., None], w_b[..., None] * out_b.float(), 0.0)
    out = torch.where(empty[..., None], 0.0, (part_a + part_b) / torch.where(empty, 1.0, total)[..., None])
    lse = torch.where(empty, m, m_safe + torch.log(torch.where(empty, 1.0, total)))
    return out.to(out_a.dtype), lse
