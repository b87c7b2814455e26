# GENERATED from notebooks/03_raw_dwordx4_loads.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.




"""Stage 3: stage 2's kernel with a software-pipelined loop.

The next tile's K (8 ``buffer_load_dwordx4`` per lane) and its block-table entries are loop-carried
values, loaded one iteration ahead; V is issued at the top of the iteration it is used in, so
Q·Kᵀ and the softmax hide its latency. K and V go straight from 128-bit loads into the raw MFMA
operands, the query is read in 128-bit chunks, exp2/rcp are the hardware's ``v_exp_f32``/``v_rcp_f32``.

Layouts and numerics are stage 2's (``pa_tile.stages.s2_register_softmax``): query
``[num_seqs, num_q_heads, 128]`` f16; K ``[num_blocks, kv_heads, block_size, 128]``; V
``[num_blocks, kv_heads, 128, block_size]``; fp8 e4m3 of the arch's flavour; per-tensor scales.
``prefetch_k=False`` rebuilds stage 2's loop (no K prefetch) for comparison.
"""

import dataclasses
import functools
import math

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.compiler.kernel_function import CompilationContext
from flydsl.expr import arith, const_expr, gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max
from pa_tile.kernel_lib import (
    HEAD_DIM, MASKED, SPAN, TILE, WAVE, WAVES, buffer_load, buffer_store, i64, imin, lane_coords, mask_tail,
    merge_waves, mfma, pv_step, query_operands, rsrc, scalar_load, softmax_step,
)
from pa_tile.stages import s2_register_softmax as s2
from pa_tile.stages.s2_register_softmax import numerics_model  # the same roundings as stage 2

__all__ = ["paged_decode", "build_launcher", "launch_args", "numerics_model", "LIMITS"]

