"""The emulator's sanitizer on FlyDSL kernels with planted out-of-bounds accesses.

Each kernel goes through FlyDSL's normal launcher into the emulator (``pa_tile.emu.launch``) and
must fail with a :class:`MemoryFault` naming the instruction, the lane and the address:

* a global load just past a tensor, a global store just past a tensor;
* an LDS write past the workgroup's LDS allocation.

The tensors are numpy views of a larger buffer handed over with ``flyc.from_dlpack``: the
sanitizer allows exactly the bytes such a view spans, and the bytes after it belong to the
larger buffer, so the first byte past the view is guaranteed to be outside every allowed region
(with separately allocated tensors a neighbouring allocation could in principle sit there).
"""

import numpy as np
import pytest

import flydsl.compiler as flyc
import flydsl.expr as fx
from pa_tile import backend
from pa_tile.emu import launch as L
from pa_tile.emu.memory import MemoryFault

N = 64  # one wave, one element per lane


@flyc.kernel
def shifted_load_kernel(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    tid = fx.thread_idx.x
    Dst[tid] = Src[tid + shift]


@flyc.jit
def shifted_load(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    shifted_load_kernel(Src, Dst, shift).launch(grid=(1, 1, 1), block=(N, 1, 1))


@flyc.kernel
def shifted_store_kernel(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    tid = fx.thread_idx.x
    Dst[tid + shift] = Src[tid]


@flyc.jit
def shifted_store(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    shifted_store_kernel(Src, Dst, shift).launch(grid=(1, 1, 1), block=(N, 1, 1))


@fx.struct
class SmallSmem:
    tile: fx.Array[fx.Float32, N]


@flyc.kernel
def lds_shift_kernel(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    tid = fx.thread_idx.x
    s = fx.SharedAllocator().allocate(SmallSmem).peek().tile.view(fx.make_layout(N, 1))
    s[tid + shift] = Src[tid]
    fx.gpu.barrier()
    Dst[tid] = s[tid]


@flyc.jit
def lds_shift(Src: fx.Tensor, Dst: fx.Tensor, shift: fx.Int32):
    lds_shift_kernel(Src, Dst, shift).launch(grid=(1, 1, 1), block=(N, 1, 1))


@pytest.fixture(scope="module", autouse=True)
def emulator():
    # Emulator tier only: installing the hook cannot be undone in-process, so on a machine whose
    # backend is a real GPU this module skips rather than route later GPU tests to the emulator.
    if backend.ensure_backend() != "emu":
        pytest.skip("emulator-tier test; this process runs on a GPU backend")
    assert L.is_installed()


@pytest.fixture
def buffers():
    """Two float32 views of N elements, each followed by N bytes nobody passed to the kernel."""
    rng = np.random.default_rng(0)
    pad_src = rng.standard_normal(2 * N).astype(np.float32)
    pad_dst = np.full(2 * N, -1.0, np.float32)
    return pad_src, pad_dst, pad_src[:N], pad_dst[:N]


def _run(fn, src, dst, shift):
    return fn(flyc.from_dlpack(src), flyc.from_dlpack(dst), shift)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_in_bounds_runs_and_the_regions_are_exactly_the_views(arch, buffers, monkeypatch):
    monkeypatch.setenv("ARCH", arch)
    pad_src, pad_dst, src, dst = buffers
    with L.record_launches() as log:
        _run(shifted_load, src, dst, 0)
    assert np.array_equal(dst, src) and (pad_dst[N:] == -1).all()
    assert sorted(r for r in log[0].regions if r[2] in ("Src", "Dst")) == sorted(
        [(src.ctypes.data, 4 * N, "Src"), (dst.ctypes.data, 4 * N, "Dst")])


def test_global_load_past_a_tensor_names_instruction_lane_and_address(buffers):
    _, pad_dst, src, dst = buffers
    with pytest.raises(MemoryFault) as info:
        _run(shifted_load, src, dst, 3)  # lanes 61..63 read the 3 floats after Src
    e = info.value
    assert e.space == "global" and "load" in e.origin and (e.lane, e.address) == (61, src.ctypes.data + 4 * N)
    assert tuple(e.bad_lanes) == (61, 62, 63)
    msg = str(e)
    assert "by lane 61" in msg and f"{src.ctypes.data + 4 * N:#x}" in msg and "'Src'" in msg
    assert "0 B past its end" in msg
    # the instruction: its mnemonic and assembly line, in the message and the emulator's note
    assert any(m in msg for m in ("global_load_dword", "buffer_load_dword"))
    assert any("while executing line" in n for n in e.__notes__)
    assert (pad_dst == -1).all()  # nothing after the fault ran: Dst untouched


def test_global_store_past_a_tensor_names_instruction_lane_and_address(buffers):
    _, pad_dst, src, dst = buffers
    with pytest.raises(MemoryFault) as info:
        _run(shifted_store, src, dst, N)  # every lane writes past Dst
    e = info.value
    assert e.space == "global" and (e.lane, e.address) == (0, dst.ctypes.data + 4 * N)
    assert len(e.bad_lanes) == N
    msg = str(e)
    assert "store of 4 B by lane 0" in msg and f"{dst.ctypes.data + 4 * N:#x}" in msg and "'Dst'" in msg
    assert any(m in msg for m in ("global_store_dword", "buffer_store_dword"))
    assert (pad_dst[N:] == -1).all()  # the bytes after Dst were never written


def test_lds_access_past_the_workgroups_lds_names_instruction_lane_and_address(buffers):
    _, _, src, dst = buffers
    _run(lds_shift, src, dst, 0)
    assert np.array_equal(dst, src)
    with L.record_launches() as log, pytest.raises(MemoryFault) as info:
        _run(lds_shift, src, dst, 2)  # lanes 62, 63 write the two floats after the 256-byte array
    lds_bytes = log[0].meta.group_segment_fixed_size
    assert lds_bytes >= 4 * N
    e = info.value
    assert lds_bytes == 4 * N  # the kernel's only LDS is the 64-float array
    assert e.space == "lds" and (e.lane, e.address) == (62, 4 * N) and tuple(e.bad_lanes) == (62, 63)
    msg = str(e)
    assert f"by lane {e.lane} at {e.address:#x}" in msg and f"{lds_bytes}-byte LDS allocation" in msg
    assert "ds_write" in msg


def test_overread_reaches_the_launch_and_gives_no_slack_to_loads_starting_past_a_tensor(buffers):
    # launch_options(overread=n) is the launch's GlobalMemory(overread=n): it lets a load that
    # starts inside a tensor run past its end (memory tests), not one that starts after it
    _, pad_dst, src, dst = buffers
    with L.launch_options(overread=16), L.record_launches() as log, pytest.raises(MemoryFault) as info:
        _run(shifted_load, src, dst, 3)
    assert log[0].overread == 16 and tuple(info.value.bad_lanes) == (61, 62, 63)
    with L.launch_options(overread=16), L.record_launches() as log:
        _run(shifted_load, src, dst, 0)
    assert np.array_equal(dst, src) and log[0].overreads == 0   # nothing used the slack
    with pytest.raises(ValueError, match="overread"):
        with L.launch_options(overread=-4):
            pass
