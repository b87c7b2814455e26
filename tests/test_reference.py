"""pa_tile.reference against an independent per-token float64 loop, plus argument checks."""

import math

import numpy as np
import pytest
import torch

from pa_tile.cache import make_case, RAGGED_CONTEXTS
from pa_tile.reference import paged_attention_reference


# ── an fp8 e4m3 decoder from the bit layout, sharing nothing with torch's casts ──

def _decode_bits(code: int, fmt: str) -> float:
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 0x7
    if fmt == "fnuz":
        bias = 8
        if code == 0x80:
            return math.nan
    else:
        bias = 7
        if exp == 0xF and man == 0x7:
            return math.nan
    if exp == 0:
        mag = (man / 8.0) * 2.0 ** (1 - bias)
    else:
        mag = (1.0 + man / 8.0) * 2.0 ** (exp - bias)
    return -mag if sign else mag


LUT = {fmt: np.array([_decode_bits(c, fmt) for c in range(256)], dtype=np.float64) for fmt in ("fnuz", "ocp")}


def test_bit_decoder_agrees_with_torch_on_every_code():
    # Anchors the loop below: both decoders must agree before the loop can vouch for anything.
    codes = torch.arange(256, dtype=torch.uint8)
    for fmt, dt in (("fnuz", torch.float8_e4m3fnuz), ("ocp", torch.float8_e4m3fn)):
        got = codes.view(dt).to(torch.float64).numpy()
        np.testing.assert_array_equal(got, LUT[fmt])
    assert LUT["fnuz"][0x7F] == 240.0 and LUT["ocp"][0x7E] == 448.0


