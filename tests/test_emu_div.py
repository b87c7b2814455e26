"""IEEE f32 division in pa_tile.emu: V_DIV_SCALE_F32 / V_DIV_FMAS_F32 / V_DIV_FIXUP_F32
(CDNA3/CDNA4 §12.11 pseudo-code; the readings taken where it cannot be literal are listed in
``numerics``, "IEEE f32 division").

The decisive check is the whole sequence LLVM emits for ``fdiv float``: a FlyDSL elementwise
division compiled for both archs, run in the emulator and compared bit for bit with torch's
division, on random bit patterns, exponents at both ends of the range (denormal quotients and
divisors, overflow) and every pair of special values.
"""

import numpy as np
import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from pa_tile.emu import numerics as nx
from test_emu_kernels import emulate, mnemonics
from test_emu_ops import ALL, asf, f32, run


@flyc.kernel
def _div_kernel(X: fx.Tensor, Y: fx.Tensor, Out: fx.Tensor, tiled_copy: fx.TiledCopy):
    tid = fx.thread_idx.x
    bm, bn = fx.block_idx.x, fx.block_idx.y
    tile = tiled_copy.tile_mn
    thr = tiled_copy.get_slice(tid)
    gx = thr.partition_S(fx.flat_divide(X, tile)[None, None, bm, bn])
    gy = thr.partition_S(fx.flat_divide(Y, tile)[None, None, bm, bn])
    go = thr.partition_D(fx.flat_divide(Out, tile)[None, None, bm, bn])
    rx, ry, ro = fx.make_fragment_like(gx), fx.make_fragment_like(gy), fx.make_fragment_like(go)
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    fx.copy(atom, gx, rx)
    fx.copy(atom, gy, ry)
    ro.store(rx.load() / ry.load())
    fx.copy(atom, ro, go)


@flyc.jit
def _div(X: fx.Tensor, Y: fx.Tensor, Out: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    tiled = fx.make_tiled_copy_tv(
        atom, fx.make_ordered_layout((8, 16), order=(1, 0)), fx.make_ordered_layout((1, 4), order=(0, 1))
    )
    tm, tn = tiled.tile_mn.unpack()
    M, N = X.shape.unpack()
    _div_kernel(X, Y, Out, tiled).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1), stream=stream)


SPECIALS = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 1.17e-38, 3e38, -3.4e38,
            1.0, 2.0 ** 126, -(2.0 ** 127), 1e-30, 7.0, 2.0 ** -126]


def _operands(rows, seed=0):
    rng = np.random.default_rng(seed)
    n = rows * 64

    def edge():  # exponents at both ends of the range, random sign and mantissa
        e = rng.choice(np.r_[0:30, 225:255], n).astype(np.uint32)
        return ((rng.integers(0, 2, n).astype(np.uint32) << 31) | (e << 23)
                | rng.integers(0, 2 ** 23, n).astype(np.uint32)).view(np.float32)

    x = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    y = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32).copy()
    half = n // 2
    x[half:], y[half:] = edge()[half:], edge()[half:]
    sp = np.array(SPECIALS, np.float32)
    xs, ys = np.meshgrid(sp, sp, indexing="ij")
    x[:sp.size ** 2], y[:sp.size ** 2] = xs.ravel(), ys.ravel()
    return torch.from_numpy(x.reshape(rows, 64)), torch.from_numpy(y.reshape(rows, 64))


