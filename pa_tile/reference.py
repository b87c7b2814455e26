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

Serving math (the conventions of gpt-oss, Gemma 2, vLLM and FlashInfer):

* ``logits_soft_cap = c > 0``: each score, softmax scale applied, becomes ``c·tanh(s/c)``, before
  masking.
* ``sinks`` [num_q_heads] float32, natural-log units, not multiplied by the softmax scale: each row
  of head ``h`` gains ``exp(sinks[h])`` in its softmax denominator and nothing in V (a key that is
  always seen and has a zero value).
* ``return_lse``: also the natural log of each row's softmax denominator, ``[rows, num_q_heads]``
  float32, ``-inf`` for a row with no key (and no sink). The sink is in it: it is the denominator
  the output was divided by, so ``(out, lse)`` is an attention state over the row's keys plus the
  sink (a zero-valued key), and two states over disjoint keys merge exactly by it
  (``pa_tile.merge_states``) when only one of them carries the sink.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from pa_tile.fp8 import FP8_DTYPES, fp8_decode, fp8_format_of

__all__ = ["paged_attention_reference", "P_FLOOR", "kernel_query", "fp8_error_bound", "within_bound"]

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
    sinks: Optional[torch.Tensor] = None,
    logits_soft_cap: Optional[float] = None,
    return_lse: bool = False,
    query_start_loc: Optional[torch.Tensor] = None,
):
    """Paged decode attention in float32; returns a tensor shaped and typed like ``query``
    (``(out, lse)`` with ``return_lse``).

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
    * ``sinks``, ``logits_soft_cap``, ``return_lse``: the serving math of the module docstring.
    * ``query_start_loc`` [num_seqs + 1] (vLLM's; FlashInfer's ``qo_indptr``): ragged query rows,
      sequence ``s`` owns rows ``loc[s] .. loc[s+1]-1``, the last ``loc[s+1] - loc[s]`` positions
      of its context (0 rows: skipped); ``query`` packs ``loc[-1]`` rows and ``query_length`` is
      not used.

    Every argument is checked (ValueError/TypeError naming it) before any arithmetic.
    """
    if query_start_loc is not None:
        return _ragged(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale, query_start_loc,
                       softmax_scale=softmax_scale, sliding_window=sliding_window, fp8_format=fp8_format,
                       sinks=sinks, logits_soft_cap=logits_soft_cap, return_lse=return_lse)
    fmt, S, Hkv, bs, d, ks, vs = _validate(
        query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale,
        query_length, softmax_scale, sliding_window, fp8_format,
    )
    _check_serving_math(sinks, logits_soft_cap, query.shape[1])
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
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)

    pos = ctx[:, None] - ql + torch.arange(ql, device=dev)[None, :]  # [S, ql]
    allowed = tok[None, None, :] <= pos[:, :, None]  # [S, ql, T]
    if sliding_window > 0:
        allowed &= tok[None, None, :] >= pos[:, :, None] - sliding_window + 1
    scores = scores.masked_fill(~allowed[:, :, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1) if return_lse or sinks is not None else None  # -inf: no key
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        denom = torch.logaddexp(lse, sinks.to(torch.float32).reshape(1, 1, Hkv, G).to(dev))
        # the softmax with the sink's share of the denominator
        probs = torch.exp(scores - denom[..., None])
        lse = denom
    out = torch.einsum("sihgt,shtd->sihgd", probs, v).reshape(S * ql, Hq, d).to(query.dtype)
    return (out, lse.reshape(S * ql, Hq)) if return_lse else out


def _ragged(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale, loc, **kw):
    """The reference over ragged query rows: each sequence with rows is its own uniform call."""
    _tensor(loc, "query_start_loc")
    if loc.dtype not in _INDEX_DTYPES or tuple(loc.shape) != (block_tables.shape[0] + 1,):
        raise ValueError(f"query_start_loc: expected int32 [{block_tables.shape[0] + 1}] (num_seqs + 1), got "
                         f"{loc.dtype} {tuple(loc.shape)}")
    starts = loc.tolist()
    if starts[0] != 0 or any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] != query.shape[0]:
        raise ValueError(f"query_start_loc: must rise from 0 to query's {query.shape[0]} rows, got {starts}")
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    lse = torch.full(query.shape[:2], float("-inf"), device=query.device)
    for s, (a, b) in enumerate(zip(starts, starts[1:])):
        if b == a:
            continue
        got = paged_attention_reference(query[a:b], k_cache, v_cache, block_tables[s:s + 1],
                                        context_lengths[s:s + 1], k_scale, v_scale, query_length=b - a, **kw)
        if kw.get("return_lse"):
            out[a:b], lse[a:b] = got
        else:
            out[a:b] = got
    return (out, lse) if kw.get("return_lse") else out