#: the same inputs as stage 2
LIMITS = dataclasses.replace(s2.LIMITS, stage="s3")


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str, prefetch_k: bool = True):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch, prefetch_k) specialization."""
    BS, G, PREFETCH = block_size, group, bool(prefetch_k)
    FMAX = fp8_max(arch)
    LOG2_FMAX = math.log2(FMAX)
    PAGE_BYTES = BS * HEAD_DIM
    PAGES_PER_SPAN = SPAN // BS

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, 2 * 16 * WAVES, 16]
        xchg: fx.Array[fx.Float32, WAVES * 2 * WAVE * 4, 16]

    @flyc.kernel(known_block_size=(WAVES * WAVE, 1, 1))
    def pa_decode_s3(
        out: fx.Tensor,
        query: fx.Tensor,
        key_cache: fx.Tensor,
        value_cache: fx.Tensor,
        block_tables: fx.Tensor,
        context_lengths: fx.Tensor,
        key_scale: fx.Tensor,
        value_scale: fx.Tensor,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        scale_log2: fx.Float32,
    ):
        tid, wave, lane, col, grp = lane_coords()
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, o_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables, out))
        ctx = scalar_load(context_lengths, seq)
        k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
        v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        head0 = seq * (num_kv_heads * G) + kvh * G

        q_ops, q_scale = query_operands(q_rs, head0 + imin(col, G - 1), col < G, FMAX, grp)
        c_qk = q_scale * k_scale * scale_log2

        last_page = (ctx - 1) // BS
        num_tiles = (ctx + (TILE - 1)) // TILE
        bt_row = seq * max_blocks
        if const_expr(PAGES_PER_SPAN > 1):
            k_lane = (col % 4) * HEAD_DIM + grp * 16
            v_lane = col * BS
        else:
            k_lane = ((col // 4) * 16 + col % 4) * HEAD_DIM + grp * 16
            v_lane = col * BS + grp * 16
        chunk_off = [((j + 2 * wave) % 8) * (16 * BS) for j in range_constexpr(8)]
        k_page_j = col // 4 if PAGES_PER_SPAN > 1 else 0
        v_page_j = grp if PAGES_PER_SPAN > 1 else 0

        def page_id(tile, j):
            # clamped: past the context, a wave re-reads the sequence's last page (masked later)
            idx = imin(tile * (TILE // BS) + wave * PAGES_PER_SPAN + j, last_page)
            return buffer_load(bt_rs, (bt_row + idx) * 4, 1)

        def slab(page):
            return (page * num_kv_heads + kvh) * PAGE_BYTES

        def load_k(page):
            voff = slab(page) + k_lane
            words = []
            for a in range_constexpr(4):
                for h in range_constexpr(2):
                    v = buffer_load(k_rs, voff, 4, offset=a * 4 * HEAD_DIM + h * 64)
                    words.extend([v[i] for i in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def load_v(page):
            voff = slab(page) + v_lane
            words = []
            for j in range_constexpr(8):
                v = buffer_load(v_rs, voff, 4, soffset=chunk_off[j])
                words.extend([v[k] for k in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def tile_math(t, k_words, v_words, o, m_old, l_old):
            s = []
            for a in range_constexpr(4):
                acc = fx.Vector.filled(4, 0.0, fx.Float32)
                for h in range_constexpr(2):
                    for half in range_constexpr(2):
                        w0 = (2 * a + h) * 4 + 2 * half
                        acc = mfma(i64(k_words[w0], k_words[w0 + 1]), q_ops[2 * h + half], acc)
                s.extend([acc[i] for i in range_constexpr(4)])
            s = fx.Vector.from_elements(s, dtype=fx.Float32)
            n_valid = ctx - (t * TILE + wave * SPAN + grp * 16)
            if t + 1 == num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, c_qk, LOG2_FMAX)
            return pv_step(o, v_words, p_ops, corr), m_new, l_new

        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        softmax0 = [zero4] * 8 + [fx.Float32(MASKED), fx.Float32(0.0)]
        if const_expr(PREFETCH):
            # carried: this tile's K (already loaded), the next tile's K page, this tile's V page
            state = [load_k(page_id(0, k_page_j)), page_id(1, k_page_j), page_id(0, v_page_j)] + softmax0
            base = 3
        else:
            state = [page_id(0, k_page_j), page_id(0, v_page_j)] + softmax0
            base = 2
        for t, st in range(0, num_tiles, 1, init=state):
            t = fx.Int32(t)
            o = [st[base + j] for j in range_constexpr(8)]
            m_old, l_old = st[base + 8], st[base + 9]
            if const_expr(PREFETCH):
                k_words, k_page_next, v_page = st[0], st[1], st[2]
                v_words = load_v(v_page)  # this tile's V: lands during Q·Kᵀ and the softmax
                k_words_next = load_k(k_page_next)  # next tile's K: lands during this whole tile
                carry = [k_words_next, page_id(t + 2, k_page_j), page_id(t + 1, v_page_j)]
            else:
                k_page, v_page = st[0], st[1]
                k_words = load_k(k_page)
                v_words = load_v(v_page)
                carry = [page_id(t + 1, k_page_j), page_id(t + 1, v_page_j)]
            # keep every load of the iteration ahead of its math (the scheduler would otherwise
            # sink the V and next-K loads below the MFMAs that do not need them)
            fx.rocdl.sched_barrier(0)
            o, m_new, l_new = tile_math(t, k_words, v_words, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]

        lds = fx.SharedAllocator().allocate(Shared).peek()
        o0, o1 = merge_waves(
            [res[base + j] for j in range_constexpr(8)], fx.Float32(res[base + 8]), fx.Float32(res[base + 9]),
            v_scale, lds, wave, lane, col, grp,
        )
        if col < G:
            row = (head0 + col) * (HEAD_DIM * 2)
            buffer_store(o0.to(fx.Float16).bitcast(fx.Int32), o_rs, row + ((2 * wave) * 16 + grp * 4) * 2)
            buffer_store(o1.to(fx.Float16).bitcast(fx.Int32), o_rs, row + ((2 * wave + 1) * 16 + grp * 4) * 2)

    @flyc.jit
    def launch(
        out: fx.Tensor,
        query: fx.Tensor,
        key_cache: fx.Tensor,
        value_cache: fx.Tensor,
        block_tables: fx.Tensor,
        context_lengths: fx.Tensor,
        key_scale: fx.Tensor,
        value_scale: fx.Tensor,
        num_seqs: fx.Int32,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        scale_log2: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        with CompilationContext.compile_hints({"fastmath": arith.FastMathFlags.contract}):
            pa_decode_s3(
                out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                num_kv_heads, max_blocks, scale_log2,
            ).launch(grid=(num_seqs, num_kv_heads, 1), block=(WAVES * WAVE, 1, 1), stream=stream)

    return launch


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """``(launcher, args, arch)`` after validation: stage 2's inputs, checks and arguments."""
    if not isinstance(prefetch_k, bool):
        raise TypeError(f"prefetch_k: expected a bool, got {type(prefetch_k).__name__}")
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = s2.kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                          out)
    return build_launcher(p.block_size, p.group, p.arch, prefetch_k), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """fp8 paged decode attention; returns ``out`` (shaped and typed like ``query``).

    Arguments as in stage 2 (``pa_tile.stages.s2_register_softmax.paged_decode``); ``prefetch_k``
    (default True) loads each tile's K one iteration ahead.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch,
                                       prefetch_k=prefetch_k)
    launching.launch(launcher, args, arch=arch)
    return args[0]
