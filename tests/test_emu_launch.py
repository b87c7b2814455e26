"""FlyDSL's real @flyc.jit host path runs on CPU tensors and hands each launch to pa_tile's launcher.

The launch handler here stands in for the emulator: it does the kernel's work in numpy using
nothing but the kernarg bytes, which proves the pointers, layouts and hidden values are right.
"""

import ctypes
import os
import struct
import traceback
import types

import numpy as np
import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx

from pa_tile import toolchain
from pa_tile.emu import launch as L


@flyc.kernel
def add_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, tiled_copy: fx.TiledCopy):
    tid = fx.thread_idx.x
    bm, bn = fx.block_idx.x, fx.block_idx.y
    tile = tiled_copy.tile_mn
    thr = tiled_copy.get_slice(tid)
    ga = thr.partition_S(fx.flat_divide(A, tile)[None, None, bm, bn])
    gb = thr.partition_S(fx.flat_divide(B, tile)[None, None, bm, bn])
    gc = thr.partition_D(fx.flat_divide(C, tile)[None, None, bm, bn])
    ra, rb, rc = fx.make_fragment_like(ga), fx.make_fragment_like(gb), fx.make_fragment_like(gc)
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    fx.copy(atom, ga, ra)
    fx.copy(atom, gb, rb)
    rc.store(ra.load() + rb.load())
    fx.copy(atom, rc, gc)


@flyc.kernel
def add_kernel_reading_grid(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, tiled_copy: fx.TiledCopy):
    # `% grid_dim` / `% block_dim` are identities that make the kernel read hidden arguments.
    tid = fx.thread_idx.x % fx.block_dim.x
    bm, bn = fx.block_idx.x % fx.grid_dim.x, fx.block_idx.y % fx.grid_dim.y
    tile = tiled_copy.tile_mn
    thr = tiled_copy.get_slice(tid)
    ga = thr.partition_S(fx.flat_divide(A, tile)[None, None, bm, bn])
    gb = thr.partition_S(fx.flat_divide(B, tile)[None, None, bm, bn])
    gc = thr.partition_D(fx.flat_divide(C, tile)[None, None, bm, bn])
    ra, rb, rc = fx.make_fragment_like(ga), fx.make_fragment_like(gb), fx.make_fragment_like(gc)
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    fx.copy(atom, ga, ra)
    fx.copy(atom, gb, rb)
    rc.store(ra.load() + rb.load())
    fx.copy(atom, rc, gc)


def _tiled():
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    return fx.make_tiled_copy_tv(
        atom, fx.make_ordered_layout((8, 16), order=(1, 0)), fx.make_ordered_layout((1, 4), order=(0, 1))
    )


@flyc.jit
def vadd(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    tc = _tiled()
    tm, tn = tc.tile_mn.unpack()
    M, N = A.shape.unpack()
    add_kernel(A, B, C, tc).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)


@flyc.jit
def vadd_grid(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    tc = _tiled()
    tm, tn = tc.tile_mn.unpack()
    M, N = A.shape.unpack()
    add_kernel_reading_grid(A, B, C, tc).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)


@flyc.jit
def vadd_twice(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    tc = _tiled()
    tm, tn = tc.tile_mn.unpack()
    M, N = A.shape.unpack()
    add_kernel(A, B, C, tc).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)
    add_kernel(C, B, A, tc).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)


# ------------------------------------------------------------------ the stand-in emulator

TENSOR_ARGS = 3  # each fx.Tensor: an 8-byte pointer + a {i32 M, i32 N, i64 stride0} layout struct


def decode_tensor_args(launch):
    """[(pointer, (M, N), stride0)] for the three fx.Tensor parameters, from the kernarg only."""
    explicit = launch.meta.explicit_args
    assert len(explicit) == 2 * TENSOR_ARGS
    out = []
    for i in range(TENSOR_ARGS):
        ptr_arg, layout_arg = explicit[2 * i], explicit[2 * i + 1]
        assert (ptr_arg.value_kind, ptr_arg.size, layout_arg.value_kind, layout_arg.size) == (
            "global_buffer", 8, "by_value", 16)
        (ptr,) = struct.unpack_from("<Q", launch.kernarg, ptr_arg.offset)
        m, n, stride = struct.unpack_from("<iiq", launch.kernarg, layout_arg.offset)
        out.append((ptr, (m, n), stride))
    return out


