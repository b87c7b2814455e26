"""The serving math in the kernels (chapter 08): attention sinks, the logit soft-cap, the
log-sum-exp out, batch invariance. Each against attention written out in float32, one sequence
and query row at a time from the logical caches (``tests/attention_by_hand.py``, not
``pa_tile.reference``, which it is also checked against), on gfx942 and gfx950 in the emulator; off, the machine code is unchanged."""

import math

import pytest
import torch

import pa_tile
from pa_tile import backend, cache
from pa_tile.fp8 import FP8_MAX
from pa_tile.stages import s6_split_k as s6

from attention_by_hand import attend, tokens

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
CONTEXTS = [1027, 300, 17]  # five tiles, two tiles, part of one: every partition count sees empties


def _case(arch, ql=1, scales="per-tensor", g=8, contexts=CONTEXTS, seed=3, kvh=1):
    return cache.make_case(len(contexts), g * kvh, kvh, 128, 16, contexts, query_length=ql, fp8_format=FMT[arch],
                           scales=scales, seed=seed, pad_block_id=-1)


def _args(case):
    return (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)


def lse_tolerance(case, window=0, cap=None):
    """How far the kernel's LSE may be from the exact one, from fp8 arithmetic: the kernel scores
    a query quantized to e4m3 per row (each element off by at most half an ulp, 2^-4 relative, or
    half a subnormal step, at most 2^-10 x the row scale amax/FP8_MAX), so each logit is off by at
    most ``scale · Σ_d |Δq_d| |k_d|``; the soft-cap is 1-Lipschitz and LSE moves by at most the
    largest logit change. Plus float32 sums and v_exp/v_log ulps (1e-5 relative)."""
    fmax = FP8_MAX[case.fp8_format]
    scale = 1.0 / math.sqrt(case.head_dim)
    ql, G = case.query_length, case.num_q_heads // case.num_kv_heads
    tol = torch.zeros(case.query.shape[:2])
    for s, n in enumerate(case.context_lengths.tolist()):
        k = tokens(case, case.k_cache, case.k_scale, s, n).abs()
        for i in range(ql):
            row = s * ql + i
            q = case.query[row].float().abs()
            dq = q * 2.0**-4 + q.amax(-1, keepdim=True) / fmax * 2.0**-10
            ds = torch.einsum("hgd,htd->hgt", dq.reshape(case.num_kv_heads, G, -1), k) * scale
            tol[row] = ds.amax(-1).reshape(-1)
    return tol


def _check(case, got, want, tol_lse=None, **math_kw):
    """``got`` (out or (out, lse)) against the float32 attention ``want``: the output within the
    fp8 bound (``pa_tile.reference.fp8_error_bound``, which takes the same serving math), the LSE
    within :func:`lse_tolerance`."""
    out, lse = got if isinstance(got, tuple) else (got, None)
    ref = pa_tile.reference.paged_attention_reference(
        case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lengths, case.k_scale,
        case.v_scale, query_length=case.query_length, return_lse=True, **math_kw)
    # the written-out attention and pa_tile.reference agree to float32 rounding
    torch.testing.assert_close(ref[0].float(), want[0].to(ref[0].dtype).float(), rtol=2e-3, atol=1e-3)
    torch.testing.assert_close(ref[1], want[1], rtol=1e-5, atol=1e-5)
    ok, worst, _ = case.check(out, **math_kw)
    assert ok, f"output {worst:.3f}x its fp8 bound"
    if lse is not None:
        err = (lse - want[1]).abs()
        assert torch.isfinite(lse).all() and (err <= tol_lse + 1e-5 * (1 + want[1].abs())).all(), \
            f"lse error {float((err - tol_lse).max()):.3g} past its bound"


@pytest.fixture(scope="module", autouse=True)
def _emulator():
    backend.ensure_backend()


# -------------------------------------------------------------------------------- the matrix

SINKS = torch.linspace(-2.0, 3.0, 8)  # around the scores' range: the sink takes a real share
CAP = 5.0
# (query_length, window, partitions, schedule, scales): every partition count and schedule with
# query_length 1 and 4, with and without a window
MATRIX = [
    (1, 0, 1, None, "per-tensor"),
    (4, 100, 1, None, "per-token"),
    (1, 100, 3, "uniform", "per-token"),
    (4, 0, 3, "uniform", "per-tensor"),
    (1, 0, 3, "balanced", "per-tensor"),
    (4, 100, 2, "balanced", "per-token"),
]