def _check_serving_math(sinks, logits_soft_cap, num_q_heads):
    if sinks is not None:
        _tensor(sinks, "sinks")
        if sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,):
            raise ValueError(f"sinks: expected float32 [{num_q_heads}] (num_q_heads), got {sinks.dtype} "
                             f"{tuple(sinks.shape)}")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
            raise TypeError(f"logits_soft_cap: expected a float or None, got {type(logits_soft_cap).__name__}")
        if not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
            raise ValueError(f"logits_soft_cap: must be finite and > 0, got {logits_soft_cap}")


# Half the smallest e4m3 subnormal: the largest absolute rounding error of a P code below the
# normal range (e4m3fnuz: subnormal step 2^-10; OCP e4m3fn: 2^-9).
P_FLOOR = {"fnuz": 2.0 ** -11, "ocp": 2.0 ** -10}
# Half an ulp of the output's 16-bit type, relative (f16: 10 mantissa bits; bf16: 7).
_OUT_ROUNDING = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}


def _abs_codes(cache: torch.Tensor) -> torch.Tensor:
    """|code| of every e4m3 code: the sign bit cleared (fnuz's NaN 0x80 becomes 0)."""
    return (cache.view(torch.uint8) & 0x7F).view(cache.dtype)


def kernel_query(query: torch.Tensor, fp8_format: str) -> torch.Tensor:
    """The query as this package's kernels use it, float32: each row (one token, one head) scaled
    so its largest magnitude lands on FP8_MAX, rounded to e4m3, scaled back, in the kernels' own
    float32 order (``kernel_lib.quantize_query``: ``rcp(amax)·FP8_MAX``, then ``amax·(1/FP8_MAX)``)."""
    from pa_tile.fp8 import FP8_MAX

    fmax = FP8_MAX[fp8_format]
    q = query.to(torch.float32)
    amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-20)
    inv = (1.0 / amax) * torch.tensor(fmax, dtype=torch.float32)
    codes = (q * inv).to(FP8_DTYPES[fp8_format]).to(torch.float32)
    return codes * (amax * torch.tensor(1.0 / fmax, dtype=torch.float32))