def add_from_kernarg(launch):
    (pa, shape, sa), (pb, _, sb), (pc, _, sc) = decode_tensor_args(launch)
    m, n = shape

    def view(ptr, stride):
        buf = (ctypes.c_float * ((m - 1) * stride + n)).from_address(ptr)
        return np.lib.stride_tricks.as_strided(np.ctypeslib.as_array(buf), (m, n), (4 * stride, 4))

    view(pc, sc)[:] = view(pa, sa) + view(pb, sb)


@pytest.fixture(scope="module", autouse=True)
def emulator(tmp_path_factory):
    # L.install() cannot be undone in-process (FlyDSL's backend registry and runtime library are
    # swapped for the rest of the process). So this module installs it only where the emulator is
    # the backend anyway; where a ROCm GPU is, it skips, and later GPU tests keep the real runtime.
    # (Run it on such a machine in its own process with PA_TILE_BACKEND=emu.)
    from pa_tile import backend

    if backend.current_backend() != "emu":
        pytest.skip("emulator-tier test; this process runs on a GPU backend (set PA_TILE_BACKEND=emu to force it)")
    toolchain.ensure_toolchain()
    saved = {k: os.environ.get(k) for k in ("FLYDSL_RUNTIME_CACHE_DIR", "ARCH", "FLYDSL_GPU_ARCH", "COMPILE_ONLY")}
    os.environ["FLYDSL_RUNTIME_CACHE_DIR"] = str(tmp_path_factory.mktemp("flydsl_cache"))
    for k in ("ARCH", "FLYDSL_GPU_ARCH", "COMPILE_ONLY"):
        os.environ.pop(k, None)
    L.install()
    previous = L.set_launch_handler(add_from_kernarg)
    yield
    L.set_launch_handler(previous)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def handler():
    """Install a handler for one test; the module's stand-in comes back afterwards."""
    previous = []

    def use(fn):
        previous.append(L.set_launch_handler(fn))

    yield use
    if previous:
        L.set_launch_handler(previous[0])


def abc(m=16, n=128, c_cols=None):
    torch.manual_seed(0)
    a, b = torch.randn(m, n), torch.randn(m, n)
    c_full = torch.zeros(m, c_cols or n)
    return a, b, c_full[:, :n]


# ------------------------------------------------------------------ the launch path


def test_vector_add_runs_through_flydsl_and_the_kernarg_decodes():
    a, b, c = abc(c_cols=160)  # C is a strided view: row stride 160, not 128
    with L.record_launches() as log:
        vadd(a, b, c)
    assert torch.equal(c, a + b)
    (launch,) = log
    assert launch.kernel == "add_kernel_0" and launch.arch == "gfx942"
    assert launch.grid == (2, 2, 1) and launch.block == (128, 1, 1) and launch.dynamic_lds == 0
    assert decode_tensor_args(launch) == [
        (a.data_ptr(), (16, 128), 128), (b.data_ptr(), (16, 128), 128), (c.data_ptr(), (16, 128), 160)]
    # explicit argument bytes are exactly what sits in the segment
    for arg, raw in zip(launch.meta.explicit_args, launch.explicit_args):
        assert launch.kernarg[arg.offset:arg.offset + arg.size] == raw
    assert len(launch.kernarg) == launch.meta.kernarg_segment_size
    # the sanitizer's regions: exactly the bytes each view spans, named after the parameters
    assert sorted(launch.regions) == sorted([
        (a.data_ptr(), a.numel() * 4, "A"), (b.data_ptr(), b.numel() * 4, "B"),
        (c.data_ptr(), (15 * 160 + 128) * 4, "C")])
    assert '.amdgcn_target "amdgcn-amd-amdhsa-unknown-gfx942"' in launch.asm


