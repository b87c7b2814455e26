"""Paged attention written out in float32 for the tests: one sequence and query row at a time,
K and V decoded from the fp8 pages its block-table row names and scaled token by token. It shares
nothing with ``pa_tile.reference`` (vectorized, gathered) but the conventions, so the tests check
each kernel against it and it against ``pa_tile.reference``."""

import math

import torch


def tokens(case, x_cache, scale, s, n):
    """Sequence ``s``'s first ``n`` tokens of a logical cache ``[blocks, kvh, block, d]``,
    dequantized: ``[kvh, n, d]`` float32."""
    bs = case.block_size
    pages = case.block_tables[s, : -(-n // bs)].long()
    x = x_cache[pages].float()  # [pages, kvh, bs, d]
    x = x * (scale[pages][..., None] if scale.numel() > 1 else scale.reshape(()))
    return x.permute(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[:, :n]


def attend(case, window=0, sinks=None, cap=None, *, query=None, loc=None):
    """``(out, lse)`` float32 of ``query`` (default ``case.query``) over ``case``'s caches.

    Row ``i`` of sequence ``s`` (of its ``q_s`` rows: ``case.query_length``, or ``loc[s+1] -
    loc[s]`` for ragged rows) sits at ``ctx_s - q_s + i`` and sees tokens ``(pos - W, pos]``
    (``window`` W; 0: all up to pos). Scores ``q·k / sqrt(d)``, then ``cap·tanh(s / cap)``; a
    head's ``sinks`` logit joins the denominator only; ``lse`` is that denominator's log."""
    query = case.query if query is None else query
    kvh = case.num_kv_heads
    G = query.shape[1] // kvh
    scale = 1.0 / math.sqrt(case.head_dim)
    ql = case.query_length
    starts = loc.tolist() if loc is not None else [s * ql for s in range(case.num_seqs + 1)]
    out, lse = torch.zeros(query.shape), torch.full(query.shape[:2], float("-inf"))
    for s, n in enumerate(case.context_lengths.tolist()):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        k = tokens(case, case.k_cache, case.k_scale, s, n)
        v = tokens(case, case.v_cache, case.v_scale, s, n)
        for i in range(b - a):
            row, pos = a + i, n - (b - a) + i
            lo = 0 if window == 0 else max(0, pos - window + 1)
            q = query[row].float().reshape(kvh, G, -1)
            logits = torch.einsum("hgd,htd->hgt", q, k[:, lo:pos + 1]) * scale
            if cap is not None:
                logits = cap * torch.tanh(logits / cap)
            full = logits if sinks is None else torch.cat([logits, sinks.reshape(kvh, G, 1).float()], -1)
            den = torch.logsumexp(full, -1)  # the sink is in the denominator, and V gains nothing
            p = torch.exp(logits - den[..., None])
            out[row] = torch.einsum("hgt,htd->hgd", p, v[:, lo:pos + 1]).reshape(kvh * G, -1)
            lse[row] = den.reshape(-1)
    return out, lse
