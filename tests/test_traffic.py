"""Traffic against compulsory bytes (issue #12's figure): what a decode call must load at least,
and what the emulator measures a stage loading."""

import pytest

from pa_tile import backend
from pa_tile.perf import tracing
from pa_tile.perf.roofline import DecodeShape


def test_compulsory_bytes_by_hand():
    sh = DecodeShape(batch=2, context=(300, 17), num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    kv_tiles = (512 + 256) * 2 * 64 * 2  # tokens rounded to 256-token tiles x K and V x head_dim x KV heads
    query = 2 * 8 * 64 * 2
    pages = (19 + 2) * 4
    assert tracing.compulsory_bytes(sh) == kv_tiles + query + pages + 2 * 4 + 8
    kv_visible = (300 + 17) * 2 * 64 * 2
    assert tracing.compulsory_bytes(sh, visible_only=True) == kv_visible + query + pages + 2 * 4 + 8
    tok = DecodeShape(batch=2, context=(300, 17), num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                      scales="per-token")
    assert tracing.compulsory_bytes(tok) - tracing.compulsory_bytes(sh) == (512 + 256) * 2 * 2 * 4 - 8


def test_distinct_bytes_counts_a_broadcast_once():
    import numpy as np

    from pa_tile.emu.memory import distinct_bytes

    mask = np.ones(64, bool)
    assert distinct_bytes(np.full(64, 4096), mask, 4) == 4  # every lane loads one page id
    assert distinct_bytes(np.arange(64) * 16, mask, 16) == 1024  # a dwordx4 row, no overlap
    assert distinct_bytes(np.arange(64) * 8, mask, 16) == 63 * 8 + 16  # half-overlapping lanes
    assert distinct_bytes(np.arange(64) * 16, np.arange(64) < 3, 16) == 48
    assert distinct_bytes(np.zeros(64), np.zeros(64, bool), 16) == 0


@pytest.fixture
def budget_plan(monkeypatch):
    """The plan these pins were made at: the rule-of-thumb split (1 partition for 3 x 1027 tokens at
    these row counts, 2 at 8 rows). The default is now the timing model's (5 partitions, one tile
    each): its extra traffic is pinned apart (``test_the_models_split_costs_its_partials``)."""
    from pa_tile.stages import s6_split_k as s6

    monkeypatch.setattr(s6, "DEFAULT_POLICY", "budget")


def _traffic(arch, group, query_length, scales="per-tensor"):
    sh = DecodeShape(batch=3, context=1027, num_q_heads=group, num_kv_heads=1, head_dim=128, block_size=16,
                     query_length=query_length, scales=scales)
    rep = tracing.trace_stage("s6", sh, arch)
    assert rep.check.ok
    return rep


# The upstream test grid's shape (3 x 1027 tokens, head_dim 128, one KV head; block 16 here), with
# the default plan: measured loaded / compulsory bytes. Compulsory rounds K/V up to whole 256-token
# tiles; the kernel reads only up to the last page, so loading every byte once lands below 1
# (about 1.07x the visible tokens' bytes: the last page, page ids, query).
# The whole grid: query_length 1-4 x group 8/16/32 x both scale kinds x both arches: every
# M-tile in one workgroup, P·V split by head_dim, K/V read once.
ONCE = [(arch, g, ql, sc) for arch in ("gfx942", "gfx950") for g in (8, 16, 32) for ql in (1, 2, 3, 4)
        for sc in ("per-tensor", "per-token")]


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
@pytest.mark.parametrize("arch,group,ql,scales", ONCE)
def test_the_finished_kernel_loads_every_byte_once(arch, group, ql, scales, budget_plan):
    rep = _traffic(arch, group, ql, scales)
    tr = rep.traffic()
    assert tr["loaded_bytes"] >= tr["visible_bytes"] * 0.999  # every visible K/V byte is read
    assert tr["vs_compulsory"] <= 1.05
    assert tr["vs_visible"] <= 1.12
    assert "x the compulsory" in rep.format()


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
def test_capping_m_tiles_per_workgroup_rereads_kv(budget_plan, monkeypatch):
    """The split chapter 5 no longer makes by default: query_length 4 x group 16 = 4 M-tiles as two
    workgroups of two (``m_tiles=2``) reads K/V twice, 1.67x the compulsory bytes."""
    from pa_tile.stages import s5_phase_split_mtp as s5

    plan = s5.plan
    monkeypatch.setattr(s5, "plan", lambda hd, g, ql, m_tiles=None: plan(hd, g, ql, 2 if m_tiles is None else m_tiles))
    s5.build_launcher.cache_clear()
    try:
        tr = _traffic("gfx942", 16, 4).traffic()
    finally:
        s5.build_launcher.cache_clear()
    assert tr["vs_compulsory"] == pytest.approx(1.67, abs=0.02)


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
def test_the_models_split_costs_its_partials():
    """The default plan (the timing model's split: 5 partitions of one tile for 3 x 1027 tokens)
    reads more than the rule of thumb's: each partition re-reads the query and its page ids, and
    the reduce reads the float32 partials back. Pinned, so the price of the model's choice (which it
    predicts ~2x faster at this small batch, chapter 06) stays visible. 8 rows: 951,684 bytes loaded
    instead of 884,040 at the rule's 2 partitions (+8 %; 1.20x the visible bytes instead of 1.11x);
    64 rows: 1.58x the compulsory bytes instead of 0.96x unsplit: K/V are read once either way,
    the reduce reads back 5 partitions x 64 rows x 130 floats per sequence."""
    from pa_tile.stages import s6_split_k as s6

    assert s6.choose_num_partitions(3, 1, 1027, arch="gfx942", group=8) == 5
    tr = _traffic("gfx942", 8, 1).traffic()
    assert tr["loaded_bytes"] >= tr["visible_bytes"] * 0.999
    assert tr["vs_compulsory"] == pytest.approx(0.96, abs=0.02)
    assert tr["vs_visible"] == pytest.approx(1.20, abs=0.02)
    assert _traffic("gfx942", 16, 4).traffic()["vs_compulsory"] == pytest.approx(1.58, abs=0.02)
