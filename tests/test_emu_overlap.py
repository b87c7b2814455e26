"""Issue 13 item 1: an instruction reads every source before it writes any destination, so a
destination that overlaps a source sees the values from before the instruction (as hardware
does). One test per family whose destination can overlap a source."""

import numpy as np

from pa_tile.emu import Wave, parse_asm, run_wave
from pa_tile.emu import numerics as nx

LANE = np.arange(64, dtype=np.uint32)


def run(body, setup, arch="gfx942"):
    prog = parse_asm(f'\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-{arch}"\n\t.type k,@function\nk:\n'
                     + body + "\n\ts_endpgm\n")
    w = Wave(arch)
    setup(w)
    before = w.v.copy()
    return run_wave(prog, w, arch=arch), before


def _regs(**rows):
    def setup(w):
        for name, value in rows.items():
            w.v[int(name[1:])] = value
    return setup


def f32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def test_pk_mov_b32_reads_its_second_source_before_writing_the_low_dword():
    # The form upstream's gfx942 code emits (issue 13): D.lo = v21, D.hi = the old v4.
    w, _ = run("v_pk_mov_b32 v[4:5], v[20:21], v[4:5] op_sel:[1,0]", _regs(v4=LANE + 400, v5=LANE + 500,
                                                                         v20=LANE + 2000, v21=LANE + 2100))
    assert (w.v[4] == LANE + 2100).all() and (w.v[5] == LANE + 400).all()
    # The high dword of D as the first source: D.lo = old v5, D.hi = old v5 -- and the mirror form.
    w, _ = run("v_pk_mov_b32 v[4:5], v[5:6], v[3:4] op_sel:[0,1]", _regs(v3=LANE + 300, v4=LANE + 400,
                                                                       v5=LANE + 500, v6=LANE + 600))
    assert (w.v[4] == LANE + 500).all() and (w.v[5] == LANE + 400).all()


def test_packed_f32_ops_with_a_shifted_overlapping_pair():
    w, b = run("v_pk_add_f32 v[4:5], v[5:6], v[4:5]\n", _regs(v4=f32(1.0), v5=f32(2.0), v6=f32(4.0)))
    assert (w.v[4] == f32(3.0)).all() and (w.v[5] == f32(6.0)).all()
    w, b = run("v_pk_fma_f32 v[4:5], v[3:4], v[4:5], v[5:6]\n",
               _regs(v3=f32(3.0), v4=f32(5.0), v5=f32(7.0), v6=f32(11.0)))
    assert (w.v[4] == f32(3 * 5 + 7.0)).all() and (w.v[5] == f32(5 * 7 + 11.0)).all()


def test_64_bit_ops_whose_destination_pair_overlaps_a_source_pair():
    old = (LANE.astype(np.uint64) << np.uint64(32)) | np.uint64(0x80000001)  # v[3:4]
    w, _ = run("v_lshlrev_b64 v[4:5], 1, v[3:4]", _regs(v3=0x80000001, v4=LANE))
    new = old << np.uint64(1)
    assert (w.v[4] == (new & np.uint64(0xFFFFFFFF)).astype(np.uint32)).all()
    assert (w.v[5] == (new >> np.uint64(32)).astype(np.uint32)).all()
    w, _ = run("v_mov_b64_e32 v[4:5], v[3:4]", _regs(v3=LANE + 3, v4=LANE + 4))
    assert (w.v[4] == LANE + 3).all() and (w.v[5] == LANE + 4).all()
    w, _ = run("v_mad_u64_u32 v[4:5], s[0:1], v5, v4, v[4:5]", _regs(v4=LANE, v5=7))
    assert (w.v[4] == 7 * LANE + LANE).all() and (w.v[5] == 7).all()


def test_mfma_whose_destination_overlaps_a_and_c():
    def setup(w):
        rng = np.random.default_rng(0)
        w.v[0:6] = f32(rng.standard_normal((6, 64)))
    w, before = run("v_mfma_f32_16x16x4_f32 v[0:3], v0, v4, v[1:4]", setup)
    want = nx.mfma("v_mfma_f32_16x16x4_f32", before[0:1], before[4:5], before[1:5], "gfx942")
    assert (w.v[0:4] == want).all()


def test_dpp_reads_neighbour_lanes_of_its_own_destination_before_writing():
    w, b = run("v_mov_b32_dpp v4, v4 row_shr:1 row_mask:0xf bank_mask:0xf bound_ctrl:1", _regs(v4=LANE + 10))
    row = LANE & 15
    assert (w.v[4] == np.where(row > 0, LANE + 9, 0)).all()
    w, b = run("v_add_u32_dpp v4, v4, v4 quad_perm:[1,0,3,2] row_mask:0xf bank_mask:0xf", _regs(v4=LANE))
    assert (w.v[4] == (LANE ^ 1) + LANE).all()


def test_sdwa_with_its_destination_as_both_sources_and_preserve():
    w, _ = run("v_add_u32_sdwa v4, v4, v4 dst_sel:WORD_1 dst_unused:UNUSED_PRESERVE src0_sel:WORD_0 "
               "src1_sel:WORD_1", _regs(v4=0x00070005))
    assert (w.v[4] == 0x000C0005).all()  # hi word = 5 + 7, lo word preserved from before


def test_permlane_swaps_with_one_register_as_both_operands():
    w, _ = run("v_permlane32_swap_b32_e32 v4, v4", _regs(v4=LANE), arch="gfx950")
    assert (w.v[4] == np.concatenate([LANE[32:], LANE[:32]])).all()
    w, _ = run("v_permlane16_swap_b32_e32 v4, v4", _regs(v4=LANE), arch="gfx950")
    want = LANE.reshape(4, 16)[[1, 0, 3, 2]].reshape(-1)
    assert (w.v[4] == want).all()


def test_fp8_unpack_into_a_pair_that_holds_its_source():
    w, before = run("v_cvt_pk_f32_fp8_e32 v[4:5], v5", _regs(v5=0x3840C8B8 + LANE))
    lo, hi = nx.cvt_pk_f32_fp8(before[5], False, nx.fp8_format_for_arch("gfx942"))
    assert (w.v[4] == np.asarray(lo, np.float32).view(np.uint32)).all()
    assert (w.v[5] == np.asarray(hi, np.float32).view(np.uint32)).all()


def test_pk_mul_f32_with_op_sel_reading_the_destination():
    # the no-neg fast path of v_pk_*_f32 computes both halves before writing either: v4 is the
    # destination's low half and the second source's high half (op_sel_hi picks it)
    w, _ = run("v_pk_mul_f32 v[4:5], v[6:7], v[4:5] op_sel:[0,1] op_sel_hi:[1,0]\n",
               _regs(v4=f32(3.0), v5=f32(5.0), v6=f32(2.0), v7=f32(7.0)))
    np.testing.assert_array_equal(w.v[4].view(np.float32), np.float32(2.0 * 5.0))
    np.testing.assert_array_equal(w.v[5].view(np.float32), np.float32(7.0 * 3.0))
