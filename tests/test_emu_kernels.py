"""Small FlyDSL kernels compiled for gfx942 and gfx950, executed by pa_tile.emu, checked with torch.

Each kernel is compiled to assembly on the CPU (``toolchain.compile_isa``) and launched with
``run_kernel`` and a kernarg segment packed here from the kernel's metadata, so these tests
exercise the emulator alone (launch.py has its own tests).
"""

import struct

import pytest
import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from pa_tile import toolchain
from pa_tile.emu import GlobalMemory, Trace, load_program, run_kernel
from pa_tile.tiny_kernels import scale_add

ARCHS = ["gfx942", "gfx950"]


def _kernarg(kernel, args):
    """Explicit arguments at their metadata offsets: a tensor is a pointer, then its dynamic layout
    (i32 shapes, then the i64 strides of all but the innermost, unit-stride dim); floats are f32."""
    meta = kernel.metadata
    slots = [a for a in meta[".args"] if not a[".value_kind"].startswith("hidden_")]
    values = []
    for a in args:
        if isinstance(a, torch.Tensor):
            assert a.stride(-1) == 1
            values.append(struct.pack("<Q", a.data_ptr()))
            values.append(struct.pack(f"<{a.dim()}i", *a.shape) + struct.pack(f"<{a.dim() - 1}q", *a.stride()[:-1]))
        else:
            values.append(struct.pack("<f", a))
    assert len(values) == len(slots)
    seg = bytearray(meta[".kernarg_segment_size"])
    for slot, v in zip(slots, values):
        assert len(v) == slot[".size"], (slot, len(v))
        seg[slot[".offset"]: slot[".offset"] + len(v)] = v
    return bytes(seg)


def emulate(jit_fn, args, grid, block, arch, trace=None):
    """Compile jit_fn(*args) for arch and run its kernel over grid x block on the tensors."""
    prog = load_program(toolchain.compile_isa(jit_fn, *args, arch=arch))
    kernel = prog.kernel()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    mem = GlobalMemory([(t.data_ptr(), t.numel() * t.element_size(), f"arg{i}") for i, t in enumerate(tensors)])
    run_kernel(prog, kernel.name, grid, block, _kernarg(kernel, args), mem, arch=arch, trace=trace)
    return prog


def mnemonics(prog):
    return {i.mnemonic for i in prog.instructions}


# --------------------------------------------------------------------------- elementwise

@pytest.mark.parametrize("arch", ARCHS)
def test_scale_add_elementwise(arch):
    torch.manual_seed(0)
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    trace = Trace(arch)
    prog = emulate(scale_add, (x, y, out, 1.5), (2, 2, 1), (128, 1, 1), arch, trace=trace)
    if "v_pk_fma_f32" in mnemonics(prog):  # fused: one rounding of the exact x * 1.5 + y
        ref = (x.double() * 1.5 + y.double()).float()
    else:
        ref = x * 1.5 + y
    assert torch.equal(out, ref)
    # 4 workgroups x 2 waves, two 128-bit loads and one store each
    assert trace.counts["global_load_dwordx4"] == 16 and trace.counts["global_store_dwordx4"] == 8
    assert "global_load_dwordx4" in mnemonics(prog)


@pytest.mark.parametrize("arch", ARCHS)
def test_trace_counts_every_instruction_by_line(arch):
    """``Trace(count_lines=True)``: each executed instruction counted at its assembly line, per
    wave (the timing model's block frequencies); the per-line counts add up to the per-mnemonic ones."""
    x, y, out = torch.randn(16, 128), torch.randn(16, 128), torch.zeros(16, 128)
    trace = Trace(arch, count_lines=True)
    prog = emulate(scale_add, (x, y, out, 1.5), (2, 2, 1), (128, 1, 1), arch, trace=trace)
    lines = {i.line: i.mnemonic for i in prog.instructions}
    assert sum(trace.line_counts.values()) == sum(trace.counts.values())
    per_line = {}
    for (line, _wave), n in trace.line_counts.items():
        per_line[line] = per_line.get(line, 0) + n
    for mn, n in trace.counts.items():
        assert sum(c for line, c in per_line.items() if lines[line] == mn) == n
    assert {n for n in per_line.values()} == {8}  # straight-line code: every line once per wave, 8 waves
    assert Trace(arch).line_counts is None  # off by default: nothing kept per line


# --------------------------------------------------------------------------- 128-bit buffer copy

