"""f32 MFMA through FlyDSL's launcher into the emulator: ``fx.rocdl.MFMA(16, 16, 4, Float32)``
compiles to ``v_mfma_f32_16x16x4_f32`` (FlyDSL's example 03 uses it) and
``MFMA(32, 32, 2, Float32)`` to ``v_mfma_f32_32x32x2_f32``; the result must equal A @ B^T."""

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from pa_tile import backend
from pa_tile.emu import launch as L
from pa_tile.emu.memory import Trace

BM, BN, BK = 64, 64, 8


def make_gemm(m, n, k, wave_layout, name):
    """C[BM, BN] = A[BM, BK] @ B[BN, BK]^T, one workgroup of 4 waves tiling m x n x k MFMAs."""

    @flyc.kernel(name=name)
    def gemm_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor):
        tid = fx.thread_idx.x
        A, B, C = (fx.rocdl.make_buffer_tensor(t) for t in (A, B, C))
        tA = fx.slice(fx.zipped_divide(A, (BM, BK)), (None, 0))
        tB = fx.slice(fx.zipped_divide(B, (BN, BK)), (None, 0))
        tC = fx.slice(fx.zipped_divide(C, (BM, BN)), (None, 0))
        atom = fx.make_mma_atom(fx.rocdl.MFMA(m, n, k, fx.Float32))
        tiled = fx.make_tiled_mma(atom, wave_layout())
        thr = tiled.thr_slice(tid)
        cp = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
        ca = fx.make_tiled_copy_A(cp, tiled).get_slice(tid)
        cb = fx.make_tiled_copy_B(cp, tiled).get_slice(tid)
        cc = fx.make_tiled_copy_C(cp, tiled).get_slice(tid)
        fa, fb, fc = thr.make_fragment_A(tA), thr.make_fragment_B(tB), thr.make_fragment_C(tC)
        fx.copy(cp, ca.partition_S(tA), ca.retile(fa), pred=None)
        fx.copy(cp, cb.partition_S(tB), cb.retile(fb), pred=None)
        fc.fill(0)
        fx.gemm(atom, fc, fa, fb, fc)
        fx.copy(cp, cc.retile(fc), cc.partition_S(tC), pred=None)

    @flyc.jit
    def gemm(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        gemm_kernel(A, B, C).launch(grid=(1, 1, 1), block=(256, 1, 1), stream=stream)

    return gemm


GEMMS = {
    "v_mfma_f32_16x16x4_f32": make_gemm(16, 16, 4, lambda: fx.make_layout((2, 2, 1), (1, 2, 0)), "gemm_f32_16x16x4"),
    "v_mfma_f32_32x32x2_f32": make_gemm(32, 32, 2, lambda: fx.make_layout((2, 2, 1), (1, 2, 0)), "gemm_f32_32x32x2"),
}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    # Emulator tier only: installing the hook cannot be undone in-process, so on a machine whose
    # backend is a real GPU this module skips rather than route later GPU tests to the emulator.
    if backend.ensure_backend() != "emu":
        pytest.skip("emulator-tier test; this process runs on a GPU backend")


@pytest.mark.parametrize("mnemonic", sorted(GEMMS))
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_f32_mfma_gemm(mnemonic, arch, monkeypatch):
    monkeypatch.setenv("ARCH", arch)
    g = torch.Generator().manual_seed(3)
    # small integers: every product and partial sum is exact, so any order gives A @ B^T exactly
    A = torch.randint(-16, 16, (BM, BK), generator=g).float()
    B = torch.randint(-16, 16, (BN, BK), generator=g).float()
    C = torch.full((BM, BN), float("nan"))
    trace = Trace(arch)
    with L.launch_options(trace=trace):
        GEMMS[mnemonic](A, B, C)
    assert trace.counts.get(mnemonic, 0) > 0, sorted(m for m in trace.counts if "mfma" in m)
    assert torch.equal(C, A @ B.T)
    # general values: f32 products, float64 sums, one rounding per MFMA
    A, B = torch.randn(BM, BK, generator=g), torch.randn(BN, BK, generator=g)
    GEMMS[mnemonic](A, B, C)
    torch.testing.assert_close(C, (A.double() @ B.double().T).float(), rtol=1e-6, atol=1e-6)
