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


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the trace exists only in the emulator")
def test_the_finished_kernel_at_query_length_1_loads_near_the_compulsory_bytes():
    """Measured here (gfx942, 3 x 1027 tokens, group 8, default partitions): 1.19x. Issue #12 asks
    for <= 1.05x; this pins today's figure so a regression (or the fix) shows."""
    sh = DecodeShape(batch=3, context=1027, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    rep = tracing.trace_stage("s6", sh, "gfx942")
    tr = rep.traffic()
    assert rep.check.ok
    assert tr["loaded_bytes"] >= tr["visible_bytes"] * 0.999  # every visible K/V byte is read
    assert tr["vs_compulsory"] == pytest.approx(1.19, abs=0.01)
    assert "x the compulsory" in rep.format()
