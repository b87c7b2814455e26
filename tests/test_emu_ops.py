"""Instruction semantics of pa_tile.emu, family by family.

Expected values are worked out by hand from the AMD Instinct MI300 (CDNA3) ISA reference guide
("CDNA3 §n" below; CDNA4 for gfx950-only instructions): §4 scalar ALU (SCC rules), §6 vector
ALU (EXEC, VOPC/carry writes, DPP, SDWA), §9 SMEM, §10 MUBUF, §11 LDS/global, §12 per-opcode
pseudo-code.
"""

import struct

import numpy as np
import pytest
import torch

from pa_tile.emu import (
    LDS,
    GlobalMemory,
    UnsupportedInstruction,
    Wave,
    decode_kernel,
    load_program,
    parse_asm,
    run_kernel,
    run_wave,
)
from pa_tile.emu.memory import encode_vsharp
from pa_tile.emu.ops_ds import LdsRaceError

LANE = np.arange(64, dtype=np.uint32)
ALL = (1 << 64) - 1


def program(body, arch="gfx942"):
    return parse_asm(f'\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-{arch}"\n\t.type k,@function\nk:\n'
                     + body + "\n\ts_endpgm\n")


def run(body, setup=None, arch="gfx942"):
    w = Wave(arch)
    if setup:
        setup(w)
    return run_wave(program(body, arch), w, arch=arch)


def f32(x):
    return np.asarray(x, np.float32).view(np.uint32)


def asf(u):
    return np.asarray(u, np.uint32).view(np.float32)


# --------------------------------------------------------------------------- SALU (CDNA3 §4, §12.1-12.4)

def test_s_add_u32_carry_and_s_addc_u32_make_a_64_bit_add():
    def setup(w):
        w.s[0:4] = [0xFFFFFFFF, 0x1, 0x1, 0x2]  # 0x1_FFFFFFFF + 0x2_00000001
    w = run("s_add_u32 s4, s0, s2\n s_addc_u32 s5, s1, s3", setup)
    assert list(w.s[4:6]) == [0x0, 0x4] and w.scc == 0  # carry consumed; 1+2+1 = 4 has no carry out


def test_s_sub_u32_borrow_and_s_add_i32_overflow_set_scc():
    w = run("s_sub_u32 s2, s0, s1", lambda w: w.s.__setitem__(slice(0, 2), [1, 2]))
    assert w.s[2] == 0xFFFFFFFF and w.scc == 1
    w = run("s_add_i32 s2, s0, s1", lambda w: w.s.__setitem__(slice(0, 2), [0x7FFFFFFF, 1]))
    assert w.s[2] == 0x80000000 and w.scc == 1  # signed overflow
    w = run("s_add_i32 s2, s0, s1", lambda w: w.s.__setitem__(slice(0, 2), [0xFFFFFFFF, 1]))
    assert w.s[2] == 0 and w.scc == 0  # -1 + 1: no signed overflow


def test_signed_and_unsigned_compares_and_cselect():
    def setup(w):
        w.s[0], w.s[1] = 0xFFFFFFFF, 1  # -1 vs 1
    w = run("s_cmp_lt_i32 s0, s1\n s_cselect_b32 s2, 10, 20\n s_cmp_lt_u32 s0, s1\n s_cselect_b32 s3, 10, 20", setup)
    assert (w.s[2], w.s[3]) == (10, 20)
    w = run("s_cmp_lg_u64 s[0:1], 0\n s_cselect_b64 s[2:3], -1, 0", lambda w: w.s.__setitem__(1, 1))
    assert (w.s[2], w.s[3]) == (0xFFFFFFFF, 0xFFFFFFFF)


def test_shifts_bfe_minmax_mul_hi():
    def setup(w):
        w.s[0] = 0x80000010
        w.s[1] = 0x12345678
        w.s[2], w.s[3] = 0xFFFFFFFE, 5  # -2, 5
    w = run("s_ashr_i32 s4, s0, 4\n s_lshr_b32 s5, s0, 4\n"
            "s_bfe_u32 s6, s1, 0x80004\n"        # offset 4, width 8 (S1[22:16]) -> 0x67
            "s_lshl_b64 s[8:9], s[0:1], 36\n"
            "s_mul_hi_i32 s10, s2, s3\n s_mul_hi_u32 s11, s2, s3\n"
            "s_min_i32 s12, s2, s3", setup)
    assert w.s[4] == 0xF8000001 and w.s[5] == 0x08000001
    assert w.s[6] == 0x67
    assert (w.s[8], w.s[9]) == (0, 0x00000100)  # 0x12345678_80000010 << 36
    assert w.s[10] == 0xFFFFFFFF and w.s[11] == 4  # hi(-10) = -1; hi(0xFFFFFFFE * 5) = 4
    assert w.s[12] == 0xFFFFFFFE and w.scc == 1  # SCC = (S0 < S1)


def test_sopk_sign_extends_simm16():
    w = run("s_movk_i32 s0, 0xff80\n s_mov_b32 s1, 100\n s_addk_i32 s1, 0xff80\n s_mulk_i32 s1, 0xfffe")
    assert w.s[0] == 0xFFFFFF80
    assert w.s[1] == ((100 - 128) * -2) & 0xFFFFFFFF


def test_s_lshl2_add_u32():
    w = run("s_lshl2_add_u32 s2, s0, s1", lambda w: w.s.__setitem__(slice(0, 2), [3, 5]))
    assert w.s[2] == 17 and w.scc == 0


