"""Ragged query rows (``query_start_loc``): sequence s has ``q_s = loc[s+1] - loc[s]`` queries
(0..8, 0 skipped), the last q_s positions of its context, causally masked. Checked in the emulator
against an independent float32 reference written here (and ``pa_tile.reference``'s, which it must
equal), within ``pa_tile.reference.fp8_error_bound``; split and unsplit, both schedules, windows and
per-token scales, gfx942 and gfx950. Also: bad ``query_start_loc`` is refused, named, before any
launch; uniform calls compile to the same machine code as before the ragged path existed; the op
compiles under ``torch.compile(fullgraph=True)`` and passes ``opcheck``; traffic stays within
1.05x of compulsory on a ragged batch."""

import dataclasses

import pytest
import torch

import pa_tile
from pa_tile import backend, cache, launching, toolchain
from pa_tile.reference import fp8_error_bound, paged_attention_reference, within_bound
from pa_tile.stages import s6_split_k as s6

from attention_by_hand import attend

ARCHS = ("gfx942", "gfx950")
FMT = {"gfx942": "fnuz", "gfx950": "ocp"}
#: mixed query counts 0..8 and contexts (short, a page, tile edges, 3 tiles): a count of 0 with a
#: context of 0 too (a finished sequence), and q_s == ctx_s (a context made of its queries only)
MIXED_Q = (3, 8, 0, 1, 5, 2, 7, 4, 6, 0)
MIXED_CTX = (9, 300, 5, 20, 700, 2, 64, 8, 260, 0)


def _ragged_case(arch, qs, ctx, *, group=8, kvh=1, head_dim=128, block_size=16, scales="per-token", seed=0,
                 query_dtype=torch.float16):
    """``(case, query, loc)``: caches and tables of ``make_case`` for contexts ``ctx`` (0 allowed),
    ``sum(qs)`` query rows drawn here, and ``loc`` int32 [S + 1]."""
    case = cache.make_case(len(ctx), group * kvh, kvh, head_dim, block_size, [max(c, 1) for c in ctx],
                           fp8_format=FMT[arch], scales=scales, seed=seed, pad_block_id=-1, device="cpu")
    case = dataclasses.replace(case, context_lengths=torch.tensor(ctx, dtype=torch.int32))
    loc = torch.tensor([0] + [sum(qs[:i + 1]) for i in range(len(qs))], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed + 100)
    query = torch.randn(int(loc[-1]), group * kvh, head_dim, generator=g).to(query_dtype)
    return case, query, loc


def _args(case, query):
    return (query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)


def check_ragged(out, case, query, loc, sliding_window=0):
    """``out`` within the fp8 bound of the independent reference, row by row of each sequence (the
    bound of each sequence as a uniform call of its own query count)."""
    mine = attend(case, sliding_window, query=query, loc=loc)[0]
    theirs = paged_attention_reference(query.float(), case.k_cache, case.v_cache, case.block_tables,
                                       case.context_lengths, case.k_scale, case.v_scale, query_start_loc=loc,
                                       sliding_window=sliding_window)
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)  # the two references agree
    starts = loc.tolist()
    assert out.shape == query.shape and out.dtype == query.dtype
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        if a == b:
            continue
        _, bound = fp8_error_bound(query[a:b], case.k_cache, case.v_cache, case.block_tables[s:s + 1],
                                   case.context_lengths[s:s + 1], case.k_scale, case.v_scale, query_length=b - a,
                                   sliding_window=sliding_window)
        ok, worst = within_bound(out[a:b], mine[a:b], bound)
        assert ok, f"sequence {s} (q={b - a}, ctx={int(case.context_lengths[s])}): {worst:.3f}x its fp8 bound"


# ---------------------------------------------------------------------------- correctness

MODES = {"unsplit": dict(num_partitions=1), "uniform": dict(num_partitions=3, schedule="uniform"),
         "balanced": dict(num_partitions=2, schedule="balanced")}