@pytest.mark.parametrize("cfg", MATRIX, ids=lambda c: "ql{}-w{}-P{}-{}-{}".format(*c))
@pytest.mark.parametrize("arch", ARCHS)
def test_sinks_cap_and_lse_together(arch, cfg):
    ql, window, parts, schedule, scales = cfg
    case = _case(arch, ql, scales)
    got = pa_tile.paged_decode(*_args(case), arch=arch, sliding_window=window, num_partitions=parts,
                               schedule=schedule, sinks=SINKS, logits_soft_cap=CAP, return_lse=True)
    want = attend(case, window, SINKS, CAP)
    _check(case, got, want, lse_tolerance(case, window, CAP), sliding_window=window, sinks=SINKS,
           logits_soft_cap=CAP)


@pytest.mark.parametrize("feature", ["sinks", "cap-near", "cap-far", "lse"])
@pytest.mark.parametrize("parts", [1, 3])
def test_each_feature_alone(feature, parts):
    """Each on its own, unsplit and split: a cap of 50 (Gemma 2's) barely bends these scores, 0.5
    saturates nearly all of them (tanh near ±1)."""
    arch = "gfx950" if parts == 1 else "gfx942"
    case = _case(arch, 2, "per-token", seed=5)
    kw = dict(sinks=SINKS) if feature == "sinks" else dict(
        logits_soft_cap={"cap-near": 50.0, "cap-far": 0.5}[feature]) if feature.startswith("cap") else {}
    got = pa_tile.paged_decode(*_args(case), arch=arch, num_partitions=parts, return_lse=feature == "lse", **kw)
    want = attend(case, sinks=kw.get("sinks"), cap=kw.get("logits_soft_cap"))
    _check(case, got, want, lse_tolerance(case), **kw)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_sink_of_minus_infinity_is_no_sink_bit_for_bit(parts):
    case = _case("gfx942", 1)
    plain = pa_tile.paged_decode(*_args(case), arch="gfx942", num_partitions=parts)
    none = pa_tile.paged_decode(*_args(case), arch="gfx942", num_partitions=parts,
                                sinks=torch.full((8,), float("-inf")))
    assert torch.equal(plain, none)


def test_a_sink_far_above_every_score_leaves_zeros_and_a_finite_lse():
    """exp(sink) past float32's range: the output is 0 (its limit) and the LSE the sink, not inf."""
    case = _case("gfx942", 1)
    sinks = torch.full((8,), 200.0)
    for parts in (1, 3):
        out, lse = pa_tile.paged_decode(*_args(case), arch="gfx942", num_partitions=parts, sinks=sinks,
                                        return_lse=True)
        assert torch.equal(out, torch.zeros_like(out))
        torch.testing.assert_close(lse, torch.full_like(lse, 200.0))


