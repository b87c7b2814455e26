"""The plain PyTorch paged decode a user would write first: gather pages, dequantize, SDPA.

It is the benchmark's point of comparison, so it must be right: tests check it against
``pa_tile.reference`` on the CPU. Unlike the reference (float32, validation first), it runs in
the query's dtype by default, takes the longest context as a Python int so it can be captured
in a CUDA graph (no host synchronization inside), and reshapes the query so each KV head is
gathered once for its whole query group (no ``repeat_interleave`` of K/V).

Caches are in the logical layout ``[num_blocks, num_kv_heads, block_size, head_dim]`` as fp8
dtypes (``float8_e4m3fnuz`` / ``float8_e4m3fn``); masks follow the reference's conventions
(row ``i`` of ``query_length`` sits at position ``L - query_length + i``, causal).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["paged_decode_torch", "baseline_from_case"]

_FP8 = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)


def _gather(cache: torch.Tensor, scale: Union[float, torch.Tensor], pages: torch.Tensor, length: int,
            dtype: torch.dtype) -> torch.Tensor:
    """[S, P] page ids -> dequantized tokens [S, kvh, length, d] in ``dtype``."""
    vals = cache[pages].to(dtype)  # [S, P, kvh, bs, d]; fp8 values are exact in f16/bf16/f32
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        vals = vals * scale[pages].to(dtype).unsqueeze(-1)  # per token: [S, P, kvh, bs, 1]
    else:
        vals = vals * (scale.to(dtype).reshape(()) if isinstance(scale, torch.Tensor) else scale)
    S, P, h, bs, d = vals.shape
    return vals.permute(0, 2, 1, 3, 4).reshape(S, h, P * bs, d)[:, :, :length]


def paged_decode_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lengths: torch.Tensor,
                       key_scale: Union[float, torch.Tensor], value_scale: Union[float, torch.Tensor], *,
                       query_length: int = 1, softmax_scale: Optional[float] = None,
                       max_context_length: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Paged decode attention with torch ops; returns ``out`` (shaped and typed like ``query``).

    Arguments as ``pa_tile.reference.paged_attention_reference`` (logical-layout fp8 caches,
    per-tensor or per-token float32 scales). ``max_context_length``: an int >= every context
    length (default: read from ``context_lengths``, which synchronizes with the GPU).
    ``compute_dtype``: dtype of the dequantized K/V and of SDPA (default: the query's).
    """
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FP8 or t.dim() != 4:
            raise TypeError(f"{name}: expected a 4-d fp8 e4m3 tensor [num_blocks, kv_heads, block_size, head_dim], "
                            f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    if query.dim() != 3:
        raise ValueError(f"query: expected [num_seqs*query_length, num_q_heads, head_dim], got {tuple(query.shape)}")
    rows, qh, d = query.shape
    nb, kvh, bs, kd = key_cache.shape
    if kd != d or tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} do not match head_dim {d}")
    if qh % kvh:
        raise ValueError(f"query: num_q_heads={qh} is not a multiple of num_kv_heads={kvh}")
    if rows % query_length:
        raise ValueError(f"query: {rows} rows is not a multiple of query_length={query_length}")
    ns, ql, g = rows // query_length, query_length, qh // kvh
    cd = compute_dtype or query.dtype
    if max_context_length is None:
        max_context_length = int(context_lengths.max())
    L = int(max_context_length)
    nblk = -(-L // bs)
    if nblk > block_tables.shape[1]:
        raise ValueError(f"max_context_length: {L} tokens need {nblk} pages, block_tables has {block_tables.shape[1]}")
    # Entries past a sequence's last page may hold anything (-1 pads); clamp so the gather is in
    # bounds, the masks below keep those tokens out of the result.
    pages = block_tables[:, :nblk].long().clamp(0, nb - 1)
    k = _gather(key_cache, key_scale, pages, L, cd)
    v = _gather(value_cache, value_scale, pages, L, cd)
    ctx = context_lengths.to(device=query.device, dtype=torch.long)
    j = torch.arange(L, device=query.device)
    # Slots past a sequence's end can hold non-finite garbage, which a -inf mask alone would
    # not stop (0 * NaN): zero them.
    live = (j[None, :] < ctx[:, None])[:, None, :, None]
    k = torch.where(live, k, torch.zeros((), dtype=cd, device=k.device))
    v = torch.where(live, v, torch.zeros((), dtype=cd, device=v.device))
    # One attention "row" per (query head of the group, query token): [S, kvh, g*ql, d].
    q = query.reshape(ns, ql, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(ns, kvh, g * ql, d).to(cd)
    pos = ctx[:, None] - ql + torch.arange(ql, device=query.device)[None, :]  # [S, ql]
    allowed = j[None, None, :] <= pos[:, :, None]  # [S, ql, L]
    mask = allowed.repeat(1, g, 1)[:, None]  # row r = group member r // ql, token r % ql
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    o = o.reshape(ns, kvh, g, ql, d).permute(0, 3, 1, 2, 4).reshape(rows, qh, d)
    if out is None:
        return o.to(query.dtype)
    out.copy_(o)
    return out


def baseline_from_case(case, **kwargs) -> torch.Tensor:
    """``paged_decode_torch`` on a ``pa_tile.cache.PagedCase`` (kwargs passed through)."""
    kwargs.setdefault("max_context_length", int(max(case.context_lengths.tolist())))
    return paged_decode_torch(case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths,
                              case.k_scale, case.v_scale, query_length=case.query_length, **kwargs)
