"""The timing model (pa_tile.perf.model): behaviour on small synthetic cases, the predict verb's
output, and the recorded hardware measurements it is validated against."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from pa_tile import backend, isa
from pa_tile.perf import hw, model
from pa_tile.perf.roofline import DecodeShape, time_floor

DATA = Path(__file__).resolve().parents[1] / "pa_tile" / "data" / "pr825_mi300x_timings.json"


def _code(loop_cycles=2000.0, vm_stall=800.0, workgroups_per_cu=2, instructions=200):
    loop = model.WaveProfile(cycles=loop_cycles, issue_cycles=loop_cycles - vm_stall, vm_stall=vm_stall,
                             instructions=instructions, valu=120, mfma=32, vmem=8, max_vm_bytes_in_flight=8192)
    fixed = model.WaveProfile(cycles=3000.0, instructions=400)
    return model.KernelCode("k", "gfx942", 128, 8192, 4, workgroups_per_cu, ("vgpr",), instructions, loop, fixed)


PER_TILE = dict(valu=480.0, mfma=128.0, salu=40.0, waitcnt=40.0, branch=8.0, buffer=64.0, ds=16.0,
                other_bytes=65536.0, other_lines=512.0, lds_bytes=8192.0, lds_conflict_cycles=0.0)


def _predict(shape, gpu=hw.HARDWARE["mi300x"], code=None, partitions=1, per_tile=PER_TILE):
    return model.predict(shape=shape, hw=gpu, per_tile=per_tile, fixed={}, main=code or _code(),
                         waves_per_workgroup=4, partitions=partitions)


SHAPES = [DecodeShape(batch=b, context=c, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
          for b in (1, 16, 128) for c in (256, 4096, 16384)]


def test_faster_memory_never_slower():
    base = hw.HARDWARE["mi300x"]
    for s in SHAPES:
        times = [_predict(s, dataclasses.replace(base, hbm_bytes_per_s=bw)).predicted_us for bw in (2e12, 5.3e12, 10e12)]
        assert times[0] >= times[1] >= times[2], (s.label, times)
    big = SHAPES[-1]
    assert _predict(big, dataclasses.replace(base, hbm_bytes_per_s=2e12)).predicted_us > \
        _predict(big, dataclasses.replace(base, hbm_bytes_per_s=10e12)).predicted_us


def test_more_occupancy_never_slower():
    for s in SHAPES:
        times = [_predict(s, code=_code(workgroups_per_cu=w)).predicted_us for w in (1, 2, 4, 8)]
        assert all(a >= b - 1e-9 for a, b in zip(times, times[1:])), (s.label, times)


def test_more_traffic_never_faster():
    for b in (1, 16, 128):
        times = [_predict(DecodeShape(batch=b, context=c, num_q_heads=8, num_kv_heads=1)).predicted_us
                 for c in (256, 1024, 4096, 16384)]
        assert all(a <= b_ + 1e-9 for a, b_ in zip(times, times[1:])), times
    for c in (1024, 16384):
        times = [_predict(DecodeShape(batch=b, context=c, num_q_heads=8, num_kv_heads=1)).predicted_us
                 for b in (1, 8, 64, 256)]
        assert all(a <= b_ + 1e-9 for a, b_ in zip(times, times[1:])), times


def test_longer_latency_never_faster():
    s = SHAPES[4]
    times = [_predict(s, code=_code(loop_cycles=c, vm_stall=c / 2)).predicted_us for c in (500, 2000, 8000)]
    assert times[0] <= times[1] <= times[2]


def test_never_below_the_hbm_floor():
    fast = dataclasses.replace(hw.HARDWARE["mi300x"], hbm_efficiency=1.0, launch_us=0.0)
    tiny = dict(valu=1.0, other_bytes=1.0, other_lines=0.5)
    for gpu in (fast, hw.HARDWARE["mi355x"]):
        for s in SHAPES:
            p = _predict(s, gpu, code=_code(loop_cycles=1.0, vm_stall=0.0), per_tile=tiny)
            assert p.predicted_us >= time_floor(s, gpu.name).time_us - 1e-9
            assert p.floor_us == pytest.approx(time_floor(s, gpu.name).time_us)


def test_split_adds_a_reduce_and_a_launch():
    s = DecodeShape(batch=1, context=16384, num_q_heads=8, num_kv_heads=1)
    one, four = _predict(s, partitions=1), _predict(s, partitions=4)
    assert "reduce" in four.terms_us and "reduce" not in one.terms_us
    assert four.details["workgroups"] == 4 * one.details["workgroups"]
    assert four.details["tiles_per_workgroup"] == 16  # 64 tiles over 4 partitions


def test_the_reduce_is_charged_one_loop_iteration_per_group_of_partitions():
    """The reduce's loop merges ``items_per_iteration`` partitions (chapter 07's ``REDUCE_GROUP``)
    an iteration: 16 partitions in groups of 4 cost 4 iterations, as many as 4 partitions one at
    a time; the seed versions' reduce (the default, 1) one per partition."""
    s = DecodeShape(batch=1, context=16384, num_q_heads=8, num_kv_heads=1)
    per_one = _code(loop_cycles=5000.0, workgroups_per_cu=8)
    per_four = dataclasses.replace(per_one, items_per_iteration=4)

    def reduce_us(code, parts):
        return model.predict(shape=s, hw=hw.HARDWARE["mi300x"], per_tile=PER_TILE, fixed={}, main=_code(),
                             waves_per_workgroup=4, partitions=parts, reduce=code).terms_us["reduce"]

    assert per_one.items_per_iteration == 1
    clk = hw.HARDWARE["mi300x"].clock_hz
    assert reduce_us(per_one, 16) - reduce_us(per_four, 16) == pytest.approx(12 * 5000.0 / clk * 1e6)
    assert reduce_us(per_four, 13) == pytest.approx(reduce_us(per_four, 16))  # ceil(13 / 4) = 4