def test_hidden_arguments_are_filled_by_value_kind():
    a, b, c = abc(m=24, n=192)
    with L.record_launches() as log:
        vadd_grid(a, b, c)
    assert torch.equal(c, a + b)
    (launch,) = log
    hidden = {h.value_kind: h for h in launch.meta.hidden_args}
    assert {"hidden_block_count_x", "hidden_block_count_y", "hidden_group_size_x", "hidden_grid_dims"} <= set(hidden)

    def value(kind):
        h = hidden[kind]
        return int.from_bytes(launch.kernarg[h.offset:h.offset + h.size], "little")

    assert [value(f"hidden_block_count_{d}") for d in "xyz"] == [3, 3, 1]
    assert [value(f"hidden_group_size_{d}") for d in "xyz"] == [128, 1, 1]
    assert [value(f"hidden_remainder_{d}") for d in "xyz"] == [0, 0, 0]
    assert value("hidden_grid_dims") == 3
    assert all(value(f"hidden_global_offset_{d}") == 0 for d in "xyz")


def test_second_call_reuses_the_loaded_module_and_compiled_functions_work():
    a, b, c = abc()
    vadd(a, b, c)
    loads = L.module_loads()
    a2, b2, c2 = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    with L.record_launches() as log:
        vadd(a2, b2, c2)  # same specialization: FlyDSL's in-memory cache hit
    assert L.module_loads() == loads
    assert torch.equal(c2, a2 + b2)
    assert decode_tensor_args(log[0])[2][0] == c2.data_ptr()

    compiled = flyc.compile(vadd, a, b, c)
    c.zero_()
    with L.record_launches() as log:
        compiled(a, b, c, fx.Stream(None))  # positional-only: the stream too
    assert torch.equal(c, a + b)
    assert sorted(r[0] for r in log[0].regions) == sorted(t.untyped_storage().data_ptr() for t in (a, b, c))


def test_switching_arch_between_calls_recompiles(monkeypatch):
    a, b, c = abc()
    seen = []
    for arch in ("gfx950", "gfx942", "gfx950"):
        monkeypatch.setenv("ARCH", arch)
        c.zero_()
        with L.record_launches() as log:
            vadd(a, b, c)
        assert torch.equal(c, a + b)
        seen.append((log[0].arch, log[0].asm.splitlines()[0].strip(), L.module_loads()))
        assert "FLYDSL_GPU_ARCH" not in os.environ  # pinned only during the call
    assert [s[0] for s in seen] == ["gfx950", "gfx942", "gfx950"]
    assert all(arch in first for arch, first, _ in seen)
    assert seen[2][2] == seen[1][2]  # back to an arch compiled before: no new module

    L.set_arch("gfx950")
    try:
        assert (os.environ["ARCH"], os.environ["FLYDSL_GPU_ARCH"], L.current_arch()) == ("gfx950",) * 3
        with L.record_launches() as log:
            vadd(a, b, c)
        assert log[0].arch == "gfx950"
    finally:
        L.set_arch(None)
    assert L.current_arch() == "gfx942"
    with pytest.raises(ValueError, match="gfx942, gfx950"):
        L.set_arch("gfx90a")
    monkeypatch.setenv("ARCH", "gfx950")  # flyc.compile() is pinned to the arch as well
    compiled = flyc.compile(vadd, a, b, c)
    assert "FLYDSL_GPU_ARCH" not in os.environ
    with L.record_launches() as log:
        compiled(a, b, c, fx.Stream(None))
    assert log[0].arch == "gfx950"

    monkeypatch.setenv("ARCH", "gfx90a")
    with pytest.raises(ValueError, match="ARCH"):
        vadd(a, b, c)