@flyc.kernel
def copy128_kernel(A: fx.Tensor, B: fx.Tensor):
    tid = fx.thread_idx.x
    bid = fx.block_idx.x
    A = fx.rocdl.make_buffer_tensor(A)
    B = fx.rocdl.make_buffer_tensor(B)
    bA = fx.slice(fx.zipped_divide(A, (8, 32)), (None, bid))
    bB = fx.slice(fx.zipped_divide(B, (8, 32)), (None, bid))
    atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), fx.Float32)
    tile_mn, tv = fx.make_layout_tv(fx.make_layout((8, 4), (4, 1)), fx.make_layout((1, 8), (1, 1)))
    thr = fx.make_tiled_copy(atom, tv, tile_mn).get_slice(tid)
    src, dst = thr.partition_S(bA), thr.partition_D(bB)
    frag = fx.make_fragment_like(src)
    fx.copy(atom, src, frag)
    fx.copy(atom, frag, dst)


@flyc.jit
def copy128(A: fx.Tensor, B: fx.Tensor):
    copy128_kernel(A, B).launch(grid=(6, 1, 1), block=(32, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_copy_with_128_bit_buffer_loads_in_a_half_wave(arch):
    a = torch.arange(16 * 96, dtype=torch.float32).reshape(16, 96)
    b = torch.zeros(16, 96)
    prog = emulate(copy128, (a, b), (6, 1, 1), (32, 1, 1), arch)
    assert {"buffer_load_dwordx4", "buffer_store_dwordx4"} <= mnemonics(prog)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- warp collectives

@flyc.kernel
def warp_reduce_kernel(A: fx.Tensor, S: fx.Tensor, M: fx.Tensor):
    tid = fx.thread_idx.x
    x = A[tid]
    S[tid] = fx.coop.warp_reduce(x, fx.ReductionOp.ADD, width=64)
    M[tid] = fx.coop.warp_reduce(x, fx.ReductionOp.MAX, width=64)


@flyc.jit
def warp_reduce(A: fx.Tensor, S: fx.Tensor, M: fx.Tensor):
    warp_reduce_kernel(A, S, M).launch(grid=(1, 1, 1), block=(64, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_warp_reduction_with_dpp(arch):
    torch.manual_seed(1)
    a = torch.randn(64)
    s, m = torch.zeros(64), torch.zeros(64)
    prog = emulate(warp_reduce, (a, s, m), (1, 1, 1), (64, 1, 1), arch)
    # row_shr with and without bound_ctrl, row_bcast:15/31 under row masks
    assert {"v_mov_b32_dpp", "v_add_f32_dpp"} <= mnemonics(prog)
    # the DPP scan adds in its own order: equal to the float64 sum up to float32 rounding
    assert torch.allclose(s, a.sum().expand(64), rtol=0, atol=2e-6)
    assert torch.equal(m, a.max().expand(64))


@flyc.kernel
def butterfly_kernel(A: fx.Tensor, S: fx.Tensor, P: fx.Tensor):
    tid = fx.thread_idx.x
    x = A[tid]
    P[tid] = fx.gpu.shuffle(x, 1, 64, mode="xor") + fx.gpu.shuffle(x, 16, 64, mode="xor") * 2.0 \
        + fx.gpu.shuffle(x, 32, 64, mode="xor") * 4.0
    for k in (1, 2, 4, 8, 16, 32):
        x = x + fx.gpu.shuffle(x, k, 64, mode="xor")
    S[tid] = x


@flyc.jit
def butterfly(A: fx.Tensor, S: fx.Tensor, P: fx.Tensor):
    butterfly_kernel(A, S, P).launch(grid=(1, 1, 1), block=(64, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_xor_shuffles_swizzle_bpermute_permlane(arch):
    torch.manual_seed(2)
    a = torch.randn(64)
    s, p = torch.zeros(64), torch.zeros(64)
    prog = emulate(butterfly, (a, s, p), (1, 1, 1), (64, 1, 1), arch)
    used = mnemonics(prog)
    assert "ds_swizzle_b32" in used
    if arch == "gfx942":
        assert "ds_bpermute_b32" in used
    else:
        assert {"v_permlane16_swap_b32_e32", "v_permlane32_swap_b32_e32"} <= used
    i = torch.arange(64)
    assert torch.equal(p, a[i ^ 1] + a[i ^ 16] * 2 + a[i ^ 32] * 4)
    # a butterfly sums in the same order on every lane: all lanes agree exactly
    assert torch.equal(s, s[0].expand(64)) and abs(float(s[0]) - float(a.sum())) < 2e-6


# --------------------------------------------------------------------------- LDS transpose

@fx.struct
class TransposeSmem:
    tile: fx.Array[fx.Float32, 16 * 17]


@flyc.kernel
def transpose_kernel(A: fx.Tensor, B: fx.Tensor):
    tid = fx.thread_idx.x
    r = tid // 16
    c = tid % 16
    smem = fx.SharedAllocator().allocate(TransposeSmem).peek()
    s = smem.tile.view(fx.make_layout(16 * 17, 1))
    s[c * 17 + r] = A[tid]  # 4 waves write ...
    fx.gpu.barrier()
    B[tid] = s[r * 17 + c]  # ... and read what the other waves wrote


@flyc.jit
def transpose(A: fx.Tensor, B: fx.Tensor):
    transpose_kernel(A, B).launch(grid=(1, 1, 1), block=(256, 1, 1))


@pytest.mark.parametrize("arch", ARCHS)
def test_lds_transpose_across_waves(arch):
    a = torch.randn(256)
    b = torch.zeros(256)
    prog = emulate(transpose, (a, b), (1, 1, 1), (256, 1, 1), arch)
    assert {"ds_write_b32", "ds_read_b32", "s_barrier"} <= mnemonics(prog)
    assert torch.equal(b.reshape(16, 16), a.reshape(16, 16).T)


# --------------------------------------------------------------------------- MFMA GEMM tiles

def make_gemm(block_mn, block_k, ab_type, copy_ab, name):
    """C[32, 32] = A[32, K] @ B[32, K]^T with 4 waves, each one 16x16 MFMA tile."""

    @flyc.kernel(name=name)
    def gemm_kernel(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor):
        tid = fx.thread_idx.x
        A = fx.rocdl.make_buffer_tensor(A)
        B = fx.rocdl.make_buffer_tensor(B)
        C = fx.rocdl.make_buffer_tensor(C)
        bA = fx.slice(fx.zipped_divide(A, (block_mn, block_k)), (None, 0))
        bB = fx.slice(fx.zipped_divide(B, (block_mn, block_k)), (None, 0))
        bC = fx.slice(fx.zipped_divide(C, (block_mn, block_mn)), (None, 0))
        mma = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, block_k, ab_type))
        tiled = fx.make_tiled_mma(mma, fx.make_layout((2, 2, 1), (1, 2, 0)))
        thr = tiled.thr_slice(tid)
        atom_ab = fx.make_copy_atom(copy_ab(), ab_type)
        atom_c = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
        ca = fx.make_tiled_copy_A(atom_ab, tiled).get_slice(tid)
        cb = fx.make_tiled_copy_B(atom_ab, tiled).get_slice(tid)
        cc = fx.make_tiled_copy_C(atom_c, tiled).get_slice(tid)
        fa, fb, fc = thr.make_fragment_A(bA), thr.make_fragment_B(bB), thr.make_fragment_C(bC)
        fx.copy(atom_ab, ca.partition_S(bA), ca.retile(fa), pred=None)
        fx.copy(atom_ab, cb.partition_S(bB), cb.retile(fb), pred=None)
        fc.fill(0)
        fx.gemm(mma, fc, fa, fb, fc)
        fx.copy(atom_c, cc.retile(fc), cc.partition_S(bC), pred=None)

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor):
        gemm_kernel(A, B, C).launch(grid=(1, 1, 1), block=(256, 1, 1))

    return launch


gemm_f16 = make_gemm(32, 16, fx.Float16, fx.rocdl.BufferCopy16b, "gemm_f16_tile")
gemm_fp8 = {
    "gfx942": make_gemm(32, 32, fx.Float8E4M3FNUZ, fx.rocdl.BufferCopy64b, "gemm_fp8_fnuz_tile"),
    "gfx950": make_gemm(32, 32, fx.Float8E4M3FN, fx.rocdl.BufferCopy64b, "gemm_fp8_ocp_tile"),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_fp16_mfma_gemm_tile(arch):
    torch.manual_seed(3)
    a, b, c = torch.randn(32, 16).half(), torch.randn(32, 16).half(), torch.zeros(32, 32)
    prog = emulate(gemm_f16, (a, b, c), (1, 1, 1), (256, 1, 1), arch)
    assert "v_mfma_f32_16x16x16_f16" in mnemonics(prog)
    ref = a.double() @ b.double().T  # exact products; one f32 rounding of the K-sum
    assert torch.allclose(c.double(), ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_mfma_gemm_tile_uses_the_arch_format(arch):
    torch.manual_seed(4)
    fp8 = torch.float8_e4m3fn if arch == "gfx950" else torch.float8_e4m3fnuz
    a, b = torch.randn(32, 32).to(fp8), torch.randn(32, 32).to(fp8)
    c = torch.zeros(32, 32)
    au, bu = a.view(torch.uint8), b.view(torch.uint8)  # the kernel reads raw bytes
    prog = emulate(gemm_fp8[arch], (au, bu, c), (1, 1, 1), (256, 1, 1), arch)
    assert "v_mfma_f32_16x16x32_fp8_fp8" in mnemonics(prog)
    ref = a.double() @ b.double().T  # fp8 products and their sum are exact in f32 here
    assert torch.equal(c.double(), ref)
    # decoding the same bytes in the other arch's format gives a different matrix: the emulator
    # really followed the arch (FNUZ has bias 8, OCP bias 7: a factor of 2 per element)
    other = (torch.float8_e4m3fnuz if arch == "gfx950" else torch.float8_e4m3fn)
    assert not torch.equal(c.double(), au.view(other).double() @ bu.view(other).double().T)
