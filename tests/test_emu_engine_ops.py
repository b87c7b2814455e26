"""The fast engine's handlers (pa_tile.emu.ops_fast, _shim/emu_fastpath.c) against the reference
semantics (pa_tile.emu.numerics through the reference handlers), bit for bit.

Each case runs one instruction on a wave whose registers hold random bit patterns mixed with the
corner cases of the operation (signed zeros, denormals, infinities, quiet and signalling NaNs,
f32 values just around fp8 rounding midpoints and overflow thresholds, fma inputs whose float64
sum lands on an f32 midpoint), under a partial EXEC, with both engines, and compares every
register bit.
"""

import numpy as np
import pytest

from pa_tile.emu import Wave, parse_asm, run_wave
from pa_tile.emu import ops_fast
from pa_tile.emu.machine import decode_kernel

pytestmark = pytest.mark.skipif(not ops_fast.available(), reason="no C compiler for the fast paths")

ARCHS = ["gfx942", "gfx950"]
SPECIAL = np.array([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF,
                    0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00000, 0x3F800000,
                    0xBF800000, 0x43700000, 0x43F00000, 0x43E00000, 0x47600000, 0x477FF000, 0x43780000,
                    0x43E80000, 0xC3F00001, 0x3B000000, 0x3A800000, 0x3A000000, 0x35800000, 0x35000000],
                   np.uint32)


def _program(body, arch):
    return parse_asm(f'\t.amdgcn_target "amdgcn-amd-amdhsa-unknown-{arch}"\n\t.type k,@function\nk:\n'
                     + body + "\n\ts_endpgm\n")


def _fp8_neighbourhood(rng, n):
    """f32 values within a few ulps of fp8/bf8 representable values and of the midpoints between
    them (the rounding decisions), across every binade the formats have and past their maximum."""
    e = rng.integers(-20, 18, n).astype(np.float64)
    m = rng.integers(0, 16, n) / 16.0 + rng.integers(0, 2, n) / 32.0     # values and midpoints
    x = np.ldexp(1.0 + m, e.astype(np.int32)).astype(np.float32).view(np.uint32).astype(np.int64)
    x += rng.integers(-3, 4, n)
    x |= rng.integers(0, 2, n) << 31
    return (x & 0xFFFFFFFF).astype(np.uint32)


def _fma_midpoints(rng, n):
    """a, b, c with a*b + c exactly between two f32 values in float64 (the double-rounding case)."""
    a = (1 + rng.integers(1, 1 << 12, n) * 2.0 ** -12).astype(np.float32)
    b = (1 + rng.integers(1, 1 << 12, n) * 2.0 ** -12).astype(np.float32)
    c = np.ldexp(rng.integers(1, 8, n).astype(np.float64), -rng.integers(40, 90, n)).astype(np.float32)
    return a.view(np.uint32), b.view(np.uint32), c.view(np.uint32)


def _registers(seed, rows=64):
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 1 << 32, (rows, 64), dtype=np.uint64).astype(np.uint32)
    for r in range(rows):
        pick = rng.random(64)
        v[r] = np.where(pick < 0.25, rng.choice(SPECIAL, 64), v[r])
        v[r] = np.where((pick >= 0.25) & (pick < 0.6), _fp8_neighbourhood(rng, 64), v[r])
        fl = rng.random(64) < 0.3      # random but ordinary floats: exponent near 127
        v[r] = np.where(fl, (v[r] & 0x807FFFFF) | ((rng.integers(100, 150, 64).astype(np.uint32)) << 23), v[r])
    a, b, c = _fma_midpoints(rng, 64)
    v[40], v[41], v[42] = a, b, c
    return v, rng


def _run(body, arch, engine, seed, exec_mask):
    v, rng = _registers(seed)
    w = Wave(arch)
    w.v[:64] = v
    w.v[256:256 + 64] = v[::-1]
    w.s[:16] = rng.integers(0, 1 << 32, 16, dtype=np.uint64).astype(np.uint32)
    w.s[4] = 0x7FC00000
    w.s[5] = 0x80000000
    w.exec = exec_mask
    run_wave(_program(body, arch), w, arch=arch, engine=engine)
    return w


def _same(body, arch, seeds=range(6)):
    decode_kernel(_program(body, arch), "k", arch, "fast")     # decodes with the fast builders
    for seed in seeds:
        for ex in ((1 << 64) - 1, 0x0F0F_F0F0_1234_8001):
            fast = _run(body, arch, "fast", seed, ex)
            ref = _run(body, arch, "reference", seed, ex)
            assert np.array_equal(fast.v, ref.v), (body, arch, seed, hex(ex))
            assert np.array_equal(fast.s, ref.s)