def _same_bits(a, b):
    a, b = a.numpy(), b.numpy()
    return (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_compiled_fdiv_matches_torch_bit_for_bit(arch):
    x, y = _operands(32, seed=1)
    out = torch.zeros_like(x)
    prog = emulate(_div, (x, y, out), (4, 1, 1), (128, 1, 1), arch)
    assert {"v_div_scale_f32", "v_div_fmas_f32", "v_div_fixup_f32", "v_rcp_f32_e32"} <= mnemonics(prog)
    same = _same_bits(out, x / y)
    assert same.all(), [(x.view(-1)[i].item(), y.view(-1)[i].item(), out.view(-1)[i].item())
                        for i in np.flatnonzero(~same.ravel())[:5]]


def test_div_scale_flags_a_denormal_quotient_and_scales_the_dividend():
    # 2^-120 / 2^10 = 2^-130 is an f32 denormal: the dividend is scaled by 2^64 and VCC set,
    # the divisor is left alone (VCC set again: it is what div_fmas reads).
    n, d = np.float32(2.0 ** -120), np.float32(2.0 ** 10)
    ns, vn = nx.div_scale_f32(n, d, n)
    ds, vd = nx.div_scale_f32(d, d, n)
    assert ns == np.float32(2.0 ** -56) and vn and ds == d and vd
    # the VOP3b form writes its lane mask to the named SGPR pair, zero for inactive lanes
    w = run("v_div_scale_f32 v2, s[4:5], v0, v1, v0",
            lambda w: (w.v.__setitem__(0, f32(n)), w.v.__setitem__(1, f32(d)), setattr(w, "exec", 0xF)))
    assert (asf(w.v[2][:4]) == np.float32(2.0 ** -56)).all() and (w.s[4], w.s[5]) == (0xF, 0)


def test_div_scale_huge_divisor_scales_both_down_and_zero_gives_nan():
    d, n = np.float32(2.0 ** 127), np.float32(3.0 * 2.0 ** 100)
    assert nx.div_scale_f32(d, d, n)[0] == np.float32(2.0 ** 63)
    assert nx.div_scale_f32(n, d, n)[0] == np.float32(3.0 * 2.0 ** 36)
    assert np.isnan(nx.div_scale_f32(np.float32(1), np.float32(0), np.float32(1))[0])


def test_div_fmas_scales_by_two_to_the_64_only_in_vcc_lanes():
    def setup(w):
        w.v[0], w.v[1] = f32(1.5), f32(2.0)
        w.v[2] = f32(np.where(np.arange(64) < 32, 4.0, 2.0 ** -70).astype(np.float32))
        w.vcc = 0xFFFF  # lanes 0..15
    w = run("v_div_fmas_f32 v3, v0, v1, v2", setup)
    r = asf(w.v[3])
    assert r[0] == np.float32(7.0 * 2.0 ** 64)            # exponent(S2) > 127: up
    assert r[20] == np.float32(7.0)                          # VCC clear: a plain fma
    assert r[40] == np.float32(3.0 + 2.0 ** -70)             # VCC clear
    w = run("v_div_fmas_f32 v3, v0, v1, v2", lambda w: (setup(w), setattr(w, "vcc", ALL)))
    # exponent(S2) <= 127: down, in one rounding into the denormal range
    assert asf(w.v[3])[40] == np.float32((3.0 + 2.0 ** -70) * 2.0 ** -64)


@pytest.mark.parametrize("q, d, n, want", [
    (1.0, 0.0, 0.0, "nan"), (1.0, float("inf"), -float("inf"), "nan"),
    (1.0, -0.0, 5.0, -float("inf")), (1.0, 2.0, float("inf"), float("inf")),
    (1.0, float("inf"), -5.0, -0.0), (1.0, 3.0, 0.0, 0.0),
    (2.5, -2.0, 5.0, -2.5), (float("nan"), 1e-30, 1e30, float("inf")),
    (1.0, 2.0 ** 100, 2.0 ** -60, 0.0),
])
def test_div_fixup_special_cases(q, d, n, want):
    r = nx.div_fixup_f32(np.float32(q), np.float32(d), np.float32(n))
    if want == "nan":
        assert np.isnan(r)
    else:
        assert r.view(np.uint32) == np.float32(want).view(np.uint32)
    # a NaN operand comes back quieted (dividend first)
    assert nx.div_fixup_f32(np.float32(1), np.float32(1), np.uint32(0x7F800001).view(np.float32)).view(np.uint32) == 0x7FC00001
