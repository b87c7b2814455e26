"""Instruction families added for emulator coverage (issue 16): 16-bit VALU, integer clamp,
v_fma_mix*, atomics, int8 / f8f6f4 MFMA, direct-to-LDS loads, LDS transpose reads, numeric
labels, internal errors, dynamic LDS, and the decode corpus of the project's own kernels.

Expected values are worked out from the CDNA3 ISA guide's pseudo-code (CDNA3 §12.10-§12.11 for
VOP2/VOP3/VOP3P, §6.1 for clamp/op_sel/SDWA; CDNA4 for gfx950-only instructions).
"""

import numpy as np
import pytest

from pa_tile.emu import UnsupportedInstruction, Wave, run_wave
from test_emu_ops import ALL, LANE, asf, f32, program, run

H = np.float16


def h16(x):
    return np.asarray(x, H).view(np.uint16).astype(np.uint32)


# --------------------------------------------------------------------------- 16-bit VALU

def _regs(**rows):
    def setup(w):
        for k, v in rows.items():
            w.v[int(k[1:])] = np.asarray(v, np.uint32)
    return setup


def test_u16_add_sub_mul_wrap_and_zero_the_high_half():
    a = (LANE * 1000 + 0xABCD0000).astype(np.uint32)   # high halves are ignored
    b = (LANE * 7 + 65000).astype(np.uint32)
    w = run("v_add_u16_e32 v2, v0, v1\n v_sub_u16_e32 v3, v0, v1\n v_mul_lo_u16_e32 v4, v0, v1\n"
            " v_subrev_u16_e32 v5, v0, v1", _regs(v0=a, v1=b))
    a16, b16 = (a & 0xFFFF).astype(np.int64), (b & 0xFFFF).astype(np.int64)
    assert (w.v[2] == (a16 + b16) & 0xFFFF).all()
    assert (w.v[3] == (a16 - b16) & 0xFFFF).all()
    assert (w.v[4] == (a16 * b16) & 0xFFFF).all()
    assert (w.v[5] == (b16 - a16) & 0xFFFF).all()


def test_u16_and_i16_clamp_saturate():
    w = run("v_add_u16_e64 v2, v0, v1 clamp\n v_sub_u16_e64 v3, v1, v0 clamp\n v_add_i16 v4, v0, v1 clamp\n"
            " v_sub_i16 v5, v1, v0 clamp", _regs(v0=np.full(64, 0x7000), v1=np.full(64, 0x2000)))
    assert w.v[2][0] == 0x9000        # no unsigned overflow
    assert w.v[3][0] == 0             # 0x2000 - 0x7000 < 0
    assert w.v[4][0] == 0x7FFF        # 0x7000 + 0x2000 > i16 max
    assert w.v[5][0] == 0xB000        # 0x2000 - 0x7000 = -0x5000 fits


def test_i32_u32_clamp_on_e64_adds():
    w = run("v_add_u32_e64 v2, v0, v1 clamp\n v_sub_u32_e64 v3, v1, v0 clamp\n v_add_i32 v4, v0, v0 clamp\n"
            " v_sub_i32 v5, v6, v0 clamp\n v_add_u32_e64 v7, v0, v0",
            _regs(v0=np.full(64, 0x7FFFFFF0), v1=np.full(64, 0x90000000), v6=np.full(64, 0x80000005)))
    assert w.v[2][0] == 0xFFFFFFFF and w.v[3][0] == 0x10000010
    assert w.v[4][0] == 0x7FFFFFFF and w.v[5][0] == 0x80000000
    assert w.v[7][0] == 0xFFFFFFE0    # without clamp it wraps


def test_16_bit_shifts_min_max_mad():
    a = np.full(64, 0xF0F0, np.uint32)
    w = run("v_lshlrev_b16_e32 v2, 20, v0\n v_lshrrev_b16_e32 v3, 4, v0\n v_ashrrev_i16_e32 v4, 4, v0\n"
            " v_max_i16_e32 v5, 1, v0\n v_max_u16_e32 v6, 1, v0\n v_min_i16_e32 v7, 1, v0\n"
            " v_mad_u16 v8, v0, 3, 7\n v_mad_i32_i16 v9, v0, 3, 7\n v_mad_u32_u16 v10, v0, v0, 1",
            _regs(v0=a))
    assert w.v[2][0] == 0x0F00        # shift count is S0[3:0] = 4
    assert w.v[3][0] == 0x0F0F and w.v[4][0] == 0xFF0F
    assert w.v[5][0] == 1 and w.v[6][0] == 0xF0F0 and w.v[7][0] == 0xF0F0
    assert w.v[8][0] == (0xF0F0 * 3 + 7) & 0xFFFF
    assert w.v[9][0] == (-0x0F10 * 3 + 7) & 0xFFFFFFFF
    assert w.v[10][0] == 0xF0F0 * 0xF0F0 + 1