def fp8_error_bound(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale, *,
                    query_length: int = 1, softmax_scale: Optional[float] = None, sliding_window: int = 0,
                    fp8_format: Optional[str] = None, out_dtype: Optional[torch.dtype] = None,
                    sinks: Optional[torch.Tensor] = None, logits_soft_cap: Optional[float] = None):
    """``(ref, bound)``: the float32 reference (``paged_attention_reference``, not rounded to the
    query's dtype) and, per output element, a bound on ``|out - ref|`` for a kernel that does this
    package's fp8 arithmetic. Arguments as ``paged_attention_reference``; ``out_dtype``: the
    kernel's output type (default: the query's).

    Output row ``o = sum_t p_t v_t / sum_t p_t`` with ``p_t = 2^(s_t - m)``. The kernel

    * rounds the query to e4m3 per row (``kernel_query``). That changes the scores and so the
      weights ``w = softmax(s)``; its effect is not bounded but computed: ``|o_q - ref|``, where
      ``o_q`` is the reference on the kernel's query;
    * rounds each P (largest P = FP8_MAX, times ``v_scale/max(v_scale)`` per token) to e4m3, but
      sums the unrounded P. A normal code is within 2^-4 of its value, so the output moves by at
      most ``2^-4 · sum_t w_t |v_t|`` (``w`` of the kernel's query); a code below the normal range
      is off by at most half a subnormal step ``h``, against a sum of P of at least FP8_MAX (the
      row's top token): at most ``h / FP8_MAX · sum_t |v_code_t| · max(v_scale)`` over the tokens
      the row sees. A split context (per-partition softmax, merged in float32) keeps both bounds:
      they are sums over the row's tokens with weights that add up to one;
    * computes in float32: scores summed from exact fp8 products, exp2 within an ulp, the row max
      rounded once, exp_shift's margin. Each moves a weight by far under 2^-8 relative; 2^-8 of
      ``sum_t w_t |v_t|`` covers them and a P or Q code that rounds the other way because of them
      (a Q code can only do so on hardware, where ``v_rcp_f32`` is within an ulp, not exact, and
      only when ``q·FP8_MAX/amax`` lies within that ulp of an e4m3 midpoint);
    * rounds the output to ``out_dtype``: half an ulp of it, relative.

    A row that sees few tokens gets a wide bound (one token's P rounding moves it by up to 2^-4·|v|);
    a long row a narrow one (about 2^-4 of the mean |v|).

    ``sinks`` and ``logits_soft_cap`` enter every weighted term through the reference (a sink only
    adds to the denominator, so it shrinks the weights; the cap's tanh has slope <= 1, so the fp8
    query moves a capped score no more than an uncapped one, and ``o_q`` computes that move); the
    subnormal term keeps its bound without them (a sink only makes the row's sum of P larger)."""
    fmt, *_ = _validate(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale,
                        query_length, softmax_scale, sliding_window, fp8_format)
    from pa_tile.fp8 import FP8_MAX

    kw = dict(query_length=query_length, softmax_scale=softmax_scale, sliding_window=sliding_window,
              fp8_format=fmt)
    math_kw = dict(kw, sinks=sinks, logits_soft_cap=logits_soft_cap)
    tables = (block_tables, context_lengths)
    q = query.to(torch.float32)
    ref = paged_attention_reference(q, k_cache, v_cache, *tables, k_scale, v_scale, **math_kw)
    q_k = kernel_query(query, fmt)
    o_q = paged_attention_reference(q_k, k_cache, v_cache, *tables, k_scale, v_scale, **math_kw)
    abs_v, abs_vs = _abs_codes(v_cache), (v_scale.abs() if isinstance(v_scale, torch.Tensor) else abs(v_scale))
    weighted_abs_v = paged_attention_reference(q_k, k_cache, abs_v, *tables, k_scale, abs_vs, **math_kw)
    # a zero query weights every token a row sees alike: the mean of |v_code|, times its count
    vs_max = float(abs_vs.max()) if isinstance(abs_vs, torch.Tensor) else float(abs_vs)
    mean_codes = paged_attention_reference(torch.zeros_like(q), k_cache, abs_v, *tables, k_scale, vs_max, **kw)
    ctx = context_lengths.to(torch.int64)
    pos = ctx[:, None] - query_length + torch.arange(query_length, device=ctx.device)[None, :]
    seen = pos + 1 if sliding_window <= 0 else torch.clamp(pos + 1, max=sliding_window)
    sum_codes = mean_codes * seen.reshape(-1, 1, 1).to(torch.float32)
    fp8_bound = (o_q - ref).abs() + (2.0 ** -4 + 2.0 ** -8) * weighted_abs_v + (
        P_FLOOR[fmt] / FP8_MAX[fmt]) * sum_codes
    out_dtype = query.dtype if out_dtype is None else out_dtype
    return ref, fp8_bound + _OUT_ROUNDING[out_dtype] * (ref.abs() + fp8_bound)


def within_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor):
    """``(ok, worst)``: ``out`` is finite and within ``bound`` of ``ref`` everywhere; ``worst`` is
    the largest ``|out - ref| / bound`` (at most 1 when ok)."""
    out = out.to(torch.float32).cpu()
    err = (out - ref.cpu()).abs()
    worst = float((err / bound.cpu()).max()) if err.numel() else 0.0
    return bool(torch.isfinite(out).all()) and worst <= 1.0, worst
