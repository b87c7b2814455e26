"""Instruction families added for emulator coverage (issue 16): 16-bit VALU, integer clamp,
v_fma_mix*, atomics, int8 / f8f6f4 MFMA, direct-to-LDS loads, LDS transpose reads, numeric
labels, internal errors, dynamic LDS, and the decode corpus of the project's own kernels.

Expected values are worked out from the CDNA3 ISA guide's pseudo-code (CDNA3 §12.10-§12.11 for
VOP2/VOP3/VOP3P, §6.1 for clamp/op_sel/SDWA; CDNA4 for gfx950-only instructions).
"""

import numpy as np
import pytest
import torch

from pa_tile.emu import LDS, GlobalMemory, UnsupportedInstruction
from pa_tile.emu import numerics as nx
from pa_tile.emu.memory import encode_vsharp
from test_emu_ops import ALL, LANE, _launch, asf, f32, program, run

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


# --------------------------------------------------------------------------- assembly reader

def test_numeric_local_labels_forward_and_backward():
    # s1 counts down from 5; "1b" is the loop head, "1f" skips over the poison write, and the
    # second "1:" is a different label than the first.
    body = ("s_mov_b32 s1, 5\n s_mov_b32 s2, 0\n"
            "1:\n s_add_u32 s2, s2, 3\n s_sub_u32 s1, s1, 1\n s_cmp_eq_u32 s1, 0\n s_cbranch_scc0 1b\n"
            " s_branch 1f\n s_mov_b32 s2, 999\n"
            "1: s_add_u32 s2, s2, 1")
    w = run(body)
    assert w.s[2] == 16


def test_unresolvable_numeric_label_and_unknown_syntax_name_the_line():
    from pa_tile.emu.asm import AsmSyntaxError

    with pytest.raises(AsmSyntaxError, match="line 4"):
        program("s_branch 2f")
    with pytest.raises(AsmSyntaxError, match="line 4.*hwreg"):
        program("s_setreg_imm32_b32 hwreg(HW_REG_MODE, 4, 2), 3")
    # a bracketed modifier with names parses; the buffer op then refuses the modifier by name
    p = program("buffer_load_format_x v1, v0, s[0:3], 0 offen format:[BUF_FMT_32_FLOAT]")
    assert p.instructions[0].mods["format"] == ("BUF_FMT_32_FLOAT",)


# --------------------------------------------------------------------------- atomics

def _mem(*tensors):
    return GlobalMemory([(t.data_ptr(), t.numel() * t.element_size(), f"t{i}") for i, t in enumerate(tensors)])


def _ptr(w, t, s):
    w.s[s], w.s[s + 1] = t.data_ptr() & 0xFFFFFFFF, t.data_ptr() >> 32


def test_global_atomic_add_f32_returns_pre_op_values_in_lane_order():
    t = torch.tensor([0.5, 0.0], dtype=torch.float32)
    vals = (np.arange(64) + 1).astype(np.float32)

    def setup(w):
        w.mem = _mem(t)
        _ptr(w, t, 2)
        w.v[0] = np.where(LANE < 48, 0, 4).astype(np.uint32)   # 48 lanes hit t[0], 16 hit t[1]
        w.v[1] = f32(vals)
    w = run("global_atomic_add_f32 v2, v0, v1, s[2:3] sc0\n global_atomic_add_f32 v0, v1, s[2:3]", setup)
    assert t[0].item() == 0.5 + 2 * vals[:48].sum() and t[1].item() == 2 * vals[48:].sum()
    ret = asf(w.v[2])
    assert ret[0] == 0.5 and ret[1] == 1.5 and ret[47] == 0.5 + vals[:47].sum()   # serial, ascending lanes
    assert ret[48] == 0 and ret[49] == vals[48]