def test_waitcnt_walk_hides_latency_behind_work():
    h = hw.HARDWARE["mi300x"]
    load = [("buffer_load_dwordx4", "v[0:3], v4, s[0:3], 0 offen")]
    work = [("v_add_f32_e32", "v5, v5, v6")] * 50
    wait = [("s_waitcnt", "vmcnt(0)")]
    exposed = model.wave_profile(load + wait + work, h)
    hidden = model.wave_profile(load + work + wait, h)
    ta = 16 * 64 / h.ta_bytes_per_clk * 4  # a coalesced dwordx4, issued by the 4 waves of a workgroup
    assert exposed.vm_stall == pytest.approx(h.mem_latency_cycles + ta - h.issue_interval)
    assert hidden.vm_stall == pytest.approx(max(0.0, h.mem_latency_cycles + ta - h.issue_interval - 50 * h.valu_cycles))
    assert hidden.cycles < exposed.cycles
    # a load issued one iteration ahead (prefetch) is waited for in the next: steady state hides it
    pre = model.wave_profile(wait + load + work, h, repeat=3, before=load)
    assert pre.vm_stall < exposed.vm_stall
    # an uncoalesced load (64 segments) returns later than a coalesced one
    assert model.wave_profile(load + wait, h, vmem_segments=64.0).cycles > model.wave_profile(load + wait, h).cycles
    nop = model.wave_profile([("s_nop", "7")], h)
    assert nop.cycles == 8 and nop.nop_cycles == 8


def test_fitted_constants_are_named_and_only_those_fit():
    assert set(hw.FITTED) == {"hbm_efficiency", "mem_latency_cycles", "launch_us", "cu_bytes_in_flight"}
    assert hw.PRIORS["cu_bytes_in_flight"] == 0.0 == hw.HARDWARE["mi308x"].cu_bytes_in_flight  # off by default
    with pytest.raises(ValueError, match="FITTED"):
        hw.with_fitted(hw.HARDWARE["mi300x"], {"compute_units": 1})
    assert hw.with_fitted(hw.HARDWARE["mi300x"], {"launch_us": 3.0}).launch_us == 3.0
    assert hw.hardware("gfx950").name == "MI355X"


def test_validation_data_parses_and_every_point_cites_a_commit():
    data = json.loads(DATA.read_text())
    assert data["gpu"] == "MI300X"
    assert data["shape_assumption"]
    steps = data["steps"]
    assert len(steps) >= 10
    sha = re.compile(r"^[0-9a-f]{40}$")
    for st in steps:
        assert sha.match(st["quoted_in"]) and sha.match(st["before_version"]) and sha.match(st["after_version"])
        assert st["quote"].strip()
        if "before_gap" in st:  # a ratio step: multiples of production's time at the same shape
            assert st["before_gap"] > 0 and st["after_gap"] > 0 and "before_us" not in st and st["note"]
        elif "ratio" in st:  # a partition-count step: one version, two quoted partition counts
            assert st["ratio"] > 0 and st["before_version"] == st["after_version"] and st["note"]
            assert st["before_partitions"] != st["after_partitions"] and "before_us" not in st
        else:
            assert st["after_us"] > 0 and st["before_us"] > 0
        DecodeShape(**st["shape"])  # a valid shape
    points = data["points"]
    assert points and all(sha.match(p["commit"]) and p["quote"].strip() and p["measured_us"] > 0 for p in points)


