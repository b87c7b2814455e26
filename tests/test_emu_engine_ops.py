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


def _registers(seed, rows=64, nans=True):
    """Random registers; ``nans=False``: no NaN bit pattern anywhere (infinities, zeros and
    denormals stay), so f32 arithmetic takes the fast engine's C path rather than its fallback."""
    rng = np.random.default_rng(seed)
    v = rng.integers(0, 1 << 32, (rows, 64), dtype=np.uint64).astype(np.uint32)
    special = SPECIAL if nans else SPECIAL[(SPECIAL & 0x7FFFFFFF) <= 0x7F800000]
    for r in range(rows):
        pick = rng.random(64)
        v[r] = np.where(pick < 0.25, rng.choice(special, 64), v[r])
        v[r] = np.where((pick >= 0.25) & (pick < 0.6), _fp8_neighbourhood(rng, 64), v[r])
        fl = rng.random(64) < 0.3      # random but ordinary floats: exponent near 127
        v[r] = np.where(fl, (v[r] & 0x807FFFFF) | ((rng.integers(100, 150, 64).astype(np.uint32)) << 23), v[r])
    a, b, c = _fma_midpoints(rng, 64)
    v[40], v[41], v[42] = a, b, c
    if not nans:     # random bits: make every NaN pattern an ordinary float of the same sign
        v = np.where((v & 0x7FFFFFFF) > 0x7F800000, v & 0xBFFFFFFF, v)
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
    """Inputs the fast paths take (no fallback): ordinary negative scores, zeros, results that
    underflow (flushed to +0) or overflow (inf), infinities."""
    rng = np.random.default_rng(1)
    for arch in ARCHS:
        for seed in range(3):
            x = np.concatenate([-rng.random(50) * 30, -rng.random(4) * 200, [0.0, -0.0, -125.9, 20.0, -126.0,
                                                                             -149.5, -np.inf, np.inf, 130.0,
                                                                             -1e30]]).astype(np.float32)
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
    w.v[4:8] = 0xDEAD0000 + np.arange(4, dtype=np.uint32)[:, None] * 256 + np.arange(64, dtype=np.uint32)
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


BUFFER_STORES = ["buffer_store_dword v4, v1, s[8:11], 0 offen", "buffer_store_dwordx2 v[4:5], v1, s[8:11], s4 offen",
                 "buffer_store_dwordx3 v[4:6], v1, s[8:11], s4 offen offset:12",
                 "buffer_store_dwordx4 v[4:7], v1, s[8:11], s4 offen offset:16",
                 "buffer_store_dwordx2 v[4:5], off, s[8:11], s4 offset:40"]


@pytest.mark.parametrize("body", BUFFER_FORMS + BUFFER_STORES)
def test_fast_buffer_load_equals_reference(body):
    """Loads: the registers; stores: the tensor's bytes (lanes colliding on one address: the
    highest wins); both: GlobalMemory._last and any fault message."""
    import torch

    tensors = torch.arange(1024, dtype=torch.int32), torch.full((256,), -7, dtype=torch.int32)
    pristine = [t.clone() for t in tensors]
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
                for t, p in zip(tensors, pristine):
                    t.copy_(p)
                w, mem, fault = _buffer_case(body, "gfx942", engine, offsets, ex, nrec, tensors, base_skip=skip)
                got.append((w.v[:8].copy(), mem._last, fault, [t.clone() for t in tensors]))
            assert np.array_equal(got[0][0], got[1][0]), (body, hex(ex), nrec, skip)
            assert got[0][1:3] == got[1][1:3], (body, hex(ex), nrec, skip)
            assert all(torch.equal(a, b) for a, b in zip(got[0][3], got[1][3])), (body, hex(ex), nrec, skip)


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


# --------------------------------------------------------------------------- straight-line blocks