def test_saveexec_and_restore():
    # CDNA3 §12.2 S_AND_SAVEEXEC_B64: D = EXEC; EXEC = S0 & EXEC; SCC = EXEC != 0
    def setup(w):
        w.exec = 0xFFFF
        w.s[4], w.s[5] = 0xFF00FF00, 0xFFFFFFFF
    w = run("s_and_saveexec_b64 s[0:1], s[4:5]", setup)
    assert w.exec == 0xFF00 and (w.s[0], w.s[1]) == (0xFFFF, 0) and w.scc == 1
    assert w.exec_mask().sum() == 8 and w.exec_mask()[8] and not w.exec_mask()[0]
    w = run("s_and_saveexec_b64 s[0:1], 0\n s_cbranch_execz .Lskip\n s_mov_b32 s7, 1\n.Lskip:\n s_or_b64 exec, exec, s[0:1]")
    assert w.s[7] == 0 and w.exec == ALL


def test_scalar_loop_with_branches():
    w = run("s_mov_b32 s0, 0\n s_mov_b32 s1, 0\n.Lloop:\n s_add_i32 s1, s1, s0\n s_add_i32 s0, s0, 1\n"
            " s_cmp_lt_i32 s0, 10\n s_cbranch_scc1 .Lloop")
    assert (w.s[0], w.s[1]) == (10, 45)


# --------------------------------------------------------------------------- VALU (CDNA3 §6, §12.7-12.11)

def test_exec_masking_keeps_inactive_lanes():
    def setup(w):
        w.v[1] = 7
        w.exec = 0x0F0F
    w = run("v_mov_b32_e32 v1, 3", setup)
    on = (0x0F0F >> LANE) & 1 == 1
    assert (w.v[1][on] == 3).all() and (w.v[1][~on] == 7).all()


def test_vopc_writes_zero_for_inactive_lanes_and_v_cmpx_writes_exec():
    def setup(w):
        w.v[0] = LANE
        w.exec = 0xFFFF_FFFF
    w = run("v_cmp_gt_u32_e32 vcc, 40, v0\n v_cmp_le_u32_e64 s[2:3], 8, v0", setup)
    assert w.vcc == (1 << 32) - 1  # lanes 32..39 would compare true but are inactive
    assert (w.s[2], w.s[3]) == (0xFFFFFF00, 0)
    w = run("v_cmpx_lt_u32_e32 vcc, v0, 5", lambda w: w.v.__setitem__(0, LANE))
    assert w.exec == 0x1F and w.vcc == 0x1F


def test_carry_chain_add_and_sub():
    def setup(w):
        w.v[0] = 0xFFFFFFFF
        w.v[1] = LANE  # low + LANE carries for every lane but 0
        w.v[2] = 5
    w = run("v_add_co_u32_e32 v3, vcc, v0, v1\n v_addc_co_u32_e32 v4, vcc, v2, 0, vcc\n"
            "v_sub_co_u32_e64 v5, s[0:1], v1, 1\n v_subbrev_co_u32_e64 v6, s[2:3], 0, 0, s[0:1]", setup)
    assert w.v[3][0] == 0xFFFFFFFF and (w.v[3][1:] == LANE[1:] - 1).all()
    assert w.v[4][0] == 5 and (w.v[4][1:] == 6).all()
    assert w.vcc == 0  # 5 + 1 does not carry
    # 0 - 1 borrows in lane 0 only; subbrev: D = S1 - S0 - borrow_in
    assert (w.s[0], w.s[1]) == (1, 0)
    assert w.v[6][0] == 0xFFFFFFFF and (w.v[6][1:] == 0).all()


def test_cndmask_inline_floats_and_literals():
    def setup(w):
        w.vcc = 0xAAAAAAAAAAAAAAAA
    w = run("v_cndmask_b32_e64 v1, 0.5, -4.0, vcc\n v_mov_b32_e32 v2, 0x4f7ffffe\n v_mov_b32_e32 v3, 0.15915494", setup)
    odd = LANE % 2 == 1
    assert (asf(w.v[1])[odd] == -4.0).all() and (asf(w.v[1])[~odd] == 0.5).all()
    assert (w.v[2] == 0x4F7FFFFE).all()
    assert (w.v[3] == 0x3E22F983).all()  # the 1/(2*pi) inline constant


def test_vop3_neg_abs_and_clamp():
    def setup(w):
        w.v[0] = f32(-3.0)
        w.v[1] = f32(0.25)
    w = run("v_add_f32_e64 v2, -|v0|, v1\n v_mul_f32_e64 v3, v0, v1 clamp\n v_add_f32_e64 v4, |v0|, -v1 clamp", setup)
    assert (asf(w.v[2]) == -2.75).all()
    assert (asf(w.v[3]) == 0.0).all()  # -0.75 clamped to [0, 1]
    assert (asf(w.v[4]) == 1.0).all()  # 2.75 clamped


def test_max_min_f32_nan_rules():
    # CDNA3 §12.7 V_MAX_F32 (IEEE mode): a quiet NaN operand is ignored; a signalling NaN is quieted
    def setup(w):
        w.v[0] = [0x7FC00000, 0x7F800001, f32(1.0), f32(-0.0)] * 16
        w.v[1] = f32(2.0)
        w.v[2] = f32(0.0)
    w = run("v_max_f32_e32 v3, v0, v1\n v_min_f32_e32 v4, v0, v1\n v_max_f32_e32 v5, v0, v2", setup)
    assert [hex(x) for x in w.v[3][:4]] == [hex(f32(2.0)), "0x7fc00001", hex(f32(2.0)), hex(f32(2.0))]
    assert asf(w.v[4][0]) == 2.0 and asf(w.v[4][2]) == 1.0
    assert w.v[5][3] == 0  # max(-0, +0) = +0


