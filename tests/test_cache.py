"""pa_tile.cache: fp8 helpers, layout builders/inverses, make_case."""

import math

import pytest
import torch

from pa_tile import cache as C
from pa_tile.cache import (
    FP8_MAX, RAGGED_CONTEXTS, dequantize, fp8_decode, from_k_blocked, from_v_plain, from_v_trans_blocked,
    layout_index, layout_shape, make_case, quantize_fp8, to_k_blocked, to_v_plain, to_v_trans_blocked,
)
from pa_tile.reference import paged_attention_reference


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


# ── fp8 helpers ──

@pytest.mark.parametrize("fmt,code,value", [
    ("fnuz", 0x40, 1.0), ("ocp", 0x38, 1.0),
    ("fnuz", 0x7F, 240.0), ("ocp", 0x7E, 448.0),
    ("fnuz", 0xFF, -240.0), ("ocp", 0xFE, -448.0),
    ("fnuz", 0x01, 2.0 ** -10), ("ocp", 0x01, 2.0 ** -9),  # smallest subnormals
    ("fnuz", 0x00, 0.0), ("ocp", 0x80, -0.0),
])
def test_fp8_decode_known_codes(fmt, code, value):
    got = fp8_decode(torch.tensor([code], dtype=torch.uint8), fmt)
    assert got.dtype == torch.float32 and got.item() == value
    assert math.copysign(1, got.item()) == math.copysign(1, value)


@pytest.mark.parametrize("fmt,nan_codes", [("fnuz", [0x80]), ("ocp", [0x7F, 0xFF])])
def test_fp8_nan_codes(fmt, nan_codes):
    vals = fp8_decode(torch.arange(256, dtype=torch.uint8), fmt)
    assert torch.isnan(vals).nonzero().flatten().tolist() == nan_codes
    assert vals[~torch.isnan(vals)].abs().max().item() == FP8_MAX[fmt]


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_quantize_saturates_and_rounds_to_nearest_even(fmt):
    m = FP8_MAX[fmt]
    x = torch.tensor([1e4, -1e4, m * 1.03, float("inf"), 1.0625, 1.1875, -1.0625, 0.0])
    got = dequantize(quantize_fp8(x, fmt, 1.0))
    # 1.0625 is halfway between 1.0 and 1.125 (even mantissa: 1.0); 1.1875 between 1.125 and 1.25.
    assert got.tolist() == [m, -m, m, m, 1.0, 1.25, -1.0, 0.0]
    assert quantize_fp8(x, fmt, 1.0).dtype == C.fp8_dtype(fmt)


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_every_finite_code_round_trips_through_a_scale(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    vals = fp8_decode(codes, fmt)
    keep = ~torch.isnan(vals) & ~((vals == 0) & (codes == 0x80))  # -0 (OCP) re-encodes as +0 or -0: skip
    scale = 0.0078125  # a power of two keeps x / scale exact
    back = quantize_fp8(vals[keep] * scale, fmt, scale).view(torch.uint8)
    assert torch.equal(back, codes[keep])


def test_per_row_scale_and_dequantize():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g) * torch.tensor([1.0, 10.0, 100.0]).reshape(3, 1, 1)
    s = C.amax_scale(x, "ocp", per_row=True)
    assert s.shape == (3, 5) and s.dtype == torch.float32
    q = quantize_fp8(x, "ocp", s)
    assert torch.equal(q.float().abs().amax(-1), torch.full((3, 5), 448.0))
    y = dequantize(q, scale=s)
    assert torch.allclose(y, x, rtol=0.0625, atol=0)  # e4m3: 3 mantissa bits, half-ulp <= 1/16 relative
    assert torch.equal(dequantize(q.view(torch.uint8), "ocp", s), y)


def test_fp8_helper_errors_name_argument():
    x = torch.ones(2, 4)
    cases = [
        ("fmt", ValueError, lambda: quantize_fp8(x, "e5m2", 1.0)),
        ("x", TypeError, lambda: quantize_fp8(torch.ones(2, dtype=torch.int32), "ocp", 1.0)),
        ("scale", ValueError, lambda: quantize_fp8(x, "ocp", torch.ones(3))),
        ("scale", TypeError, lambda: quantize_fp8(x, "ocp", torch.ones(2, dtype=torch.float16))),
        ("codes", ValueError, lambda: fp8_decode(torch.zeros(4, dtype=torch.uint8))),
        ("codes", TypeError, lambda: fp8_decode(torch.zeros(4))),
        ("codes", ValueError, lambda: fp8_decode(torch.zeros(4).to(torch.float8_e4m3fn), "fnuz")),
        ("dtype", TypeError, lambda: C.fp8_format_of(torch.float16)),
    ]
    for name, exc, fn in cases:
        with pytest.raises(exc) as info:
            fn()
        assert str(info.value).startswith(name + ":"), str(info.value)


# ── layouts ──

def _ids(nb, h, bs, d):
    return torch.arange(nb * h * bs * d, dtype=torch.int32).reshape(nb, h, bs, d)


