"""Groups up to 128 and query_length up to 8, wherever a KV head's rows (group x query_length, MTP
position outer, head inner) fit the kernel's 8 M-tiles of 16 rows: checked in the emulator against
an independent float32 reference written here (and ``pa_tile.reference``'s), within
``pa_tile.reference.fp8_error_bound``, on gfx942 and gfx950, split and unsplit; past the rows a
named ValueError gives the largest group for the query length."""


import pytest
import torch

import pa_tile
from pa_tile import cache, problem
from pa_tile.stages import s5_phase_split_mtp as s5
from pa_tile.stages import s6_split_k as s6

from attention_by_hand import attend

FMT = {"gfx942": "fnuz", "gfx950": "ocp"}


def _case(arch, group, ql, ctx=(260, 33), kvh=1, scales="per-tensor", seed=0, head_dim=128):
    return cache.make_case(len(ctx), group * kvh, kvh, head_dim, 16, list(ctx), query_length=ql,
                           fp8_format=FMT[arch], scales=scales, seed=seed, pad_block_id=-1, device="cpu")


def _args(case):
    return (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)


def _check(out, case, sliding_window=0):
    ref, bound = case.error_bound(out_dtype=out.dtype, sliding_window=sliding_window)
    mine = attend(case, sliding_window)[0]
    torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)  # the two references agree
    ok, worst = pa_tile.reference.within_bound(out, mine, bound)
    assert ok, f"{worst:.3f}x the fp8 bound"


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("group", [48, 64, 71, 128])
def test_wide_groups_at_query_length_one(arch, group):
    """3, 4, 5 (71: not a power of two, a padded last M-tile) and 8 M-tiles in one workgroup."""
    case = _case(arch, group, 1, seed=group)
    _check(pa_tile.paged_decode(*_args(case), num_partitions=1, arch=arch), case)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("group,schedule", [(71, "uniform"), (128, "balanced")])
def test_wide_groups_split(arch, group, schedule):
    """The same with the split (partials and the reduce over 128 rows), per-token scales."""
    case = _case(arch, group, 1, scales="per-token", seed=group + 1)
    _check(pa_tile.paged_decode(*_args(case), num_partitions=2, schedule=schedule, arch=arch), case)


@pytest.mark.parametrize("group,ql,window", [(16, 8, 0), (8, 5, 30), (2, 8, 0)])
def test_query_lengths_up_to_eight(group, ql, window):
    """EAGLE-style drafts: up to 8 query positions (group 16 x 8 = 128 rows), two KV heads."""
    case = _case("gfx950", group, ql, ctx=(300, ql + 1), kvh=2, scales="per-token", seed=ql)
    _check(pa_tile.paged_decode(*_args(case), sliding_window=window, num_partitions=2, schedule="uniform",
                                arch="gfx950"), case, window)


def test_the_rows_rule():
    lim = pa_tile.api.LIMITS
    assert lim.max_rows == 16 * lim.max_m_tiles == 128 and lim.max_query_length == 8 and lim.max_group == 128
    assert [lim.largest_group(ql) for ql in range(1, 9)] == [128, 64, 42, 32, 25, 21, 18, 16]
    assert lim.allows_group(128, 1) and not lim.allows_group(129, 1) and not lim.allows_group(33, 4)
    assert s5.plan(128, 71, 1)[1:] == (5, 5, 1) and s5.plan(128, 16, 8)[1:] == (8, 8, 1)
    assert s6.reduce_geometry(128, 64, 2).ROWS == 128
    with pytest.raises(ValueError, match="group 1..42 at this query_length"):
        s6.reduce_geometry(128, 43, 3)


@pytest.mark.parametrize("group,ql,largest", [(33, 4, 32), (129, 1, 128), (17, 8, 16), (65, 2, 64)])
def test_past_the_rows_a_named_error_gives_the_largest_group(group, ql, largest):
    case = _case("gfx942", group, ql, ctx=(20,))
    with pytest.raises(ValueError, match=rf"^query: num_q_heads={group} must be .*\(the largest group for "
                                         rf"query_length {ql} is {largest}\)"):
        pa_tile.paged_decode(*_args(case), arch="gfx942")
    with pytest.raises(ValueError, match="^query: "):
        problem.describe(*_args(case), limits=s5.LIMITS, query_length=ql)


def test_query_length_nine_is_refused():
    case = _case("gfx942", 2, 9, ctx=(20,))
    with pytest.raises(ValueError, match=r"^query_length: must be in \[1, 8\], got 9"):
        pa_tile.paged_decode(*_args(case), arch="gfx942")


@pytest.mark.parametrize("group,ql", [(71, 1), (128, 1), (16, 8)])
def test_wide_rows_read_kv_once(group, ql):
    """The new row counts (up to 128 a KV head: eight M-tiles in one workgroup) still load every K
    and V byte once: within 1.05x the compulsory bytes, on upstream's grid shape, default plan."""
    from pa_tile import backend
    from pa_tile.perf import tracing
    from pa_tile.perf.roofline import DecodeShape

    if backend.current_backend() != "emu":
        pytest.skip("the trace exists only in the emulator")
    sh = DecodeShape(batch=3, context=1027, num_q_heads=group, num_kv_heads=1, head_dim=128, block_size=16,
                     query_length=ql)
    rep = tracing.trace_stage("s6", sh, "gfx942")
    tr = rep.traffic()
    assert rep.check.ok and tr["loaded_bytes"] >= tr["visible_bytes"] * 0.999 and tr["vs_compulsory"] <= 1.05, tr