def test_fma_rounds_once():
    # (1 + 2^-12)^2 + 2^-80: an fma rounds once to 1 + 2^-11 + 2^-23; mul-then-add loses the 2^-24 term
    a = np.float32(1 + 2.0 ** -12)

    def setup(w):
        w.v[0] = f32(a)
        w.v[1] = f32(2.0 ** -80)
    w = run("v_fma_f32 v2, v0, v0, v1\n v_mov_b32_e32 v3, v1\n v_fmac_f32_e32 v3, v0, v0\n"
            "v_mul_f32_e32 v4, v0, v0\n v_add_f32_e32 v4, v4, v1", setup)
    exact = np.float32(1 + 2.0 ** -11 + 2.0 ** -23)
    assert (asf(w.v[2]) == exact).all() and (asf(w.v[3]) == exact).all()
    assert (asf(w.v[4]) == np.float32(1 + 2.0 ** -11)).all()


def test_integer_valu():
    def setup(w):
        w.v[0] = 0xF0F0F0F0
        w.v[1] = 0x0FF00FF0
        w.v[2] = 0x12345678
        w.v[3] = 0x80000000
    w = run("v_bitop3_b32 v4, v0, v1, v2 bitop3:0xf2\n"          # S0 | (~S1 & S2)
            "v_perm_b32 v5, v0, v2, 0x0c080500\n"                 # bytes: S1.b0, S1.b5->S0.b1, sign(S1.b1), 0
            "v_bfe_u32 v6, v2, 4, 8\n v_bfe_i32 v7, v3, 28, 4\n"
            "v_ashrrev_i32_e32 v8, 4, v3\n v_mul_hi_u32 v9, v3, 6\n"
            "v_lshl_add_u32 v10, v2, 4, 1\n v_add3_u32 v11, v0, v1, v2", setup, arch="gfx950")
    a, b, c = 0xF0F0F0F0, 0x0FF00FF0, 0x12345678
    assert (w.v[4] == (a | (~b & c)) & 0xFFFFFFFF).all()
    # {S0, S1} = 0xF0F0F0F0_12345678: sel 0 -> 0x78, sel 5 -> 0xF0, sel 8 -> sign of bit 15 (0x56 -> 0), 12 -> 0
    assert (w.v[5] == 0x0000F078).all()
    assert (w.v[6] == 0x67).all() and (w.v[7] == 0xFFFFFFF8).all()
    assert (w.v[8] == 0xF8000000).all() and (w.v[9] == 3).all()
    assert (w.v[10] == ((c << 4) + 1) & 0xFFFFFFFF).all()
    assert (w.v[11] == (a + b + c) & 0xFFFFFFFF).all()


def test_64_bit_valu():
    def setup(w):
        w.v[0] = 0xFFFFFFFF
        w.v[1] = LANE
        w.v[2], w.v[3] = 0xFFFFFFFF, 0x0  # 64-bit 0xFFFFFFFF
        w.s[4], w.s[5] = 0x10, 0x1
    w = run("v_mad_u64_u32 v[4:5], s[0:1], v0, v1, v[2:3]\n"
            "v_lshl_add_u64 v[6:7], v[2:3], 4, s[4:5]\n"
            "v_mov_b64_e32 v[8:9], s[4:5]\n v_cmp_lt_i64_e32 vcc, s[4:5], v[6:7]", setup)
    full = (0xFFFFFFFF * LANE.astype(object) + 0xFFFFFFFF)
    assert (w.v[4] == np.array([x & 0xFFFFFFFF for x in full], np.uint32)).all()
    assert (w.v[5] == np.array([x >> 32 for x in full], np.uint32)).all()
    assert (w.s[0], w.s[1]) == (0, 0)  # never exceeds 64 bits
    assert (w.v[6] == 0).all() and (w.v[7] == 0x11).all()  # 0xF_FFFFFFF0 + 0x1_00000010
    assert (w.v[8] == 0x10).all() and (w.v[9] == 1).all()
    assert w.vcc == ALL


def test_conversions():
    def setup(w):
        w.v[0] = f32([-1.5, 3e9, 5e9, np.nan] * 16)
        w.v[1] = 0x80FF7F01
    w = run("v_cvt_u32_f32_e32 v2, v0\n v_cvt_i32_f32_e32 v3, v0\n v_cvt_f32_ubyte1_e32 v4, v1\n"
            "v_cvt_f32_i32_e32 v5, v1\n v_cvt_f16_f32_e32 v6, v0", setup)
    assert list(w.v[2][:4]) == [0, 3000000000, 0xFFFFFFFF, 0]  # clamp to [0, 2^32-1], NaN -> 0
    assert list(w.v[3][:4]) == [0xFFFFFFFF, 0x7FFFFFFF, 0x7FFFFFFF, 0]
    assert (asf(w.v[4]) == 127.0).all()
    assert (asf(w.v[5]) == np.float32(np.int32(np.uint32(0x80FF7F01).view(np.int32)))).all()
    assert w.v[6][0] == 0xBE00  # -1.5 in f16, high half zeroed


