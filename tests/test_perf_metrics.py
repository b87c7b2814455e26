"""Performance regressions caught without a GPU: the metrics of ``pa_tile.perf.stage_metrics``
(static main-loop length from the compiled code; instructions per 256-token tile, K/V load
width and coalescing, LDS bank conflicts from the emulator trace) pinned per stage and arch.

The EXPECTED numbers were measured with flydsl 0.5.0 (group 8, head_dim 128, pages of 16, one
sequence of one KV head, contexts 1024 and 2048) by ``python -m pa_tile.perf.stage_metrics``,
which prints the entry of any stage. A change that makes a stage slower by these measures fails
here; a change that makes it clearly better fails too, asking for the pin to be lowered, so the
numbers stay the stage's real ones.
"""

import functools

import numpy as np
import pytest

from pa_tile import backend
from pa_tile.perf import adapters, stage_metrics

ARCHS = stage_metrics.ARCHS
IDEAL_KV_BYTES_PER_TILE = 2 * 256 * 128  # K and V of 256 tokens x 128 channels, fp8, one KV head

# loop_static: instructions in the main loop of the compiled code (static, one wave).
# per_tile: dynamic wave-instructions per 256-token tile, all 4 waves (difference of two runs).
# k/v_coalescing: unique bytes / (128 x 128-byte lines touched) over the K/V loads; 1.0 = nothing wasted.
# k/v_bytes_per_load: bytes one wave-wide K/V load requests (1024 = 64 lanes x dwordx4).
# kv_bytes_per_tile: K+V bytes requested per tile (ideal 65536: each byte once).
# lds_degree: worst LDS bank-conflict degree; lds_cycles_per_tile: conflict cycles per tile.
EXPECTED = {
    # s1: Q.K^T with K plain read as dwordx2 by lanes 16 B apart: 4 lanes x 8 B = 32 B of each token's
    # 128-byte row (one 128-byte line) per instruction -> a quarter of each line used,
    # and the LDS softmax round trip: 16-way conflicts, 2432 (gfx942) / 1280 (gfx950) cycles a tile.
    ("s1", "gfx942"): dict(loop_static=808, per_tile=3232, k_coalescing=0.250, v_coalescing=1.000,
                           k_bytes_per_load=512, v_bytes_per_load=512, kv_bytes_per_tile=65536,
                           lds_degree=16, lds_cycles_per_tile=2432.0),
    ("s1", "gfx950"): dict(loop_static=817, per_tile=3268, k_coalescing=0.250, v_coalescing=1.000,
                           k_bytes_per_load=512, v_bytes_per_load=512, kv_bytes_per_tile=65536,
                           lds_degree=16, lds_cycles_per_tile=1280.0),
    # s2-s6 K: a wave's dwordx4 K load reads 64 bytes of each of 16 128-byte lines (stage 3's plain
    # rows, stage 4's blocked 4-lane groups alike) and the wave's next load the other 64: 0.5 a load,
    # every line read whole over the pair (tests/test_stage4.py). V: whole lines, 1.0.
    # s2: register softmax, dwordx4 K/V loads, no LDS in the loop (the 2-way
    # conflict is the one-off merge after it). s2-s4 fold P's exponent margin (kernel_lib.exp_shift)
    # into the exponent's fma, as s5 does: their loops are 18-21 instructions shorter than before it.
    ("s2", "gfx942"): dict(loop_static=269, per_tile=680, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=0.0),
    ("s2", "gfx950"): dict(loop_static=277, per_tile=712, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=0.0),
    # s3: raw dwordx4 loads issued a tile ahead: more registers and loop instructions, same traffic.
    ("s3", "gfx942"): dict(loop_static=306, per_tile=828, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=0.0),
    ("s3", "gfx950"): dict(loop_static=317, per_tile=868, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=0.0),
    # s4: s3's loop on blocked K / trans-blocked V; the merge after the loop is conflict free now.
    ("s4", "gfx942"): dict(loop_static=305, per_tile=824, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=1, lds_cycles_per_tile=0.0),
    ("s4", "gfx950"): dict(loop_static=315, per_tile=860, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=1, lds_cycles_per_tile=0.0),
    # s5: phase-split MTP / wide-GQA kernel at ql 1, group 8 (one M-tile), P·V split across the
    # waves by head_dim (chapter 5). Against the register-resident loop it replaced (271 / 281
    # static, 688 / 728 per tile, no conflict cycles) the loop carries the split's sharing: the row
    # max to a table and back, P to the slab and four spans' P back, two barriers, and the V page
    # id of every span (415 / 425 static, 848 / 888 per tile, V issued after the scores), for 12
    # fewer registers (98 / 4 waves) and a model-predicted faster stage 6. Issuing V with K
    # ("When to load V": one memory wait a tile instead of two, 108 registers, still 4 waves) drops
    # the second wait's sched_barrier and bookkeeping: 409 / 421 static, 824 / 868 per tile. Issuing
    # the first tile's page ids before the query is staged (one memory wait less a workgroup) costs
    # the loop 3 instructions (412 / 424 static, 836 / 880 per tile). The max table's write puts the
    # 16 rows' words on 8 banks twice: degree 2, 8 cycles a tile.
    ("s5", "gfx942"): dict(loop_static=412, per_tile=836, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=8.0),
    ("s5", "gfx950"): dict(loop_static=424, per_tile=880, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=8.0),
    # s6: s5's kernel split into the partitions the default picks (the timing model's table
    # within the traffic cap: 1024 tokens 2, 2048 tokens 3) plus the reduce: per tile it executes
    # ~1.4x s5's instructions (each partition's prologue, merge of the row sums, bounded
    # descriptors and partial store, and the reduce). LDS: the max table's 8 conflict cycles a
    # tile, and the row sums' 8 (the same table after the loop) once per partition, (3 - 2)
    # partitions over 4 tiles: 10 a tile. Laid out as the balanced work list (the default since
    # chapter 07's "Ragged batches"). The reduce merging four partitions a loop iteration (one
    # pass; before, two passes of one each) and V with K: 1197 / 1243 -> 1135 / 1184 per tile; the
    # first tile's page ids before the query's staging, as in s5: 1147 / 1197.
    ("s6", "gfx942"): dict(loop_static=412, per_tile=1147, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=10.0),
    ("s6", "gfx950"): dict(loop_static=424, per_tile=1197, k_coalescing=0.500, v_coalescing=1.000,
                           k_bytes_per_load=1024, v_bytes_per_load=1024, kv_bytes_per_tile=65536,
                           lds_degree=2, lds_cycles_per_tile=10.0),
}

