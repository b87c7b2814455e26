"""pa_tile.reference's serving math (sinks, logit soft-cap, LSE out) against attention written
here row by row, with none of the reference's vectorized gathers or masks."""

import math

import pytest
import torch

from pa_tile import cache
from pa_tile.fp8 import fp8_decode
from pa_tile.reference import fp8_error_bound, paged_attention_reference


def _case(ql=1, window=0, contexts=(37, 300), heads=(8, 2), scales="per-token"):
    return cache.make_case(len(contexts), heads[0], heads[1], 64, 16, list(contexts), query_length=ql,
                           scales=scales, seed=5)


def _rows(case, window=0, sinks=None, cap=None):
    """(out, lse) per row, one (sequence, query, head) at a time: decode the row's keys one token at
    a time from its pages, score, cap, keep the causal window, softmax with the sink appended."""
    ql, bs = case.query_length, 16
    Hq, Hkv = case.query.shape[1], case.k_cache.shape[1]
    G = Hq // Hkv
    scale = 1 / math.sqrt(64)
    outs, lses = torch.zeros(case.query.shape), torch.zeros(case.query.shape[:2])
    for s, n in enumerate(case.context_lengths.tolist()):
        for i in range(ql):
            pos = n - ql + i
            lo = 0 if window == 0 else max(0, pos - window + 1)
            for h in range(Hq):
                kv = h // G
                ks, vs = [], []
                for t in range(lo, pos + 1):
                    page, slot = int(case.block_tables[s, t // bs]), t % bs
                    ksc = case.k_scale[page, kv, slot] if case.per_token else case.k_scale.reshape(())
                    vsc = case.v_scale[page, kv, slot] if case.per_token else case.v_scale.reshape(())
                    ks.append(fp8_decode(case.k_cache[page, kv, slot]).float() * ksc)
                    vs.append(fp8_decode(case.v_cache[page, kv, slot]).float() * vsc)
                q = case.query[s * ql + i, h].float()
                logits = torch.stack([q @ k for k in ks]) * scale
                if cap is not None:
                    logits = cap * torch.tanh(logits / cap)
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h:h + 1]])
                lses[s * ql + i, h] = torch.logsumexp(logits, 0)  # the sink is in the denominator
                w = torch.softmax(logits, 0)[: len(vs)]
                outs[s * ql + i, h] = sum(wj * v for wj, v in zip(w, vs))
    return outs, lses


@pytest.mark.parametrize("ql,window", [(1, 0), (3, 0), (1, 20), (2, 100)])
@pytest.mark.parametrize("math_on", ["sinks", "cap", "both"])
def test_serving_math_matches_row_by_row_attention(ql, window, math_on):
    case = _case(ql=ql)
    sinks = torch.linspace(-3.0, 4.0, 8) if math_on in ("sinks", "both") else None
    cap = 2.0 if math_on in ("cap", "both") else None  # small enough that tanh bends real scores
    out, lse = paged_attention_reference(case.query.float(), case.k_cache, case.v_cache, case.block_tables,
                                         case.context_lengths, case.k_scale, case.v_scale, query_length=ql,
                                         sliding_window=window, sinks=sinks, logits_soft_cap=cap, return_lse=True)
    want_out, want_lse = _rows(case, window, sinks, cap)
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-5)  # float32 sums in other orders
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_lse_is_the_denominator_with_the_sink_and_off_changes_nothing():
    case = _case()
    args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths, case.k_scale,
            case.v_scale)
    plain = paged_attention_reference(*args)
    out, lse = paged_attention_reference(*args, return_lse=True)
    assert torch.equal(out, plain)
    _, lse_sinks = paged_attention_reference(*args, return_lse=True, sinks=torch.full((8,), 3.0))
    torch.testing.assert_close(lse_sinks, torch.logaddexp(lse, torch.tensor(3.0)))
    # a sink of -inf is no sink
    torch.testing.assert_close(paged_attention_reference(*args, sinks=torch.full((8,), float("-inf"))).float(),
                               plain.float(), rtol=2e-3, atol=1e-3)  # float16 outputs, exp vs softmax order


def test_error_bound_takes_the_serving_math():
    case = _case(scales="per-tensor")
    sinks, cap = torch.linspace(-1.0, 2.0, 8), 5.0
    ref, bound = case.error_bound(sinks=sinks, logits_soft_cap=cap)
    want = paged_attention_reference(case.query.float(), case.k_cache, case.v_cache, case.block_tables,
                                     case.context_lengths, case.k_scale, case.v_scale, sinks=sinks,
                                     logits_soft_cap=cap)
    assert torch.equal(ref, want)
    assert torch.isfinite(bound).all() and (bound > 0).all()
    # the reference itself, rounded to float16, is within its own bound
    assert case.check(ref.half(), sinks=sinks, logits_soft_cap=cap)[0]


@pytest.mark.parametrize("kw,name", [
    (dict(sinks=torch.zeros(7)), "sinks"),
    (dict(sinks=torch.zeros(8, dtype=torch.float64)), "sinks"),
    (dict(sinks=[0.0] * 8), "sinks"),
    (dict(logits_soft_cap=0.0), "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap"),
    (dict(logits_soft_cap="50"), "logits_soft_cap"),
])
def test_bad_serving_math_is_named(kw, name):
    case = _case()
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        paged_attention_reference(case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths,
                                  case.k_scale, case.v_scale, **kw)


def test_ragged_query_rows_match_each_sequence_alone():
    """query_start_loc packs each sequence's own number of query rows (0 allowed): every sequence's
    rows equal the uniform reference of that sequence alone with its query_length."""
    full = cache.make_case(4, 8, 2, 64, 16, [40, 300, 9, 130], query_length=8, scales="per-token", seed=2)
    lengths = [1, 8, 0, 5]
    keep = [r for s, q in enumerate(lengths) for r in range(s * 8 + 8 - q, s * 8 + 8)]
    query = full.query[keep]
    loc = torch.tensor([0, 1, 9, 9, 14], dtype=torch.int32)
    args = (full.k_cache, full.v_cache, full.block_tables, full.context_lengths, full.k_scale, full.v_scale)
    out, lse = paged_attention_reference(query, *args, query_start_loc=loc, return_lse=True, sliding_window=50)
    for s, q in enumerate(lengths):
        if q == 0:
            continue
        a = int(loc[s])
        alone = paged_attention_reference(query[a:a + q], args[0], args[1], args[2][s:s + 1], args[3][s:s + 1],
                                          *args[4:], query_length=q, return_lse=True, sliding_window=50)
        assert torch.equal(out[a:a + q], alone[0]) and torch.equal(lse[a:a + q], alone[1])
    with pytest.raises(ValueError, match="^query_start_loc: "):
        paged_attention_reference(query, *args, query_start_loc=torch.tensor([0, 1, 9, 8, 14], dtype=torch.int32))