def test_launch_options_reach_the_handler():
    a, b, c = abc()
    with L.record_launches() as log:
        with L.launch_options(trace="the-trace", progress=True, lds_races="warn", quantum=4):
            vadd(a, b, c)
        vadd(a, b, c)
    assert [(x.trace, x.progress, x.lds_races, x.quantum) for x in log] == [
        ("the-trace", True, "warn", 4), (None, None, "raise", None)]
    for bad in (dict(lds_races="ignore"), dict(quantum=0), dict(quantum=1.5), dict(quantum=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with L.launch_options(**bad):
                pass


def test_scalar_argument_bytes(handler):
    from pa_tile.tiny_kernels import scale_add

    x, y, out = torch.randn(8, 64), torch.randn(8, 64), torch.zeros(8, 64)
    launches = []
    handler(launches.append)
    scale_add(x, y, out, 2.5)
    (launch,) = launches
    kinds = [a.value_kind for a in launch.meta.explicit_args]
    assert kinds.count("global_buffer") == 3
    alpha = [a for a in launch.meta.explicit_args if a.value_kind == "by_value" and a.size == 4]
    assert [struct.unpack("<f", launch.kernarg[a.offset:a.offset + 4])[0] for a in alpha] == [2.5]


# ------------------------------------------------------------------ with the real emulator


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_default_handler_runs_the_kernel_in_the_emulator(handler, monkeypatch, arch):
    from pa_tile.tiny_kernels import scale_add

    handler(None)  # back to run_on_emulator -> pa_tile.emu.machine.run_kernel
    monkeypatch.setenv("ARCH", arch)
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    scale_add(x, y, out, 2.0)
    assert torch.equal(out, 2.0 * x + y)


def test_the_sanitizer_names_the_argument_a_kernel_overruns(handler):
    from pa_tile.emu.memory import MemoryFault
    from pa_tile.tiny_kernels import scale_add

    handler(None)
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(8, 128)  # out too short
    with pytest.raises(MemoryFault, match="'Out'"):
        scale_add(x, y, out, 2.0)


def test_launch_options_reach_run_kernel(handler, monkeypatch, capsys):
    from pa_tile.emu import machine
    from pa_tile.emu.memory import Trace
    from pa_tile.tiny_kernels import scale_add

    handler(None)
    seen = []
    real = machine.run_kernel

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("trace", "progress", "lds_races", "quantum")})
        return real(*args, **kwargs)

    monkeypatch.setattr(machine, "run_kernel", spy)
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    trace = Trace("gfx942")
    with L.launch_options(trace=trace, progress=True, lds_races="off", quantum=1):
        scale_add(x, y, out, 2.0)
    assert torch.equal(out, 2.0 * x + y)
    assert seen == [dict(trace=trace, progress=True, lds_races="off", quantum=1)]
    assert trace.counts["global_load_dwordx4"] == 2 * 8  # 4 workgroups x 2 waves x 2 loads
    # the progress bar went to stderr and counted the 4 workgroups
    err = capsys.readouterr().err
    assert "[emu] scale_add_kernel_0" in err and "4/4" in err
    scale_add(x, y, out, 2.0)
    assert seen[-1] == dict(trace=None, progress=None, lds_races="raise", quantum=None)
    assert "[emu]" not in capsys.readouterr().err


def test_progress_bar_of_run_kernel_itself(capsys):
    from pa_tile.emu import machine
    from pa_tile.emu.asm import parse
    from pa_tile.emu.memory import GlobalMemory

    prog = parse(ENDPGM_ONLY)
    machine.run_kernel(prog, "k", (5, 2), (64,), b"", GlobalMemory([]), progress=True)
    err = capsys.readouterr().err
    assert "[emu] k" in err and "10/10" in err and "wg" in err
    machine.run_kernel(prog, "k", (5, 2), (64,), b"", GlobalMemory([]))
    assert capsys.readouterr().err == ""


ENDPGM_ONLY = """\
\t.amdgcn_target "amdgcn-amd-amdhsa--gfx942"
\t.text
\t.globl k
\t.p2align 8
\t.type k,@function
k:
\ts_endpgm
\t.amdhsa_kernel k
\t\t.amdhsa_next_free_vgpr 1
\t\t.amdhsa_next_free_sgpr 8
\t.end_amdhsa_kernel
"""


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_from_dlpack_arguments_are_allowed_regions(handler, kind):
    from pa_tile.tiny_kernels import scale_add

    handler(None)
    torch.manual_seed(1)
    x, y = torch.randn(16, 128), torch.randn(16, 128)
    out = torch.zeros(16, 160)[:, :128]  # a strided view: its region is the bytes it spans
    if kind == "numpy":
        x, y, out = x.numpy(), y.numpy(), np.zeros((16, 160), np.float32)[:, :128]
    with L.record_launches() as log:
        scale_add(*(flyc.from_dlpack(t) for t in (x, y, out)), 2.0)
    expect = 2.0 * np.asarray(x) + np.asarray(y)
    assert np.array_equal(np.asarray(out), expect)
    regions = {r[2]: r[:2] for r in log[0].regions if not r[2].startswith("mgpu")}
    ptr = (lambda t: t.data_ptr()) if kind == "torch" else (lambda t: t.ctypes.data)
    assert regions == {"X": (ptr(x), 8192), "Y": (ptr(y), 8192), "Out": (ptr(out), (15 * 160 + 128) * 4)}
    # (tests/test_emu_sanitizer.py plants out-of-bounds accesses through from_dlpack views)