@pytest.mark.slow
def test_predict_verb_prints_the_contract_line(capsys):
    from pa_tile.__main__ import main

    rc = main(["predict", "--stage", "s6", "--gpu", "mi300x", "--batch", "4", "--context", "2048",
               "--q-heads", "8", "--kv-heads", "1", "--head-dim", "128", "--query-length", "1", "--block-size", "16"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert "PREDICTED" in out[0] and any(line.startswith("bound:") for line in out)
    m = re.fullmatch(r"predicted_us=(\d+\.\d+) floor_us=(\d+\.\d+)", out[-1])
    assert m and float(m.group(1)) >= float(m.group(2)) > 0
    # the part the validation timings come from is a choice too
    assert main(["predict", "--stage", "s6", "--gpu", "mi308x", "--batch", "4", "--context", "2048", "--q-heads", "8",
                 "--kv-heads", "1"]) == 0
    assert "MI308X" in capsys.readouterr().out


ASM = """\
k:
  s_load_dword s4, s[0:1], 0x0
.LBB0_1:
  buffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen
  s_waitcnt vmcnt(0)
  v_add_f32_e32 v5, v5, v6
  s_cbranch_scc1 .LBB0_2
  buffer_load_dword v7, v4, s[0:3], 0 offen
  s_waitcnt vmcnt(0)
  v_add_f32_e32 v5, v5, v7
.LBB0_2:
  ds_swizzle_b32 v8, v5 offset:swizzle(SWAP,16)
  s_cbranch_scc0 .LBB0_1
  s_endpgm
.Lfunc_end0:
"""


def test_block_frequencies_follow_the_sampled_executions():
    lines = ASM.splitlines()
    ln = {text.strip().split()[0] + str(i): i for i, text in enumerate(lines, 1) if text.strip()}
    first, skipped = ln["buffer_load_dwordx44"], ln["buffer_load_dword8"]
    start, end = 3, 13
    # the conditional load ran in a quarter of the iterations: its block (to the label) runs 1/4
    f = model.block_frequencies(ASM, start, end, {first: 8.0, skipped: 2.0})
    assert f[skipped] == pytest.approx(0.25) and f[skipped + 2] == pytest.approx(0.25)
    assert f[first] == 1.0
    # the swizzle touches no LDS memory, the trace records nothing for it: its block counts as run
    assert f[ln["ds_swizzle_b3212"]] == 1.0
    # never ran: skipped; no counts at all: everything walked
    assert model.block_frequencies(ASM, start, end, {first: 8.0})[skipped] == 0.0
    assert set(model.block_frequencies(ASM, start, end, {}).values()) == {1.0}
    # counts move to another build of the same code by instruction sequence
    other = ASM.replace("k:\n", "k:\n  s_mov_b32 s9, 0\n")
    moved = model.map_lines({first: 8.0, skipped: 2.0}, ASM, other, "k", "k")
    assert moved == {first + 1: 8.0, skipped + 1: 2.0}


def _ta_cycles(lane_offsets, nbytes=16):
    import numpy as np

    tr = model.line_trace("gfx942")
    tr.bases = np.array([0], dtype=np.uint64)
    tr.global_access("global_load_dwordx4", 1, np.asarray(lane_offsets, dtype=np.uint64), np.ones(64, bool), nbytes)
    return tr.ta_cycles, tr.lines


def test_addresser_clocks_per_lane_group():
    """64 bytes of request per clock, lanes in order, one clock per distinct 128-byte line of a group."""
    lanes = list(range(64))
    # coalesced dwordx4: 16 clocks, 8 lines
    assert _ta_cycles([16 * l for l in lanes]) == (16, 8)
    # the plain token-major K of the pr-825 seeds: lane l reads token l % 16 (rows 128 B apart) at
    # byte 32 * (l // 16): the wave touches 16 lines, but each 4-lane group 4 of them
    assert _ta_cycles([128 * (l % 16) + 32 * (l // 16) for l in lanes]) == (64, 16)
    # the blocked K (61539270): consecutive lanes 32 B apart: one line per group, same 16 lines per wave
    assert _ta_cycles([4096 * (l // 16) + 32 * (l % 16) for l in lanes]) == (16, 16)
    # a vmem_segments figure follows the per-group count when the sample has it
    assert model.vmem_segments({"buffer": 4.0, "other_ta_cycles": 256.0, "other_lines": 32.0}) == 64.0


def test_tail_wave_is_timed_with_its_own_residency():
    """One workgroup more than a full generation: the tail runs alone, so an issue-bound kernel takes
    less than two full generations (and more than one)."""
    h = hw.HARDWARE["mi300x"]
    issue_bound = dict(PER_TILE, valu=8000.0)
    code = _code(loop_cycles=400.0, vm_stall=0.0, workgroups_per_cu=2)
    one = DecodeShape(batch=h.compute_units * 2, context=4096, num_q_heads=8, num_kv_heads=1)
    tail = DecodeShape(batch=h.compute_units * 3, context=4096, num_q_heads=8, num_kv_heads=1)
    t1 = _predict(one, code=code, per_tile=issue_bound)
    t2 = _predict(tail, code=code, per_tile=issue_bound)
    assert t1.details["generations"] == 1 and t2.details["generations"] == 2
    assert 1.3 * t1.terms_us["cu"] < t2.terms_us["cu"] < 1.9 * t1.terms_us["cu"]


def test_mi308x_is_the_80_cu_gfx942_part_and_has_a_floor():
    h = hw.hardware("mi308x")
    assert (h.compute_units, h.arch, h.hbm_bytes_per_s) == (80, "gfx942", 5.3e12)
    assert hw.hardware("gfx942").name == "MI300X"  # the arch still names MI300X
    s = DecodeShape(batch=128, context=16384, num_q_heads=8, num_kv_heads=1)
    p = _predict(s, gpu=h)
    assert p.floor_us == pytest.approx(time_floor(s, "MI300X").time_us)  # same HBM, same bytes
    assert p.predicted_us >= p.floor_us


def test_a_stage_is_predicted_with_the_split_it_would_pick_on_that_device():
    """``predict_stage`` without ``partitions`` asks the stage's chooser with the device's CU count,
    as ``pa_tile.plan`` does on a GPU: the 80-CU MI308X gets its own table's split (5 at 128 x 16k
    tokens), not the MI300X's (3)."""
    from pa_tile.perf import hw, model
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.stages import s6_split_k as s6

    shape = DecodeShape(batch=128, context=16384, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    picks = {}
    for gpu in ("mi300x", "mi308x"):
        cus = hw.HARDWARE[gpu].compute_units
        picks[gpu] = model._stage_partitions("s6", shape, "gfx942", cus)
        assert picks[gpu] == s6.choose_num_partitions(128, 1, 16384, arch="gfx942", cu_count=cus)
    assert picks["mi308x"] != picks["mi300x"]
    assert model._stage_partitions("s4", shape, "gfx942", 80) == 1  # no split before chapter 07


def test_mva_round_bounds_and_monotonicity():
    """The resident workgroups' round (model.mva_round, exact mean-value analysis): one workgroup
    alone takes its walk (or its units' total, if larger); more take longer per round but never
    less throughput; the round lies between the overlap bound and the no-overlap bound; more
    demand on any unit or a longer walk never makes it faster."""
    for walk, d in ((14000.0, (1700.0, 1100.0, 4100.0)), (3000.0, (1700.0, 1100.0, 4100.0)),
                    (9000.0, (0.0, 0.0, 0.0)), (5000.0, (2500.0,))):
        assert model.mva_round(walk, d, 1) == pytest.approx(max(walk, sum(d)))
        prev_c, prev_x = 0.0, 0.0
        for n in range(1, 9):
            c = model.mva_round(walk, d, n)
            z = max(0.0, walk - sum(d))
            assert max(walk, n * max(d)) - 1e-6 <= c <= z + n * sum(d) + 1e-6, (walk, d, n, c)
            assert c >= prev_c - 1e-9 and n / c >= prev_x - 1e-12
            prev_c, prev_x = c, n / c
        for k in range(len(d)):
            more = tuple(x * 1.5 if i == k else x for i, x in enumerate(d))
            assert model.mva_round(walk, more, 3) >= model.mva_round(walk, d, 3) - 1e-9
        assert model.mva_round(walk * 1.5, d, 3) >= model.mva_round(walk, d, 3) - 1e-9


def test_contention_never_beats_the_overlap_form_nor_the_floor():
    """With the queueing form the prediction is never below the perfect-overlap form of the
    same facts, and never below the HBM floor."""
    old = model.CU_CONTENTION
    try:
        for s in SHAPES:
            for w in (1, 2, 4):
                model.CU_CONTENTION = "max"
                a = _predict(s, code=_code(workgroups_per_cu=w))
                model.CU_CONTENTION = "mva"
                b = _predict(s, code=_code(workgroups_per_cu=w))
                assert b.predicted_us >= a.predicted_us - 1e-9 and b.predicted_us >= b.floor_us
    finally:
        model.CU_CONTENTION = old


def test_utilisation_of_peak_loads_the_latency_less_and_keeps_the_floor():
    """The loaded latency's utilisation taken of the DRAM's peak (the default) is hbm_efficiency
    times the one of the achievable bandwidth, so it never predicts slower than that form, and
    still never below the HBM floor; with both, more bandwidth is never slower."""
    old = model.UTILISATION_OF
    try:
        for s in SHAPES:
            model.UTILISATION_OF = "achievable"
            a = _predict(s)
            model.UTILISATION_OF = "peak"
            b = _predict(s)
            assert b.predicted_us <= a.predicted_us + 1e-9 and b.predicted_us >= b.floor_us
            assert b.details["hbm_utilisation"] <= a.details["hbm_utilisation"] + 1e-9
    finally:
        model.UTILISATION_OF = old


@pytest.mark.skipif(backend.current_backend() != "emu", reason="the sample is an emulator trace")
def test_stage_6_is_sampled_unsplit_with_its_reduce_kernel():
    """The sample's two runs must be the unsplit kernel at both contexts (their difference is the
    per-tile figure), and the reduce comes from a third, split run. Stage 6's ``paged_decode``
    takes ``num_partitions`` through ``**options``; when the sampler did not see it there, the
    runs took the partition table's own split (so the table the model writes fed its own input)
    and the sample had no reduce kernel and no branch frequencies."""
    shape = DecodeShape(batch=1, context=1024, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    smp = model.sample_stage("s6", shape, "gfx950")
    assert smp.reduce_kernel and "pa_reduce" in smp.reduce_kernel and smp.reduce_asm
    assert smp.line_per_tile  # both runs compiled the same (unsplit) kernel
    assert smp.checks_ok


def test_every_line_counted_gives_every_block_its_frequency_and_the_last_tile_its_tail():
    """With every instruction counted by line (``Trace(count_lines=True)``), a block with no memory
    instruction that never ran in the sample (a last-tile fix-up) is skipped by the steady-state
    walk, and walked once in the workgroup's fixed part: its wait for memory is charged once, not
    every tile. Before, such a block counted as run every iteration."""
    body = ("\tbuffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen\n\ts_cmp_eq_u32 s4, 7\n\ts_cbranch_scc0 .LBB0_2\n"
            "\ts_waitcnt vmcnt(0)\n" + "\tv_mul_f32_e32 v5, v5, v0\n" * 20 + ".LBB0_2:\n"
            "\tv_add_f32_e32 v6, v6, v6\n\ts_waitcnt vmcnt(0)\n\tv_add_f32_e32 v5, v5, v1\n")
    asm = _asm_kernel(body)
    lines = asm.splitlines()
    where = {i: text.strip() for i, text in enumerate(lines, 1)}
    loop = isa.IsaStats.from_asm(asm).main_loop
    every = {i: 8.0 for i, t in where.items() if loop.start_line <= i <= loop.end_line and t and not t.endswith(":")}
    tail = [i for i, t in where.items() if t.startswith("v_mul")]
    for i in tail + [tail[0] - 1]:  # the fix-up block (its wait and its VALU work) ran on no sampled tile
        every[i] = 0.0
    f = model.block_frequencies(asm, loop.start_line, loop.end_line, every)
    assert all(f[i] == 0.0 for i in tail) and f[tail[-1] + 2] == 1.0
    h = hw.HARDWARE["mi300x"]
    counted = model.kernel_code(asm, hw=h, line_counts=every)
    walked = model.kernel_code(asm, hw=h)  # no counts: every block every iteration
    assert walked.loop.valu == 22 and counted.loop.valu == 2
    assert counted.loop.vm_stalled_waits == 1 and counted.fixed.valu == walked.fixed.valu + 20
    assert counted.fixed.cycles > walked.fixed.cycles


def test_the_pipeline_fill_is_the_workgroups_fixed_cost():
    """A loop whose first iteration waits for a load the prologue issued, and whose steady
    iterations wait for nothing: that wait is charged once per workgroup (the fixed part), not
    per tile, and not dropped with the warm-up iterations the loop's profile leaves out."""
    h = hw.HARDWARE["mi300x"]
    asm = _asm_kernel("\ts_waitcnt vmcnt(0)\n" + "\tv_add_f32_e32 v5, v5, v0\n" * 4)
    asm = asm.replace("k:\n\ts_mov_b32 s4, 0\n", "k:\n\ts_mov_b32 s4, 0\n\tbuffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen\n")
    code = model.kernel_code(asm, hw=h)
    assert code.loop.vm_stalled_waits == 0 and code.fixed.vm_stalled_waits == 1
    assert code.fixed.cycles >= h.mem_latency_cycles


def _asm_kernel(body: str) -> str:
    """A one-kernel assembly listing with a main loop (label, body, backward branch)."""
    return (".amdgcn_target \"amdgcn-amd-amdhsa--gfx942\"\n\t.text\n\t.globl k\n\t.p2align 8\n\t.type k,@function\n"
            "k:\n\ts_mov_b32 s4, 0\n.LBB0_1:\n" + body +
            "\ts_add_u32 s4, s4, 1\n\ts_cmp_lt_u32 s4, 8\n\ts_cbranch_scc1 .LBB0_1\n\ts_endpgm\n")


def test_latency_exposures_count_the_serial_waits_of_one_iteration():
    load = "\tbuffer_load_dwordx4 v[0:3], v4, s[0:3], 0 offen\n"
    wait = "\ts_waitcnt vmcnt(0)\n"
    work = "\tv_add_f32_e32 v5, v5, v6\n" * 20
    h = hw.HARDWARE["mi300x"]
    serial = model.kernel_code(_asm_kernel((load + wait + work) * 3), hw=h)
    single = model.kernel_code(_asm_kernel(load + wait + work), hw=h)
    assert serial.loop is not None and single.loop is not None
    assert serial.latency_exposures == pytest.approx(3.0, abs=0.05)
    assert single.latency_exposures == pytest.approx(1.0, abs=0.05)


def test_a_latency_bound_prediction_outside_the_calibration_says_so():
    s = SHAPES[1]
    one = _predict(s, code=dataclasses.replace(_code(loop_cycles=20000.0, vm_stall=18000.0),
                                               latency_curve=((6400.0, 20000.0, 3000.0), (9600.0, 23200.0, 3000.0))))
    three = _predict(s, code=dataclasses.replace(_code(loop_cycles=20000.0, vm_stall=18000.0),
                                                 latency_curve=((6400.0, 20000.0, 3000.0), (9600.0, 29600.0, 3000.0))))
    assert one.bound.startswith("memory latency") and three.bound.startswith("memory latency")
    assert one.details["latency_exposures_per_tile"] < three.details["latency_exposures_per_tile"]
    assert model.calibration_note(one) is None
    note = model.calibration_note(three)
    assert note and note.startswith("CAUTION") and "held-out points of this kind" in note
    assert note in model.format_prediction(three)
    assert model.format_prediction(three).splitlines()[-1].startswith("predicted_us=")


def test_validation_report_holds_the_fresh_points_out_of_the_fit():
    rep = json.loads((DATA.parent / "model_validation.json").read_text())
    rows, summary = rep["rows"], rep["summary"]
    fit = [r for r in rows if r["role"] == "fit"]
    fresh = [r for r in rows if r["fresh"]]
    assert fresh and all(r["role"] == "held-out" for r in fresh)
    assert 3 * len(fit) <= len(rows)  # at most a third of the points fitted
    # the fit rule: every third point of the versions flydsl 0.5.0 builds, in version order
    assert all(r["flydsl"] == "flydsl 0.5.0" for r in fit)
    assert all(r["flydsl"] != "flydsl 0.5.0" for r in fresh)
    assert summary["fresh_points"] == len(fresh) and summary["held_out"] == len(rows) - len(fit)
    assert summary["fresh_within_15"] == sum(abs(r["err"]) <= 0.15 for r in fresh)
    reg = summary["latency_regime"]
    assert reg["serial"]["points"] + reg["calibrated"]["points"] == summary["held_out"]
    assert reg["serial"]["steps"] + reg["calibrated"]["steps"] == summary["steps"] == len(rep["steps"])
    assert summary["fresh_steps"] == sum(st["fresh"] for st in rep["steps"])
    lo, hi = reg["fit_exposures"]
    assert lo == min(r["exposures"] for r in fit) and hi == max(r["exposures"] for r in fit)
    # three folds: the reported one is the summary's, each fits at most a third and holds out the rest
    folds = summary["folds"]
    assert sorted(folds) == ["0", "1", "2"] and summary["fit_offset"] == 0
    assert folds["0"]["fitted"] == summary["fitted"] and folds["0"]["held_within_15"] == summary["held_within_15"]
    for f in folds.values():
        assert 3 * f["fit_points"] <= summary["points"] and f["held_out"] == summary["points"] - f["fit_points"]
        assert f["fresh_points"] == summary["fresh_points"]  # the fresh points are held out in every fold
    assert "## Cross-validation: the fit on each third" in (DATA.parent / "model_validation.md").read_text()


def test_the_harness_relaxes_the_emulator_hook_only_below_its_supported_flydsl():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_model", DATA.parents[2] / "scripts" / "validate_model.py")
    vm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vm)
    from pa_tile.emu import launch

    before = (launch.SUPPORTED_FLYDSL, launch._PLACEHOLDER_HOOKS, launch.compare_exports)
    vm._fit_hook_to_seed_flydsl()  # the installed flydsl is supported: nothing changes
    assert (launch.SUPPORTED_FLYDSL, launch._PLACEHOLDER_HOOKS, launch.compare_exports) == before
    assert vm.FALLBACK_FLYDSL == "0.2.2"


def _harness():
    import importlib.util

    spec = importlib.util.spec_from_file_location("validate_model", DATA.parents[2] / "scripts" / "validate_model.py")
    vm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vm)
    return vm


def test_the_later_history_steps_are_recorded_with_what_they_assume():
    later = [st for st in json.loads(DATA.read_text())["steps"] if st.get("round")]
    assert len(later) == 14
    for st in later:
        assert re.fullmatch(r"0\.2\.[34]", st["flydsl"])  # the release of the version's date
        assert "ASSUMED" in st["note"] or "assumed" in st["note"] or "assume_block_sizes" in st
        assert set(st.get("assume_block_sizes", [16])) <= {16, 64}
        assert set(st.get("vgpr_quoted", {})) <= {"before", "after"}
    assert sum("ratio" in st for st in later) == 4 and sum("before_gap" in st for st in later) == 7
    # 81f14e5c's three are absolute-time steps against its parent: both versions built, no forced count
    abs_steps = [st for st in later if st["quoted_in"].startswith("81f14e5c")]
    assert len(abs_steps) == 3 and all("before_us" in st and st["before_version"] != st["after_version"]
                                       for st in abs_steps)


def test_the_harness_predicts_a_later_step_under_each_assumption():
    vm = _harness()
    np_step = dict(before_version="a", after_version="a", before_partitions=8, after_partitions=32,
                   assume_block_sizes=[16, 64], shape=dict(batch=1, context=16384, num_q_heads=8, num_kv_heads=1,
                                                           head_dim=128, block_size=16, query_length=1,
                                                           scales="per-tensor"))
    alts = vm._step_shapes(np_step)
    assert [label for label, _ in alts] == ["block 16", "block 64"]
    for (label, ((b, bs), (a, as_))) in alts:
        assert (bs["partitions"], as_["partitions"]) == (8, 32) and bs["block_size"] == as_["block_size"]
        assert vm._config_tag(bs) == vm._config_tag(as_) != ""  # one build serves both counts
    gap = dict(np_step, after_version="b")
    for k in ("before_partitions", "after_partitions", "assume_block_sizes"):
        gap.pop(k)
    [(label, ((b, bs), (a, as_)))] = vm._step_shapes(gap)
    assert label == "" and (b, a) == ("a", "b") and "partitions" not in bs
    legacy = dict(gap["shape"], block_size=1024)
    assert vm._config_tag(legacy) == ""  # the first rounds' builds keep their cached names
    # a change of more than 2% needs a predicted change of more than 1% the same way
    assert vm._same_direction(0.9, 0.98) and not vm._same_direction(0.9, 0.995)
    assert vm._same_direction(1.3, 1.05) and not vm._same_direction(1.3, 0.9)


def test_the_report_predicts_every_later_step_with_builds_that_match_their_quoted_registers():
    rep = json.loads((DATA.parent / "model_validation.json").read_text())
    later, s = rep["later_steps"], rep["summary"]
    data = [st for st in json.loads(DATA.read_text())["steps"] if st.get("round")]
    assert [r["quote"] for r in later] == [st["quote"] for st in data]
    assert all(r["built"] for r in later) and s["later_built"] == s["later_steps"] == len(later)
    assert s["later_sign_ok"] == sum(r["sign_ok"] for r in later)
    for r in later:
        assert r["sign_ok"] == all(a["sign_ok"] for a in r["alternatives"])
        for a in r["alternatives"]:
            for i, k in enumerate(("before", "after")):
                if k in (r["vgpr_quoted"] or {}):
                    assert a["vgpr"][i] == r["vgpr_quoted"][k]  # the release of its date rebuilds what was measured
    assert s["later_vgpr_checks"] >= 5 and s["later_vgpr_match"] == s["later_vgpr_checks"]
    if s["later_sign_ok"] < s["later_steps"]:
        assert s["verdict"] == "NOT MET"


def test_a_cap_on_bytes_in_flight_charges_the_bytes_once_and_the_latency_per_wait():
    """Little's law on one CU: with at most C bytes outstanding a batch of B bytes returns about
    (B / C) latencies after it is sent; a loop that waits for K and V apart pays the latency twice
    but the bytes once, so it costs less than twice a loop that waits for both together."""
    h = hw.HARDWARE["mi308x"]
    capped = dataclasses.replace(h, cu_bytes_in_flight=16384.0)
    load = [("buffer_load_dwordx4", "v[0:3], v4, s[0:3], 0 offen")]
    wait = [("s_waitcnt", "vmcnt(0)")]
    lat, ta = h.mem_latency_cycles, 16 * 64 / h.ta_bytes_per_clk * 4
    # no cap: 16 loads (4 KiB each across the workgroup's 4 waves) return one latency after the addresser
    assert model.wave_profile(load * 16 + wait, h).vm_stall == pytest.approx(lat + 16 * ta - 16 * h.issue_interval)
    # a 16 KiB cap keeps 4 in flight: the 16 return in 4 latencies
    both = model.wave_profile(load * 16 + wait, capped)
    assert both.cycles == pytest.approx(4 * lat + ta + 16 * h.issue_interval, rel=0.02)
    apart = model.wave_profile(load * 8 + wait + load * 8 + wait, capped)
    uncapped_apart = model.wave_profile(load * 8 + wait + load * 8 + wait, h)
    assert apart.cycles == pytest.approx(both.cycles, rel=0.05)          # bytes-bound: waiting twice costs ~nothing
    assert uncapped_apart.cycles > 1.8 * model.wave_profile(load * 16 + wait, h).cycles - 2 * 16 * ta
    # a cap never makes a walk faster, and a larger cap is never slower than a smaller one
    for n in (1, 4, 16):
        walks = [model.wave_profile(load * n + wait, dataclasses.replace(h, cu_bytes_in_flight=c)).cycles
                 for c in (4096.0, 16384.0, 65536.0)]
        assert walks == sorted(walks, reverse=True)
        assert walks[-1] >= model.wave_profile(load * n + wait, h).cycles - 1e-6


def test_the_cap_on_bytes_in_flight_is_shared_by_the_resident_workgroups():
    shape = DecodeShape(batch=128, context=16384, num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=16)
    base = _predict(shape, gpu=hw.HARDWARE["mi308x"], code=_code(workgroups_per_cu=3))
    capped = _predict(shape, gpu=dataclasses.replace(hw.HARDWARE["mi308x"], cu_bytes_in_flight=8192.0),
                      code=_code(workgroups_per_cu=3))
    assert capped.predicted_us > base.predicted_us
    assert "bytes_in_flight" in capped.details["round_terms"]
    assert capped.predicted_us >= capped.floor_us


def test_mfma_and_transcendental_rates_are_the_isa_guides_not_the_data_sheets():
    """hw.py's sourced facts: v_mfma_f32_16x16x32_fp8_fp8 is 4 passes (16 cycles) on gfx942 and on
    gfx950 (CDNA3/CDNA4 ISA guides); MI300X's data-sheet fp8 peak is that instruction's rate, while
    MI355X's is twice it (v_mfma_f32_16x16x128_f8f6f4's); CDNA4 doubles the transcendental rate."""
    from pa_tile.perf.roofline import GPUS

    mi300x, mi355x = hw.HARDWARE["mi300x"], hw.HARDWARE["mi355x"]
    assert mi300x.mfma_cycles == mi355x.mfma_cycles == hw.HARDWARE["mi308x"].mfma_cycles == 16
    per_cu = lambda h: h.simds_per_cu * 2 * 16 * 16 * 32 // h.mfma_cycles  # noqa: E731
    assert per_cu(mi300x) == GPUS["MI300X"].fp8_flops_per_clock_per_cu
    assert 2 * per_cu(mi355x) == GPUS["MI355X"].fp8_flops_per_clock_per_cu
    assert mi300x.trans_cycles == 4 * mi300x.valu_cycles and mi355x.trans_cycles == mi300x.trans_cycles // 2