def test_fp8_pack_follows_the_arch_format():
    # 1.0 is 0x40 in e4m3 FNUZ (bias 8, gfx942) and 0x38 in OCP e4m3 (bias 7, gfx950)
    def setup(w):
        w.v[0] = f32(1.0)
        w.v[1] = f32(-2.0)
        w.v[2] = 0xAAAA5555
    for arch, one, mtwo in (("gfx942", 0x40, 0xC8), ("gfx950", 0x38, 0xC0)):
        w = run("v_cvt_pk_fp8_f32 v2, v0, v1 op_sel:[0,0,1]", setup, arch=arch)
        assert (w.v[2] == ((mtwo << 24) | (one << 16) | 0x5555)).all(), arch


def test_packed_f32_op_sel_and_neg():
    # CDNA3 §12.11 VOP3P: result lo uses S[op_sel], hi uses S[op_sel_hi]; neg_lo/neg_hi negate
    def setup(w):
        w.v[0], w.v[1] = f32(1.0), f32(2.0)
        w.v[2], w.v[3] = f32(10.0), f32(20.0)
        w.v[4], w.v[5] = f32(100.0), f32(200.0)
        w.s[8], w.s[9] = f32(3.0), f32(99.0)
    w = run("v_pk_fma_f32 v[6:7], v[0:1], v[2:3], v[4:5] op_sel_hi:[1,0,1] neg_lo:[0,0,1] neg_hi:[0,0,1]\n"
            "v_pk_mul_f32 v[8:9], v[0:1], s[8:9] op_sel_hi:[1,0]\n"
            "v_pk_mov_b32 v[10:11], v[0:1], v[2:3] op_sel:[1,0]\n"
            "v_pk_add_f32 v[12:13], v[0:1], v[2:3] op_sel:[1,0] op_sel_hi:[0,1]", setup)
    assert (asf(w.v[6]) == 1 * 10 - 100).all() and (asf(w.v[7]) == 2 * 10 - 200).all()
    assert (asf(w.v[8]) == 3.0).all() and (asf(w.v[9]) == 6.0).all()
    assert (asf(w.v[10]) == 2.0).all() and (asf(w.v[11]) == 10.0).all()
    assert (asf(w.v[12]) == 12.0).all() and (asf(w.v[13]) == 21.0).all()


# --------------------------------------------------------------------------- DPP (CDNA3 §6.2)

def _dpp(ctrl, old=1000, exec_=ALL):
    def setup(w):
        w.v[0] = LANE
        w.v[1] = old
        w.exec = exec_
    return run(f"v_mov_b32_dpp v1, v0 {ctrl}", setup).v[1].copy()


def test_dpp_row_shift_without_and_with_bound_ctrl():
    r = _dpp("row_shr:1 row_mask:0xf bank_mask:0xf")
    # lane 0 of each row has no source: not written (keeps 1000)
    assert r[0] == 1000 and r[16] == 1000 and r[1] == 0 and r[17] == 16 and r[63] == 62
    r = _dpp("row_shr:1 row_mask:0xf bank_mask:0xf bound_ctrl:1")
    assert r[0] == 0 and r[16] == 0 and r[5] == 4  # invalid source reads 0 with BOUND_CTRL
    assert (_dpp("row_shr:1 row_mask:0xf bank_mask:0xf bound_ctrl:0") == r).all()  # gfx9 spelling, same bit
    r = _dpp("row_shl:4 row_mask:0xf bank_mask:0xf")
    assert r[0] == 4 and r[11] == 15 and r[12] == 1000


def test_dpp_patterns():
    assert list(_dpp("quad_perm:[1,0,3,2] row_mask:0xf bank_mask:0xf")[:8]) == [1, 0, 3, 2, 5, 4, 7, 6]
    assert list(_dpp("row_ror:1 row_mask:0xf bank_mask:0xf")[:3]) == [15, 0, 1]
    r = _dpp("row_bcast:15 row_mask:0xa bank_mask:0xf")
    assert (r[16:32] == 15).all() and (r[48:64] == 47).all() and (r[0:16] == 1000).all() and (r[32:48] == 1000).all()
    r = _dpp("row_bcast:31 row_mask:0xc bank_mask:0xf")
    assert (r[32:] == 31).all() and (r[:32] == 1000).all()
    r = _dpp("wave_shr:1 row_mask:0xf bank_mask:0xf")
    assert r[0] == 1000 and r[1] == 0 and r[63] == 62
    r = _dpp("row_mirror row_mask:0xf bank_mask:0xf")
    assert r[0] == 15 and r[17] == 30


def test_dpp_row_and_bank_masks():
    r = _dpp("quad_perm:[0,0,0,0] row_mask:0x1 bank_mask:0x5")
    # row 0 only; banks 0 and 2 (lanes 0-3, 8-11) written
    assert list(r[0:4]) == [0, 0, 0, 0] and list(r[8:12]) == [8] * 4
    assert (r[4:8] == 1000).all() and (r[16:] == 1000).all()


def test_dpp_source_lane_off_in_exec_is_invalid():
    r = _dpp("row_shr:1 row_mask:0xf bank_mask:0xf", exec_=ALL & ~(1 << 4))
    assert r[5] == 1000  # lane 4 is off: lane 5's source is invalid
    assert r[4] == 1000  # and lane 4 itself is not written
    r = _dpp("row_shr:1 row_mask:0xf bank_mask:0xf bound_ctrl:1", exec_=ALL & ~(1 << 4))
    assert r[5] == 0