BLOCK_VALU = ["v_mov_b32_e32 v{d}, {s}", "v_not_b32_e32 v{d}, {s}", "v_add_u32_e32 v{d}, {s}, v{b}",
              "v_sub_u32_e32 v{d}, {s}, v{b}", "v_subrev_u32_e32 v{d}, {s}, v{b}", "v_and_b32_e32 v{d}, {s}, v{b}",
              "v_or_b32_e32 v{d}, {s}, v{b}", "v_xor_b32_e32 v{d}, {s}, v{b}", "v_lshlrev_b32_e32 v{d}, {s}, v{b}",
              "v_lshrrev_b32_e32 v{d}, {s}, v{b}", "v_ashrrev_i32_e32 v{d}, {s}, v{b}",
              "v_max_i32_e32 v{d}, {s}, v{b}", "v_min_i32_e32 v{d}, {s}, v{b}", "v_max_u32_e32 v{d}, {s}, v{b}",
              "v_min_u32_e32 v{d}, {s}, v{b}", "v_med3_i32 v{d}, {s}, v{b}, v{c}", "v_mul_lo_u32 v{d}, {s}, v{b}",
              "v_add3_u32 v{d}, {s}, v{b}, v{c}", "v_lshl_add_u32 v{d}, v{b}, {s}, v{c}",
              "v_add_lshl_u32 v{d}, v{b}, {s}, v{c}", "v_lshl_or_b32 v{d}, v{b}, {s}, v{c}",
              "v_and_or_b32 v{d}, v{b}, {s}, v{c}", "v_or3_b32 v{d}, v{b}, {s}, v{c}",
              "v_bfe_u32 v{d}, v{b}, {s}, v{c}", "v_cndmask_b32_e32 v{d}, {s}, v{b}, vcc",
              "v_cndmask_b32_e64 v{d}, {s}, v{b}, s[{p}:{p1}]", "v_cndmask_b32_e64 v{d}, -{s}, |v{b}|, s[{p}:{p1}]",
              "v_cmp_gt_i32_e32 vcc, {s}, v{b}", "v_cmp_lt_u32_e32 vcc, {s}, v{b}", "v_cmp_ne_u32_e64 s[{p}:{p1}], {s}, v{b}",
              "v_cmp_eq_i32_e64 s[{p}:{p1}], v{b}, {s}", "v_cmp_le_i32_e32 vcc, {s}, v{b}",
              "v_cmp_ge_u32_e32 vcc, {s}, v{b}",
              "v_max_f32_e32 v{d}, {s}, v{b}", "v_fma_f32 v{d}, {s}, v{b}, v{c}", "v_fmac_f32_e32 v{d}, {s}, v{b}",
              "v_pk_fma_f32 v[{d}:{d1}], v[{b}:{b1}], v[{c}:{c1}], v[{d}:{d1}] op_sel_hi:[0,1,1]",
              "v_cvt_pk_fp8_f32 v{d}, {s}, v{b} op_sel:[0,0,1]",
              "v_mfma_f32_16x16x32_fp8_fp8 v[16:19], v[{b}:{b1}], v[{c}:{c1}], v[16:19]",
              "v_add_f32_e32 v{d}, {s}, v{b}", "v_sub_f32_e64 v{d}, -{s}, |v{b}|", "v_subrev_f32_e32 v{d}, {s}, v{b}",
              "v_mul_f32_e32 v{d}, {s}, v{b}", "v_mul_f32_e64 v{d}, |v{c}|, -v{b}", "v_cvt_f32_f16_e32 v{d}, {s}",
              "v_pk_mul_f32 v[{d}:{d1}], v[{b}:{b1}], v[{c}:{c1}] op_sel_hi:[0,1]",
              "v_pk_add_f32 v[{d}:{d1}], v[{b}:{b1}], v[{c}:{c1}] neg_lo:[1,0] neg_hi:[0,1]",
              "v_pk_mul_f32 v[{d}:{d1}], v[{b}:{b1}], s[{p}:{p1}] op_sel:[1,0]",
              "v_cvt_f32_f16_sdwa v{d}, v{b} dst_sel:DWORD dst_unused:UNUSED_PAD src0_sel:WORD_1",
              "v_cvt_f32_f16_sdwa v{d}, v{c} dst_sel:DWORD dst_unused:UNUSED_PAD src0_sel:WORD_0",
              "ds_bpermute_b32 v{d}, v{b}, v{c}", "ds_bpermute_b32 v{d}, v{b}, v{d} offset:12",
              "ds_swizzle_b32 v{d}, v{b} offset:swizzle(SWAP,16)", "ds_swizzle_b32 v{d}, v{d} offset:0x8055"]