@pytest.mark.parametrize("mode,window", [("unsplit", 0), ("unsplit", 40), ("uniform", 0), ("balanced", 0),
                                         ("balanced", 40)])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_lengths_match_the_reference(arch, mode, window):
    """Counts 0..8 mixed (the bound defaults to 8), per-token scales; a window of 40 tokens moves
    each sequence's first tile by its own count."""
    case, query, loc = _ragged_case(arch, MIXED_Q, MIXED_CTX, seed=1 + window)
    out = pa_tile.paged_decode(*_args(case, query), query_start_loc=loc, sliding_window=window, arch=arch,
                               **MODES[mode])
    check_ragged(out, case, query, loc, window)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("q", [1, 8])
def test_all_one_and_all_eight(arch, q):
    """Every sequence with the same count (the bound: its default 8, and q), per-tensor scales: with
    the bound q, the same answer as the uniform call of that query_length, bit for bit."""
    ctx = (40, 300, 1027)
    case, query, loc = _ragged_case(arch, (q,) * 3, ctx, scales="per-tensor", seed=q)
    args = _args(case, query)
    check_ragged(pa_tile.paged_decode(*args, query_start_loc=loc, arch=arch, num_partitions=2), case, query, loc)
    uniform = pa_tile.paged_decode(*args, query_length=q, arch=arch, num_partitions=1)
    ragged = pa_tile.paged_decode(*args, query_start_loc=loc, arch=arch, num_partitions=1, query_length=q)
    assert torch.equal(ragged, uniform)  # same bound, same rows: the same arithmetic


def test_sixteen_heads_at_bound_eight_fill_every_m_tile():
    """group 16 x bound 8 = 128 rows, the kernel's 8 M-tiles; two KV heads, bf16, plain V."""
    qs, ctx = (8, 1, 0, 5), (700, 3, 30, 77)
    case, query, loc = _ragged_case("gfx950", qs, ctx, group=16, kvh=2, scales="per-tensor", seed=5,
                                    query_dtype=torch.bfloat16)
    args = (query, case.k_blocked(), case.v_plain()) + _args(case, query)[3:]
    out = pa_tile.paged_decode(*args, query_start_loc=loc, arch="gfx950", num_partitions=2, schedule="uniform")
    check_ragged(out, case, query, loc)


@pytest.mark.parametrize("resident", [False, True], ids=["m_tiles_1", "resident_loop"])
def test_m_groups_and_the_register_resident_loop(resident, monkeypatch, request):
    """One M-tile per workgroup (4 M-groups at bound 8, group 8: a short sequence's upper groups
    are all padding) and the appendix's register-resident loop (``WIDE_ABOVE``), windowed."""
    from pa_tile.stages import s5_phase_split_mtp as s5

    if resident:
        monkeypatch.setattr(s5, "WIDE_ABOVE", 8)
        s5.build_launcher.cache_clear()  # no launcher of the default split is reused, nor these later
        request.addfinalizer(s5.build_launcher.cache_clear)
    qs, ctx = (8, 1, 0, 5), (300, 3, 30, 77)
    case, query, loc = _ragged_case("gfx942", qs, ctx, seed=11)
    out = pa_tile.paged_decode(*_args(case, query), query_start_loc=loc, arch="gfx942", sliding_window=20,
                               num_partitions=2, schedule="uniform", m_tiles=1 if not resident else None)
    check_ragged(out, case, query, loc, 20)


def test_plan_runs_again_after_the_counts_change_in_place():
    """A plan keeps ``query_start_loc``: new counts written into it (same total rows) take effect
    at the next run (``refresh`` re-lays a balanced split's work list)."""
    case, query, loc = _ragged_case("gfx942", (2, 4, 0), (50, 600, 10), scales="per-tensor", seed=7)
    pl = pa_tile.plan(*_args(case, query), query_start_loc=loc, num_partitions=2, schedule="balanced")
    check_ragged(pl.run(query, case.k_blocked(), case.v_trans_blocked()), case, query, loc)
    loc.copy_(torch.tensor([0, 0, 1, 6], dtype=torch.int32))  # 0, 1 and 5 queries now
    out = pl.refresh().run(query, case.k_blocked(), case.v_trans_blocked())
    check_ragged(out, case, query, loc)


# ---------------------------------------------------------------------------- validation

def _bad(loc_fn, **kw):
    case, query, loc = _ragged_case("gfx942", (2, 3, 1), (10, 40, 5), scales="per-tensor")
    return _args(case, query), loc_fn(loc), kw