def test_16_bit_sdwa_and_op_sel_place_the_result():
    a = np.full(64, 0x00050003, np.uint32)
    w = run("v_mov_b32_e32 v2, 0x11112222\n"
            "v_add_u16_sdwa v2, v0, v0 dst_sel:WORD_1 dst_unused:UNUSED_PRESERVE src0_sel:WORD_1 src1_sel:WORD_0\n"
            "v_mov_b32_e32 v3, 0x11112222\n v_mul_lo_u16_sdwa v3, v0, v0 dst_sel:WORD_0 dst_unused:UNUSED_PAD "
            "src0_sel:WORD_1 src1_sel:WORD_1\n"
            "v_mov_b32_e32 v4, 0x11112222\n v_add_u16_e64 v4, v0, v0 op_sel:[1,0,1]", _regs(v0=a))
    assert w.v[2][0] == 0x00082222
    assert w.v[3][0] == 25
    assert w.v[4][0] == 0x00082222


def test_f16_ops_and_compares():
    a, b = h16(np.full(64, 1.5)), h16(np.full(64, -2.25))
    w = run("v_subrev_f16_e32 v2, v0, v1\n v_max3_f16 v3, v0, v1, 2.0\n v_cvt_f16_u16_e32 v4, 300\n"
            " v_cvt_u16_f16_e32 v5, v0\n v_cvt_i16_f16_e32 v6, v1\n v_cmp_class_f16_e64 s[2:3], v1, 8\n"
            " v_add_f16_e64 v7, v0, v0 clamp", _regs(v0=a, v1=b))
    assert w.v[2][0] == h16(-3.75) and w.v[3][0] == h16(2.0) and w.v[4][0] == h16(300)
    assert w.v[5][0] == 1 and w.v[6][0] == 0xFFFE
    assert w.s[2] == 0xFFFFFFFF    # -2.25 is a negative normal (class bit 3)
    assert w.v[7][0] == h16(1.0)


def test_packed_16_bit_integer_ops():
    a = np.full(64, 0x0003FFFE, np.uint32)   # (hi, lo) = (3, -2)
    b = np.full(64, 0x00050004, np.uint32)
    w = run("v_pk_sub_u16 v2, v0, v1\n v_pk_mul_lo_u16 v3, v0, v1\n v_pk_max_i16 v4, v0, v1\n"
            " v_pk_ashrrev_i16 v5, 1, v0 op_sel_hi:[0,1]\n v_pk_mad_i16 v6, v0, v1, v1", _regs(v0=a, v1=b))
    assert w.v[2][0] == 0xFFFEFFFA
    assert w.v[3][0] == ((15 << 16) | ((0xFFFE * 4) & 0xFFFF))
    assert w.v[4][0] == 0x00050004
    assert w.v[5][0] == 0x0001FFFF
    assert w.v[6][0] == ((20 << 16) | ((-8 + 4) & 0xFFFF))


# --------------------------------------------------------------------------- v_fma_mix

def test_fma_mix_f32_selects_f16_halves_with_op_sel():
    a = (h16(1.5) | (h16(-3.0) << 16)).astype(np.uint32)
    b = np.full(64, f32(0.25), np.uint32)
    c = (h16(0.5) << 16).astype(np.uint32)
    w = run("v_fma_mix_f32 v3, v0, v1, v2 op_sel:[1,0,1] op_sel_hi:[1,0,1]\n"
            "v_fma_mix_f32 v4, -v0, |v1|, v1 op_sel_hi:[1,0,0]", _regs(v0=a, v1=b, v2=c))
    assert asf(w.v[3])[0] == np.float32(-3.0 * 0.25 + 0.5)
    assert asf(w.v[4])[0] == np.float32(-1.5 * 0.25 + 0.25)


def test_fma_mixlo_mixhi_round_once_and_keep_the_other_half():
    # 1 + 2^-11 + 2^-30 rounds up to 1 + 2^-10 in one rounding; rounding to f32 first would
    # keep 2^-30 and still round up -- pick operands where two roundings differ instead:
    # x = 1 + 2^-11 exactly (a tie in f16, RNE -> 1.0), plus 2^-40 (exact result above the tie).
    a = np.full(64, f32(1.0 + 2.0 ** -11), np.uint32)
    b = np.full(64, f32(1.0), np.uint32)
    c = np.full(64, f32(2.0 ** -40), np.uint32)
    w = run("v_mov_b32_e32 v3, 0xAAAA5555\n v_fma_mixlo_f16 v3, v0, v1, v2\n"
            "v_mov_b32_e32 v4, 0xAAAA5555\n v_fma_mixhi_f16 v4, v0, v1, v2 clamp", _regs(v0=a, v1=b, v2=c))
    up = int(h16(1.0 + 2.0 ** -10)[()])
    assert w.v[3][0] == (0xAAAA0000 | up)
    assert w.v[4][0] == ((int(h16(1.0)[()]) << 16) | 0x5555)    # clamp to [0, 1]
