"""Issue 13 item 8: kernels beyond attention, written with FlyDSL here, run through FlyDSL's
launcher into the emulator on both archs and checked against torch. Each exercises instruction
families pa_tile's attention kernels do not use:

* an f16 GEMM with FlyDSL's tile API (tiled MMA, tiled copies, a K loop) over a grid of output
  tiles: ``v_mfma_f32_16x16x16_f16`` (the attention kernels only use the fp8 MFMA), 64-bit
  buffer loads of f16 pairs;
* a row reduction: full-wave and 16-lane segmented DPP sums (``row_bcast`` under row masks),
  a DPP max, ``v_readlane``, and a cross-wave combine through LDS (``ds_write2``/``ds_read2``);
* a tiled f16 transpose through padded LDS: ``ds_read_u16``, ``ds_write_b64``, ``v_perm_b32``
  half packing, several workgroups each with four waves and a barrier.
"""

import re

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from pa_tile import backend
from pa_tile.emu import launch as L

ARCHS = ["gfx942", "gfx950"]


@pytest.fixture(scope="module", autouse=True)
def emulator():
    # Emulator tier only (the hook cannot be uninstalled in-process): skip on a GPU backend.
    if backend.ensure_backend() != "emu":
        pytest.skip("emulator-tier test; this process runs on a GPU backend")


def _run(jit_fn, arch, *args):
    L.set_arch(arch)
    try:
        with L.record_launches() as log:
            jit_fn(*args)
    finally:
        L.set_arch(None)
    (launch,) = log
    assert launch.arch == arch
    return set(re.findall(r"^\s*([a-z_][a-z0-9_]*)", launch.asm, re.M))


# --------------------------------------------------------------------------- f16 MFMA GEMM

GM, GN, GK = 128, 128, 64
BM, BN, BK = 64, 64, 16