def test_dlpack_region_of_negative_and_zero_strides():
    adaptor = lambda shape, stride, ptr=0x1000, space=0: types.SimpleNamespace(  # noqa: E731
        shape=shape, stride=stride, element_bits=32, data_ptr=ptr, address_space=space)
    assert L._dlpack_region(adaptor((4, 3), (3, 1)), "a") == (0x1000, 48)
    assert L._dlpack_region(adaptor((4,), (-1,)), "a") == (0x1000 - 12, 16)
    assert L._dlpack_region(adaptor((4, 3), (0, 1)), "a") == (0x1000, 12)  # broadcast rows
    assert L._dlpack_region(adaptor((0, 3), (3, 1)), "a") is None
    with pytest.raises(ValueError, match="device memory"):
        L._dlpack_region(adaptor((4,), (1,), space=1), "a")


# ------------------------------------------------------------------ failures


def test_exception_in_a_launch_is_reraised_with_its_traceback(handler):
    def broken_emulator(launch):
        raise ZeroDivisionError("emulator blew up")

    handler(broken_emulator)
    a, b, c = abc()
    with pytest.raises(ZeroDivisionError, match="emulator blew up") as info:
        vadd(a, b, c)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "broken_emulator" in frames
    assert any("re-raised after it returned" in n for n in getattr(info.value, "__notes__", []))
    assert L._local.call is None

    handler(add_from_kernarg)  # the next call is clean: no stale error
    c.zero_()
    vadd(a, b, c)
    assert torch.equal(c, a + b)


def test_after_a_failed_launch_the_rest_of_the_launcher_is_skipped(handler):
    calls = []

    def fail_first(launch):
        calls.append(launch.kernel)
        raise RuntimeError("first launch failed")

    handler(fail_first)
    a, b, c = abc()
    with pytest.raises(RuntimeError, match="first launch failed"):
        vadd_twice(a, b, c)
    assert calls == ["add_kernel_0"]

    handler(add_from_kernarg)
    a0 = a.clone()
    vadd_twice(a, b, c)  # C = A + B, then A = C + B
    assert torch.equal(c, a0 + b) and torch.equal(a, c + b)


def test_non_cpu_tensors_are_rejected_before_anything_runs(handler):
    launches = []
    handler(launches.append)
    a, b, _ = abc()
    with pytest.raises(ValueError, match="'C' is a tensor on meta"):
        vadd(a, b, torch.empty(16, 128, device="meta"))
    assert launches == []


def test_elf_modules_are_refused_with_an_explanation(capsys):
    blob = ctypes.create_string_buffer(b"\x7fELF\x02\x01\x01" + bytes(57))
    handle = L._modules.load(ctypes.addressof(blob), 64, 0)
    module = L._modules.by_handle.pop(handle)
    assert isinstance(module.error, L.LaunchError) and "assembly text" in str(module.error)
    assert "outside a @flyc.jit call" in capsys.readouterr().err


# ------------------------------------------------------------------ metadata and kernarg units

