"""float32 torch reference for fp8 paged decode attention.

The oracle every stage kernel is checked against. It dequantizes the fp8 K/V pages a
sequence actually uses, then does plain masked softmax attention in float32, vectorized
over sequences, query rows and heads (pages are gathered, not walked token by token).

Masking conventions (position ``j`` = token index within a sequence, 0-based):

* A sequence of context length ``L`` owns tokens ``0 .. L-1``. With ``query_length``
  ``ql``, its query row ``i`` (0 <= i < ql) sits at position ``pos = L - ql + i`` and is
  causal: it sees ``j <= pos``.
* ``sliding_window = W > 0`` keeps a window of **W tokens including the current one**:
  ``pos - W + 1 <= j <= pos``. (Upstream FlyDSL ``pa_decode_swa`` keeps ``j >= pos - W``,
  i.e. W+1 tokens; pass ``W + 1`` here to match that kernel.) ``W = 0`` means no window.

Tokens past ``L`` in a sequence's last page, and block-table entries past its last page,
are never read into the result (garbage or NaN codes there cannot leak into it).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from pa_tile.fp8 import FP8_DTYPES, fp8_decode, fp8_format_of

__all__ = ["paged_attention_reference"]

_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")


def _int_arg(v, name, minimum):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
    if v < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {v}")


def _cache_format(cache, name, fp8_format) -> str:
    _tensor(cache, name)
    if cache.dtype == torch.uint8:
        if fp8_format is None:
            raise ValueError(f"fp8_format: {name} holds uint8 codes, so fp8_format='fnuz' or 'ocp' is required")
        if fp8_format not in FP8_DTYPES:
            raise ValueError(f"fp8_format: expected 'fnuz' or 'ocp', got {fp8_format!r}")
        return fp8_format
    if cache.dtype not in FP8_DTYPES.values():
        raise TypeError(
            f"{name}: expected fp8 e4m3 codes (float8_e4m3fnuz, float8_e4m3fn, or uint8 with fp8_format), got {cache.dtype}"
        )
    own = fp8_format_of(cache.dtype)
    if fp8_format is not None and fp8_format != own:
        raise ValueError(f"fp8_format: {fp8_format!r} contradicts {name} dtype {cache.dtype} (format {own!r})")
    return own


def _scale_kind(scale, name, per_token_shape) -> Union[float, torch.Tensor]:
    """Per-tensor scale as a float, per-token scale as the [nb, kvh, bs] tensor."""
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    _tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype float32, got {scale.dtype}")
    if scale.dim() == 0 or tuple(scale.shape) == (1,):
        return float(scale.reshape(()))
    if tuple(scale.shape) == per_token_shape:
        return scale
    raise ValueError(
        f"{name}: expected shape () or (1,) (per tensor) or {per_token_shape} (per token), got {tuple(scale.shape)}"
    )


def _validate(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale,
              query_length, softmax_scale, sliding_window, fp8_format):
    _int_arg(query_length, "query_length", 1)
    _int_arg(sliding_window, "sliding_window", 0)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale: expected a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale: must be finite, got {softmax_scale}")

    _tensor(query, "query")
    if query.dtype not in _QUERY_DTYPES:
        raise TypeError(f"query: expected float16, bfloat16 or float32, got {query.dtype}")
    if query.dim() != 3:
        raise ValueError(f"query: expected [num_seqs*query_length, num_q_heads, head_dim], got {tuple(query.shape)}")
    rows, num_q_heads, head_dim = query.shape
    if rows == 0 or rows % query_length:
        raise ValueError(f"query: {rows} rows is not a positive multiple of query_length={query_length}")
    num_seqs = rows // query_length

    fmt = _cache_format(k_cache, "k_cache", fp8_format)
    _cache_format(v_cache, "v_cache", fp8_format)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: dtype {v_cache.dtype} differs from k_cache dtype {k_cache.dtype}")
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache: expected logical layout [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(k_cache.shape)}"
        )
    num_blocks, num_kv_heads, block_size, kd = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} differs from k_cache shape {tuple(k_cache.shape)}")
    if kd != head_dim:
        raise ValueError(f"k_cache: head_dim {kd} differs from the query's head_dim {head_dim}")
    if num_kv_heads == 0 or block_size == 0 or num_blocks == 0:
        raise ValueError(f"k_cache: empty dimension in shape {tuple(k_cache.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query: num_q_heads={num_q_heads} is not a multiple of k_cache num_kv_heads={num_kv_heads}")

    _tensor(block_tables, "block_tables")
    if block_tables.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_tables: expected int32 (or int64), got {block_tables.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables: expected [{num_seqs}, max_blocks_per_seq], got {tuple(block_tables.shape)}")
    _tensor(context_lengths, "context_lengths")
    if context_lengths.dtype not in _INDEX_DTYPES:
        raise TypeError(f"context_lengths: expected int32 (or int64), got {context_lengths.dtype}")
    if tuple(context_lengths.shape) != (num_seqs,):
        raise ValueError(f"context_lengths: expected shape ({num_seqs},), got {tuple(context_lengths.shape)}")

    per_token_shape = (num_blocks, num_kv_heads, block_size)
    ks = _scale_kind(k_scale, "k_scale", per_token_shape)
    vs = _scale_kind(v_scale, "v_scale", per_token_shape)

    ctx = context_lengths.to(torch.int64)
    short = ctx < query_length
    if short.any():
        s = int(short.nonzero()[0])
        raise ValueError(f"context_lengths: sequence {s} has {int(ctx[s])} tokens, fewer than query_length={query_length}")
    room = block_tables.shape[1] * block_size
    long_ = ctx > room
    if long_.any():
        s = int(long_.nonzero()[0])
        raise ValueError(
            f"context_lengths: sequence {s} has {int(ctx[s])} tokens but block_tables holds only {room} "
            f"({block_tables.shape[1]} pages of {block_size})"
        )
    used = torch.arange(block_tables.shape[1], device=ctx.device) * block_size < ctx[:, None]
    bt = block_tables.to(torch.int64)
    bad = used & ((bt < 0) | (bt >= num_blocks))
    if bad.any():
        s, j = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"block_tables: entry [{s}, {j}] = {int(bt[s, j])} is not a page id in [0, {num_blocks})")
    return fmt, num_seqs, num_kv_heads, block_size, head_dim, ks, vs


def _gather_pages(cache, scale, pages, fmt):
    """Dequantized tokens of the given pages: [S, P] page ids -> [S, kvh, P*bs, d] float32."""
    vals = fp8_decode(cache[pages], fmt)  # [S, P, kvh, bs, d]
    if isinstance(scale, torch.Tensor):
        vals = vals * scale[pages].unsqueeze(-1)
    else:
        vals = vals * scale
    S, P, h, bs, d = vals.shape
    return vals.permute(0, 2, 1, 3, 4).reshape(S, h, P * bs, d)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    k_scale,
    v_scale,
    *,
    query_length: int = 1,
    softmax_scale: Optional[float] = None,
    sliding_window: int = 0,
    fp8_format: Optional[str] = None,
) -> torch.Tensor:
    """Paged decode attention in float32; returns a tensor shaped and typed like ``query``.

    * ``query``: [num_seqs*query_length, num_q_heads, head_dim] float16/bfloat16/float32;
      row ``s*query_length + i`` is query ``i`` of sequence ``s``.
    * ``k_cache``/``v_cache``: logical layout [num_blocks, num_kv_heads, block_size, head_dim],
      fp8 e4m3 codes as torch.float8_e4m3fnuz (gfx942) / torch.float8_e4m3fn (gfx950), or
      uint8 codes with ``fp8_format='fnuz'|'ocp'``. Value = decode(code) * scale.
    * ``block_tables``: [num_seqs, max_blocks_per_seq] int32 page ids; only the first
      ``ceil(L/block_size)`` entries of a row are read (others may hold anything, e.g. -1).
    * ``context_lengths``: [num_seqs] int32, each >= query_length.
    * ``k_scale``/``v_scale``: float32 per tensor (shape () or (1,), or a Python float) or
      per token ([num_blocks, num_kv_heads, block_size]).
    * GQA: q head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)``.
    * ``softmax_scale`` defaults to ``1/sqrt(head_dim)``; masks as in the module docstring.

    Every argument is checked (ValueError/TypeError naming it) before any arithmetic.
    """
    fmt, S, Hkv, bs, d, ks, vs = _validate(
        query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale,
        query_length, softmax_scale, sliding_window, fp8_format,
    )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    ql = query_length
    Hq = query.shape[1]
    G = Hq // Hkv

    ctx = context_lengths.to(torch.int64)
    n_pages = -(-int(ctx.max()) // bs)
    T = n_pages * bs
    dev = ctx.device
    tok = torch.arange(T, device=dev)
    page_used = torch.arange(n_pages, device=dev)[None, :] * bs < ctx[:, None]
    # Unused entries may be -1 or junk: point them at page 0 for the gather, then mask.
    pages = torch.where(page_used, block_tables[:, :n_pages].to(torch.int64), 0)
    in_seq = (tok[None, :] < ctx[:, None])[:, None, :, None]  # [S, 1, T, 1]
    # where(), not a multiply, so NaN codes in slots past the context cannot leak through.
    k = torch.where(in_seq, _gather_pages(k_cache, ks, pages, fmt), 0.0)
    v = torch.where(in_seq, _gather_pages(v_cache, vs, pages, fmt), 0.0)

    q = query.to(torch.float32).reshape(S, ql, Hkv, G, d)
    scores = torch.einsum("sihgd,shtd->sihgt", q, k) * softmax_scale

    pos = ctx[:, None] - ql + torch.arange(ql, device=dev)[None, :]  # [S, ql]
    allowed = tok[None, None, :] <= pos[:, :, None]  # [S, ql, T]
    if sliding_window > 0:
        allowed &= tok[None, None, :] >= pos[:, :, None] - sliding_window + 1
    scores = scores.masked_fill(~allowed[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("sihgt,shtd->sihgd", probs, v)
    return out.reshape(S * ql, Hq, d).to(query.dtype)