BLOCK_SALU = ["s_mov_b32 s{d}, {t}", "s_mov_b64 s[{p}:{p1}], s[{q}:{q1}]", "s_add_u32 s{d}, {t}, s{e}",
              "s_sub_u32 s{d}, {t}, s{e}", "s_add_i32 s{d}, {t}, s{e}", "s_sub_i32 s{d}, {t}, s{e}",
              "s_mul_i32 s{d}, {t}, s{e}", "s_and_b32 s{d}, {t}, s{e}", "s_or_b32 s{d}, {t}, s{e}",
              "s_xor_b32 s{d}, {t}, s{e}", "s_andn2_b32 s{d}, {t}, s{e}", "s_and_b64 s[{p}:{p1}], s[{q}:{q1}], -1",
              "s_or_b64 s[{p}:{p1}], s[{q}:{q1}], s[{p}:{p1}]", "s_xor_b64 s[{p}:{p1}], s[{q}:{q1}], 0x1234",
              "s_andn2_b64 s[{p}:{p1}], s[{q}:{q1}], s[{p}:{p1}]", "s_lshl_b32 s{d}, {t}, s{e}",
              "s_lshr_b32 s{d}, {t}, s{e}", "s_ashr_i32 s{d}, {t}, s{e}", "s_lshl_b64 s[{p}:{p1}], s[{q}:{q1}], s{e}",
              "s_lshr_b64 s[{p}:{p1}], s[{q}:{q1}], {t}", "s_min_i32 s{d}, {t}, s{e}", "s_max_i32 s{d}, {t}, s{e}",
              "s_min_u32 s{d}, {t}, s{e}", "s_max_u32 s{d}, {t}, s{e}", "s_cselect_b32 s{d}, {t}, s{e}",
              "s_cselect_b64 s[{p}:{p1}], -1, 0", "s_cmp_lt_i32 {t}, s{e}", "s_cmp_eq_u32 s{d}, {t}",
              "s_cmp_lg_u32 {t}, s{e}", "s_cmp_gt_i32 s{e}, {t}", "s_cmp_ge_u32 s{e}, {t}", "s_cmp_le_i32 {t}, s{e}",
              "s_waitcnt lgkmcnt(0)", "s_nop 1", "s_and_b64 exec, exec, s[{p}:{p1}]", "s_mov_b64 exec, s[{q}:{q1}]",
              "s_or_b64 exec, exec, s[{q}:{q1}]", "s_addc_u32 s{d}, {t}, s{e}", "s_subb_u32 s{d}, {t}, s{e}",
              "s_and_saveexec_b64 s[{p}:{p1}], s[{q}:{q1}]", "s_or_saveexec_b64 s[{p}:{p1}], -1",
              "s_andn2_saveexec_b64 s[{p}:{p1}], vcc", "s_xor_saveexec_b64 s[{p}:{p1}], s[{p}:{p1}]",
              "s_addk_i32 s{d}, 0x7fff", "s_addk_i32 s{d}, 0xfff0", "s_movk_i32 s{d}, 0x8001"]
BRANCHES = ["s_branch", "s_cbranch_scc0", "s_cbranch_scc1", "s_cbranch_vccz", "s_cbranch_vccnz",
            "s_cbranch_execz", "s_cbranch_execnz"]


def _random_block(rng, n):
    lines = []
    for _ in range(n):
        form = rng.choice(BLOCK_VALU if rng.random() < 0.6 else BLOCK_SALU)
        d, b, c = (int(x) for x in rng.integers(0, 14, 3) * 2)
        p, q = (int(x) for x in rng.integers(10, 30, 2) * 2)
        s = rng.choice([f"v{int(rng.integers(0, 28))}", f"s{int(rng.integers(0, 60))}",
                        str(int(rng.integers(-16, 65))), "0x3f800000", "0.5", "0xfffff000"])
        t = rng.choice([f"s{int(rng.integers(0, 60))}", str(int(rng.integers(-16, 65))), "0x80000000", "0xabcdef"])
        lines.append(form.format(d=d, d1=d + 1, b=b, b1=b + 1, c=c, c1=c + 1, p=p, p1=p + 1, q=q, q1=q + 1,
                                 e=int(rng.integers(0, 60)), s=s, t=t))
    if rng.random() < 0.5:     # the block ends with a branch over one instruction, taken or not
        lines += [f"{rng.choice(BRANCHES)} .Lskip", "v_mov_b32_e32 v0, 0x1234", ".Lskip:", "v_add_u32_e32 v1, 1, v1"]
    return "\n".join(lines)


