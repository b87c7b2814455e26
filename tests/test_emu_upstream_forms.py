"""Instruction forms met running FlyDSL's own GEMM / MoE / conv / attention kernel tests in the
emulator (issue 16, ``scripts/check_upstream_flydsl.py --tests``). Expected values follow the
CDNA3/CDNA4 ISA guides' pseudo-code.
"""

import numpy as np

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