BAD = [
    ("dtype", TypeError, "query_start_loc: expected int32", lambda l: l.long()),
    ("float", TypeError, "query_start_loc: expected int32", lambda l: l.float()),
    ("not a tensor", TypeError, "query_start_loc: expected a torch.Tensor", lambda l: l.tolist()),
    ("device", ValueError, "query_start_loc: on meta", lambda l: l.to("meta")),
    ("short", ValueError, "query_start_loc: expected [4]", lambda l: l[:3]),
    ("2-d", ValueError, "query_start_loc: expected [4]", lambda l: l.view(1, 4)),
    ("not from 0", ValueError, "query_start_loc: must start at 0", lambda l: l + 1),
    ("decreasing", ValueError, "query_start_loc: decreases at sequence 1",
     lambda l: torch.tensor([0, 4, 3, 6], dtype=torch.int32)),
    ("past the rows", ValueError, "query_start_loc: ends at 7, but query has 6 rows",
     lambda l: torch.tensor([0, 2, 5, 7], dtype=torch.int32)),
    ("short of the rows", ValueError, "query_start_loc: ends at 5",
     lambda l: torch.tensor([0, 2, 4, 5], dtype=torch.int32)),
    ("over the bound", ValueError, "query_start_loc: sequence 1 has 3 query rows, more than query_length=2",
     None),
    ("over the context", ValueError, "context_lengths: sequence 2 has 5 tokens",
     lambda l: torch.tensor([0, 0, 0, 6], dtype=torch.int32)),
]


