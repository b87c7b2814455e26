"""What upstream FlyDSL's paged-attention kernels needed of the emulator, run GPU-harness style
(scripts/run_upstream_pa.py):

* raw ``data_ptr()`` integers handed to a launch on the simulated ``cuda`` device
  (``pa_tile.emu.device``) allow the device allocation they point into, as device memory does on
  a GPU (upstream's reduce, sliding-window and block-1024 kernels take only such pointers);
* a buffer access that is partly out of its descriptor's range touches only its in-range dwords
  (the rest read 0 / are dropped), so only those are checked against the descriptor's region
  (upstream's tile kernel reads its block table 16 bytes at a time, past the table's end).
"""

import numpy as np
import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx

from pa_tile import backend
from pa_tile.emu import device as sim
from pa_tile.emu import launch as L
from pa_tile.emu.memory import GlobalMemory, MemoryFault, buffer_load, buffer_store, decode_vsharp, encode_vsharp

LANE = np.arange(64)


def test_a_partly_in_range_buffer_access_is_checked_on_the_bytes_it_touches():
    table = torch.arange(10, dtype=torch.int32)  # 40 B, like a [2, 5] block table
    st = table.untyped_storage()
    mem = GlobalMemory([(st.data_ptr(), st.nbytes(), "block_tables")])
    rsrc = decode_vsharp(encode_vsharp(table.data_ptr(), 40))  # num_records = the table's bytes
    voff = (LANE * 16).astype(np.uint32)
    # lane 2 reads bytes 32..48: dwords 32 and 36 are in range, 40 and 44 read 0 (never touched)
    res = buffer_load(mem, rsrc, LANE < 3, 16, vaddr_offset=voff, offen=True, origin="k:1 buffer_load_dwordx4")
    got = res.data[2].view(np.int32)
    assert got.tolist() == [8, 9, 0, 0]
    assert res.data[:2].view(np.int32).reshape(-1).tolist() == list(range(8))
    src = np.full((64, 16), 0x11, np.uint8)
    buffer_store(mem, rsrc, LANE == 2, src, vaddr_offset=voff, offen=True, origin="k:2 buffer_store_dwordx4")
    assert table[8:].view(torch.uint8).eq(0x11).all()
    # a descriptor that really reaches past the table still faults on the bytes it touches
    wide = decode_vsharp(encode_vsharp(table.data_ptr(), 0xFFFFFFFF))
    with pytest.raises(MemoryFault, match="block_tables"):
        buffer_load(mem, wide, LANE == 2, 16, vaddr_offset=voff, offen=True, origin="k:3 buffer_load_dwordx4")


def test_raw_pointers_name_the_device_allocation_they_point_into():
    with sim.simulated_device("gfx942", 304):
        a = torch.zeros(64, device="cuda")
        view = a[16:32]
        got = L.pointer_regions({"out": view.data_ptr(), "n": 64, "flag": True, "pair": (a.data_ptr(), 3)})
        st = a.host.untyped_storage()
        span = (st.data_ptr(), st.nbytes())
        assert [(b, n) for b, n, _ in got] == [span]  # the whole allocation, found once
        assert got[0][2] == "out (pointer)|pair[0] (pointer)"
        assert sim.allocation_containing(st.data_ptr() + 100) == span
        host = torch.zeros(8)  # not device memory: no region
        assert L.pointer_regions({"p": host.data_ptr()}) == []
        del a, view
    assert L.pointer_regions({"p": 1 << 40}) == []  # no simulated device: nothing is device memory


@flyc.kernel
def _copy_from_int_pointer_kernel(src: fx.Int64, Out: fx.Tensor):
    tid = fx.thread_idx.x
    ptr = fx.inttoptr(fx.PointerType.get(elem_ty=fx.Float32.ir_type, address_space=fx.AddressSpace.Global,
                                         alignment=4), src)
    Out[tid] = fx.generic_load(ptr, dtype=fx.Float32) + fx.Float32(1.0)


@flyc.jit
def _copy_from_int_pointer(src: fx.Int64, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    _copy_from_int_pointer_kernel(src, Out).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)


def test_a_raw_pointer_launch_on_the_simulated_device_runs_and_is_bounded():
    with sim.simulated_device("gfx942", 304):
        backend.ensure_backend()
        src = torch.full((4,), 5.0, device="cuda")
        out = torch.zeros(64, device="cuda")
        with L.record_launches() as log:
            _copy_from_int_pointer(src.data_ptr(), out, torch.cuda.current_stream())
        assert out.cpu().eq(6.0).all()
        assert any("src (pointer)" in name for _, _, name in log[0].regions)
        # a pointer into no device allocation: the access faults
        stray = torch.full((4,), 5.0)
        with pytest.raises(MemoryFault, match="outside every allowed region"):
            _copy_from_int_pointer(stray.data_ptr(), out, torch.cuda.current_stream())