FORMS = [
    "v_max_f32_e32 v0, v1, v2", "v_min_f32_e32 v0, v1, v2", "v_max_f32_e64 v0, |v1|, -v2",
    "v_max_f32_e32 v0, s4, v2", "v_max_f32_e32 v0, 0, v2", "v_min_f32_e64 v0, v1, 1.0",
    "v_max3_f32 v0, v1, v2, v3", "v_max3_f32 v0, |v1|, s8, |v2|", "v_min3_f32 v0, v1, -v2, s5",
    "v_max3_f32 v0, v0, v1, v0",
    "v_fma_f32 v0, v1, v2, v3", "v_fma_f32 v0, v40, v41, v42", "v_fma_f32 v0, -v1, |v2|, s4",
    "v_fma_f32 v3, v3, 0x3fb8aa3b, -v4", "v_fmac_f32_e32 v0, v1, v2", "v_fmac_f32_e32 v42, v40, v41",
    "v_fmac_f32_e32 v0, s5, v2",
    "v_pk_fma_f32 v[0:1], v[2:3], v[4:5], v[6:7]",
    "v_pk_fma_f32 v[0:1], v[2:3], v[4:5], v[6:7] op_sel_hi:[0,1,1]",
    "v_pk_fma_f32 v[2:3], v[2:3], s[4:5], v[6:7] op_sel:[1,0,0] op_sel_hi:[0,1,0]",
    "v_pk_fma_f32 v[0:1], v[2:3], v[4:5], v[6:7] neg_lo:[1,0,1] neg_hi:[0,1,1]",
    "v_pk_fma_f32 v[0:1], v[40:41], v[40:41], v[42:43] op_sel:[0,1,0] op_sel_hi:[0,1,1]",
    "v_pk_fma_f32 v[0:1], v[2:3], 1.0, v[6:7]",
    "v_cvt_pk_fp8_f32 v0, v1, v2", "v_cvt_pk_fp8_f32 v0, v1, v2 op_sel:[0,0,1]",
    "v_cvt_pk_fp8_f32 v1, v1, v1", "v_cvt_pk_fp8_f32 v0, -v1, |v2|", "v_cvt_pk_fp8_f32 v0, s4, 0.5",
    "v_cvt_pk_bf8_f32 v0, v1, v2", "v_cvt_pk_bf8_f32 v0, v1, v2 op_sel:[0,0,1]",
    "v_exp_f32_e32 v0, v1", "v_exp_f32_e32 v0, v0", "v_exp_f32_e64 v0, -v1", "v_exp_f32_e32 v0, s4",
]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("body", FORMS)
def test_fast_handler_equals_reference(body, arch):
    _same(body, arch)


def test_exp_fast_path_on_ordinary_softmax_inputs():
    """Inputs the fast path takes (no fallback): ordinary negative scores and zeros."""
    rng = np.random.default_rng(1)
    for arch in ARCHS:
        for seed in range(3):
            x = np.concatenate([-rng.random(60) * 30, [0.0, -0.0, -125.9, 20.0]]).astype(np.float32)
            outs = []
            for engine in ("fast", "reference"):
                w = Wave(arch)
                w.v[1] = x.view(np.uint32)
                run_wave(_program("v_exp_f32_e32 v0, v1", arch), w, arch=arch, engine=engine)
                outs.append(w.v[0].copy())
            assert np.array_equal(*outs)


MFMAS = [("gfx942", "v_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], v[12:15]"),
         ("gfx942", "v_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], 0"),
         ("gfx942", "v_mfma_f32_16x16x32_fp8_fp8 v[8:11], v[8:9], v[10:11], v[8:11]"),
         ("gfx942", "v_mfma_f32_32x32x16_fp8_fp8 v[16:31], v[0:1], v[2:3], v[16:31]"),
         ("gfx942", "v_mfma_f32_16x16x32_fp8_fp8 a[0:3], v[8:9], v[10:11], a[0:3]"),
         ("gfx950", "v_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], v[12:15]"),
         ("gfx950", "v_mfma_f32_32x32x16_fp8_fp8 v[16:31], v[0:1], v[2:3], v[32:47]"),
         ("gfx950", "v_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], 1.0")]