def test_dpp_on_a_vop2():
    def setup(w):
        w.v[0] = f32(LANE.astype(np.float32))
        w.v[1] = f32(1000.0)
    w = run("v_add_f32_dpp v1, v0, v0 row_shr:1 row_mask:0xf bank_mask:0xf bound_ctrl:1", setup)
    assert asf(w.v[1][0]) == 0.0 and asf(w.v[1][3]) == 2.0 + 3.0


# --------------------------------------------------------------------------- SDWA (CDNA3 §6.3)

def test_sdwa_selects():
    def setup(w):
        w.v[0] = 0x00050003
        w.v[1] = 0x00070009
        w.v[2] = 0xDEADBEEF
        w.v[3] = 0xDEADBEEF
        w.v[4] = 0x000000F0
    w = run("v_add_u32_sdwa v2, v0, v1 dst_sel:WORD_1 dst_unused:UNUSED_PAD src0_sel:DWORD src1_sel:WORD_1\n"
            "v_and_b32_sdwa v3, v0, v1 dst_sel:BYTE_0 dst_unused:UNUSED_PRESERVE src0_sel:BYTE_0 src1_sel:BYTE_0\n"
            "v_add_u32_sdwa v5, sext(v4), v4 dst_sel:WORD_0 dst_unused:UNUSED_SEXT src0_sel:BYTE_0 src1_sel:BYTE_0", setup)
    assert (w.v[2] == ((0x00050003 + 7) & 0xFFFF) << 16).all()
    assert (w.v[3] == 0xDEADBE01).all()  # 3 & 9 = 1 into byte 0, rest preserved
    # sext(byte 0xF0) + byte 0xF0 = -16 + 240 = 0xE0 -> WORD_0; UNUSED_SEXT copies bit 15 (0) upward
    assert (w.v[5] == 0xE0).all()


# --------------------------------------------------------------------------- cross-lane

def test_readlane_writelane_readfirstlane_mbcnt():
    def setup(w):
        w.v[0] = LANE * 3
        w.s[5] = 7
        w.exec = ALL & ~0xF  # first active lane is 4
    w = run("v_readlane_b32 s0, v0, 13\n v_readlane_b32 s1, v0, s5\n v_readfirstlane_b32 s2, v0\n"
            "v_writelane_b32 v0, s5, 2\n v_mbcnt_lo_u32_b32 v1, -1, 0\n v_mbcnt_hi_u32_b32 v1, -1, v1", setup)
    assert (w.s[0], w.s[1], w.s[2]) == (39, 21, 12)
    assert w.v[0][2] == 7  # writelane ignores EXEC
    assert (w.v[1][4:] == LANE[4:]).all()  # lane id from mbcnt(-1)


def test_permlane_swaps_gfx950():
    def setup(w):
        w.v[0] = LANE
        w.v[1] = LANE + 100
    w = run("v_permlane32_swap_b32_e32 v0, v1", setup, arch="gfx950")
    assert (w.v[0][:32] == LANE[:32]).all() and (w.v[0][32:] == LANE[:32] + 100).all()
    assert (w.v[1][:32] == LANE[32:]).all() and (w.v[1][32:] == LANE[32:] + 100).all()
    w = run("v_permlane16_swap_b32_e32 v0, v1", setup, arch="gfx950")
    assert (w.v[0][16:32] == LANE[0:16] + 100).all() and (w.v[1][0:16] == LANE[16:32]).all()
    assert (w.v[0][0:16] == LANE[0:16]).all() and (w.v[1][16:32] == LANE[16:32] + 100).all()


@pytest.mark.parametrize("line", ["v_mfma_f32_16x16x32_f16 v[0:3], v[4:7], v[8:11], 0",
                                  "v_permlane32_swap_b32_e32 v0, v1", "v_bitop3_b32 v0, v1, v2, v3 bitop3:0xf2"])
def test_gfx950_only_instructions_are_rejected_on_gfx942_at_decode(line):
    with pytest.raises(UnsupportedInstruction, match=line.split()[0]):
        decode_kernel(program(line, "gfx942"), "k", "gfx942")
    decode_kernel(program(line, "gfx950"), "k", "gfx950")


# --------------------------------------------------------------------------- DS (CDNA3 §11, §12.13)

def _with_lds(nbytes=4096, **regs):
    def setup(w):
        w.lds = LDS(nbytes)
        for k, v in regs.items():
            w.v[int(k[1:])] = v
    return setup


def test_ds_write_read_and_read2_write2_st64():
    w = run("ds_write_b32 v0, v1 offset:16\n ds_read_b32 v2, v0 offset:16\n"
            "ds_write2st64_b32 v3, v1, v4 offset0:1 offset1:2\n ds_read2st64_b32 v[6:7], v3 offset0:1 offset1:2\n"
            "ds_write_b128 v5, v[8:11]\n ds_read_b64 v[12:13], v5 offset:8",
            _with_lds(8192, v0=LANE * 4, v1=LANE + 1, v3=LANE * 4 + 4096 - 512, v4=LANE + 500,
                      v5=LANE * 16 + 1024, v8=1, v9=2, v10=3, v11=4))
    assert (w.v[2] == LANE + 1).all()
    assert (w.v[6] == LANE + 1).all() and (w.v[7] == LANE + 500).all()  # x256 byte strides
    assert (w.lds.data[4096 - 512 + 256: 4096 - 512 + 256 + 4].view(np.uint32) == 1).all()
    assert (w.v[12] == 3).all() and (w.v[13] == 4).all()