def loop_reference(query, k_cache, v_cache, block_tables, context_lengths, k_scale, v_scale, fmt,
                   query_length=1, softmax_scale=None, sliding_window=0):
    """Token by token: look up each token's page, decode, score, softmax in float64."""
    q = query.to(torch.float64).numpy()
    kc = k_cache.view(torch.uint8).numpy()
    vc = v_cache.view(torch.uint8).numpy()
    bt = block_tables.numpy()
    ctx = context_lengths.numpy()
    ks = k_scale.numpy().astype(np.float64)
    vs = v_scale.numpy().astype(np.float64)
    per_token = ks.ndim == 3
    lut = LUT[fmt]
    rows, hq, d = q.shape
    hkv, bs = kc.shape[1], kc.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = np.zeros((rows, hq, d))
    for s in range(rows // query_length):
        for i in range(query_length):
            row = s * query_length + i
            pos = int(ctx[s]) - query_length + i
            first = max(0, pos - sliding_window + 1) if sliding_window else 0
            for kvh in range(hkv):
                qh = q[row, kvh * group:(kvh + 1) * group]  # the q heads sharing this kv head
                scores, values = [], []
                for t in range(first, pos + 1):
                    page, slot = int(bt[s, t // bs]), t % bs
                    k_s = ks[page, kvh, slot] if per_token else ks.reshape(-1)[0]
                    v_s = vs[page, kvh, slot] if per_token else vs.reshape(-1)[0]
                    kvec = lut[kc[page, kvh, slot]] * k_s
                    scores.append(qh @ kvec * scale)
                    values.append(lut[vc[page, kvh, slot]] * v_s)
                sc = np.stack(scores)  # [n_tok, group]
                p = np.exp(sc - sc.max(axis=0))
                p /= p.sum(axis=0)
                out[row, kvh * group:(kvh + 1) * group] = p.T @ np.stack(values)
    return torch.from_numpy(out)


CONFIGS = [
    # (num_seqs, q_heads, kv_heads, head_dim, block_size, contexts, ql, fmt, scales, qdtype, window)
    pytest.param(4, 8, 1, 64, 16, RAGGED_CONTEXTS, 1, "fnuz", "per-tensor", torch.float32, 0, id="gqa8-ragged-fnuz"),
    pytest.param(3, 16, 2, 128, 16, (1, 17, 100), 1, "ocp", "per-token", torch.float32, 0, id="gqa8-pertoken-ocp"),
    pytest.param(3, 4, 4, 64, 64, (4, 70, 300), 4, "fnuz", "per-token", torch.float32, 0, id="mha-ql4-causal"),
    pytest.param(3, 8, 2, 64, 16, (4, 33, 200), 4, "ocp", "per-tensor", torch.float32, 5, id="ql4-window5"),
    pytest.param(2, 4, 1, 32, 16, (1, 50), 1, "fnuz", "per-token", torch.float32, 16, id="window16-pertoken"),
    pytest.param(3, 8, 2, 64, 16, (1, 17, 129), 1, "fnuz", "per-tensor", torch.float16, 0, id="f16-query"),
    pytest.param(2, 8, 4, 64, 64, (65, 200), 4, "ocp", "per-token", torch.bfloat16, 0, id="bf16-query-ql4"),
]


@pytest.mark.parametrize("ns,hq,hkv,d,bs,ctx,ql,fmt,scales,qdt,window", CONFIGS)
def test_matches_per_token_loop(ns, hq, hkv, d, bs, ctx, ql, fmt, scales, qdt, window):
    c = make_case(ns, hq, hkv, d, bs, ctx, query_length=ql, fp8_format=fmt, scales=scales,
                  query_dtype=qdt, seed=hq * 7 + d + ql + window)
    got = c.reference(sliding_window=window)
    assert got.shape == c.query.shape and got.dtype == qdt
    want = loop_reference(c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths, c.k_scale,
                          c.v_scale, fmt, query_length=ql, sliding_window=window)
    if qdt == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want.to(qdt))


def test_custom_softmax_scale_and_uint8_codes():
    c = make_case(2, 8, 2, 64, 16, (5, 40), fp8_format="ocp", scales="per-token", query_dtype=torch.float32, seed=3)
    got = paged_attention_reference(c.query, c.k_cache.view(torch.uint8), c.v_cache.view(torch.uint8),
                                    c.block_tables, c.context_lengths, c.k_scale, c.v_scale,
                                    softmax_scale=0.37, fp8_format="ocp")
    want = loop_reference(c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths, c.k_scale,
                          c.v_scale, "ocp", softmax_scale=0.37)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The same bytes read as the other format are different numbers: the format matters.
    other = paged_attention_reference(c.query, c.k_cache.view(torch.uint8), c.v_cache.view(torch.uint8),
                                      c.block_tables, c.context_lengths, c.k_scale, c.v_scale,
                                      softmax_scale=0.37, fp8_format="fnuz")
    assert not torch.allclose(got, other)


def test_window_of_one_is_the_current_token_value():
    # Convention check: W tokens *including* the current one, so W=1 sees only position pos.
    c = make_case(3, 4, 2, 32, 16, (3, 20, 47), query_length=3, scales="per-token", query_dtype=torch.float32, seed=5)
    got = c.reference(sliding_window=1)
    for s, L in enumerate(c.context_lengths.tolist()):
        for i in range(3):
            pos = L - 3 + i
            page, slot = int(c.block_tables[s, pos // 16]), pos % 16
            for h in range(4):
                kvh = h // 2
                v = c.v_cache[page, kvh, slot].float() * c.v_scale[page, kvh, slot]
                assert torch.equal(got[s * 3 + i, h], v)


def test_window_at_least_context_is_no_window():
    c = make_case(2, 4, 1, 64, 16, (30, 64), query_length=2, query_dtype=torch.float32, seed=6)
    assert torch.equal(c.reference(sliding_window=64), c.reference())
    assert not torch.allclose(c.reference(sliding_window=63), c.reference())


def test_multi_token_rows_equal_single_token_decode_at_their_position():
    # Row i of a ql=4 sequence is a plain decode of that query with context pos+1.
    ql = 4
    c = make_case(2, 8, 2, 64, 16, (9, 37), query_length=ql, scales="per-token", query_dtype=torch.float32, seed=7)
    got = c.reference()
    for s, L in enumerate(c.context_lengths.tolist()):
        for i in range(ql):
            row = s * ql + i
            one = paged_attention_reference(c.query[row:row + 1], c.k_cache, c.v_cache, c.block_tables[s:s + 1],
                                            torch.tensor([L - ql + i + 1], dtype=torch.int32), c.k_scale, c.v_scale)
            torch.testing.assert_close(got[row:row + 1], one, rtol=1e-6, atol=1e-6)


def test_garbage_outside_the_context_never_leaks():
    c = make_case(3, 4, 2, 32, 16, (1, 17, 40), scales="per-token", query_dtype=torch.float32, seed=8,
                  num_blocks=12, max_blocks_per_seq=5, pad_block_id=-1)
    clean = c.reference()
    k = c.k_cache.view(torch.uint8).clone()
    v = c.v_cache.view(torch.uint8).clone()
    used = set()
    for s, L in enumerate(c.context_lengths.tolist()):
        pages = c.block_tables[s, : -(-L // 16)].tolist()
        used.update(pages)
        k[pages[-1], :, L - (len(pages) - 1) * 16:] = 0x80  # fnuz NaN in the tail slots
        v[pages[-1], :, L - (len(pages) - 1) * 16:] = 0x80
    for p in set(range(12)) - used:
        k[p] = 0x80
        v[p] = 0x80
    assert (c.block_tables == -1).any()
    dirty = paged_attention_reference(c.query, k, v, c.block_tables, c.context_lengths, c.k_scale, c.v_scale,
                                      fp8_format="fnuz")
    assert torch.equal(dirty, clean)


def test_per_tensor_scale_forms_agree():
    c = make_case(2, 4, 2, 32, 16, (10, 20), query_dtype=torch.float32, seed=9)
    base = c.reference()
    ks, vs = c.k_scale, c.v_scale
    for kk, vv in ((ks.reshape(()), vs.reshape(())), (float(ks), float(vs))):
        got = paged_attention_reference(c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths, kk, vv)
        assert torch.equal(got, base)
    doubled = paged_attention_reference(c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths, ks, vs * 2)
    torch.testing.assert_close(doubled, base * 2)


# ── argument checking ──

def _args():
    c = make_case(2, 8, 2, 32, 16, (5, 20), query_length=2, scales="per-token", seed=1)
    return dict(query=c.query, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables,
                context_lengths=c.context_lengths, k_scale=c.k_scale, v_scale=c.v_scale, query_length=2)


def _call(a):
    return paged_attention_reference(
        a.pop("query"), a.pop("k_cache"), a.pop("v_cache"), a.pop("block_tables"), a.pop("context_lengths"),
        a.pop("k_scale"), a.pop("v_scale"), **a)


BAD = [
    ("query", TypeError, lambda a: a.update(query=a["query"].to(torch.int32))),
    ("query", TypeError, lambda a: a.update(query=a["query"].numpy())),
    ("query", ValueError, lambda a: a.update(query=a["query"][:, 0])),
    ("query", ValueError, lambda a: a.update(query=a["query"][:3])),
    ("query", ValueError, lambda a: a.update(query=a["query"][:, :5])),  # 5 q heads, 2 kv heads -> not GQA
    ("k_cache", TypeError, lambda a: a.update(k_cache=a["k_cache"].float())),
    ("k_cache", ValueError, lambda a: a.update(k_cache=a["k_cache"].reshape(*a["k_cache"].shape[:3], 2, 16))),
    ("k_cache", ValueError, lambda a: a.update(k_cache=a["k_cache"][..., :16], v_cache=a["v_cache"][..., :16])),
    ("v_cache", TypeError, lambda a: a.update(v_cache=a["v_cache"].view(torch.float8_e4m3fn))),
    ("v_cache", ValueError, lambda a: a.update(v_cache=a["v_cache"][:1])),
    ("fp8_format", ValueError, lambda a: a.update(k_cache=a["k_cache"].view(torch.uint8),
                                                   v_cache=a["v_cache"].view(torch.uint8))),
    ("fp8_format", ValueError, lambda a: a.update(fp8_format="ocp")),
    ("fp8_format", ValueError, lambda a: a.update(k_cache=a["k_cache"].view(torch.uint8),
                                                   v_cache=a["v_cache"].view(torch.uint8), fp8_format="e4m3")),
    ("block_tables", TypeError, lambda a: a.update(block_tables=a["block_tables"].float())),
    ("block_tables", ValueError, lambda a: a.update(block_tables=a["block_tables"][:1])),
    ("block_tables", ValueError, lambda a: a["block_tables"].__setitem__((1, 1), 999)),
    ("block_tables", ValueError, lambda a: a["block_tables"].__setitem__((0, 0), -1)),
    ("context_lengths", TypeError, lambda a: a.update(context_lengths=a["context_lengths"].float())),
    ("context_lengths", ValueError, lambda a: a.update(context_lengths=a["context_lengths"][:1])),
    ("context_lengths", ValueError, lambda a: a["context_lengths"].__setitem__(0, 1)),  # < query_length
    ("context_lengths", ValueError, lambda a: a["context_lengths"].__setitem__(1, 10_000)),
    ("k_scale", TypeError, lambda a: a.update(k_scale=a["k_scale"].half())),
    ("k_scale", ValueError, lambda a: a.update(k_scale=a["k_scale"][:, :, :8])),
    ("v_scale", ValueError, lambda a: a.update(v_scale=torch.ones(2, dtype=torch.float32))),
    ("v_scale", TypeError, lambda a: a.update(v_scale="1.0")),
    ("query_length", ValueError, lambda a: a.update(query_length=0)),
    ("query_length", TypeError, lambda a: a.update(query_length=2.0)),
    ("sliding_window", ValueError, lambda a: a.update(sliding_window=-1)),
    ("softmax_scale", ValueError, lambda a: a.update(softmax_scale=float("nan"))),
    ("softmax_scale", TypeError, lambda a: a.update(softmax_scale="0.1")),
]


def test_valid_args_pass():
    assert _call(_args()).shape == (4, 8, 32)


@pytest.mark.parametrize("name,exc,mutate", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_argument_is_named(name, exc, mutate):
    a = _args()
    mutate(a)
    with pytest.raises(exc) as info:
        _call(a)
    assert str(info.value).startswith(name + ":"), str(info.value)


# ── fp8_error_bound: what a kernel doing this package's fp8 arithmetic must meet ──

def _model_case(fmt, scales="per-tensor", seed=1):
    # stage 4's numerics_model (a torch model of the kernels' exact roundings) takes blocked K
    return make_case(len(RAGGED_CONTEXTS), 8, 1, 128, 16, list(RAGGED_CONTEXTS), fp8_format=fmt, scales=scales,
                     seed=seed, pad_block_id=-1)


def _bound(case, **kw):
    return case.error_bound(out_dtype=torch.float32, **kw)


@pytest.mark.parametrize("scales", ["per-tensor", "per-token"])
@pytest.mark.parametrize("fmt,arch", [("fnuz", "gfx942"), ("ocp", "gfx950")])
def test_the_kernels_rounding_model_is_inside_the_bound(fmt, arch, scales):
    from pa_tile.reference import within_bound
    from pa_tile.stages import s4_blocked_layouts as s4

    for seed in (1, 2, 3):
        case = _model_case(fmt, scales, seed)
        model = s4.numerics_model(case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables,
                                  case.context_lengths, case.k_scale, case.v_scale, arch=arch)
        ref, bound = _bound(case)
        ok, worst = within_bound(model, ref, bound)
        assert ok, f"seed {seed}: the model is {worst:.3f}x the bound"
        assert worst > 0.2  # not vacuous: the model's own error uses a good part of it


def test_the_bound_is_narrow_for_long_rows_and_wide_for_few_tokens():
    case = _model_case("fnuz")
    ref, bound = _bound(case)
    v = case.v_cache.float().abs().mean() * float(case.v_scale)
    per_seq = bound.amax(dim=(1, 2))
    # 1027 tokens: about 2^-4 of the mean |v| plus the query's computed effect, far under the
    # old flat 0.1; one token: 2^-4 of that token's |v| (no averaging)
    assert per_seq[3] < 0.1 and bound[3].mean() < 2 * 2.0**-4 * v
    assert per_seq[0] > per_seq[3]


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_the_bound_rejects_a_lost_token_and_a_wrong_v_scale(fmt):
    from pa_tile.reference import within_bound

    case = _model_case(fmt)
    ref, bound = _bound(case)
    kw = dict(fp8_format=fmt)
    args = (case.query, case.k_cache, case.v_cache, case.block_tables)
    short = case.context_lengths.clone()
    short[1] -= 1  # the 17-token sequence loses its last token
    lost = paged_attention_reference(*args, short, case.k_scale, case.v_scale, **kw).float()
    assert not within_bound(lost[1:2], ref[1:2], bound[1:2])[0]
    scaled = paged_attention_reference(*args, case.context_lengths, case.k_scale, case.v_scale * 1.125, **kw)
    assert not within_bound(scaled.float(), ref, bound)[0]
    assert within_bound(ref, ref, bound)[0]


def test_kernel_query_rounds_each_row_to_e4m3_at_its_own_scale():
    from pa_tile.fp8 import FP8_MAX
    from pa_tile.reference import kernel_query

    q = torch.tensor([[[1.0, -3.0, 0.1, 2.0]], [[0.0, 0.0, 0.0, 0.0]]], dtype=torch.float16)
    got = kernel_query(q, "ocp")
    # row 0: amax 3 lands on 448. e4m3 steps: 1 in [8, 16), 16 in [128, 256), 32 in [256, 448]
    codes = {1: -448, 0: 144, 3: 288, 2: 15}  # -3, 149.3 -> 144, 298.7 -> 288, 14.93 -> 15
    for i, c in codes.items():
        assert float(got[0, 0, i]) == pytest.approx(c * 3 / FP8_MAX["ocp"], rel=2e-7)
    assert torch.equal(got[1], torch.zeros(1, 4))  # an all-zero row stays zero (tiny scale, no NaN)