@pytest.mark.parametrize("nans", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_random_straight_line_blocks_equal_reference(arch, nans):
    """Random runs of the block operations (SCC producers and consumers, EXEC writes in the
    middle, sources of every kind) run as one C block under the fast engine and one handler at a
    time under the reference one: every register, SCC and EXEC the same."""
    from pa_tile.emu.machine import run_code

    rng = np.random.default_rng((7 if arch == "gfx942" else 8) + 2 * nans)
    for trial in range(100):
        body = _random_block(rng, int(rng.integers(2, 40)))
        prog = _program(body, arch)
        fast_code = run_code(prog, "k", arch, "fast")
        assert fast_code[prog.kernel("k").entry].__qualname__.startswith("_block_handler")
        v, _ = _registers(trial, nans=nans)
        sregs = rng.integers(0, 1 << 32, 128, dtype=np.uint64).astype(np.uint32)
        if not nans:
            sregs = np.where((sregs & 0x7FFFFFFF) > 0x7F800000, sregs & 0xBFFFFFFF, sregs)
        sregs[rng.integers(0, 128, 20)] = rng.integers(0, 40, 20)   # small shift counts and values
        exec_mask = int(rng.integers(0, 1 << 63)) * 2 + 1 if trial % 3 else (1 << 64) - 1
        out = []
        for engine in ("fast", "reference"):
            w = Wave(arch)
            w.v[:64] = v
            w.s[:] = sregs
            w.scc = int(trial % 2)
            w.exec = exec_mask
            run_wave(prog, w, arch=arch, engine=engine)
            out.append((w.v.copy(), w.s.copy(), w.scc, w.em.copy(), w.eall))
        (vf, sf, cf, ef, af), (vr, sr, cr, er, ar) = out
        assert np.array_equal(vf, vr) and np.array_equal(sf, sr), body
        assert cf == cr and np.array_equal(ef, er) and af == ar, body


def test_blocks_stop_at_labels_and_branches():
    """A branch target inside a run starts a new block; a loop runs through blocks the same."""
    from pa_tile.emu.machine import run_code

    body = ("s_mov_b32 s0, 0\ns_mov_b32 s1, 5\n.L1:\ns_add_u32 s0, s0, 3\nv_add_u32_e32 v1, s0, v1\n"
            "s_sub_u32 s1, s1, 1\ns_cmp_lg_u32 s1, 0\ns_cbranch_scc1 .L1\nv_mov_b32_e32 v2, s0")
    prog = _program(body, "gfx942")
    code = run_code(prog, "k", "gfx942", "fast")
    names = [getattr(h, "__qualname__", "") for h in code[:8]]
    assert names[0].startswith("_block_handler") and names[2].startswith("_block_handler")
    outs = []
    for engine in ("fast", "reference"):
        w = Wave("gfx942")
        w.v[1] = np.arange(64, dtype=np.uint32)
        run_wave(prog, w, arch="gfx942", engine=engine)
        outs.append((w.v[:4].copy(), w.s[:4].copy(), w.scc))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2] and outs[0][1][0] == 15


@pytest.mark.parametrize("body", ["s_load_dword s8, s[0:1], 0x10", "s_load_dwordx2 s[8:9], s[0:1], s4",
                                  "s_load_dwordx4 s[8:11], s[0:1], s4 offset:0x8",
                                  "s_load_dwordx8 s[8:15], s[0:1], 0x3",       # low address bits ignored
                                  "s_load_dwordx2 s[0:1], s[0:1], 0x0\ns_load_dword s2, s[0:1], 0x4"])
def test_fast_s_load_equals_reference(body):
    """Scalar loads inside and past the tensor (a fault: the same message), the base overwritten."""
    import torch

    from pa_tile.emu import GlobalMemory, MemoryFault

    data = torch.arange(64, dtype=torch.int32)
    ptrs = torch.tensor([data.data_ptr(), data.data_ptr() + 200], dtype=torch.int64)
    mem = GlobalMemory([(data.data_ptr(), 256, "data"), (ptrs.data_ptr(), 16, "ptrs")])
    for base, soff in ((data.data_ptr(), 8), (data.data_ptr() + 240, 4), (ptrs.data_ptr(), 0)):
        got = []
        for engine in ("fast", "reference"):
            w = Wave("gfx942")
            w.s[0], w.s[1], w.s[4] = base & 0xFFFFFFFF, base >> 32, soff
            w.mem = mem
            try:
                run_wave(_program(body, "gfx942"), w, arch="gfx942", engine=engine)
                got.append((w.s.copy().tolist(), None))
            except MemoryFault as e:
                got.append((None, str(e)))
        assert got[0] == got[1], (body, base - data.data_ptr(), soff)