def test_ds_bpermute_and_swizzle():
    w = run("ds_bpermute_b32 v2, v1, v0\n ds_swizzle_b32 v3, v0 offset:swizzle(SWAP,16)\n"
            "ds_swizzle_b32 v4, v0 offset:swizzle(QUAD_PERM,3,2,1,0)\n"
            "ds_swizzle_b32 v5, v0 offset:swizzle(BROADCAST,8,3)",
            _with_lds(v0=LANE + 100, v1=((LANE + 1) % 64) * 4))
    assert (w.v[2] == (LANE + 1) % 64 + 100).all()
    assert (w.v[3] == (LANE ^ 16) + 100).all()
    assert (w.v[4] == (LANE & 0xFFFFFFFC) + 3 - (LANE & 3) + 100).all()
    assert (w.v[5] == (LANE & 0xFFFFFFF8) + 3 + 100).all()

    def off(w):
        _with_lds(v0=LANE + 100, v1=np.zeros(64, np.uint32))(w)
        w.exec = ALL & ~1
    w = run("ds_bpermute_b32 v2, v1, v0", off)
    assert (w.v[2][1:] == 0).all()  # everyone reads lane 0, which is off: 0


def test_lds_out_of_range_is_an_error():
    from pa_tile.emu import MemoryFault

    with pytest.raises(MemoryFault, match="LDS"):
        run("ds_read_b32 v1, v0 offset:4096", _with_lds(4096, v0=LANE * 0))


# --------------------------------------------------------------------------- global / buffer / smem

def _mem(*tensors):
    return GlobalMemory([(t.data_ptr(), t.numel() * t.element_size(), f"t{i}") for i, t in enumerate(tensors)])