def test_the_shared_prefix_and_each_suffix_merge_by_their_lse():
    """Cascade attention: the first 512 tokens (32 pages) as one call, each sequence's own rest as
    another, merged by ``pa_tile.merge_states``, equal attention over the whole context; the sinks
    go to one part only."""
    arch, bs, cut = "gfx950", 16, 512
    case = _case(arch, 1, "per-token", contexts=[1100, 700, 520])
    q, k, v, bt, ctx, ks, vs = _args(case)
    pre = pa_tile.paged_decode(q, k, v, bt[:, : cut // bs].contiguous(), torch.full_like(ctx, cut), ks, vs,
                               arch=arch, return_lse=True, sinks=SINKS)
    suf = pa_tile.paged_decode(q, k, v, bt[:, cut // bs:].contiguous(), ctx - cut, ks, vs, arch=arch,
                               return_lse=True)
    out, lse = pa_tile.merge_states(pre[0].float(), pre[1], suf[0].float(), suf[1])
    want = attend(case, sinks=SINKS)
    # each part within its own fp8 bound; merged, the weights sum to 1, so the bound holds too
    _check(case, (out.to(case.query.dtype), lse), want, lse_tolerance(case), sinks=SINKS)


# -------------------------------------------------------------------------------- batch invariance

def _sub(case, seqs):
    """Sequences ``seqs`` of ``case`` as a batch of their own (the same pages and caches)."""
    idx = torch.tensor(seqs)
    q = case.query.reshape(case.num_seqs, case.query_length, case.num_q_heads, -1)[idx]
    return (q.reshape(-1, case.num_q_heads, q.shape[-1]), case.k_blocked(), case.v_trans_blocked(),
            case.block_tables[idx].contiguous(), case.context_lengths[idx].contiguous(), case.k_scale,
            case.v_scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_invariant_bits_do_not_depend_on_the_batch(arch):
    case = _case(arch, 1, "per-token", contexts=[2600, 40, 1500, 700, 3100], seed=7)
    batches = ([0, 1, 2], [2, 4, 0, 3], [0])
    outs = [pa_tile.paged_decode(*_sub(case, b), arch=arch, batch_invariant=True) for b in batches]
    row = {b[i]: o[i] for b, o in zip(batches, outs) for i in range(len(b))}
    for b, o in zip(batches, outs):
        for i, s in enumerate(b):
            assert torch.equal(o[i], row[s]), (b, s)
    case.assert_matches(torch.stack([row[s] for s in range(case.num_seqs)]))  # and right


def test_batch_invariant_arguments():
    case = _case("gfx942", 1)
    with pytest.raises(ValueError, match="num_partitions"):
        pa_tile.plan(*_args(case), arch="gfx942", batch_invariant=True, num_partitions=3)
    with pytest.raises(ValueError, match="schedule"):
        pa_tile.plan(*_args(case), arch="gfx942", batch_invariant=True, schedule="uniform")
    with pytest.raises(TypeError, match="batch_invariant"):
        pa_tile.plan(*_args(case), arch="gfx942", batch_invariant=1)
    pl = pa_tile.plan(*_args(case), arch="gfx942", batch_invariant=True)
    per = s6.chunk_floor(128, 8, 1)
    assert pl.chunk_tiles == per and pl.schedule == "balanced"
    assert pl.num_partitions == -(-(-(-case.block_tables.shape[1] * 16 // s6.TILE)) // per)


# -------------------------------------------------------------------------------- bad values

def _good():
    c = _case("gfx942", 1)
    return dict(zip(("query", "key_cache", "value_cache", "block_tables", "context_lengths", "key_scale",
                     "value_scale"), _args(c)))


BAD = [
    ("sinks", TypeError, dict(sinks=torch.zeros(8, dtype=torch.float64))),
    ("sinks", ValueError, dict(sinks=torch.zeros(7))),
    ("sinks", ValueError, dict(sinks=torch.zeros(8, 1))),
    ("sinks", ValueError, dict(sinks=torch.zeros(8, device="meta"))),
    ("sinks", TypeError, dict(sinks=[0.0] * 8)),
    ("sinks", ValueError, dict(sinks=torch.tensor([0.0] * 7 + [float("nan")]))),
    ("sinks", ValueError, dict(sinks=torch.tensor([0.0] * 7 + [float("inf")]))),
    ("logits_soft_cap", ValueError, dict(logits_soft_cap=0.0)),
    ("logits_soft_cap", ValueError, dict(logits_soft_cap=-50.0)),
    ("logits_soft_cap", ValueError, dict(logits_soft_cap=float("inf"))),
    ("logits_soft_cap", ValueError, dict(logits_soft_cap=float("nan"))),
    ("logits_soft_cap", TypeError, dict(logits_soft_cap="50")),
    ("logits_soft_cap", TypeError, dict(logits_soft_cap=True)),
    ("return_lse", TypeError, dict(return_lse=1)),
    ("lse", ValueError, dict(return_lse=True, lse=torch.empty(3, 7))),
    ("lse", ValueError, dict(return_lse=True, lse=torch.empty(3, 8, dtype=torch.float16))),
    ("lse", ValueError, dict(return_lse=True, lse=torch.empty(8, 3).t())),
    ("lse", ValueError, dict(return_lse=True, lse=torch.empty(3, 8, device="meta"))),
    ("lse", ValueError, dict(lse=torch.empty(3, 8))),  # a buffer without return_lse=True
    ("batch_invariant", TypeError, dict(batch_invariant="yes")),
]


@pytest.mark.parametrize("name,exc,kw", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_serving_arguments_are_named_before_anything_is_built(name, exc, kw, nothing_built):
    with pytest.raises(exc, match=name):
        pa_tile.paged_decode(**_good(), arch="gfx942", **kw)


def test_run_takes_per_layer_sinks_and_refuses_what_the_plan_cannot(nothing_built):
    g = _good()
    pl = pa_tile.plan(*g.values(), arch="gfx942")
    with pytest.raises(ValueError, match="sinks"):  # the plan's kernel has no sinks
        pl.run(g["query"], g["key_cache"], g["value_cache"], sinks=torch.zeros(8))
    with pytest.raises(ValueError, match="lse"):
        pl.run(g["query"], g["key_cache"], g["value_cache"], lse=torch.empty(3, 8))
    pl = pa_tile.plan(*g.values(), arch="gfx942", sinks=torch.zeros(8))
    with pytest.raises(ValueError, match="sinks"):
        pl.run(g["query"], g["key_cache"], g["value_cache"], sinks=torch.zeros(4))


def test_plan_run_per_layer_sinks_and_lse():
    arch = "gfx950"
    case = _case(arch, 1)
    args = _args(case)
    pl = pa_tile.plan(*args, arch=arch, sinks=torch.zeros(8), return_lse=True, logits_soft_cap=CAP)
    layer2 = -SINKS  # another layer's sinks, given to run
    got = pl.run(*args[:3], sinks=layer2)
    _check(case, got, attend(case, sinks=layer2, cap=CAP), lse_tolerance(case), sinks=layer2, logits_soft_cap=CAP)


# -------------------------------------------------------------------------------- off costs nothing

# the instructions with every option at its default: tests/test_machine_code_unchanged.py


def test_on_the_machine_code_changes_only_where_it_should():
    """Sinks and the LSE live in the epilogue (unsplit) or the reduce (split): a split's partial
    kernel is the same with them; the soft-cap is in the loop, so it changes the partial kernel."""
    arch = "gfx942"
    case = _case(arch, 1)
    plain = pa_tile.plan(*_args(case), arch=arch, num_partitions=3, schedule="uniform")
    served = pa_tile.plan(*_args(case), arch=arch, num_partitions=3, schedule="uniform", sinks=SINKS,
                          return_lse=True)
    capped = pa_tile.plan(*_args(case), arch=arch, num_partitions=3, schedule="uniform", logits_soft_cap=CAP)
    assert served._partial is plain._partial and served._reduce is not plain._reduce
    assert capped._partial is not plain._partial and capped._reduce is plain._reduce


# -------------------------------------------------------------------------------- the PyTorch path

def test_op_opcheck_and_compile_with_each_feature_in_a_fresh_process():
    """What a serving stack does, in a new interpreter: ``opcheck`` of the op with each feature,
    then ``torch.compile(fullgraph=True)`` of ``paged_decode`` (defaults otherwise) with sinks, a
    soft-cap, ``return_lse`` and batch invariance, and of ``Plan.run`` with per-layer sinks; each
    equal to eager, one graph each."""
    from test_user_path import run_fresh

    out = run_fresh("""
    import torch._dynamo.utils as du
    op = torch.ops.pa_tile.paged_decode
    c = make(contexts=(20, 290), heads=(8, 1))
    k, v = c.k_blocked().view(torch.uint8), c.v_trans_blocked().view(torch.uint8)
    sinks = torch.linspace(-1.0, 2.0, 8)
    base = (c.query, k, v, c.block_tables, c.context_lengths, c.k_scale, c.v_scale, torch.empty_like(c.query))
    lse = torch.empty(c.query.shape[:2])
    for kw in (dict(sinks=sinks), dict(logits_soft_cap=5.0), dict(lse=lse), dict(batch_invariant=True),
               dict(sinks=sinks, logits_soft_cap=5.0, lse=lse, num_partitions=2)):
        res = torch.library.opcheck(op.default, base, kw)
        assert all(v == "SUCCESS" for v in res.values()), (kw, res)
    print("opcheck ok")
    a = make()
    x = inputs(a)
    sinks = torch.linspace(-1.0, 2.0, 16)
    for kw in (dict(sinks=sinks), dict(logits_soft_cap=5.0), dict(return_lse=True), dict(batch_invariant=True)):
        def layer(q, k, v, bt, ctx, ks, vs):
            return pa_tile.paged_decode(q * 1.0, k, v, bt, ctx, ks, vs, **kw)
        torch._dynamo.reset()
        got = torch.compile(layer, fullgraph=True)(*x)
        want = layer(*x)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert all(torch.equal(g, w) for g, w in zip(got, want)), kw
        print("compiled", sorted(kw), du.counters["stats"]["unique_graphs"])
    plan = pa_tile.plan(*x, sinks=sinks, return_lse=True)
    def per_layer(q, k, v, s):
        o, l = plan.run(q, k, v, sinks=s)
        return o * 1.0, l + 0.0
    torch._dynamo.reset()
    run = torch.compile(per_layer, fullgraph=True)
    for s in (sinks, -sinks):
        got, want = run(*x[:3], s), plan.run(*x[:3], sinks=s)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    print("plan.run ok")
    """)
    assert "opcheck ok" in out and "plan.run ok" in out and out.count("compiled") == 4, out


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
@pytest.mark.parametrize("parts", [1, 2])
def test_the_serving_math_keeps_the_traffic_within_the_cap(parts):
    """With sinks, soft-cap and LSE on, K/V are still read once: within 1.05x the compulsory bytes
    (the sinks add 4 bytes a row, the LSE is a store), unsplit and split."""
    from pa_tile.emu import launch
    from pa_tile.emu.memory import Trace
    from pa_tile.perf import tracing
    from pa_tile.perf.roofline import DecodeShape

    shape = DecodeShape(batch=3, context=1027, num_q_heads=16, num_kv_heads=2, head_dim=128, block_size=16)
    case = cache.make_case(3, 16, 2, 128, 16, [1027] * 3, fp8_format="fnuz")
    trace = Trace("gfx942")
    with launch.launch_options(trace=trace):
        out, _ = pa_tile.paged_decode(*_args(case), arch="gfx942", num_partitions=parts,
                                      sinks=torch.linspace(-1, 1, 16), logits_soft_cap=CAP, return_lse=True)
    tr = tracing.report_from_trace(trace, "serving math", shape=shape).traffic()
    assert tr["loaded_bytes"] >= tr["visible_bytes"] * 0.999 and tr["vs_compulsory"] <= 1.05, tr


def test_batch_invariant_with_its_own_workspace_allocates_nothing_more():
    """``make_workspace(..., batch_invariant=True)`` sizes the fixed chunks' work list; with ``out``
    and it given, the call's bits are those of the call that allocates."""
    case = _case("gfx950", 1, contexts=[2600, 40, 900])
    args = _args(case)
    ws = pa_tile.make_workspace(case.query, args[1], case.block_tables, arch="gfx950", batch_invariant=True)
    out = torch.empty_like(case.query)
    got = pa_tile.paged_decode(*args, arch="gfx950", batch_invariant=True, out=out, workspace=ws)
    assert got is out and torch.equal(out, pa_tile.paged_decode(*args, arch="gfx950", batch_invariant=True))
    with pytest.raises(ValueError, match="workspace"):
        pa_tile.paged_decode(*args, arch="gfx950", batch_invariant=True, workspace=ws[:8])


@pytest.mark.parametrize("parts,schedule", [(1, None), (2, "balanced")])
def test_the_serving_math_on_ragged_query_rows(parts, schedule):
    """Sinks, soft-cap and LSE with per-sequence draft counts (0 to 4 here, bound 4): the rows of a
    uniform 4-query case that each sequence keeps, against attention written here."""
    arch, counts = "gfx950", [2, 0, 4, 1]
    case = _case(arch, 4, "per-token", contexts=[1027, 300, 520, 17])
    keep = torch.cat([torch.arange(4 - n, 4) + 4 * s for s, n in enumerate(counts)])
    loc = torch.tensor([0, 2, 2, 6, 7], dtype=torch.int32)
    q, *rest = _args(case)
    out, lse = pa_tile.paged_decode(q[keep], *rest, arch=arch, query_start_loc=loc, query_length=4,
                                    num_partitions=parts, schedule=schedule, sinks=SINKS,
                                    logits_soft_cap=CAP, return_lse=True)
    want_out, want_lse = attend(case, sinks=SINKS, cap=CAP)
    ref, bound = case.error_bound(out_dtype=out.dtype, sinks=SINKS, logits_soft_cap=CAP)
    ok, worst = pa_tile.reference.within_bound(out, ref[keep], bound[keep])
    assert ok, f"output {worst:.3f}x its fp8 bound"
    torch.testing.assert_close(ref[keep], want_out[keep], rtol=2e-3, atol=1e-3)
    err = (lse - want_lse[keep]).abs()
    assert (err <= lse_tolerance(case)[keep] + 1e-5 * (1 + want_lse[keep].abs())).all()