SNIPPET = """\
\t.text
\t.amdgpu_metadata
---
amdhsa.kernels:
  - .args:
      - .address_space:  global
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
      - .offset:         8
        .size:           4
        .value_kind:     by_value
      - .offset:         16
        .size:           4
        .value_kind:     hidden_block_count_y
      - .offset:         20
        .size:           2
        .value_kind:     hidden_group_size_x
      - .offset:         24
        .size:           4
        .value_kind:     hidden_dynamic_lds_size
      - .address_space:  global
        .offset:         32
        .size:           8
        .value_kind:     hidden_printf_buffer
      - .address_space:  global
        .offset:         40
        .size:           8
        .value_kind:     hidden_some_future_pointer
    .group_segment_fixed_size: 512
    .kernarg_segment_align: 8
    .kernarg_segment_size: 48
    .max_flat_workgroup_size: 256
    .name:           k
    .private_segment_fixed_size: 0
    .sgpr_count:     20
    .symbol:         k.kd
    .vgpr_count:     12
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa-unknown-gfx950
amdhsa.version:
  - 1
  - 2
...

\t.end_amdgpu_metadata
"""


def test_metadata_is_parsed_into_dataclasses():
    md = L.parse_amdgpu_metadata(SNIPPET)
    assert (md.arch, md.target, md.version) == ("gfx950", "amdgcn-amd-amdhsa-unknown-gfx950", (1, 2))
    k = md.kernels["k"]
    assert (k.kernarg_segment_size, k.group_segment_fixed_size, k.vgpr_count) == (48, 512, 12)
    assert k.max_flat_workgroup_size == 256
    assert [a.value_kind for a in k.explicit_args] == ["global_buffer", "by_value"]
    assert k.explicit_args[0].address_space == "global" and k.reqd_workgroup_size is None
    assert len(k.hidden_args) == 5
    with pytest.raises(ValueError, match="no .amdgpu_metadata"):
        L.parse_amdgpu_metadata("\ts_endpgm\n")


def test_build_kernarg_places_explicit_and_hidden_values():
    k = L.parse_amdgpu_metadata(SNIPPET).kernels["k"]
    seg = L.build_kernarg(k, [(0x1122334455667788).to_bytes(8, "little"), struct.pack("<f", 1.5)],
                          grid=(5, 7, 1), block=(256, 1, 1), dynamic_lds=1024)
    assert len(seg) == 48
    assert struct.unpack_from("<Qf", seg, 0) == (0x1122334455667788, 1.5)
    assert struct.unpack_from("<IH", seg, 16) == (7, 256)
    assert struct.unpack_from("<I", seg, 24) == (1024,)
    assert seg[32:48] == bytes(16)  # service pointers, known and unknown, are 0

    with pytest.raises(L.KernargError, match="1 argument values for 2"):
        L.build_kernarg(k, [bytes(8)], (1, 1, 1), (1, 1, 1))
    with pytest.raises(L.KernargError, match="has 8 bytes, metadata says 4"):
        L.build_kernarg(k, [bytes(8), bytes(8)], (1, 1, 1), (1, 1, 1))
    with pytest.raises(L.KernargError, match="does not fit"):
        L.build_kernarg(k, [bytes(8), bytes(4)], (1, 1, 1), (70000, 1, 1))


def test_unknown_non_pointer_hidden_kind_raises():
    pointer_entry = "      - .address_space:  global\n        .offset:         40"
    text = SNIPPET.replace(pointer_entry, "      - .offset:         40")
    k = L.parse_amdgpu_metadata(text).kernels["k"]
    with pytest.raises(L.KernargError, match="hidden_some_future_pointer"):
        L.build_kernarg(k, [bytes(8), bytes(4)], (1, 1, 1), (1, 1, 1))