def test_global_loads_and_stores_off_and_saddr_forms():
    src = torch.arange(256, dtype=torch.int32)
    dst = torch.zeros(256, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(src, dst)
        a = src.data_ptr() + LANE.astype(np.uint64) * 16
        w.v[0], w.v[1] = (a & 0xFFFFFFFF).astype(np.uint32), (a >> 32).astype(np.uint32)
        w.s[2], w.s[3] = dst.data_ptr() & 0xFFFFFFFF, dst.data_ptr() >> 32
        w.v[2] = LANE * 4
        w.exec = 0xFFFF  # lanes 0..15
    w = run("global_load_dwordx4 v[4:7], v[0:1], off offset:0\n"
            "global_store_dword v2, v5, s[2:3] offset:64\n global_load_ushort v8, v2, s[2:3] offset:64\n"
            "global_load_sbyte v9, v2, s[2:3] offset:69", setup)
    assert (w.v[4][:16] == LANE[:16] * 4).all() and (w.v[7][:16] == LANE[:16] * 4 + 3).all()
    assert (dst[16:32] == torch.arange(16) * 4 + 1).all() and (dst[:16] == 0).all() and (dst[32:] == 0).all()
    assert (w.v[8][:16] == (LANE[:16] * 4 + 1) & 0xFFFF).all()
    assert (w.v[9][:16] == 0).all()  # byte 1 of lane 1's value


def test_global_access_outside_the_tensors_faults():
    from pa_tile.emu import MemoryFault

    t = torch.zeros(16, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(t)
        w.s[2], w.s[3] = t.data_ptr() & 0xFFFFFFFF, t.data_ptr() >> 32
        w.v[2] = LANE * 4
    with pytest.raises(MemoryFault, match="global_load_dword v1, v2, s\\[2:3\\]"):
        run("global_load_dword v1, v2, s[2:3]", setup)


def test_buffer_load_offen_soffset_and_num_records():
    t = torch.arange(64, dtype=torch.int32)
    out = torch.zeros(64, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(t, out)
        w.s[8:12] = encode_vsharp(t.data_ptr(), 100)  # 25 dwords in range
        w.s[12:16] = encode_vsharp(out.data_ptr(), 256)
        w.s[2] = 8
        w.v[0] = LANE * 4
    w = run("buffer_load_dword v1, v0, s[8:11], s2 offen offset:4\n"
            "buffer_store_dword v1, v0, s[12:15], 0 offen", setup)
    # dword index = lane + 3; in range while (lane*4 + 4) + 8 + 4 <= 100
    expect = np.where(LANE + 3 < 25, LANE + 3, 0)
    assert (w.v[1] == expect).all()
    assert (out.numpy() == expect).all()


def test_s_load_and_s_buffer_load():
    t = torch.arange(32, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(t)
        w.s[0], w.s[1] = t.data_ptr() & 0xFFFFFFFF, t.data_ptr() >> 32
        w.s[8:12] = encode_vsharp(t.data_ptr(), 32 * 4)
        w.s[20] = 16
    w = run("s_load_dwordx4 s[4:7], s[0:1], 0x8\n s_buffer_load_dword s12, s[8:11], s20 offset:0x4\n"
            "s_load_dword s13, s[0:1], s20", setup)
    assert list(w.s[4:8]) == [2, 3, 4, 5] and w.s[12] == 5 and w.s[13] == 4


# --------------------------------------------------------------------------- MFMA

def test_mfma_register_plumbing_matches_a_matmul():
    from pa_tile.emu import numerics as nx

    m = "v_mfma_f32_16x16x16_f16"
    A = torch.randn(16, 16).half()
    B = torch.randn(16, 16).half()
    C = torch.randn(16, 16)

    def setup(w):
        w.v[4:6] = nx.mfma_pack_operand(m, "A", A.numpy().view(np.uint16))
        w.v[6:8] = nx.mfma_pack_operand(m, "B", B.numpy().view(np.uint16))
        w.v[256:260] = nx.mfma_pack_operand(m, "C", C.numpy())  # accumulator in a[0:3]
        w.exec = 1  # MFMA ignores EXEC
    w = run(f"{m} a[0:3], v[4:5], v[6:7], a[0:3]\n v_accvgpr_read_b32 v10, a0", setup)
    D = nx.mfma_unpack_result(m, w.v[256:260])
    ref = A.double() @ B.double() + C.double()
    assert np.abs(D - ref.numpy()).max() < 1e-5
    assert w.v[10][0] == w.v[256][0]


# --------------------------------------------------------------------------- decode-time errors

def test_unsupported_instruction_fails_at_decode_with_kernel_and_line():
    p = program("s_mov_b32 s0, 1\n v_frobnicate_b32 v0, v1")
    with pytest.raises(UnsupportedInstruction, match=r"v_frobnicate_b32 \(kernel k, line 5"):
        decode_kernel(p, "k")


def test_unsupported_modifier_is_not_ignored():
    with pytest.raises(UnsupportedInstruction, match="mul"):
        decode_kernel(program("v_mul_f32_e64 v0, v1, v2 mul:2"), "k")


# --------------------------------------------------------------------------- whole-kernel behaviour

LAUNCH = """\
\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-gfx942"
\t.type k,@function
k:
{body}
\ts_endpgm
\t.amdhsa_kernel k
\t\t.amdhsa_group_segment_fixed_size {lds}
\t\t.amdhsa_user_sgpr_count 2
\t\t.amdhsa_user_sgpr_kernarg_segment_ptr 1
\t\t.amdhsa_system_sgpr_workgroup_id_x 1
\t\t.amdhsa_system_sgpr_workgroup_id_y 1
\t\t.amdhsa_system_sgpr_workgroup_id_z 0
\t\t.amdhsa_system_vgpr_workitem_id 1
\t.end_amdhsa_kernel
"""


def _launch(body, grid, block, out, lds=0, **kw):
    p = load_program(LAUNCH.format(body=body, lds=lds))
    kernarg = struct.pack("<Qi", out.data_ptr(), 12345)
    run_kernel(p, "k", grid, block, kernarg, _mem(out), **kw)


def test_launch_state_sgprs_vgprs_exec():
    # each thread stores (wg_x, wg_y, packed tid, kernarg int) at out[flat_thread]
    out = torch.zeros(2 * 3 * 100, 4, dtype=torch.int32)
    body = """
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\ts_load_dword s6, s[0:1], 0x8
\tv_and_b32_e32 v1, 0x3ff, v0
\tv_bfe_u32 v2, v0, 10, 10
\tv_mad_u32_u24 v1, v2, 50, v1
\ts_mul_i32 s7, s3, 2
\ts_add_i32 s7, s7, s2
\ts_mul_i32 s7, s7, 100
\tv_add_u32_e32 v1, s7, v1
\tv_lshlrev_b32_e32 v1, 4, v1
\tv_mov_b32_e32 v4, s2
\tv_mov_b32_e32 v5, s3
\tv_mov_b32_e32 v6, v0
\ts_waitcnt lgkmcnt(0)
\tv_mov_b32_e32 v7, s6
\tglobal_store_dwordx4 v1, v[4:7], s[4:5]
"""
    _launch(body, (2, 3), (50, 2), out)
    out = out.reshape(3, 2, 2, 50, 4)  # [wg_y, wg_x, ty, tx, field]
    assert (out[..., 0] == torch.arange(2).reshape(1, 2, 1, 1)).all()
    assert (out[..., 1] == torch.arange(3).reshape(3, 1, 1, 1)).all()
    tid = torch.arange(50).reshape(1, 50) | (torch.arange(2).reshape(2, 1) << 10)
    assert (out[..., 2] == tid).all()  # v0 = x | y << 10; the 28 missing lanes of wave 1 never ran
    assert (out[..., 3] == 12345).all()


BARRIER_SWAP = """
\tv_lshlrev_b32_e32 v1, 2, v0
\tv_add_u32_e32 v2, 1000, v0
\tds_write_b32 v1, v2
\t{sync}
\tv_xor_b32_e32 v3, 64, v0
\tv_lshlrev_b32_e32 v3, 2, v3
\tds_read_b32 v4, v3
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\ts_waitcnt lgkmcnt(0)
\tglobal_store_dword v1, v4, s[4:5]
"""


def test_barrier_orders_lds_between_waves():
    # wave 0 reads what wave 1 wrote and vice versa
    out = torch.zeros(128, dtype=torch.int32)
    _launch(BARRIER_SWAP.format(sync="s_waitcnt lgkmcnt(0)\n\ts_barrier"), (1, 1), (128, 1), out, lds=512)
    assert (out == torch.arange(128).bitwise_xor(64) + 1000).all()


def test_missing_barrier_is_reported_as_an_lds_race():
    out = torch.zeros(128, dtype=torch.int32)
    with pytest.raises(LdsRaceError, match="write-after-read race.*wave 1.*ds_write_b32.*wave 0.*ds_read_b32"):
        _launch(BARRIER_SWAP.format(sync="s_nop 0"), (1, 1), (128, 1), out, lds=512)
    with pytest.warns(RuntimeWarning, match="race"):
        _launch(BARRIER_SWAP.format(sync="s_nop 0"), (1, 1), (128, 1), out, lds=512, lds_races="warn")


SAME_SLOT = """
\tv_mov_b32_e32 v1, 0
\tv_mov_b32_e32 v2, {value}
\tds_write_b32 v1, v2
\ts_waitcnt lgkmcnt(0)
\ts_barrier
\tds_read_b32 v4, v1
\tv_lshlrev_b32_e32 v3, 2, v0
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\ts_waitcnt lgkmcnt(0)
\tglobal_store_dword v3, v4, s[4:5]
"""


def test_waves_storing_one_constant_to_one_slot_do_not_race():
    # every thread of both waves stores the same word to LDS[0]: no order can show a difference
    out = torch.zeros(128, dtype=torch.int32)
    _launch(SAME_SLOT.format(value=7), (1, 1), (128, 1), out, lds=512)
    assert (out == 7).all()
    # the byte already holds 0 (LDS starts zeroed here): storing 0 is unobservable too
    _launch(SAME_SLOT.format(value=0), (1, 1), (128, 1), out, lds=512)
    assert (out == 0).all()
    # storing the value a slot holds races with no reader: wave 1 reads LDS[0] while wave 0 (in
    # run-to-barrier order, first) stores the 0 it already holds
    body = SAME_SLOT.format(value=0).replace("\ts_waitcnt lgkmcnt(0)\n\ts_barrier\n", "", 1)
    _launch(body, (1, 1), (128, 1), out, lds=512)
    with pytest.raises(LdsRaceError, match="read-after-write race"):
        _launch(body.replace("v_mov_b32_e32 v2, 0", "v_mov_b32_e32 v2, 3"), (1, 1), (128, 1), out, lds=512)
    # different values from the two waves are a real write-write race
    with pytest.raises(LdsRaceError, match="write-write race"):
        _launch(SAME_SLOT.format(value="v0").replace("v_mov_b32_e32 v2, v0", "v_lshrrev_b32_e32 v2, 6, v0"),
                (1, 1), (128, 1), out, lds=512)


def test_lds_oob_hardware_reads_zero_past_the_allocation_instead_of_faulting():
    from pa_tile.emu import MemoryFault
    # lane i reads LDS[32 i]: lanes 32-63 land past a 1024-byte allocation (a whole number of
    # gfx942 granules): a fault by default, 0 under lds_oob="hardware"
    body = SAME_SLOT.format(value=5).replace("\tds_read_b32 v4, v1\n", "\tv_lshlrev_b32_e32 v5, 5, v0\n"
                                             "\tds_read_b32 v4, v5\n")
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(MemoryFault, match="outside the workgroup's 1024-byte LDS allocation"):
        _launch(body, (1, 1), (64, 1), out, lds=1024)
    _launch(body, (1, 1), (64, 1), out, lds=1024, lds_oob="hardware")
    assert out[0] == 5 and (out[1:] == 0).all()
    with pytest.raises(ValueError, match="lds_oob"):
        _launch(body, (1, 1), (64, 1), out, lds=1024, lds_oob="quiet")


# --------------------------------------------------------------------------- fast paths vs numerics

def _random_f32_bits(n, seed):
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 1, 0x807FFFFF,
                        f32(1.0), f32(-1.0), 0x3F800001, 0x7F7FFFFF], np.uint32)
    bits[: special.size * 8] = np.tile(special, 8)
    # many values near 1 so that products and sums interact (cancellation, midpoints)
    near = f32(1 + rng.integers(-2 ** 12, 2 ** 12, n // 2) * 2.0 ** -12)
    bits[n // 2:] = near[: n - n // 2]
    return rng.permutation(bits)


def test_fma_and_minmax_fast_paths_equal_numerics_bit_for_bit():
    a, b, c = (asf(_random_f32_bits(64 * 200, s)) for s in (1, 2, 3))
    # include the classic double-rounding case: (1 + 2^-12)^2 + 2^-80 lands on a float64 midpoint
    a[:64], b[:64], c[:64] = np.float32(1 + 2.0 ** -12), np.float32(1 + 2.0 ** -12), np.float32(2.0 ** -80)
    with np.errstate(all="ignore"):  # as inside run_kernel: NaN/inf inputs are part of the test
        _compare_fast_paths(a, b, c)


def _compare_fast_paths(a, b, c):
    from pa_tile.emu import numerics as nx
    from pa_tile.emu.ops_valu import _fma, _max, _min

    for k in range(0, a.size, 64):
        sl = slice(k, k + 64)
        assert (f32(_fma(a[sl], b[sl], c[sl])) == f32(nx.fma_f32(a[sl], b[sl], c[sl]))).all()
        assert (f32(_max(a[sl], b[sl])) == f32(nx.max_f32(a[sl], b[sl]))).all()
        assert (f32(_min(a[sl], c[sl])) == f32(nx.min_f32(a[sl], c[sl]))).all()


def test_lockstep_schedule_interleaves_waves():
    # without a barrier, run-to-barrier order lets wave 0 read before wave 1 wrote; in lock-step
    # (quantum=1) both waves write before either reads, as they would on a CU
    out = torch.zeros(128, dtype=torch.int32)
    with pytest.warns(RuntimeWarning, match="race"):
        _launch(BARRIER_SWAP.format(sync="s_nop 0"), (1, 1), (128, 1), out, lds=512, lds_races="warn")
    assert (out[:64] != torch.arange(64, 128) + 1000).any()
    out.zero_()
    with pytest.warns(RuntimeWarning, match="race"):
        _launch(BARRIER_SWAP.format(sync="s_nop 0"), (1, 1), (128, 1), out, lds=512, lds_races="warn", quantum=1)
    assert (out == torch.arange(128).bitwise_xor(64) + 1000).all()
