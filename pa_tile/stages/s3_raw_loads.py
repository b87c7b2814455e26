# GENERATED from notebooks/03_raw_dwordx4_loads.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 3: stage 2's kernel with a software-pipelined loop.

The next tile's K (8 ``buffer_load_dwordx4`` per lane) and its block-table entries are loop-carried
values, loaded one iteration ahead; V is issued at the top of the iteration it is used in, so
Q·Kᵀ and the softmax hide its latency. K and V go straight from 128-bit loads into the raw MFMA
operands, the query is read in 128-bit chunks, exp2/rcp are the hardware's ``v_exp_f32``/
``v_rcp_f32``.

Layouts and numerics are stage 2's (``pa_tile.stages.s2_register_softmax``): query
``[num_seqs, num_q_heads, 128]`` f16; K ``[num_blocks, kv_heads, block_size, 128]``; V
``[num_blocks, kv_heads, 128, block_size]``; fp8 e4m3 of the arch's flavour; per-tensor scales.
``prefetch_k=False`` rebuilds stage 2's loop (no K prefetch) for comparison.
"""

import dataclasses
import functools

import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max
from pa_tile.kernel_lib import MASKED, jit_launcher, mask_tail
from pa_tile.stages import s2_register_softmax as s2
from pa_tile.stages.s2_register_softmax import numerics_model  # the same roundings as stage 2

__all__ = ["paged_decode", "build_launcher", "launch_args", "numerics_model", "LIMITS"]

#: the same inputs as stage 2
LIMITS = dataclasses.replace(s2.LIMITS, stage="s3")


def loop_entry_state(pages, prefetch):
    """``(values, base)``: what the tile loop carries in, and the index where its softmax state
    starts. With the K prefetch: tile 0's K (loaded here, before the loop), tile 1's K page and tile
    0's V page; without: tile 0's K and V pages. Then 8 zero output chunks, the running max
    (``MASKED``) and the running sum (0)."""
    zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
    softmax0 = [zero4] * 8 + [fx.Float32(MASKED), fx.Float32(0.0)]
    if prefetch:
        carried = [pages.k(pages.page_id(0, pages.k_j)), pages.page_id(1, pages.k_j),
                   pages.page_id(0, pages.v_j)]
    else:
        carried = [pages.page_id(0, pages.k_j), pages.page_id(0, pages.v_j)]
    return carried + softmax0, len(carried)


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str, prefetch_k: bool = True):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch, prefetch_k) specialization."""
    PREFETCH = bool(prefetch_k)

    def pa_decode_s3(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
                     scale_log2: fx.Float32):
        wg = s2.Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths,
                          key_scale, value_scale, num_kv_heads, max_blocks, scale_log2,
                          block_size=block_size, group=group, fp8_max=fp8_max(arch))
        pages = wg.pages
        state, base = loop_entry_state(pages, PREFETCH)
        for t, st in range(0, wg.num_tiles, 1, init=state):
            t = fx.Int32(t)
            o = [st[base + j] for j in range_constexpr(8)]
            m_old, l_old = st[base + 8], st[base + 9]
            if const_expr(PREFETCH):
                k_words, k_page_next, v_page = st[0], st[1], st[2]
                v_words = pages.v(v_page)  # this tile's V: lands during Q·Kᵀ and the softmax
                k_words_next = pages.k(k_page_next)  # next tile's K: lands during this whole tile
                carry = [k_words_next, pages.page_id(t + 2, pages.k_j),
                         pages.page_id(t + 1, pages.v_j)]
            else:
                k_page, v_page = st[0], st[1]
                k_words = pages.k(k_page)
                v_words = pages.v(v_page)
                carry = [pages.page_id(t + 1, pages.k_j), pages.page_id(t + 1, pages.v_j)]
            # keep every load of the iteration ahead of its math (the scheduler would otherwise
            # sink the V and next-K loads below the MFMAs that do not need them)
            fx.rocdl.sched_barrier(0)
            s, n_valid = wg.tile_scores(t, k_words)
            if t + 1 == wg.num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            o, m_new, l_new = wg.softmax_pv(s, v_words, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]

        mine = wg.merge([res[base + j] for j in range_constexpr(8)], res[base + 8], res[base + 9])
        store = wg.store
        if wg.col < group:
            store(mine)

    return jit_launcher(pa_decode_s3)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *, softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """``(launcher, args, arch)`` after validation: stage 2's inputs, checks and arguments."""
    if not isinstance(prefetch_k, bool):
        raise TypeError(f"prefetch_k: expected a bool, got {type(prefetch_k).__name__}")
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale, limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = s2.kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths,
                          key_scale, value_scale, out)
    return build_launcher(p.block_size, p.group, p.arch, prefetch_k), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *, softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """fp8 paged decode attention; returns ``out`` (shaped and typed like ``query``).

    Arguments as in stage 2 (``pa_tile.stages.s2_register_softmax.paged_decode``); ``prefetch_k``
    (default True) loads each tile's K one iteration ahead.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths,
                                       key_scale, value_scale, softmax_scale=softmax_scale, out=out,
                                       arch=arch, prefetch_k=prefetch_k)
    launching.launch(launcher, args, arch=arch)
    return args[0]