def test_launch_checks_arguments_and_dimensions_against_metadata():
    module = L.LoadedModule(handle=10**6, blob=b"", text=SNIPPET, meta=L.parse_amdgpu_metadata(SNIPPET))
    L._modules.by_handle[module.handle] = module
    try:
        ptr, alpha = ctypes.c_uint64(0xABC0), ctypes.c_float(0.5)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(ptr), ctypes.addressof(alpha))

        def make(dims, nparams=2, name=b"k"):
            return L._make_launch(module.handle, name, dims, 64, params, None, nparams)

        launch = make([4, 3, 2, 256, 1, 1, 1, 1, 1])
        assert launch.explicit_args == (struct.pack("<Q", 0xABC0), struct.pack("<f", 0.5))
        assert struct.unpack_from("<IHxxI", launch.kernarg, 16) == (3, 256, 64)
        assert launch.arch == "gfx950" and launch.grid == (4, 3, 2) and launch.dynamic_lds == 64
        with pytest.raises(L.KernargError, match="passed 1 arguments but the kernel metadata lists 2"):
            make([1, 1, 1, 64, 1, 1, 1, 1, 1], nparams=1)
        with pytest.raises(L.LaunchError, match="allows 256"):
            make([1, 1, 1, 512, 1, 1, 1, 1, 1])
        with pytest.raises(L.LaunchError, match="no clusters"):
            make([1, 1, 1, 64, 1, 1, 2, 1, 1])
        with pytest.raises(L.LaunchError, match="kernels \\['k'\\] only"):
            make([1, 1, 1, 64, 1, 1, 1, 1, 1], name=b"other")
    finally:
        L._modules.by_handle.pop(module.handle)


def test_mgpu_allocations_are_regions_too():
    lib = ctypes.CDLL(str(L.build_shim()))  # own function objects: argtypes stay local
    lib.mgpuMemAlloc.restype = ctypes.c_void_p
    lib.mgpuMemAlloc.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_bool]
    lib.mgpuMemFree.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    p = lib.mgpuMemAlloc(1000, None, False)
    try:
        assert p % 256 == 0
        assert [r[1] for r in L._live_allocations() if r[0] == p] == [1000]
    finally:
        lib.mgpuMemFree(p, None)
    assert all(r[0] != p for r in L._live_allocations())


def test_tensor_regions_walk_nested_containers_and_merge_shared_storage():
    base = torch.zeros(4, 8)
    other = torch.ones(3, dtype=torch.float16)
    regions = L.tensor_regions({"x": base, "pair": (base[1:], [other]), "opts": {"k": 3}, "n": 7})
    assert sorted(regions) == sorted([  # per view (the default): base[1:] is its own region
        (base.data_ptr(), 128, "x"), (base[1:].data_ptr(), 96, "pair[0]"), (other.data_ptr(), 6, "pair[1][0]")])
    regions = L.tensor_regions({"x": base, "pair": (base[1:], [other])}, bounds="storage")
    assert sorted(regions) == sorted([
        (base.data_ptr(), 128, "x|pair[0]"), (other.data_ptr(), 6, "pair[1][0]")])
    with pytest.raises(ValueError, match="'q\\[0\\]' is a tensor on meta"):
        L.tensor_regions({"q": [torch.empty(2, device="meta")]})


# ------------------------------------------------------------------ install, self-test, shim


def test_install_is_idempotent_and_registers_the_emulator_backend():
    from flydsl.compiler import backends as B
    from flydsl.compiler import jit_function
    from flydsl.compiler.backends.rocm import RocmBackend

    cls = B._registry["rocm"]
    call = jit_function.JitFunction.__call__
    L.install()
    L.install()
    assert B._registry["rocm"] is cls and getattr(cls, "pa_tile_emulator", False)
    assert jit_function.JitFunction.__call__ is call
    assert not hasattr(call._pa_tile_emu_original, "_pa_tile_emu_original")  # wrapped once

    target = RocmBackend.make_target("gfx942")
    emu, real = cls(target), RocmBackend(target)
    assert emu.hash() != real.hash()  # different cache keys: no artifact sharing with real GPUs
    assert emu.pipeline_fragments(compile_hints={})[-1].startswith("gpu-module-to-binary{format=isa")
    assert emu.pipeline_fragments(compile_hints={})[:-1] == real.pipeline_fragments(compile_hints={})[:-1]
    assert emu.jit_runtime_lib_basenames()[0] == str(L.build_shim())


def test_self_test_passes_on_this_flydsl():
    passed = L.self_test()
    assert any("mgpu" in p for p in passed) and any("resolves the shim" in p for p in passed)