#: Counts may grow by nothing; a drop below 90% of the pin means the pin is stale.
STALE_BELOW = 0.9
COALESCING_SLACK = 0.01

needs_emu = pytest.mark.skipif(
    backend.current_backend() != "emu",
    reason="the trace metrics run in pa_tile's emulator; this process uses the GPU backend "
           "(the CPU tier runs these tests)")


@functools.lru_cache(maxsize=None)
def _static(stage, arch):
    return stage_metrics.static_metrics(stage, arch, 16)


@functools.lru_cache(maxsize=None)
def _trace(stage, arch):
    return stage_metrics.trace_metrics(stage, arch, 16)


def _expected(stage, arch):
    e = EXPECTED.get((stage, arch))
    if e is None:
        try:
            line = stage_metrics.expected_entry(stage, arch)
        except Exception as err:  # noqa: BLE001 - the message still says what is missing
            line = f"(could not measure it here: {type(err).__name__}: {err})"
        pytest.fail(f"stage {stage} on {arch} is present but tests/test_perf_metrics.py has no EXPECTED entry "
                    f"for it: measure it with `python -m pa_tile.perf.stage_metrics --stages {stage}` and add, "
                    f"with a comment on what it shows:\n{line}")
    return e


def _at_most(name, got, pin):
    assert got <= pin, f"{name} regressed: {got} > pinned {pin}"
    assert got >= STALE_BELOW * pin, (f"{name} improved to {got} (pinned {pin}): lower the pin in "
                                      f"tests/test_perf_metrics.py to the new value")


CASES = [(s, a) for s in adapters.stage_names() for a in ARCHS]


@pytest.mark.parametrize("stage,arch", CASES)
def test_main_loop_instruction_count(stage, arch):
    e = _expected(stage, arch)
    s = _static(stage, arch)
    _at_most(f"{stage}/{arch} main-loop instructions", s.loop_instructions, e["loop_static"])


@needs_emu
@pytest.mark.parametrize("stage,arch", CASES)
def test_dynamic_instructions_per_tile(stage, arch):
    e = _expected(stage, arch)
    t = _trace(stage, arch)
    assert t.checks_ok, f"the traced runs must be correct before their counts mean anything: {t.check}"
    _at_most(f"{stage}/{arch} wave-instructions per tile", t.instructions_per_tile, e["per_tile"])


