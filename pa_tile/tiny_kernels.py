"""The smallest FlyDSL kernel of the course, ``Out = alpha * X + Y``: chapter 00 shows this file
(lines within 100 characters), launches the kernel and reads its assembly."""

import flydsl.compiler as flyc
import flydsl.expr as fx


@flyc.kernel
def scale_add_kernel(X: fx.Tensor, Y: fx.Tensor, Out: fx.Tensor, alpha: fx.Float32,
                     tiled_copy: fx.TiledCopy):
    """Out = alpha * X + Y over one [8, 64] tile per workgroup (128 threads, 4 floats each)."""
    tid = fx.thread_idx.x  # CUDA's threadIdx.x: the lane's number in the workgroup
    bm, bn = fx.block_idx.x, fx.block_idx.y  # CUDA's blockIdx: which [8, 64] tile
    tile = tiled_copy.tile_mn
    thr = tiled_copy.get_slice(tid)  # this thread's share of every tile (its 4 floats)
    # flat_divide cuts the [M, N] tensor into [8, 64] tiles; [None, None, bm, bn] picks ours
    gx = thr.partition_S(fx.flat_divide(X, tile)[None, None, bm, bn])
    gy = thr.partition_S(fx.flat_divide(Y, tile)[None, None, bm, bn])
    go = thr.partition_D(fx.flat_divide(Out, tile)[None, None, bm, bn])
    rx, ry, ro = fx.make_fragment_like(gx), fx.make_fragment_like(gy), fx.make_fragment_like(go)
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)  # one 128-bit load per thread
    fx.copy(atom, gx, rx)  # global -> registers
    fx.copy(atom, gy, ry)
    ro.store(rx.load() * alpha + ry.load())  # arithmetic on the register fragments
    fx.copy(atom, ro, go)  # registers -> global


@flyc.jit
def scale_add(X: fx.Tensor, Y: fx.Tensor, Out: fx.Tensor, alpha: fx.Float32,
              stream: fx.Stream = fx.Stream(None)):
    """Launch ``scale_add_kernel``; X, Y, Out are float32 [M, N], M % 8 == 0, N % 64 == 0."""
    atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
    # threads as an [8, 16] grid, each holding [1, 4] values: an [8, 64] tile per workgroup
    threads = fx.make_ordered_layout((8, 16), order=(1, 0))
    values = fx.make_ordered_layout((1, 4), order=(0, 1))
    tiled = fx.make_tiled_copy_tv(atom, threads, values)
    tm, tn = tiled.tile_mn.unpack()
    M, N = X.shape.unpack()
    scale_add_kernel(X, Y, Out, alpha, tiled).launch(grid=(M // tm, N // tn, 1), block=(128, 1, 1),
                                                     stream=stream)