@pytest.mark.parametrize("arch,body", MFMAS)
def test_fast_fp8_mfma_equals_reference(arch, body):
    """Random fp8 codes (NaN codes included) and random/corner-case f32 accumulators."""
    _same(body, arch, seeds=range(10))


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_fp8_mfma_signed_zeros_and_overflow(arch):
    """All-zero products (both zero codes) with C = -0, and sums that overflow f32 through C."""
    body = "v_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], v[12:15]"
    for a_code, c_bits in ((0x80, 0x80000000), (0x00, 0x80000000), (0x00, 0x00000000), (0x7E, 0x7F7FFFFF),
                           (0xFE, 0xFF7FFFFF)):
        outs = []
        for engine in ("fast", "reference"):
            w = Wave(arch)
            w.v[8:10] = a_code * 0x01010101
            w.v[10:12] = 0x38383838        # 1.0-ish codes
            w.v[12:16] = c_bits
            run_wave(_program(body, arch), w, arch=arch, engine=engine)
            outs.append(w.v[0:4].copy())
        assert np.array_equal(*outs), (arch, hex(a_code), hex(c_bits))


def test_fast_engine_decodes_the_fast_handlers():
    """The fast builders are really used for these forms (not silently the reference ones)."""
    p = _program("v_max3_f32 v0, v1, v2, v3\nv_mfma_f32_16x16x32_fp8_fp8 v[0:3], v[8:9], v[10:11], 0", "gfx942")
    fast = decode_kernel(p, "k", "gfx942", "fast")
    ref = decode_kernel(p, "k", "gfx942", "reference")
    assert all(f.__module__ == "pa_tile.emu.ops_fast" for f in fast[:2])
    assert all(r.__module__ != "pa_tile.emu.ops_fast" for r in ref[:2])


def test_unknown_engine_is_refused(monkeypatch):
    monkeypatch.setenv("PA_TILE_EMU_ENGINE", "turbo")
    with pytest.raises(ValueError, match="engine"):
        decode_kernel(_program("s_nop 0", "gfx942"), "k", "gfx942")


# --------------------------------------------------------------------------- MUBUF loads

def _buffer_case(body, arch, engine, offsets, exec_mask, num_records, tensors, soffset=8, base_skip=64):
    """One buffer load over a 4 KiB tensor whose V# starts *base_skip* bytes in; returns the
    wave, the memory, and the fault message if it faulted."""
    from pa_tile.emu import GlobalMemory, MemoryFault
    from pa_tile.emu.memory import encode_vsharp

    data, other = tensors
    mem = GlobalMemory([(data.data_ptr(), 4096, "data"), (other.data_ptr(), 1024, "other")])
    w = Wave(arch)
    w.v[1] = offsets
    w.v[4:8] = 0xDEADBEEF
    w.s[8:12] = encode_vsharp(data.data_ptr() + base_skip, num_records)
    w.s[4] = soffset
    w.exec = exec_mask
    w.mem = mem
    fault = None
    try:
        run_wave(_program(body, arch), w, arch=arch, engine=engine)
    except MemoryFault as e:
        fault = str(e)
    return w, mem, fault


BUFFER_FORMS = ["buffer_load_dword v4, v1, s[8:11], 0 offen", "buffer_load_dwordx2 v[4:5], v1, s[8:11], s4 offen",
                "buffer_load_dwordx3 v[4:6], v1, s[8:11], s4 offen offset:12",
                "buffer_load_dwordx4 v[4:7], v1, s[8:11], s4 offen offset:16",
                "buffer_load_dwordx4 v[1:4], v1, s[8:11], 0 offen",
                "buffer_load_dwordx2 v[4:5], off, s[8:11], s4 offset:40",
                "buffer_load_dword v4, v1, s[8:11], 4 offen glc"]


@pytest.mark.parametrize("body", BUFFER_FORMS)
def test_fast_buffer_load_equals_reference(body):
    import torch

    tensors = torch.arange(1024, dtype=torch.int32), torch.full((256,), -7, dtype=torch.int32)
    rng = np.random.default_rng(3)
    lanes = np.arange(64, dtype=np.uint32)
    cases = [(lanes * 16, (1 << 64) - 1, 4000),            # in range: the fast path
             (lanes * 16, 0x00FF_00FF_F0F0_0F0F, 4000),    # a partial EXEC
             (lanes * 64, (1 << 64) - 1, 2000),            # the upper lanes past num_records (read 0)
             (lanes * 64, 0xFFFF_FFFF, 2000),              # ... but they are off
             (rng.integers(0, 3900, 64).astype(np.uint32) & np.uint32(0xFFFFFFFC), (1 << 64) - 1, 4000),
             (lanes * 16 + np.uint32(0xFFFFFFF0), (1 << 64) - 1, 4000),   # wrapped offsets
             (lanes * 16, 0, 4000),                        # no lane on
             (lanes * 80, (1 << 64) - 1, 1 << 20),         # past the tensor: a fault
             (lanes * 16, (1 << 64) - 1, 1 << 20)]
    for offsets, ex, nrec in cases:
        for skip in (64, -64):                            # a base inside / below the tensor
            got = []
            for engine in ("fast", "reference"):
                w, mem, fault = _buffer_case(body, "gfx942", engine, offsets, ex, nrec, tensors, base_skip=skip)
                got.append((w.v[:8].copy(), mem._last, fault))
            assert np.array_equal(got[0][0], got[1][0]), (body, hex(ex), nrec, skip)
            assert got[0][1:] == got[1][1:], (body, hex(ex), nrec, skip)