def test_self_test_fails_loudly_when_flydsl_internals_move(monkeypatch):
    from flydsl.compiler import backends as B
    from flydsl.compiler import jit_executor
    from flydsl.compiler.backends.rocm import RocmBackend

    with monkeypatch.context() as m:
        m.setattr(jit_executor, "_resolve_runtime_libs", lambda: [str(L.build_shim())])
        with pytest.raises(RuntimeError, match="_resolve_runtime_libs is no longer an lru_cache"):
            L.self_test()
    with monkeypatch.context() as m:
        moved = ["cse", "gpu-module-to-binary{format=bin}"]
        m.setattr(RocmBackend, "pipeline_fragments", lambda self, *, compile_hints: moved)
        with pytest.raises(RuntimeError, match="last pipeline pass is 'gpu-module-to-binary\\{format=bin\\}'"):
            L.self_test()
        # and compiling through the emulator backend would fail the same way, never silently
        with pytest.raises(L.EmuSetupError, match="cannot switch it to assembly"):
            B._registry["rocm"](RocmBackend.make_target("gfx942")).pipeline_fragments(compile_hints={})
    with monkeypatch.context() as m:
        m.setattr(RocmBackend, "jit_runtime_lib_basenames", lambda self: ["libother_runtime.so"])
        with pytest.raises(RuntimeError, match="libfly_jit_runtime.so first"):
            L.self_test()
    with monkeypatch.context() as m:
        m.setitem(B._registry, "rocm", RocmBackend)
        with pytest.raises(RuntimeError, match="re-registered by someone else"):
            L.self_test()
    L.self_test()  # everything restored


def test_shim_exports_exactly_the_real_runtime_mgpu_symbols():
    real = L.elf_exported_functions(L.real_runtime_path())
    shim = L.elf_exported_functions(L.build_shim())
    assert {n for n in real if n.startswith("mgpu")} == {n for n in shim if n.startswith("mgpu")}
    assert "mgpuLaunchKernel" in shim and "mgpuModuleLoadJIT" in shim
    # a FlyDSL upgrade that adds a runtime symbol must fail the self-test loudly
    assert any("mgpuNewThing" in p for p in L.compare_exports(real | {"mgpuNewThing"}, shim))
    assert any("flydslNewHook" in p for p in L.compare_exports(real | {"flydslNewHook"}, shim))
    assert L.compare_exports(real, shim) == []


def test_shim_is_built_in_the_cache_not_the_source_tree(tmp_path):
    out = L.build_shim(tmp_path)
    assert out.parent == tmp_path and out.name.startswith("shim-") and out.suffix == ".so"
    mtime = out.stat().st_mtime_ns
    assert L.build_shim(tmp_path) == out and out.stat().st_mtime_ns == mtime  # built once
    assert not list(L.SHIM_SOURCE.parent.glob("*.so"))


def test_missing_c_compiler_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-cc-anywhere")
    with pytest.raises(L.EmuSetupError, match="no C compiler"):
        L.build_shim(tmp_path)


def test_flydsl_version_guard():
    for ok in ("0.4.2", "0.5.0", "0.5.9.dev3"):
        assert L.check_flydsl_version(ok) == ok
    for bad in ("0.4.1", "0.6.0", "0.6.0rc1", "1.0"):
        with pytest.raises(L.EmuSetupError, match=">=0.4.2,<0.6"):
            L.check_flydsl_version(bad)


def test_install_refuses_when_the_real_runtime_is_already_loaded(tmp_path, monkeypatch):
    assert not L._real_runtime_loaded()  # this process never loaded FlyDSL's HIP runtime
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 42   /usr/lib/libc.so.6\n"
        f"7f0000002000-7f0000003000 r-xp 00000000 08:01 43   {L.real_runtime_path()}\n")
    assert L._real_runtime_loaded(str(maps))
    monkeypatch.setattr(L, "_real_runtime_loaded", lambda: True)
    with pytest.raises(L.EmuSetupError, match="before the first @flyc.jit call"):
        L._preflight()
    monkeypatch.setattr(L, "_real_runtime_loaded", lambda: False)
    L._preflight()
    monkeypatch.setenv("FLYDSL_COMPILE_BACKEND", "other")
    with pytest.raises(L.EmuSetupError, match="FLYDSL_COMPILE_BACKEND"):
        L._preflight()