@pytest.mark.parametrize("bs,d", [(16, 64), (64, 128), (32, 16)])
def test_layouts_place_every_element_where_documented(bs, d):
    nb, h = 3, 2
    logical = _ids(nb, h, bs, d)
    b, hh, t, dd = (i.flatten() for i in torch.meshgrid(
        torch.arange(nb), torch.arange(h), torch.arange(bs), torch.arange(d), indexing="ij"))
    want = logical[b, hh, t, dd]
    built = {
        "k_plain": logical,
        "k_blocked": to_k_blocked(logical),
        "v_plain": to_v_plain(logical),
        "v_trans_blocked": to_v_trans_blocked(logical),
    }
    for name, x in built.items():
        assert tuple(x.shape) == layout_shape(name, nb, h, bs, d), name
        assert x.is_contiguous(), name
        assert torch.equal(x[layout_index(name, b, hh, t, dd)], want), name
    # Spot-check the headline claims independently of layout_index.
    kb = built["k_blocked"]
    assert kb[1, 1, 0, 5].tolist() == logical[1, 1, 5, :16].tolist()  # 16 channels of one token, contiguous
    vt = built["v_trans_blocked"]
    assert vt[2, 0, 0, 7].tolist() == logical[2, 0, :16, 7].tolist()  # 16 tokens of one channel, contiguous


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn, torch.uint8, torch.float32])
def test_layout_round_trips_are_bit_exact(dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (5, 2, 32, 64), generator=g, dtype=torch.uint8)  # includes NaN codes
    x = raw.view(dtype) if dtype != torch.float32 else torch.randn(5, 2, 32, 64, generator=g)
    for to, back in ((to_k_blocked, from_k_blocked), (to_v_plain, from_v_plain),
                     (to_v_trans_blocked, from_v_trans_blocked)):
        y = back(to(x))
        assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
        assert torch.equal(_bytes(y), _bytes(x)) if dtype != torch.float32 else torch.equal(y, x)


def test_layout_errors_name_argument():
    ok = torch.zeros(2, 1, 16, 64)
    cases = [
        ("k", ValueError, lambda: to_k_blocked(torch.zeros(2, 1, 16, 40))),
        ("k", ValueError, lambda: to_k_blocked(torch.zeros(16, 64))),
        ("k", TypeError, lambda: to_k_blocked(ok.numpy())),
        ("kb", ValueError, lambda: from_k_blocked(torch.zeros(2, 1, 4, 16, 8))),
        ("kb", ValueError, lambda: from_k_blocked(ok)),
        ("v", ValueError, lambda: to_v_trans_blocked(torch.zeros(2, 1, 8, 64))),
        ("v", ValueError, lambda: to_v_plain(torch.zeros(2, 16, 64))),
        ("vp", ValueError, lambda: from_v_plain(torch.zeros(2, 1, 4, 16, 16))),
        ("vt", ValueError, lambda: from_v_trans_blocked(ok)),
        ("layout", ValueError, lambda: layout_shape("k_weird", 1, 1, 16, 64)),
    ]
    for name, exc, fn in cases:
        with pytest.raises(exc) as info:
            fn()
        assert str(info.value).startswith(name + ":"), str(info.value)


# ── make_case ──

def _all_tensors(c):
    return [c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths, c.k_scale, c.v_scale]


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


@pytest.mark.parametrize("scales", ["per-tensor", "per-token"])
def test_make_case_is_deterministic_by_seed(scales):
    args = (4, 8, 2, 64, 16, RAGGED_CONTEXTS)
    a = make_case(*args, scales=scales, seed=3)
    b = make_case(*args, scales=scales, seed=3)
    c = make_case(*args, scales=scales, seed=4)
    assert all(_same(x, y) for x, y in zip(_all_tensors(a), _all_tensors(b)))
    for x, y in zip(_all_tensors(a)[:4], _all_tensors(c)[:4]):
        assert not _same(x, y)


def test_pages_are_shuffled_distinct_and_cover_the_pool():
    c = make_case(4, 8, 1, 64, 16, RAGGED_CONTEXTS, seed=0)
    need = [math.ceil(L / 16) for L in RAGGED_CONTEXTS]
    assert c.block_tables.dtype == torch.int32 and c.context_lengths.dtype == torch.int32
    assert tuple(c.block_tables.shape) == (4, max(need)) == (4, c.max_blocks_per_seq)
    assert c.num_blocks == sum(need) == c.k_cache.shape[0]
    used = torch.cat([c.block_tables[s, :n] for s, n in enumerate(need)])
    assert sorted(used.tolist()) == list(range(c.num_blocks))  # a permutation of the pool
    assert used.tolist() != list(range(c.num_blocks))
    longest = c.block_tables[3, :need[3]]
    assert (longest[1:] - longest[:-1] != 1).sum() > need[3] // 2  # consecutive pages mostly not adjacent
    # Unused entries default to valid page ids.
    pad = torch.cat([c.block_tables[s, n:] for s, n in enumerate(need)])
    assert pad.numel() > 0 and ((pad >= 0) & (pad < c.num_blocks)).all()


