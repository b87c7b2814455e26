"""Instruction forms met running FlyDSL's own GEMM / MoE / conv / attention kernel tests in the
emulator (issue 16, ``scripts/check_upstream_flydsl.py --tests``). Expected values follow the
CDNA3/CDNA4 ISA guides' pseudo-code.
"""

import numpy as np
import pytest

from pa_tile.emu import UnsupportedInstruction
from pa_tile.emu import numerics as nx

from test_emu_ops import run


def test_s_bitset_sets_or_clears_one_bit_and_keeps_scc():
    # CDNA3 SOP1: S_BITSET1_B32  D.u32[S0.u32[4:0]] = 1;  S_BITSET0_B64  D.u64[S0.u32[5:0]] = 0
    def setup(w):
        w.s[6], w.s[7], w.s[8], w.s[9] = 0x0000_0003, 42, 0xFFFF_FFFF, 0xFFFF_FFFF
        w.scc = 1
    w = run("s_bitset1_b32 s6, 10\n s_bitset1_b32 s7, 33\n s_bitset0_b64 s[8:9], 36\n"
            " s_bitset0_b32 s6, 0", setup)
    assert w.s[6] == (0x3 | 1 << 10) & ~1
    assert w.s[7] == 42 | 1 << 1              # only S0[4:0] selects the bit
    assert (int(w.s[9]) << 32 | int(w.s[8])) == 0xFFFF_FFFF_FFFF_FFFF & ~(1 << 36)
    assert w.scc == 1