@flyc.kernel
def hgemm_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor):
    """C[BM, BN] tile (bm, bn) = A[bm] @ B[bn]^T; 4 waves of 16x16x16 MFMAs, K in BK steps."""
    tid = fx.thread_idx.x
    bm, bn = fx.block_idx.x, fx.block_idx.y
    A, B, C = (fx.rocdl.make_buffer_tensor(t) for t in (A, B, C))
    dA, dB = fx.zipped_divide(A, (BM, BK)), fx.zipped_divide(B, (BN, BK))
    tC = fx.slice(fx.zipped_divide(C, (BM, BN)), (None, (bm, bn)))
    atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 16, fx.Float16))
    tiled = fx.make_tiled_mma(atom, fx.make_layout((2, 2, 1), (1, 2, 0)))
    thr = tiled.thr_slice(tid)
    cp = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float16)
    cpc = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
    ca = fx.make_tiled_copy_A(cp, tiled).get_slice(tid)
    cb = fx.make_tiled_copy_B(cp, tiled).get_slice(tid)
    cc = fx.make_tiled_copy_C(cpc, tiled).get_slice(tid)
    fa = thr.make_fragment_A(fx.slice(dA, (None, (bm, 0))))
    fb = thr.make_fragment_B(fx.slice(dB, (None, (bn, 0))))
    fc = thr.make_fragment_C(tC)
    fc.fill(0)
    for kt in fx.range_constexpr(GK // BK):
        fx.copy(cp, ca.partition_S(fx.slice(dA, (None, (bm, kt)))), ca.retile(fa), pred=None)
        fx.copy(cp, cb.partition_S(fx.slice(dB, (None, (bn, kt)))), cb.retile(fb), pred=None)
        fx.gemm(atom, fc, fa, fb, fc)
    fx.copy(cpc, cc.retile(fc), cc.partition_S(tC), pred=None)


@flyc.jit
def hgemm(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
    hgemm_kernel(A, B, C).launch(grid=(GM // BM, GN // BN, 1), block=(256, 1, 1), stream=stream)


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_mfma_gemm_with_the_tile_api(arch):
    torch.manual_seed(0)
    a, b, c = torch.randn(GM, GK).half(), torch.randn(GN, GK).half(), torch.zeros(GM, GN)
    used = _run(hgemm, arch, a, b, c)
    assert "v_mfma_f32_16x16x16_f16" in used
    ref = a.double() @ b.double().T  # f16 products are exact in f32: only the f32 sums round
    bound = (a.double().abs() @ b.double().abs().T) * GK * 2.0**-24
    assert ((c.double() - ref).abs() <= bound).all()


# --------------------------------------------------------------------------- row reduction

RR, RW = 4, 256


@fx.struct
class Partials:
    s: fx.Array[fx.Float32, 4]
    m: fx.Array[fx.Float32, 4]


@flyc.kernel
def rowred_kernel(A: fx.Tensor, S: fx.Tensor, Mx: fx.Tensor, Seg: fx.Tensor):
    """One row per workgroup: sum and max of its 256 values (4 waves), and 16-lane segment sums."""
    tid = fx.thread_idx.x
    row = fx.block_idx.x
    x = A[row * RW + tid]
    Seg[row * RW + tid] = fx.coop.warp_reduce(x, fx.ReductionOp.ADD, width=16)
    ws = fx.coop.warp_reduce(x, fx.ReductionOp.ADD, width=64)
    wm = fx.coop.warp_reduce(x, fx.ReductionOp.MAX, width=64)
    p = fx.SharedAllocator().allocate(Partials).peek()
    ps, pm = p.s.view(fx.make_layout(4, 1)), p.m.view(fx.make_layout(4, 1))
    if tid % 64 == 0:
        ps[tid // 64] = ws
        pm[tid // 64] = wm
    fx.gpu.barrier()
    if tid == 0:
        S[row] = (ps[0] + ps[1]) + (ps[2] + ps[3])
        Mx[row] = fx.max(fx.max(pm[0], pm[1]), fx.max(pm[2], pm[3]))


@flyc.jit
def rowred(A: fx.Tensor, S: fx.Tensor, Mx: fx.Tensor, Seg: fx.Tensor):
    rowred_kernel(A, S, Mx, Seg).launch(grid=(RR, 1, 1), block=(RW, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_row_reduction_with_dpp_and_an_lds_combine(arch):
    torch.manual_seed(1)
    a = torch.randn(RR * RW)
    s, m, seg = torch.zeros(RR), torch.zeros(RR), torch.zeros(RR * RW)
    used = _run(rowred, arch, a, s, m, seg)
    assert {"v_add_f32_dpp", "v_mov_b32_dpp", "s_barrier"} <= used
    rows = a.reshape(RR, RW)
    assert torch.equal(m, rows.max(1).values)
    # any f32 summation order is within n * 2^-24 * sum|x| of the exact sum
    assert ((s.double() - rows.double().sum(1)).abs() <= RW * 2.0**-24 * rows.abs().double().sum(1)).all()
    segs = rows.reshape(RR, 16, 16).double()
    want = segs.sum(2, keepdim=True).expand(-1, -1, 16)
    assert ((seg.reshape(RR, 16, 16).double() - want).abs() <= 16 * 2.0**-24 * segs.abs().sum(2, keepdim=True)).all()


# --------------------------------------------------------------------------- tiled copy through LDS

T, TP = 32, 34  # tile edge; padded LDS row in halves
TM, TN = 64, 96


@fx.struct
class Tile:
    t: fx.Array[fx.Float16, T * TP]


@flyc.kernel
def tcopy_kernel(A: fx.Tensor, B: fx.Tensor):
    """B = A^T (f16 [TM, TN]), one 32x32 tile per workgroup: each of 256 threads moves 4 halves
    of a tile row into LDS and, after the barrier, 4 halves of a tile column out."""
    tid = fx.thread_idx.x
    bi, bj = fx.block_idx.x, fx.block_idx.y
    s = fx.SharedAllocator().allocate(Tile).peek().t.view(fx.make_layout(T * TP, 1))
    r, c0 = tid // 8, (tid % 8) * 4
    for k in fx.range_constexpr(4):
        s[r * TP + c0 + k] = A[(bi * T + r) * TN + bj * T + c0 + k]
    fx.gpu.barrier()
    for k in fx.range_constexpr(4):
        B[(bj * T + r) * TM + bi * T + c0 + k] = s[(c0 + k) * TP + r]


@flyc.jit
def tcopy(A: fx.Tensor, B: fx.Tensor):
    tcopy_kernel(A, B).launch(grid=(TM // T, TN // T, 1), block=(256, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiled_f16_transpose_through_lds(arch):
    torch.manual_seed(2)
    a, b = torch.randn(TM * TN).half(), torch.zeros(TN * TM).half()
    used = _run(tcopy, arch, a, b)
    assert {"ds_read_u16", "s_barrier"} <= used
    assert torch.equal(b.reshape(TN, TM), a.reshape(TM, TN).T)