def test_pad_block_id_and_larger_pool():
    c = make_case(3, 4, 2, 32, 16, (1, 17, 40), num_blocks=20, max_blocks_per_seq=6, pad_block_id=-1, seed=2)
    need = [1, 2, 3]
    assert tuple(c.block_tables.shape) == (3, 6) and c.k_cache.shape[0] == 20
    used = torch.cat([c.block_tables[s, :n] for s, n in enumerate(need)]).tolist()
    assert len(set(used)) == len(used) == 6 and all(0 <= p < 20 for p in used)
    assert all((c.block_tables[s, n:] == -1).all() for s, n in enumerate(need))


@pytest.mark.parametrize("fmt", ["fnuz", "ocp"])
def test_scales_use_the_fp8_range(fmt):
    nb_h_bs = None
    for scales in ("per-tensor", "per-token"):
        c = make_case(2, 4, 2, 64, 16, (20, 45), fp8_format=fmt, scales=scales, seed=5)
        assert c.k_cache.dtype == c.v_cache.dtype == C.fp8_dtype(fmt) and c.fp8_max == FP8_MAX[fmt]
        assert c.k_cache.shape == (c.num_blocks, 2, 16, 64) and c.k_scale.dtype == torch.float32
        for codes, scale in ((c.k_cache, c.k_scale), (c.v_cache, c.v_scale)):
            mags = codes.float().abs()
            assert not torch.isnan(mags).any()
            if scales == "per-tensor":
                assert tuple(scale.shape) == (1,) and mags.max().item() == FP8_MAX[fmt]
            else:
                nb_h_bs = (c.num_blocks, 2, 16)
                assert tuple(scale.shape) == nb_h_bs
                assert torch.equal(mags.amax(-1), torch.full(nb_h_bs, FP8_MAX[fmt]))
            x = dequantize(codes, scale=scale)
            assert 0.85 < x.std().item() < 1.15 and abs(x.mean().item()) < 0.1  # ~N(0, 1)
    assert nb_h_bs is not None


def test_tail_slots_hold_data():
    # Slots past the context in a last page are finite, non-zero garbage: a missing mask must show.
    c = make_case(1, 2, 1, 32, 16, 17, seed=0)
    last = int(c.block_tables[0, 1])
    tail = c.k_cache[last, :, 1:].float()
    assert torch.isfinite(tail).all() and (tail != 0).any()


def test_case_metadata_and_reference():
    c = make_case(2, 8, 2, 64, 16, (6, 30), query_length=3, fp8_format="ocp", scales="per-token",
                  query_dtype=torch.bfloat16, seed=9)
    assert (c.num_seqs, c.num_q_heads, c.num_kv_heads, c.head_dim, c.block_size) == (2, 8, 2, 64, 16)
    assert (c.query_length, c.query_group_size, c.fp8_format, c.scales, c.seed) == (3, 4, "ocp", "per-token", 9)
    assert c.per_token and c.query.shape == (6, 8, 64) and c.query.dtype == torch.bfloat16
    assert c.context_lengths.tolist() == [6, 30]
    out = c.reference(sliding_window=4)
    direct = paged_attention_reference(c.query, c.k_cache, c.v_cache, c.block_tables, c.context_lengths,
                                       c.k_scale, c.v_scale, query_length=3, sliding_window=4)
    assert torch.equal(out, direct) and out.dtype == torch.bfloat16
    assert torch.equal(from_k_blocked(c.k_blocked()).view(torch.uint8), c.k_cache.view(torch.uint8))
    assert torch.equal(from_v_plain(c.v_plain()).view(torch.uint8), c.v_cache.view(torch.uint8))
    assert torch.equal(from_v_trans_blocked(c.v_trans_blocked()).view(torch.uint8), c.v_cache.view(torch.uint8))
    assert "PagedCase(" in repr(c) and "tensor(" not in repr(c)


def test_make_case_errors_name_argument():
    base = dict(num_seqs=2, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, context_lengths=(5, 20))
    cases = [
        ("num_q_heads", ValueError, dict(num_q_heads=6, num_kv_heads=4)),
        ("head_dim", ValueError, dict(head_dim=0)),
        ("block_size", TypeError, dict(block_size=16.0)),
        ("context_lengths", ValueError, dict(context_lengths=(5, 20, 7))),
        ("context_lengths", ValueError, dict(context_lengths=(2, 20), query_length=3)),
        ("context_lengths", ValueError, dict(context_lengths=(0, 20))),
        ("fp8_format", ValueError, dict(fp8_format="e4m3")),
        ("scales", ValueError, dict(scales="per-block")),
        ("query_dtype", TypeError, dict(query_dtype=torch.int8)),
        ("num_blocks", ValueError, dict(num_blocks=2)),
        ("max_blocks_per_seq", ValueError, dict(max_blocks_per_seq=1)),
        ("pad_block_id", ValueError, dict(pad_block_id=-2)),
        ("pad_block_id", ValueError, dict(pad_block_id=3)),  # pool is exactly 3 pages
    ]
    for name, exc, over in cases:
        with pytest.raises(exc) as info:
            make_case(**{**base, **over})
        assert str(info.value).startswith(name + ":"), str(info.value)
