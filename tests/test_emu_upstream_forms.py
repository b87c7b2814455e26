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


@pytest.mark.parametrize("name, M, sel", [("v_mfma_scale_f32_16x16x128_f8f6f4", 16, (0, 0, 0, 0)),
                                          ("v_mfma_scale_f32_16x16x128_f8f6f4", 16, (1, 0, 1, 1)),
                                          ("v_mfma_scale_f32_32x32x64_f8f6f4", 32, (0, 1, 1, 0))])
def test_gfx950_scaled_mfma_applies_one_e8m0_scale_per_32_k_block(name, M, sel):
    # CDNA4 §7.1.2: D = (A * scaleA) x (B * scaleB) + C, one E8M0 code (2**(e-127)) per 32 K items
    # of a row of A / a column of B; every lane holds one such block. A fp8 (cbsz:0), B fp4 (blgp:4).
    rng = np.random.default_rng(M + sum(sel))
    K, kl = 128 * 16 // M, 32
    a_items = rng.integers(0, 256, (64, kl)).astype(np.uint32)
    a_items = np.where((a_items & 0x7F) >= 0x7C, a_items & 0x3F, a_items)   # no NaN codes
    b_items = rng.integers(0, 16, (64, kl)).astype(np.uint32)
    a_codes = rng.integers(120, 135, 64).astype(np.uint32)
    b_codes = rng.integers(120, 135, 64).astype(np.uint32)
    sa_byte, sb_byte = sel[0] | sel[2] << 1, sel[1] | sel[3] << 1
    junk = rng.integers(0, 1 << 32, (2, 64), dtype=np.uint64).astype(np.uint32)
    put = lambda j, codes, byte: (junk[j] & ~np.uint32(0xFF << 8 * byte)) | (codes << np.uint32(8 * byte))  # noqa: E731
    av = nx.fp8_decode(a_items.astype(np.uint8), "ocp").astype(np.float64) * 2.0 ** (a_codes.astype(np.int64) - 127)[:, None]
    bv = nx._mini_decode(b_items.astype(np.int64), "fp4") * 2.0 ** (b_codes.astype(np.int64) - 127)[:, None]
    A = av.reshape(64 // M, M, kl).transpose(1, 0, 2).reshape(M, K)     # lane i + M*g: row i, k-block g
    B = bv.reshape(64 // M, M, kl).transpose(0, 2, 1).reshape(K, M)
    nc = M * M // 64

    def setup(w):
        w.v[0:8], w.v[8:12] = _pack_bits(a_items, 8), _pack_bits(b_items, 4)
        w.v[40], w.v[41] = put(0, a_codes, sa_byte), put(1, b_codes, sb_byte)
    mods = f"op_sel:[{sel[0]},{sel[1]},0] op_sel_hi:[{sel[2]},{sel[3]},0]"
    w = run(f"{name} v[16:{15 + nc}], v[0:7], v[8:15], 0, v40, v41 {mods} cbsz:0 blgp:4", setup, arch="gfx950")
    ref = "v_mfma_f32_16x16x4_f32" if M == 16 else "v_mfma_f32_32x32x2_f32"
    D = nx.mfma_unpack_result(ref, w.v[16:16 + nc])
    assert np.allclose(D, (A @ B).astype(np.float32), rtol=1e-6, atol=1e-30)
    assert np.isnan(nx.e8m0_scale(0xFF)) and nx.e8m0_scale(127) == 1.0


def test_scaled_mfma_is_gfx950_only():
    with pytest.raises(UnsupportedInstruction, match="does not exist on gfx942"):
        run("v_mfma_scale_f32_16x16x128_f8f6f4 v[16:19], v[0:7], v[8:15], 0, v40, v41", arch="gfx942")
