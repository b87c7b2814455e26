"""Scratch (private segment) in the emulator: ``scratch_*`` instructions address each lane's own
``.amdhsa_private_segment_fixed_size`` bytes, bounds-checked per lane; the setups a HIP runtime
would refuse for gfx942/gfx950 (architected flat scratch) are refused by name."""

import numpy as np
import pytest

from pa_tile.emu import GlobalMemory, UnsupportedInstruction, parse_asm, run_kernel
from pa_tile.emu.memory import MemoryFault

LANE = np.arange(64, dtype=np.uint32)


def kernel(body, private=64, arch="gfx942", **desc):
    extra = "".join(f"\t\t.amdhsa_{k} {v}\n" for k, v in desc.items())
    return parse_asm(
        f'\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-{arch}"\n\t.text\n\t.globl k\n\t.type k,@function\nk:\n'
        + body + "\n\ts_endpgm\n"
        f"\t.amdhsa_kernel k\n\t\t.amdhsa_private_segment_fixed_size {private}\n"
        f"\t\t.amdhsa_enable_private_segment {1 if private else 0}\n"
        "\t\t.amdhsa_user_sgpr_kernarg_segment_ptr 1\n\t\t.amdhsa_user_sgpr_count 2\n"
        f"{extra}\t.end_amdhsa_kernel\n")


def launch(prog, out, block=64):
    mem = GlobalMemory([(out.ctypes.data, out.nbytes, "out")])
    kernarg = np.array([out.ctypes.data], np.uint64).tobytes()
    run_kernel(prog, "k", (2, 1, 1), (block, 1, 1), kernarg, mem)


# Each lane spills lane*3 + workgroup id at offsets 0 and 60 (two forms), overwrites its register,
# reloads and stores the reload to out[lane]: lanes never see each other's private bytes.
SPILL = """
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\tv_mul_u32_u24_e32 v1, 3, v0
\tv_add_u32_e32 v1, s2, v1
\tscratch_store_dword off, v1, off offset:60
\tv_lshlrev_b32_e32 v2, 2, v0
\tv_mov_b32_e32 v3, 4
\tscratch_store_dwordx2 off, v[1:2], off
\tv_mov_b32_e32 v1, 0
\tv_mov_b32_e32 v2, 0
\tscratch_load_dword v5, off, off offset:60
\tscratch_load_dwordx2 v[6:7], v3, off offset:-4
\ts_waitcnt vmcnt(0) lgkmcnt(0)
\tv_add_u32_e32 v5, v5, v6
\tv_lshlrev_b32_e32 v4, 2, v0
\tglobal_store_dword v4, v5, s[4:5]
"""


def test_scratch_round_trip_is_per_lane():
    out = np.zeros(64, np.uint32)
    launch(kernel(SPILL), out)
    assert (out == 2 * (3 * LANE + 1)).all()  # the last workgroup (id 1) wrote last


def test_scratch_past_the_private_segment_faults_per_lane():
    body = "\tv_lshlrev_b32_e32 v1, 2, v0\n\tscratch_store_dword v1, v0, off offset:4\n"
    with pytest.raises(MemoryFault, match=r"lane 15 at private offset 64 .* private segment of 64 B \(49 of 64"):
        launch(kernel(body), np.zeros(64, np.uint32))
    with pytest.raises(MemoryFault, match="private offset -4"):
        launch(kernel("\tscratch_load_dword v1, off, off offset:-4\n"), np.zeros(64, np.uint32))
    # fine once the segment is large enough: 4 * 63 + 4 + 4 bytes
    launch(kernel(body, private=260), np.zeros(64, np.uint32))


def test_scratch_without_a_private_segment_and_refused_setups():
    with pytest.raises(MemoryFault, match="declares no private segment"):
        launch(kernel("\tscratch_store_dword off, v0, off\n", private=0), np.zeros(64, np.uint32))
    for flag in ("user_sgpr_private_segment_buffer", "user_sgpr_flat_scratch_init"):
        with pytest.raises(UnsupportedInstruction, match=f"{flag}.*architected flat scratch"):
            launch(kernel("\tv_nop\n", **{flag: 1}), np.zeros(64, np.uint32))
    with pytest.raises(UnsupportedInstruction, match="dynamic stack"):
        launch(kernel("\tv_nop\n", uses_dynamic_stack=1), np.zeros(64, np.uint32))