def _pack_bits(items, bits):
    """(64, n) codes -> (regs, 64) dwords, items back to back little-endian."""
    b = ((items[:, :, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(64, -1)
    return np.packbits(b, axis=1, bitorder="little").view(np.uint32).T.copy()


def _blog_k(M, K, bits, lane, item):
    """K of item *item* of *lane* in A (or B) of a gfx950 f8f6f4 MFMA, written out from the loads
    of AMD's CDNA4 matrix-core blog examples (ROCm blogs, "Matrix Core Programming on AMD CDNA3
    and CDNA4 architecture"): fp8 32x32x64, ``a_reg[i*16 + j] = A[lane % 32][(lane / 32) * 16 +
    i * 32 + j]`` (B likewise down its columns); fp4 32x32x64, 32 consecutive K from
    ``(lane / 32) * 32``. 16x16x128 is the same pattern over four lane groups, the 8-bit halves
    64 apart (what FlyDSL's MXFP8 GEMM, written for MI355, needs to match torch)."""
    g = lane // M
    if bits == 8:
        return g * 16 + (item // 16) * (K // 2) + item % 16
    return g * 32 + item


def _operand(rng, M, K, code):
    """Random codes of one operand, as an (M, K) matrix (rows of A / columns of B) and its
    (64, 32) per-lane items laid out by :func:`_blog_k`, plus the decoded values."""
    kind, bits = nx.F8F6F4_FORMATS[code]
    codes = rng.integers(0, 1 << bits, (M, K)).astype(np.uint32)
    if bits == 8:   # keep clear of the NaN/inf codes
        codes = np.where((codes & 0x7F) >= 0x7C, codes & 0x3F, codes)
        dec = nx.fp8_decode if code == 0 else nx.bf8_decode
        vals = np.asarray(dec(codes.astype(np.uint8), "ocp"), np.float64)
    else:
        vals = nx._mini_decode(codes.astype(np.int64), kind)
    lane, item = np.meshgrid(np.arange(64), np.arange(32), indexing="ij")
    items = codes[lane % M, _blog_k(M, K, bits, lane, item)]
    return vals, _pack_bits(items, bits)


@pytest.mark.parametrize("name, M, cbsz, blgp, sel", [
    ("v_mfma_scale_f32_16x16x128_f8f6f4", 16, 0, 4, (0, 0, 0, 0)),
    ("v_mfma_scale_f32_16x16x128_f8f6f4", 16, 0, 0, (1, 0, 1, 1)),
    ("v_mfma_scale_f32_16x16x128_f8f6f4", 16, 2, 1, (0, 1, 0, 0)),
    # FP4 x FP4 with op_sel bytes 2 and 3: the form FlyDSL's fp4_gemm_4wave issues
    ("v_mfma_scale_f32_16x16x128_f8f6f4", 16, 4, 4, (0, 1, 1, 1)),
    ("v_mfma_scale_f32_32x32x64_f8f6f4", 32, 0, 0, (0, 1, 1, 0)),
    ("v_mfma_scale_f32_32x32x64_f8f6f4", 32, 1, 4, (1, 1, 0, 0)),
    ("v_mfma_f32_16x16x128_f8f6f4", 16, 4, 0, None),
    ("v_mfma_f32_32x32x64_f8f6f4", 32, 3, 0, None)])
def test_gfx950_f8f6f4_mfma_follows_amds_cdna4_layouts_and_scales(name, M, cbsz, blgp, sel):
    # CDNA4 §7.1.2: D = (A * scaleA) x (B * scaleB) + C, one E8M0 code (2**(e-127)) per 32 K items
    # of a row of A / a column of B; lane i + M*g holds the scale of row (column) i, K block g.
    # Mixing an 8-bit with a 4/6-bit operand, or applying a scale per lane's own items, would
    # give a different answer: the K orders of the two operands differ.
    rng = np.random.default_rng(M + cbsz * 7 + blgp)
    K = 128 * 16 // M
    av, ra = _operand(rng, M, K, cbsz)
    bv, rb = _operand(rng, M, K, blgp)
    nc = M * M // 64
    if sel is None:
        A, B, tail, mods = av, bv, "", ""
    else:
        a_codes = rng.integers(120, 135, (K // 32, M)).astype(np.uint32)   # [k block, row]
        b_codes = rng.integers(120, 135, (K // 32, M)).astype(np.uint32)
        A = av * np.repeat(2.0 ** (a_codes.T.astype(np.int64) - 127), 32, axis=1)
        B = bv * np.repeat(2.0 ** (b_codes.T.astype(np.int64) - 127), 32, axis=1)
        sa_byte, sb_byte = sel[0] | sel[2] << 1, sel[1] | sel[3] << 1
        junk = rng.integers(0, 1 << 32, (2, 64), dtype=np.uint64).astype(np.uint32)
        put = lambda j, codes, byte: (junk[j] & ~np.uint32(0xFF << 8 * byte)) | (codes.reshape(64) << np.uint32(8 * byte))  # noqa: E731
        tail = ", v40, v41"
        mods = f" op_sel:[{sel[0]},{sel[1]},0] op_sel_hi:[{sel[2]},{sel[3]},0]"

    def setup(w):
        w.v[0:len(ra)], w.v[8:8 + len(rb)] = ra, rb
        if sel is not None:
            w.v[40], w.v[41] = put(0, a_codes, sa_byte), put(1, b_codes, sb_byte)
    w = run(f"{name} v[16:{15 + nc}], v[0:7], v[8:15], 0{tail}{mods} cbsz:{cbsz} blgp:{blgp}", setup, arch="gfx950")
    ref = "v_mfma_f32_16x16x4_f32" if M == 16 else "v_mfma_f32_32x32x2_f32"
    D = nx.mfma_unpack_result(ref, w.v[16:16 + nc])
    assert np.allclose(D, (A @ B.T).astype(np.float32), rtol=1e-6, atol=1e-30)
    assert (nx.f8f6f4_k_index(name, cbsz) == _blog_k(M, K, nx.F8F6F4_FORMATS[cbsz][1], *np.meshgrid(
        np.arange(64), np.arange(32), indexing="ij"))).all()
    assert np.isnan(nx.e8m0_scale(0xFF)) and nx.e8m0_scale(127) == 1.0


def test_scaled_mfma_is_gfx950_only():
    with pytest.raises(UnsupportedInstruction, match="does not exist on gfx942"):
        run("v_mfma_scale_f32_16x16x128_f8f6f4 v[16:19], v[0:7], v[8:15], 0, v40, v41", arch="gfx942")
