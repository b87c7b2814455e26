# GENERATED from notebooks/02_register_softmax.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 2: fp8 paged-attention decode with a register-resident softmax.

Scores are computed turned around, ``D[token, head] = K·Qᵀ`` on the fp8 16x16x32 MFMA, so every
lane owns one query head; each wave runs its own online softmax over its 64 tokens of every
256-token tile and multiplies its own P by its own V straight from registers. The only LDS is
the final merge of the four waves' (max, sum, O): 8.5 KB, used once.

Layouts (see ``pa_tile.cache``): query ``[num_seqs, num_q_heads, 128]`` f16; K cache
``[num_blocks, num_kv_heads, block_size, 128]`` and V cache ``[num_blocks, num_kv_heads, 128,
block_size]`` fp8 e4m3 (``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950, or uint8
codes); per-tensor float32 scales ``[1]``; ``block_size`` 16 or 64; 8 or 16 query heads per KV head.
The building blocks live in ``pa_tile.kernel_lib``; this module adds the kernel and its launcher.
"""

import functools
import math

import torch

import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max, fp8_torch_dtype
from pa_tile.kernel_lib import (
    HEAD_DIM, LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, imin, jit_launcher, lane_coords,
                                mask_tail,
    merge_waves, pv_step, query_operands, rsrc, scalar_load, scores, softmax_model, softmax_step,
                                store_chunks,
    model_operands,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "kernel_args", "numerics_model",
           "LIMITS", "Shared",
           "Workgroup"]

#: what the stage-2 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s2", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))


@fx.struct
class Shared:
    """The merge's LDS (the kernel's only LDS): 8.5 KB, used once."""
    stats: fx.Array[fx.Float32, 2 * 16 * WAVES, 16]  # [max | sum][head][wave]
    xchg: fx.Array[fx.Float32, WAVES * 2 * WAVE * 4, 16]  # [sender][2 slots][lane] x f32x4


class Workgroup:
    """What one workgroup fixes before its loop, and its per-tile math (runs while tracing)."""

    def __init__(self, out, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, num_kv_heads, max_blocks, scale_log2, *, block_size, group, fp8_max):
        G = group
        self.log2_fmax = math.log2(fp8_max)
        # col: MFMA column = this lane's query head (and the A-operand row it loads); grp: row band
        tid, wave, lane, col, grp = lane_coords()
        self.tid, self.wave, self.lane, self.col, self.grp = tid, wave, lane, col, grp
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        tensors = (query, key_cache, value_cache, block_tables, out)
        q_rs, k_rs, v_rs, bt_rs, self.o_rs = (rsrc(t) for t in tensors)
        self.ctx = ctx = scalar_load(context_lengths, seq)
        k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
        self.v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        self.head0 = head0 = seq * (num_kv_heads * G) + kvh * G  # first query row of this group
        self.q_ops, q_scale = query_operands(q_rs, (head0 + imin(col, G - 1)) * HEAD_DIM, col < G,
                                             fp8_max, grp)
        self.c_qk = q_scale * k_scale * scale_log2
        last_page = (ctx - 1) // block_size
        self.num_tiles = (ctx + (TILE - 1)) // TILE
        self.pages = Pages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave,
                           col, grp, block_size=block_size)

    def tile_scores(self, t, k_words):
        """Tile ``t``'s 16 raw scores of this lane, and how many of its tokens are in context."""
        s = fx.Vector.from_elements(scores(k_words, self.q_ops), dtype=fx.Float32)
        return s, self.ctx - (t * TILE + self.wave * SPAN + self.grp * 16)

    def softmax_pv(self, s, v_words, o, m_old, l_old):
        """The online-softmax step and P·V: the new ``(o, m, l)``."""
        p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, self.c_qk, self.log2_fmax)
        return pv_step(o, v_words, p_ops, corr), m_new, l_new

    def merge(self, o, m, l):
        """After the loop: the four waves' results combined; this wave's 2 d-chunks, normalized."""
        lds = fx.SharedAllocator().allocate(Shared).peek()
        return merge_waves(o, fx.Float32(m), fx.Float32(l), self.v_scale, lds, self.wave,
                           self.lane, self.col)

    def store(self, mine):
        """This lane's share of its head's output row, f16 (only for the group's real heads)."""
        store_chunks(self.o_rs, mine, (self.head0 + self.col) * (HEAD_DIM * 2), self.wave, self.grp)


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch) specialization."""

    def pa_decode_s2(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
                     scale_log2: fx.Float32):
        wg = Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths,
                       key_scale, value_scale,
                       num_kv_heads, max_blocks, scale_log2, block_size=block_size, group=group,
                       fp8_max=fp8_max(arch))
        pages = wg.pages
        # Page ids are read one tile ahead, so the loads at the top of an iteration never
        # wait on a block-table read.
        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        state = [pages.page_id(0, pages.k_j), pages.page_id(0, pages.v_j)] + [zero4] * 8
        for t, st in range(0, wg.num_tiles, 1, init=state + [fx.Float32(MASKED), fx.Float32(0.0)]):
            t = fx.Int32(t)
            k_page, v_page = st[0], st[1]
            o = [st[2 + j] for j in range_constexpr(8)]
            m_old, l_old = st[10], st[11]
            k_words = pages.k(k_page)
            v_words = pages.v(v_page)  # in flight during Q·Kᵀ and the softmax
            k_page_next = pages.page_id(t + 1, pages.k_j)  # clamped: always a page of this sequence
            v_page_next = pages.page_id(t + 1, pages.v_j)
            # keep all of the tile's loads ahead of its math: left alone, the scheduler would
            # issue V only after K has landed, paying two memory latencies per tile
            fx.rocdl.sched_barrier(0)
            s, n_valid = wg.tile_scores(t, k_words)
            if t + 1 == wg.num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            o, m_new, l_new = wg.softmax_pv(s, v_words, o, m_old, l_old)
            res = yield [k_page_next, v_page_next] + o + [m_new, l_new]

        # `store` is taken out of `wg` first: a method of `wg` called inside a traced `if` would
        # make FlyDSL carry `wg` through the branch as a value
        mine, store = wg.merge([res[2 + j] for j in range_constexpr(8)], res[10], res[11]), wg.store
        if wg.col < group:
            store(mine)

    # launch(out, query, ..., value_scale, num_seqs, num_kv_heads, max_blocks, scale_log2, stream)
    return jit_launcher(pa_decode_s2)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *,
                softmax_scale=None, out=None, arch=None):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel,
    ``pa_tile.toolchain.compile_isa(launcher, *args, arch=arch)`` shows its assembly."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                       value_scale, out)
    return build_launcher(p.block_size, p.group, p.arch), args, p.arch


def kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, out):
    """The launcher's arguments for a validated problem ``p`` (chapter 3's kernel uses them too)."""
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    return (problem.output(p, query, out), query.contiguous(), key_cache.view(torch.uint8),
            value_cache.view(torch.uint8), block_tables, context_lengths, ks, vs,
            p.num_seqs, p.num_kv_heads, p.max_blocks, p.scale_log2)


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *,
                 softmax_scale=None, out=None, arch=None):
    """fp8 paged decode attention; returns ``out`` (shaped and typed like ``query``).

    ``query`` [num_seqs, num_q_heads, 128] f16; ``key_cache`` [num_blocks, num_kv_heads,
    block_size, 128] and ``value_cache`` [num_blocks, num_kv_heads, 128, block_size] fp8 e4m3 in
    the arch's flavour (or uint8 codes); ``block_tables`` [num_seqs, max_blocks] int32;
    ``context_lengths`` [num_seqs] int32 (each 1 .. max_blocks·block_size); per-tensor
    ``key_scale``/``value_scale`` (float32 [1] or floats, > 0); ``softmax_scale`` defaults to
    1/sqrt(128); ``arch`` defaults to the tensors' device (the emulator's for CPU tensors).
    Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                   value_scale, *,
                   softmax_scale=None, arch):
    """float32 torch model of the stage-2 kernel's roundings (same arguments as ``paged_decode``);
    returns a float32 tensor shaped like ``query``. CPU only; loops over sequences and tiles."""
    fmax, fp8 = fp8_max(arch), fp8_torch_dtype(arch)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else float(softmax_scale)
    ks = float(torch.as_tensor(key_scale).reshape(()))
    vs = float(torch.as_tensor(value_scale).reshape(()))
    num_seqs, num_q_heads, _ = query.shape
    kvh = key_cache.shape[1]
    group = num_q_heads // kvh
    kc = key_cache.view(torch.uint8).view(fp8).float()
    # -> [blocks, kvh, bs, 128]
    vc = value_cache.view(torch.uint8).view(fp8).float().transpose(2, 3)
    out = torch.empty(num_seqs, num_q_heads, HEAD_DIM)
    for s in range(num_seqs):
        q = query[s].float().reshape(kvh, group, HEAD_DIM)
        q8, q_scale, k, v, _ = model_operands(q, kc, vc, block_tables[s], int(context_lengths[s]),
                                              fmax, fp8)
        c_qk = q_scale * ks * (scale * LOG2E)  # the kernel's float32 order
        res = softmax_model(torch.einsum("hgd,htd->hgt", q8, k), c_qk, v, fmax, fp8) * vs
        out[s] = res.reshape(num_q_heads, HEAD_DIM)
    return out