# --------------------------------------------------------------------------- LDS reads and writes

DS_BODY = """
ds_write_b32 v1, v10 offset:{o1}
ds_read_b128 v[20:23], v2
ds_write_b128 v3, v[10:13] offset:16
ds_read_b32 v24, v1 offset:{o1}
ds_write_b64 v2, v[12:13]
ds_read_b96 v[25:27], v3 offset:4
ds_read_b64 v[28:29], v1
"""


def _ds_state(engine, arch, seed, mode, collide, exec_masks, same_values):
    """Three waves of one workgroup run the body in turn on one LDS and one race checker (no
    barrier: a race is reported unless the addresses keep the waves apart or the values agree)."""
    from pa_tile.emu.memory import LDS
    from pa_tile.emu.ops_ds import LdsRaceChecker

    rng = np.random.default_rng(seed)
    lds = LDS(4096, arch=arch)
    lds.data[:] = rng.integers(0, 256, 4096, dtype=np.uint8)
    races = LdsRaceChecker(4096, mode, lambda pc: f"pc {pc}") if mode else None
    prog = _program(DS_BODY.format(o1=rng.integers(0, 64) * 4), arch)
    regs, errors = [], []
    for wave in range(3):
        w = Wave(arch)
        span = 4096 - 64 if collide else 1024
        base = 0 if collide else wave * 1024
        for r in (1, 2, 3):
            w.v[r] = base + rng.integers(0, (span - 64) // 4, 64).astype(np.uint32) * 4
        w.v[10:14] = rng.integers(0, 4, (4, 64)) * 0x01010101 if same_values else rng.integers(0, 1 << 32, (4, 64))
        w.lds, w.races, w.wave_id = lds, races, wave
        w.exec = exec_masks[wave]
        try:
            run_wave(prog, w, arch=arch, engine=engine)
        except Exception as e:          # a race in raise mode: the message must match too
            errors.append(f"{type(e).__name__}: {e}")
        regs.append(w.v[:32].copy())
    state = [lds.data.copy()] + regs
    if races is not None:
        state += [getattr(races, n).copy() for n in fastpath_arrays()] + [list(races.races)]
    return state, errors


def fastpath_arrays():
    from pa_tile.emu import fastpath

    return fastpath._RACE_ARRAYS


@pytest.mark.parametrize("mode", [None, "warn", "raise"])
@pytest.mark.parametrize("collide", [False, True])
@pytest.mark.parametrize("same_values", [False, True])
def test_fast_ds_equals_reference(mode, collide, same_values):
    full = (1 << 64) - 1
    for seed in range(4):
        for masks in ((full, full, full), (0xFFFF_0000_FFFF_0000, full, 0x8000_0000_0000_0001), (0, full, 0)):
            got = [_ds_state(e, "gfx942", seed, mode, collide, masks, same_values) for e in ("fast", "reference")]
            (sf, ef), (sr, er) = got
            assert ef == er, (seed, masks)
            assert len(sf) == len(sr) and all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                                              for a, b in zip(sf, sr)), (seed, masks)


def test_fast_ds_out_of_bounds_faults_like_the_reference():
    from pa_tile.emu import MemoryFault
    from pa_tile.emu.memory import LDS

    msgs = []
    for engine in ("fast", "reference"):
        w = Wave("gfx942")
        w.lds = LDS(1024, arch="gfx942")
        w.v[1] = np.arange(64, dtype=np.uint32) * 16
        with pytest.raises(MemoryFault) as e:
            run_wave(_program("ds_read_b128 v[4:7], v1 offset:8", "gfx942"), w, arch="gfx942", engine=engine)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]
