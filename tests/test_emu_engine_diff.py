"""Differential test of the emulator's engines: the same launches under ``reference`` and ``fast``
(pa_tile.emu.machine.ENGINES) must give the same bits everywhere.

* Real kernels: every stage's ``paged_decode`` (s1..s6: stage 6 is the finished kernel, split-K
  plus its reduce) on gfx942 and gfx950, run by both engines on the same tensors
  (``pa_tile.perf.emu_speed.compare``): every output byte and every trace record (instruction
  counts, each global/buffer/LDS access, scalar loads up to where each launch's kernarg segment
  landed) must be equal.
* The sanitizer: LDS races (raised and warned, with the same message naming the same waves and
  instructions), an out-of-bounds global access (the same fault message) and the final memory of
  a racy run under ``lds_races="warn"`` (the schedule's answer) are the same under both engines.
"""

import struct
import warnings

import numpy as np
import pytest
import torch

from pa_tile import backend
from pa_tile.emu import GlobalMemory, MemoryFault, load_program, ops_fast, run_kernel
from pa_tile.emu.ops_ds import LdsRaceError
from pa_tile.perf import emu_speed

ARCHS = ["gfx942", "gfx950"]
ENGINES = ("reference", "fast")


@pytest.fixture(autouse=True)
def _emu_backend():
    backend.set_backend("emu")
    yield
    backend.set_backend(None)


def test_the_fast_engine_really_runs_its_fast_paths():
    """Otherwise the comparisons below would compare the reference engine with itself."""
    assert ops_fast.available()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stage", ["s1", "s2", "s3", "s4", "s5", "s6"])
def test_stage_kernels_give_identical_bytes_and_traces(stage, arch):
    # two sequences of different lengths: different loop trip counts, a partial last tile; the
    # finished kernel long enough to split a sequence into several partitions for its reduce
    context = [37, 700] if stage == "s6" else [37, 70]
    c = emu_speed.compare(arch, stage, num_seqs=2, num_q_heads=8, context=context, engines=ENGINES)
    assert c.identical, f"{stage} {arch}: the engines differ"
    assert all(r.ok for r in c.results.values())
    assert c.results["fast"].instructions == c.results["reference"].instructions > 1000


def test_trace_comparison_notices_a_difference():
    a = (10, [("v_add", 3)], [(1, 0, "buffer_load_dword", 5, 4096)], [], [(1, 0, "s_load_dword", 3, 100, 4)])
    assert emu_speed.same_trace(a, a, 1)
    moved = a[:4] + ([(1, 0, "s_load_dword", 3, 164, 4)],)
    assert emu_speed.same_trace(a, moved, 1)       # a kernarg segment elsewhere
    assert not emu_speed.same_trace(a, moved, 0)
    other = (10, [("v_add", 3)], [(1, 0, "buffer_load_dword", 5, 4100)], [], a[4])
    assert not emu_speed.same_trace(a, other, 1)
    buffer_moved = a[:4] + ([(1, 0, "s_buffer_load_dword", 3, 164, 4)],)
    assert not emu_speed.same_trace(a, buffer_moved, 1)
    in_tensor = a[:4] + ([(1, 0, "s_load_dword", 3, ("offsets", 4), 4)],)
    assert emu_speed.same_trace(in_tensor, in_tensor, 1)
    other_offset = a[:4] + ([(1, 0, "s_load_dword", 3, ("offsets", 8), 4)],)
    assert not emu_speed.same_trace(in_tensor, other_offset, 1)


# --------------------------------------------------------------------------- the sanitizer

LAUNCH = """\t.amdgcn_target "amdgcn-amd-amdhsa--{arch}"
\t.text
\t.globl k
\t.type k,@function
k:
{body}
\ts_endpgm
\t.amdhsa_kernel k
\t\t.amdhsa_group_segment_fixed_size 512
\t\t.amdhsa_user_sgpr_count 2
\t\t.amdhsa_user_sgpr_kernarg_segment_ptr 1
\t\t.amdhsa_system_sgpr_workgroup_id_x 1
\t\t.amdhsa_system_vgpr_workitem_id 0
\t.end_amdhsa_kernel
"""

# waves 0 and 1 swap LDS words; {sync} is a barrier (race-free) or nothing (a race). The values go
# through a max3 and an fma (fast-engine instructions) on their way.
SWAP = """
\tv_lshlrev_b32_e32 v1, 2, v0
\tv_cvt_f32_u32_e32 v2, v0
\tv_max3_f32 v2, v2, 0.5, v2
\tds_write_b32 v1, v2
\t{sync}
\tv_xor_b32_e32 v3, 64, v0
\tv_lshlrev_b32_e32 v3, 2, v3
\tds_read_b32 v4, v3
\tv_fma_f32 v4, v4, 2.0, 1.0
\ts_load_dwordx2 s[4:5], s[0:1], 0x0
\ts_waitcnt lgkmcnt(0)
\tglobal_store_dword v{addr}, v4, s[4:5]
"""


def _launch(arch, engine, body, out, **kw):
    p = load_program(LAUNCH.format(arch=arch, body=body))
    mem = GlobalMemory([(out.data_ptr(), out.numel() * out.element_size(), "out")])
    run_kernel(p, "k", (2, 1, 1), (128, 1, 1), struct.pack("<Q", out.data_ptr()), mem, arch=arch,
               engine=engine, **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_race_free_swap_is_identical(arch):
    outs = []
    for engine in ENGINES:
        out = torch.zeros(128, dtype=torch.float32)
        _launch(arch, engine, SWAP.format(sync="s_waitcnt lgkmcnt(0)\n\ts_barrier", addr=1), out)
        outs.append(out.numpy().tobytes())
    assert outs[0] == outs[1]
    assert np.array_equal(np.frombuffer(outs[0], np.float32), np.maximum(np.arange(128) ^ 64, 0.5) * 2.0 + 1.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_race_findings_are_identical(arch):
    body = SWAP.format(sync="s_nop 0", addr=1)
    raised, warned, results = [], [], []
    for engine in ENGINES:
        out = torch.zeros(128, dtype=torch.float32)
        with pytest.raises(LdsRaceError) as e:
            _launch(arch, engine, body, out)
        raised.append(str(e.value))
        out = torch.zeros(128, dtype=torch.float32)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            _launch(arch, engine, body, out, lds_races="warn")
        warned.append(sorted(str(x.message) for x in w))
        results.append(out.numpy().tobytes())
    assert raised[0] == raised[1] and "ds_write_b32" in raised[0] and "ds_read_b32" in raised[0]
    assert warned[0] == warned[1] and warned[0]
    assert results[0] == results[1]   # the schedule's (racy) answer, the same under both


@pytest.mark.parametrize("arch", ARCHS)
def test_out_of_bounds_fault_is_identical(arch):
    # lane i stores at out + 4 * (i ^ 64) + 512: the upper lanes run past the 512-byte tensor
    body = SWAP.format(sync="s_waitcnt lgkmcnt(0)\n\ts_barrier", addr=5).replace(
        "\tglobal_store_dword", "\tv_add_u32_e32 v5, 0x100, v1\n\tglobal_store_dword")
    msgs = []
    out = torch.zeros(96, dtype=torch.float32)   # one tensor: the message names its addresses
    for engine in ENGINES:
        with pytest.raises(MemoryFault) as e:
            _launch(arch, engine, body, out)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "outside every allowed region" in msgs[0]