@needs_emu
@pytest.mark.parametrize("stage,arch", CASES)
def test_kv_loads_width_and_coalescing(stage, arch):
    e = _expected(stage, arch)
    t = _trace(stage, arch)
    for tensor, fig in (("k", t.k), ("v", t.v)):
        assert fig["loads"] > 0, f"no {tensor.upper()} loads attributed: the address tagging broke"
        assert fig["coalescing"] >= e[f"{tensor}_coalescing"] - COALESCING_SLACK, (
            f"{tensor.upper()} coalescing regressed: {fig['coalescing']:.3f} < {e[tensor + '_coalescing']}")
        assert fig["bytes_per_load"] >= e[f"{tensor}_bytes_per_load"], (
            f"{tensor.upper()} loads narrowed: {fig['bytes_per_load']} B < {e[tensor + '_bytes_per_load']} B")
    kv = t.k["bytes_per_tile"] + t.v["bytes_per_tile"]
    assert kv <= e["kv_bytes_per_tile"], f"K/V over-fetch: {kv} B per tile > pinned {e['kv_bytes_per_tile']}"
    assert kv >= IDEAL_KV_BYTES_PER_TILE, f"{kv} B per tile is less than the K/V a tile holds: the accounting broke"


@needs_emu
@pytest.mark.parametrize("stage,arch", CASES)
def test_lds_bank_conflicts(stage, arch):
    e = _expected(stage, arch)
    t = _trace(stage, arch)
    assert t.lds_max_degree <= e["lds_degree"], f"LDS conflict degree {t.lds_max_degree} > pinned {e['lds_degree']}"
    assert t.lds_conflict_cycles_per_tile <= e["lds_cycles_per_tile"], (
        f"LDS conflict cycles per tile {t.lds_conflict_cycles_per_tile} > pinned {e['lds_cycles_per_tile']}")
    if e["lds_cycles_per_tile"]:
        assert t.lds_conflict_cycles_per_tile >= STALE_BELOW * e["lds_cycles_per_tile"], (
            f"LDS conflict cycles per tile fell to {t.lds_conflict_cycles_per_tile}: lower the pin")


def test_every_pinned_stage_is_known():
    from pa_tile import stages

    for stage, arch in EXPECTED:
        assert stage in stages.STAGES and arch in ARCHS


# ---------------------------------------------------------------------------------------------
# the measurement itself, on synthetic accesses worked out by hand


def test_tagged_trace_attributes_and_measures_accesses():
    base_k, base_v = 1 << 20, 1 << 21
    tr = stage_metrics._tagged_trace_class()("gfx942", {"K": (base_k, base_k + 4096), "V": (base_v, base_v + 4096)})
    lanes = np.arange(64, dtype=np.uint64)
    mask = np.ones(64, bool)
    tr.global_access("buffer_load_dwordx4", 1, base_k + lanes * 16, mask, 16, kind="buffer")  # 1 KiB contiguous
    tr.global_access("buffer_load_dwordx2", 2, base_v + lanes * 16, mask, 8, kind="buffer")  # 8 of every 16 B
    tr.global_access("buffer_load_dword", 3, np.full(64, base_v, np.uint64), mask, 4, kind="buffer")  # broadcast
    tr.global_access("buffer_load_dword", 4, np.full(64, 64, np.uint64), mask, 4, kind="buffer")  # elsewhere
    half = mask.copy()
    half[32:] = False
    tr.global_access("buffer_store_dword", 5, base_k + lanes * 4, half, 4, kind="buffer", write=True)
    (r1, r2, r3, r4, r5) = tr.tagged
    assert r1 == ("K", "buffer_load_dwordx4", False, 1024, 1024, 8)  # 8 lines, every byte used
    assert r2 == ("V", "buffer_load_dwordx2", False, 512, 512, 8)  # 8 lines, half of each used
    assert r3 == ("V", "buffer_load_dword", False, 256, 4, 1)  # 64 lanes, 4 distinct bytes, one line
    assert r4[0] == "other"
    assert r5 == ("K", "buffer_store_dword", True, 128, 128, 1)
    big = dict(executions=2, bytes=1024 + 512, unique=1024 + 512, lines_128B=16)
    small = dict(executions=1, bytes=1024, unique=1024, lines_128B=8)
    fig = stage_metrics._kv_figures(small, big, tiles=2)
    assert fig == dict(loads=2, bytes_per_load=768.0, lines_128B_per_load=8.0, coalescing=1536 / 2048,
                       bytes_per_tile=256.0)


def test_trace_metrics_rejects_bad_contexts():
    if backend.current_backend() != "emu":
        pytest.skip("needs the emulator backend")
    with pytest.raises(ValueError, match="multiples of 256"):
        stage_metrics.trace_metrics("s2", "gfx942", 16, contexts=(300, 1024))
    with pytest.raises(ValueError, match="increasing"):
        stage_metrics.trace_metrics("s2", "gfx942", 16, contexts=(1024, 256))
