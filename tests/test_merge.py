"""pa_tile.merge_states: two attentions over disjoint key sets merge into the attention over their
union, checked against an attention computed over the union directly (float32, written here)."""

import math

import pytest
import torch

import pa_tile


def _attend(q, k, v):
    """float32 attention of q [rows, heads, d] over k/v [rows, n, heads, d]: (out, lse)."""
    s = torch.einsum("rhd,rnhd->rhn", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(s, -1)
    return torch.einsum("rhn,rnhd->rhd", torch.softmax(s, -1), v), lse


def _keys(rows=5, n=70, heads=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, d, generator=g), 3 * torch.randn(rows, n, heads, d, generator=g),
            torch.randn(rows, n, heads, d, generator=g))


@pytest.mark.parametrize("cut", [1, 17, 69])
def test_prefix_and_suffix_merge_to_the_whole_context(cut):
    q, k, v = _keys()
    whole, whole_lse = _attend(q, k, v)
    a, la = _attend(q, k[:, :cut], v[:, :cut])   # e.g. a shared prefix
    b, lb = _attend(q, k[:, cut:], v[:, cut:])   # each sequence's own suffix
    out, lse = pa_tile.merge_states(a, la, b, lb)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)  # float32 rounding of two sums
    torch.testing.assert_close(lse, whole_lse, rtol=1e-6, atol=1e-5)


def test_merge_is_associative_over_three_chunks():
    q, k, v = _keys(seed=1)
    parts = [_attend(q, k[:, i:j], v[:, i:j]) for i, j in ((0, 20), (20, 45), (45, 70))]
    left = pa_tile.merge_states(*pa_tile.merge_states(*parts[0], *parts[1]), *parts[2])
    right = pa_tile.merge_states(*parts[0], *pa_tile.merge_states(*parts[1], *parts[2]))
    whole = _attend(q, k, v)
    for got in (left, right):
        torch.testing.assert_close(got[0], whole[0], rtol=1e-5, atol=1e-5)


def test_an_empty_side_contributes_nothing_whatever_it_holds():
    q, k, v = _keys(rows=3)
    a, la = _attend(q, k, v)
    b = torch.full_like(a, float("nan"))        # an empty partial may hold anything
    lb = torch.full_like(la, float("-inf"))
    out, lse = pa_tile.merge_states(a, la, b, lb)
    assert torch.equal(out, a) and torch.equal(lse, la)
    out, lse = pa_tile.merge_states(b, lb, a, la)
    assert torch.equal(out, a) and torch.equal(lse, la)
    out, lse = pa_tile.merge_states(b, lb, b.clone(), lb.clone())  # no key on either side
    assert torch.equal(out, torch.zeros_like(a)) and torch.equal(lse, lb)


def test_half_precision_outputs_keep_their_dtype():
    q, k, v = _keys(seed=2)
    a, la = _attend(q, k[:, :30], v[:, :30])
    b, lb = _attend(q, k[:, 30:], v[:, 30:])
    out, lse = pa_tile.merge_states(a.half(), la, b.half(), lb)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    # inputs rounded to float16 (2^-11 relative of |out| <= ~3) and the result once more
    torch.testing.assert_close(out.float(), _attend(q, k, v)[0], rtol=0, atol=4e-3)


def test_compiles_fullgraph():
    q, k, v = _keys(rows=2)
    a, la = _attend(q, k[:, :9], v[:, :9])
    b, lb = _attend(q, k[:, 9:], v[:, 9:])
    got = torch.compile(pa_tile.merge_states, fullgraph=True)(a, la, b, lb)
    want = pa_tile.merge_states(a, la, b, lb)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,name", [
    (lambda a, la, b, lb: (a.int(), la, b, lb), "out_a"),
    (lambda a, la, b, lb: (a, la, b[:1], lb), "out_b"),
    (lambda a, la, b, lb: (a, la.double(), b, lb), "lse_a"),
    (lambda a, la, b, lb: (a, la, b, lb[:, :1]), "lse_b"),
    (lambda a, la, b, lb: (a, la, b, [0.0]), "lse_b"),
])
def test_bad_arguments_are_named(change, name):
    q, k, v = _keys(rows=2)
    args = change(*_attend(q, k[:, :9], v[:, :9]), *_attend(q, k[:, 9:], v[:, 9:]))
    with pytest.raises((TypeError, ValueError), match=f"^{name}: "):
        pa_tile.merge_states(*args)