def test_global_atomic_integer_ops_and_cmpswap():
    t = torch.tensor([10, -5, 7, 100], dtype=torch.int32)

    def setup(w):
        w.mem = _mem(t)
        _ptr(w, t, 2)
        w.exec = 1
        w.v[0], w.v[1], w.v[2], w.v[3] = 0, 3, 42, 7
    w = run("global_atomic_smax v0, v1, s[2:3]\n global_atomic_umin v0, v1, s[2:3] offset:4\n"
            "global_atomic_cmpswap v4, v0, v[2:3], s[2:3] offset:8 sc0\n"
            "global_atomic_cmpswap v5, v0, v[2:3], s[2:3] offset:12 sc0\n"
            "global_atomic_add v6, v0, v1, s[2:3] offset:12 sc0", setup)
    assert t.tolist() == [10, 3, 42, 103]      # smax(10,3); umin(0xfffffffb,3); 7 == 7 -> 42; 100 != 7
    assert (w.v[4][0], w.v[5][0], w.v[6][0]) == (7, 100, 100)


def test_buffer_atomic_pk_add_f16_and_returning_add_with_range_check():
    h = torch.tensor([1.0, 2.0, 0.0, 0.0], dtype=torch.float16)
    u = torch.zeros(4, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(h, u)
        w.s[8:12] = encode_vsharp(h.data_ptr(), 8)
        w.s[12:16] = encode_vsharp(u.data_ptr(), 8)          # dwords 0 and 1 in range
        w.v[0] = np.where(LANE < 32, 0, 4).astype(np.uint32)
        w.v[1] = (h16(0.25) | (h16(0.5) << 16)).astype(np.uint32)
        w.v[2] = (LANE % 4 * 4).astype(np.uint32)
        w.v[3] = 1
    w = run("buffer_atomic_pk_add_f16 v1, v0, s[8:11], 0 offen\n"
            "buffer_atomic_add v3, v2, s[12:15], 0 offen sc0", setup)
    assert h.tolist() == [1.0 + 32 * 0.25, 2.0 + 32 * 0.5, 32 * 0.25, 32 * 0.5]
    assert u.tolist() == [16, 16, 0, 0]          # dwords 2, 3 are past num_records: dropped
    assert w.v[3][0] == 0 and w.v[3][4] == 1 and w.v[3][2] == 0   # pre-op values; dropped -> 0


def test_ds_atomics_and_waves_adding_to_one_address():
    # two waves of one workgroup add into one LDS dword (no barrier: atomics are not a race),
    # then thread 0 stores it; ds_add_rtn returns each lane's prefix
    out = torch.zeros(129, dtype=torch.int32)
    body = """
\tv_mov_b32_e32 v1, 0
\tv_mov_b32_e32 v2, 1
\tds_add_rtn_u32 v3, v1, v2
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\tv_lshlrev_b32_e32 v4, 2, v0
\ts_waitcnt lgkmcnt(0)
\tglobal_store_dword v4, v3, s[4:5] offset:4
\ts_barrier
\tds_read_b32 v5, v1
\ts_waitcnt lgkmcnt(0)
\tglobal_store_dword v1, v5, s[4:5]
"""
    _launch(body, (1, 1), (128, 1), out, lds=16)
    assert out[0].item() == 128
    assert sorted(out[1:].tolist()) == list(range(128))
    w = run("ds_max_rtn_i32 v3, v0, v1\n ds_cmpst_rtn_b32 v4, v0, v2, v1 offset:4\n ds_min_f32 v0, v5 offset:8",
            lambda w: (_regs(v0=np.zeros(64), v1=np.full(64, 0xFFFFFFFF), v2=np.zeros(64), v5=f32(-LANE.astype(np.float32)))(w),
                       setattr(w, "lds", LDS(64))))
    assert w.v[3][0] == 0 and w.lds.data[:4].view(np.int32)[0] == 0       # max(0, -1) = 0
    assert w.v[4][0] == 0 and w.lds.data[4:8].view(np.int32)[0] == -1     # 0 == 0 -> store -1
    assert w.lds.data[8:12].view(np.float32)[0] == -63.0


# --------------------------------------------------------------------------- internal errors

def test_internal_errors_become_emulation_errors_naming_the_instruction(monkeypatch):
    from pa_tile.emu import ops_base
    from pa_tile.emu.ops_base import EmulationError

    def broken(ctx):
        def h(w):
            return np.uint64(1) >> np.int64(1)   # numpy: no common type -> TypeError
        return h
    monkeypatch.setitem(ops_base.OPS, "v_nop", broken)
    out = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(EmulationError, match=r"internal emulator error TypeError.*v_nop.*workgroup"):
        _launch("\tv_nop", (1, 1), (64, 1), out)


_SHIFTY = ["v_lshlrev_b32 v2, v0, v1", "v_lshrrev_b32 v2, v0, v1", "v_ashrrev_i32 v2, v0, v1",
           "v_lshlrev_b64 v[2:3], v0, v[4:5]", "v_lshrrev_b64 v[2:3], v0, v[4:5]", "v_ashrrev_i64 v[2:3], v0, v[4:5]",
           "v_lshlrev_b16 v2, v0, v1", "v_lshrrev_b16 v2, v0, v1", "v_ashrrev_i16 v2, v0, v1",
           "v_bfe_u32 v2, v0, v1, v6", "v_bfe_i32 v2, v0, v1, v6", "v_alignbit_b32 v2, v0, v1, v6",
           "v_lshl_add_u32 v2, v0, v1, v6", "v_lshl_or_b32 v2, v0, v1, v6", "v_lshl_add_u64 v[2:3], v[4:5], v0, v[4:5]",
           "v_cmp_class_f32 vcc, v0, v1", "v_pk_lshlrev_b16 v2, v0, v1", "v_pk_ashrrev_i16 v2, v0, v1",
           "s_lshl_b32 s2, s0, s1", "s_lshr_b64 s[2:3], s[4:5], s1", "s_ashr_i32 s2, s0, s1", "s_ashr_i64 s[2:3], s[4:5], s1",
           "s_bfe_u32 s2, s0, s1", "s_bfe_i32 s2, s0, s1", "s_bfe_i64 s[2:3], s[4:5], s1", "s_lshl2_add_u32 s2, s0, s1"]


@pytest.mark.parametrize("line", _SHIFTY)
def test_shift_and_bitfield_ops_take_any_operand_kind(line):
    # each source replaced by a VGPR, an SGPR, a negative inline constant and a literal
    rng = np.random.default_rng(0)
    ops = line.split(None, 1)[1].split(", ")
    forms = {"v0": ["v0", "s0", "-7", "0x8000001f"], "v1": ["v1", "s1", "-1", "0xffff0011"],
             "s0": ["s0", "-3", "0x8000001f"], "s1": ["s1", "63", "0xffffff00", "-2"]}
    for i, o in enumerate(ops[1:], 1):
        for alt in forms.get(o, [o]):
            text = line.split()[0] + " " + ", ".join(ops[:i] + [alt] + ops[i + 1:])
            def setup(w):
                w.v[:8] = rng.integers(0, 2 ** 32, (8, 64), dtype=np.uint64).astype(np.uint32)
                w.s[:8] = rng.integers(0, 2 ** 32, 8, dtype=np.uint64).astype(np.uint32)
            run(text, setup)


# --------------------------------------------------------------------------- dynamic LDS

def test_lds_is_the_static_size_plus_the_launch_dynamic_bytes():
    from pa_tile.emu import MemoryFault

    out = torch.zeros(4, dtype=torch.int32)
    body = "\tv_mov_b32_e32 v1, 0x{addr:x}\n\tds_write_b32 v1, v0"
    _launch(body.format(addr=0x1FFC), (1, 1), (64, 1), out, lds=4096, dynamic_lds=4096)
    with pytest.raises(MemoryFault):
        _launch(body.format(addr=0x1FFC), (1, 1), (64, 1), out, lds=4096)
    with pytest.raises(MemoryFault):
        _launch(body.format(addr=0x2000), (1, 1), (64, 1), out, lds=4096, dynamic_lds=4096)


# --------------------------------------------------------------------------- MFMA int8, f8f6f4

# (matrix, row, col) -> (register, lane, bit) as amd_matrix_instruction_calculator prints them
# for CDNA3 (-R -c); the emulator's layouts were compared with the whole tables.
_CALC = {
    "v_mfma_i32_16x16x32_i8": [("A", 0, 8, (0, 16, 0)), ("A", 3, 5, (1, 3, 8)), ("B", 0, 3, (0, 3, 0)),
                               ("D", 1, 0, (1, 0))],
    "v_mfma_i32_32x32x16_i8": [("A", 4, 1, (0, 4, 8)), ("A", 17, 8, (0, 49, 0)), ("B", 9, 1, (0, 33, 8)),
                               ("D", 9, 0, (5, 0))],
}


@pytest.mark.parametrize("name", sorted(_CALC))
def test_int8_mfma_layout_matches_the_calculator_and_math_is_exact(name):
    L = nx.mfma_lane_layout(name)
    for which, r, c, want in _CALC[name]:
        got = L["A_where"][r, c] if which == "A" else L["B_where"][r, c] if which == "B" else L["C_where"][r, c]
        assert tuple(got) == want, (which, r, c)
    M, N, K = L["M"], L["N"], L["K"]
    rng = np.random.default_rng(3)
    A = rng.integers(-128, 128, (M, K)).astype(np.int8)
    B = rng.integers(-128, 128, (K, N)).astype(np.int8)
    C = rng.integers(-2 ** 31, 2 ** 31, (M, N)).astype(np.int32)
    ra = nx.mfma_pack_operand(name, "A", A.view(np.uint8))
    rb = nx.mfma_pack_operand(name, "B", B.view(np.uint8))
    rc = np.empty((L["c_regs"], 64), np.uint32)
    rc[L["C_where"][..., 0], L["C_where"][..., 1]] = C.view(np.uint32)
    n = L["c_regs"]

    def setup(w):
        w.v[0:2], w.v[2:4], w.v[8:8 + n] = ra, rb, rc
    w = run(f"{name} v[8:{7 + n}], v[0:1], v[2:3], v[8:{7 + n}]", setup)
    D = w.v[8:8 + n][L["C_where"][..., 0], L["C_where"][..., 1]].view(np.int32)
    want = ((A.astype(np.int64) @ B.astype(np.int64) + C) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    assert (D == want).all()


def _pack_bits(items, bits):
    """(64, n) codes -> (regs, 64) dwords, items back to back little-endian."""
    b = ((items[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(64, -1)
    return np.packbits(b, axis=1, bitorder="little").view(np.uint32).T.copy()


@pytest.mark.parametrize("cbsz, blgp", [(0, 1), (2, 4), (3, 3)])
def test_gfx950_f8f6f4_mfma_formats(cbsz, blgp):
    rng = np.random.default_rng(cbsz * 10 + blgp)
    name = "v_mfma_f32_16x16x128_f8f6f4"
    kl = 32
    vals = {}
    regs = []
    for which, code in (("A", cbsz), ("B", blgp)):
        kind, bits = nx.F8F6F4_FORMATS[code]
        items = rng.integers(0, 1 << bits, (64, kl)).astype(np.uint32)
        if bits == 8:   # keep clear of the NaN/inf codes
            items = np.where((items & 0x7F) >= 0x7C, items & 0x3F, items)
            v = nx.fp8_decode(items.astype(np.uint8), "ocp") if code == 0 else nx.bf8_decode(items.astype(np.uint8), "ocp")
        else:
            v = nx._mini_decode(items.astype(np.int64), kind)
        vals[which] = np.asarray(v, np.float64)
        regs.append(_pack_bits(items, bits))
    A = vals["A"].reshape(4, 16, kl).transpose(1, 0, 2).reshape(16, 128)
    B = vals["B"].reshape(4, 16, kl).transpose(0, 2, 1).reshape(128, 16)
    na, nb = len(regs[0]), len(regs[1])

    def setup(w):
        w.v[0:na], w.v[8:8 + nb] = regs
    w = run(f"{name} v[16:19], v[0:7], v[8:15], 0 cbsz:{cbsz} blgp:{blgp}", setup, arch="gfx950")
    D = nx.mfma_unpack_result("v_mfma_f32_16x16x4_f32", w.v[16:20])
    assert np.allclose(D, (A @ B).astype(np.float32), rtol=1e-6, atol=1e-30)
    assert (nx._mini_decode(np.arange(8), "fp4") == [0, 0.5, 1, 1.5, 2, 3, 4, 6]).all()
    with pytest.raises(UnsupportedInstruction, match="does not exist on gfx942"):
        run(f"{name} v[16:19], v[0:7], v[8:15], 0", arch="gfx942")


# --------------------------------------------------------------------------- LDS: direct loads, transpose

@pytest.mark.parametrize("arch, width, n", [("gfx942", "dword", 4), ("gfx950", "dwordx4", 16)])
def test_buffer_load_to_lds_uses_m0_and_packs_lanes(arch, width, n):
    src = torch.arange(64 * 4, dtype=torch.int32)

    def setup(w):
        w.mem = _mem(src)
        w.lds = LDS(8192)
        w.s[8:12] = encode_vsharp(src.data_ptr(), 64 * 16 - 16)   # the last lane's 16 bytes are out of range
        w.v[0] = (63 - LANE) * n                                   # lanes read in reverse
        w.m0 = 1024
        w.exec = ALL & ~2                                          # lane 1 off
        w.v[5] = 77
    w = run(f"buffer_load_{width} v0, s[8:11], 0 offen offset:16 lds", setup, arch=arch)
    got = w.lds.data[1024 + 16: 1024 + 16 + 64 * n].view(np.int32).reshape(64, n // 4)
    # inst offset:16 also moves the global address: 4 dwords further
    want = ((63 - LANE)[:, None] * (n // 4) + np.arange(n // 4) + 4).astype(np.int32)
    if n == 16:
        want[0] = 0           # lane 0 reads bytes 1008..1023: past num_records -> 0
    assert (got[0] == want[0]).all() and (got[2:] == want[2:]).all()
    assert (got[1] == 0).all() and w.v[5][0] == 77             # inactive lane: no LDS write; VGPRs untouched


def test_buffer_load_dwordx4_to_lds_is_gfx950_only():
    with pytest.raises(UnsupportedInstruction, match="gfx950 only"):
        run("buffer_load_dwordx4 v0, s[8:11], 0 offen lds", arch="gfx942")


def test_ds_read_b64_tr_b16_transposes_4x16():
    # LDS holds 16-bit element (lane, e) = lane * 4 + e at lane * 8 + 2 * e
    def setup(w):
        w.lds = LDS(1024)
        w.lds.data[:512] = np.arange(256, dtype=np.uint16).view(np.uint8)
        w.v[0] = LANE * 8
    w = run("ds_read_b64_tr_b16 v[2:3], v0", setup, arch="gfx950")
    got = np.stack([w.v[2] & 0xFFFF, w.v[2] >> 16, w.v[3] & 0xFFFF, w.v[3] >> 16], axis=1)
    # lane 0 gets element 0 of lanes 0, 4, 8, 12; lane 5 gets element 1 of lanes 1, 5, 9, 13
    assert got[0].tolist() == [0, 16, 32, 48]
    assert got[5].tolist() == [1 * 4 + 1, 5 * 4 + 1, 9 * 4 + 1, 13 * 4 + 1]
    assert got[16 + 14].tolist() == [(16 + 3) * 4 + 2, (16 + 7) * 4 + 2, (16 + 11) * 4 + 2, (16 + 15) * 4 + 2]
    with pytest.raises(UnsupportedInstruction, match="does not exist on gfx942"):
        run("ds_read_b64_tr_b16 v[2:3], v0", arch="gfx942")


def test_f64_adds_and_gfx950_bitop3_b16():
    def setup(w):
        x = np.full(64, 0.1, np.float64).view(np.uint32).reshape(64, 2).T
        w.v[4:6] = x
        w.v[0], w.v[1], w.s[2] = 0xFFF0, 0x0FF0, 0x00FF
    w = run("v_add_f64 v[2:3], v[4:5], 0.5\n v_mul_f64 v[6:7], v[4:5], v[4:5]\n"
            "v_bitop3_b16 v8, v0, v1, s2 bitop3:0xec", setup, arch="gfx950")
    f = lambda r: np.ascontiguousarray(w.v[r:r + 2].T).view(np.float64)[:, 0]  # noqa: E731
    assert f(2)[0] == 0.1 + 0.5 and f(6)[0] == 0.1 * 0.1
    tt, a, b, c = 0xEC, 0xFFF0, 0x0FF0, 0x00FF
    want = sum(((tt >> (((a >> k & 1) << 2) | ((b >> k & 1) << 1) | (c >> k & 1))) & 1) << k for k in range(16))
    assert w.v[8][0] == want