@pytest.mark.parametrize("name,exc,msg,fn", BAD, ids=[b[0] for b in BAD])
def test_bad_query_start_loc_is_named_before_any_launch(name, exc, msg, fn, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(launching, "launch", no_launch)
    monkeypatch.setattr(launching, "call", no_launch)
    args, loc, kw = _bad(fn or (lambda l: l), **({"query_length": 2} if fn is None else {}))
    with pytest.raises(exc, match="^" + msg.replace("[", r"\[").replace("]", r"\]")):
        pa_tile.paged_decode(*args, query_start_loc=loc, arch="gfx942", **kw)
    with pytest.raises(exc):  # the plan (and the workspace sizing, for metadata) refuse it alike
        pa_tile.plan(*args, query_start_loc=loc, arch="gfx942", **kw)


def test_the_default_bound_needs_the_rows_rule():
    """query_length defaults to 8 with query_start_loc only where group x 8 <= 128 rows."""
    case, query, loc = _ragged_case("gfx942", (1, 2), (10, 20), group=32, scales="per-tensor")
    with pytest.raises(ValueError, match="^query_length: required with query_start_loc at group 32"):
        pa_tile.plan(*_args(case, query), query_start_loc=loc)
    assert pa_tile.plan(*_args(case, query), query_start_loc=loc, query_length=4).problem.query_length == 4
    with pytest.raises(ValueError, match="largest group for query_length 8 is 16"):
        pa_tile.plan(*_args(case, query), query_start_loc=loc, query_length=8)
    ws = pa_tile.make_workspace(query, case.k_blocked(), case.block_tables, query_start_loc=loc, query_length=2,
                                num_partitions=3, schedule="uniform")
    assert ws.numel() == pa_tile.workspace_size(2, 1, 32, 2, 128, 3, "uniform")


# ---------------------------------------------------------------------------- machine code

def _isa(key, ragged=False):
    arch, bs, hd, g, ql, sc, w, parts, sched = key
    case = cache.make_case(2, g, 1, hd, bs, [300, 40], query_length=ql, fp8_format=FMT[arch], scales=sc,
                           device="cpu")
    a = (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
         case.k_scale, case.v_scale)
    extra = dict(query_start_loc=torch.tensor([0, ql, 2 * ql], dtype=torch.int32), query_length=ql) if ragged else {}
    pipe, args, arch = s6.launch_args(*a, sliding_window=w, num_partitions=parts, schedule=sched, arch=arch, **extra)
    return toolchain.compile_isa(pipe, *args, arch=arch)


# with query_start_loc=None the instructions are those of before: tests/test_machine_code_unchanged.py


def test_ragged_calls_are_their_own_specialization():
    """Both kernels of a ragged split take query_start_loc as their last argument, under their own
    names; neither spills."""
    from pa_tile import isa

    text = _isa(("gfx942", 16, 128, 4, 3, "per-tensor", 0, 4, "balanced"), ragged=True)
    names = isa.kernel_names(text)
    assert "pa_decode_s5_ragged" in names[0] and "pa_reduce_s6_listed_ragged" in names[1]
    for k in (0, 1):
        st = isa.IsaStats.from_asm(text, kernel=k)
        assert st.scratch_bytes == 0 and st.vgpr_spill == 0 and st.sgpr_spill == 0


# ---------------------------------------------------------------------------- traffic

@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
def test_ragged_traffic_is_within_the_cap():
    """Loaded bytes (distinct per instruction, vector + scalar) over compulsory ones: K/V once per
    (sequence, KV head) rounded to 256-token tiles, the query rows that exist, page ids, lengths,
    row starts, scales. Padding rows of short sequences load no query and cost no K/V re-read."""
    from pa_tile.emu import launch
    from pa_tile.emu.memory import Trace
    from pa_tile.perf.tracing import compulsory_bytes, report_from_trace
    from pa_tile.perf.roofline import DecodeShape

    qs, ctx = (1, 8, 0, 3), (1027, 900, 700, 1027)
    case, query, loc = _ragged_case("gfx942", qs, ctx, scales="per-tensor", seed=3)
    trace = Trace("gfx942")
    with launch.launch_options(trace=trace):
        out = pa_tile.paged_decode(*_args(case, query), query_start_loc=loc, arch="gfx942", num_partitions=1)
    check_ragged(out, case, query, loc)
    rep = report_from_trace(trace, "ragged")
    loaded = sum(r["distinct_bytes"] for r in rep.vmem if r["op"] == "load") + rep.scalar_load_bytes
    # compulsory: the sequences with queries (one without needs no K/V) at one query each, with the
    # real query rows instead, plus the row starts and the skipped sequence's length
    live = [c for c, q in zip(ctx, qs) if q]
    extra = query.numel() * 2 - len(live) * 8 * 128 * 2 + loc.numel() * 4 + 4

    def need(visible_only):
        return extra + compulsory_bytes(DecodeShape(batch=len(live), context=tuple(live), num_q_heads=8,
                                                    num_kv_heads=1, head_dim=128, block_size=16),
                                        visible_only=visible_only)

    assert loaded >= need(True)  # every visible K/V byte is read
    assert loaded <= 1.05 * need(False), loaded / need(False)


# ---------------------------------------------------------------------------- PyTorch


def test_compiles_fullgraph_with_default_arguments_and_passes_opcheck():
    """In a fresh process: ``torch.compile(fullgraph=True)`` of ``pa_tile.paged_decode(...,
    query_start_loc=loc)`` with every other argument at its default matches eager, and the op with
    ``query_start_loc`` passes ``torch.library.opcheck``."""
    from test_user_path import run_fresh

    out = run_fresh("""
    import torch._dynamo.utils as du
    c = make(contexts=(20, 300, 9), heads=(8, 1))
    loc = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 8, 128, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    def layer(q, k, v, bt, ctx, ks, vs, loc):
        return pa_tile.paged_decode(q * 1.0, k, v, bt, ctx, ks, vs, query_start_loc=loc) + 0.0
    a = (q, c.k_blocked(), c.v_trans_blocked(), c.block_tables, c.context_lengths, c.k_scale, c.v_scale, loc)
    got = torch.compile(layer, fullgraph=True)(*a)
    print("frames", du.counters["stats"]["unique_graphs"])
    assert torch.equal(got, layer(*a))
    op = torch.ops.pa_tile.paged_decode
    k, v = c.k_blocked().view(torch.uint8), c.v_trans_blocked().view(torch.uint8)
    args = (q, k, v, c.block_tables, c.context_lengths, c.k_scale, c.v_scale, torch.empty_like(q))
    print(torch.library.opcheck(op.default, args, dict(query_start_loc=loc, num_partitions=2)))
    """)
    assert "frames 1" in out and out.count("'SUCCESS'") == 4 and "FAIL" not in out, out
