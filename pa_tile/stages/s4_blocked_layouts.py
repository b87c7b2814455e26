# GENERATED from notebooks/04_blocked_layouts.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 4: blocked K/V cache layouts, a conflict-free merge, and the widened scope.

Stage 3's pipelined kernel reading K blocked
``[num_blocks, kv_heads, head_dim//16, block_size, 16]`` and V trans-blocked
``[num_blocks, kv_heads, block_size//16, head_dim, 16]`` (or V plain
``[num_blocks, kv_heads, head_dim, block_size]`` with ``v_layout="plain"``). Scope: block_size
16/64, head_dim 64/128, f16 or bf16 query (output in the query's dtype; the query may be
strided, e.g. a slice of a fused QKV tensor, as long as its last dim is contiguous), 8 or 16
query heads per KV head, fp8 e4m3 K/V of the arch's flavour, per-tensor ``[1]`` or per-token
``[num_blocks, kv_heads, block_size]`` float32 scales.
"""

import functools
import math
import types

import torch

import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max, fp8_torch_dtype
from pa_tile.kernel_lib import (
    LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, buffer_load, imin, jit_launcher, lane_coords,
    mask_tail, merge_waves, pv_step, query_operands, rcp, rsrc, scalar_load, scores, softmax_model,
    softmax_step, store_chunks, model_operands,
)

__all__ = [
    "paged_decode", "build_launcher", "launch_args", "numerics_model", "LIMITS", "V_LAYOUTS",
    "ScaledPages", "merge_lds", "kernel_spec", "query_and_factor", "tile_pages", "first_loop_state",
    "make_kernel"
]

#: what the stage-4 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s4", head_dims=(64, 128), block_sizes=(16, 64), groups=(8, 16),
                        query_dtypes=(torch.float16, torch.bfloat16), k_layouts=("blocked",),
                        v_layouts=("trans_blocked", "plain"), per_token_scales=True,
                        strided_query=True)
V_LAYOUTS = LIMITS.v_layouts
#: words per head row of the merge's (max, sum) table: 4 waves + 1 pad (see the notebook)
STATS_STRIDE = 5


class ScaledPages(Pages):
    """``Pages`` plus the 16 per-token scales ``[page, kv_head, block]`` of the lane's V tokens."""

    def scales(self, rs, page):
        s_lane = (0 if self.pps > 1 else self.grp) * 16 * 4  # bytes into the (page, head) row
        voff = ((page * self.num_kv_heads + self.kvh) * self.bs) * 4 + s_lane
        vals = []
        for k in range_constexpr(4):
            v = buffer_load(rs, voff, 4, offset=16 * k).bitcast(fx.Float32)
            vals.extend([v[i] for i in range_constexpr(4)])
        return vals

    def tile_scores(self, k_words, q_ops, halves, v_page, scales=None):
        """The tile's 16 scores of this lane and P's weights (None per tensor). Per token
        (``scales = (ks_rs, vs_rs, 1/max(v_scale))``) each score is times its token's K scale
        (``s[4a + i]`` is token ``16·grp + 4a + i``: scale ``4a + i``) and the weights are
        ``v_scale / max(v_scale)``."""
        s = scores(k_words, q_ops, halves)
        p_weight = None
        if const_expr(scales is not None):
            ks_rs, vs_rs, inv_vnorm = scales
            ks = self.scales(ks_rs, v_page)
            s = [fx.Float32(s[i]) * fx.Float32(ks[i]) for i in range_constexpr(16)]
            p_weight = [fx.Float32(x) * inv_vnorm for x in self.scales(vs_rs, v_page)]
        return fx.Vector.from_elements(s, dtype=fx.Float32), p_weight


def merge_lds(stats_stride, nj):
    """The LDS struct of the merge for ``nj`` d-chunks of O, the table's rows ``stats_stride``
    words apart."""
    if stats_stride < WAVES:
        raise ValueError(f"stats_stride: at least {WAVES} words (one per wave), got {stats_stride}")

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, 2 * 16 * stats_stride, 16]
        xchg: fx.Array[fx.Float32, WAVES * (nj // WAVES) * WAVE * 4, 16]

    return Shared


def kernel_spec(block_size, head_dim, group, arch, q_dtype, per_token, v_layout, stats_stride):
    """The compile-time constants of one specialization (``build_launcher``'s arguments)."""
    return types.SimpleNamespace(
        Shared=merge_lds(stats_stride, head_dim // 16),
        STATS_STRIDE=stats_stride,
        BS=block_size,
        HD=head_dim,
        G=group,
        PT=bool(per_token),
        V_TRANS=v_layout == "trans_blocked",
        FMAX=fp8_max(arch),
        LOG2_FMAX=math.log2(fp8_max(arch)),
        NJ=head_dim // 16,  # d-chunks of O
        HALVES=head_dim // 64,  # 64-channel halves of a K row / of the query
        ODT=fx.BFloat16 if q_dtype == "bf16" else fx.Float16,
    )


def query_and_factor(c, q_rs, seq, kvh, col, grp, q_seq_stride, q_head_stride, key_scale,
                     value_scale, v_scale, scale_log2):
    """``(q_ops, c_qk, scales)``: the lane's query operands (head ``kvh·G + col`` of sequence
    ``seq``, read through the two strides; zeros for a padding row ``col >= G``), the factor from
    raw scores to log2 units, and per token ``(ks_rs, vs_rs, 1/max(v_scale))`` for
    ``ScaledPages.tile_scores`` (None per tensor)."""
    q_row = seq * q_seq_stride + (kvh * c.G + imin(col, c.G - 1)) * q_head_stride
    q_ops, q_scale = query_operands(q_rs, q_row, col < c.G, c.FMAX, grp, c.HALVES, c.ODT)
    if c.PT:
        c_qk = q_scale * scale_log2  # K's scale multiplies each score instead
        scales = (rsrc(key_scale), rsrc(value_scale), rcp(v_scale))
    else:
        c_qk, scales = q_scale * scalar_load(key_scale, 0).bitcast(fx.Float32) * scale_log2, None
    return q_ops, c_qk, scales


def tile_pages(c, bt_rs, k_rs, v_rs, seq, max_blocks, ctx, kvh, num_kv_heads, wave, col, grp):
    """``(pages, num_tiles)``: the lane's ``ScaledPages`` and the context's 256-token tiles."""
    last_page = (ctx - 1) // c.BS
    num_tiles = (ctx + (TILE - 1)) // TILE
    pages = ScaledPages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave,
                        col, grp, block_size=c.BS, head_dim=c.HD, k_blocked=True, v_trans=c.V_TRANS)
    return pages, num_tiles


def first_loop_state(pages, nj):
    """The loop state before tile 0: tile 0's K words, tile 1's K page, tile 0's V page, then
    ``nj`` zero d-chunks of O, the running max (``MASKED``) and the running sum (0)."""
    zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
    state = [
        pages.k(pages.page_id(0, pages.k_j)),
        pages.page_id(1, pages.k_j),
        pages.page_id(0, pages.v_j)
    ]
    return state + [zero4] * nj + [fx.Float32(MASKED), fx.Float32(0.0)]


def make_kernel(c):
    """The kernel function of specialization ``c`` (``kernel_spec``)."""
    NJ = c.NJ  # d-chunks of O
    def pa_decode_s4(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, v_norm: fx.Tensor, num_kv_heads: fx.Int32,
                     max_blocks: fx.Int32, q_seq_stride: fx.Int32, q_head_stride: fx.Int32,
                     scale_log2: fx.Float32):
        tid, wave, lane, col, grp = lane_coords()
        seq, kvh = fx.Int32(gpu.block_id("x")), fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, o_rs = map(rsrc, (query, key_cache, value_cache, block_tables,
                                                   out))
        ctx = scalar_load(context_lengths, seq)
        v_scale = scalar_load(v_norm, 0).bitcast(fx.Float32)  # per token: the largest V scale
        q_ops, c_qk, scales = query_and_factor(c, q_rs, seq, kvh, col, grp, q_seq_stride,
                                               q_head_stride, key_scale, value_scale, v_scale,
                                               scale_log2)
        pages, num_tiles = tile_pages(c, bt_rs, k_rs, v_rs, seq, max_blocks, ctx, kvh, num_kv_heads,
                                      wave, col, grp)
        def tile_math(t, k_words, v_words, v_page, o, m_old, l_old):
            s, p_weight = pages.tile_scores(k_words, q_ops, c.HALVES, v_page, scales)
            n_valid = ctx - (t * TILE + wave * SPAN + grp * 16)
            if t + 1 == num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, c_qk, c.LOG2_FMAX, p_weight)
            return pv_step(o, v_words, p_ops, corr), m_new, l_new

        for t, st in range(0, num_tiles, 1, init=first_loop_state(pages, NJ)):
            t = fx.Int32(t)
            k_words, k_page_next, v_page = st[0], st[1], st[2]
            o = [st[3 + j] for j in range_constexpr(NJ)]
            m_old, l_old = st[3 + NJ], st[4 + NJ]
            v_words, k_words_next = pages.v(v_page), pages.k(k_page_next)
            carry = [k_words_next, pages.page_id(t + 2, pages.k_j), pages.page_id(t + 1, pages.v_j)]
            fx.rocdl.sched_barrier(0)
            o, m_new, l_new = tile_math(t, k_words, v_words, v_page, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]
        lds = fx.SharedAllocator().allocate(c.Shared).peek()
        mine = merge_waves([res[3 + j] for j in range_constexpr(NJ)], fx.Float32(res[3 + NJ]),
                           fx.Float32(res[4 + NJ]), v_scale, lds, wave, lane, col, c.STATS_STRIDE)
        if col < c.G:
            store_chunks(o_rs, mine, (seq * (num_kv_heads * c.G) + kvh * c.G + col) * (c.HD * 2),
                         wave, grp, c.ODT)

    return pa_decode_s4


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, head_dim: int, group: int, arch: str, q_dtype: str = "f16",
                   per_token: bool = False, v_layout: str = "trans_blocked",
                   stats_stride: int = STATS_STRIDE):
    """The ``@flyc.jit`` launcher for one specialization (``stats_stride=4``: the unpadded merge
    table)."""
    spec = kernel_spec(block_size, head_dim, group, arch, q_dtype, per_token, v_layout,
                       stats_stride)
    return jit_launcher(make_kernel(spec))


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *, softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale, limits=LIMITS, softmax_scale=softmax_scale, arch=arch,
                         v_layout=v_layout)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    # per token, P is weighted by v_scale / max(v_scale) <= 1 so that it stays in fp8 range
    v_norm = vs.amax().reshape(1) if p.per_token else vs
    out = problem.output(p, query, out)
    launcher = build_launcher(p.block_size, p.head_dim, p.group, p.arch, p.q_dtype, p.per_token,
                              p.v_layout)
    args = (
        out, query, key_cache.view(torch.uint8), value_cache.view(torch.uint8),
        block_tables, context_lengths, ks, vs, v_norm,
        p.num_seqs, p.num_kv_heads, p.max_blocks, query.stride(0), query.stride(1), p.scale_log2,
    )
    return launcher, args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *, softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """fp8 paged decode attention; returns ``out`` (shaped like ``query``, in the query's dtype).

    ``query`` [num_seqs, num_q_heads, 64|128] f16/bf16, last dim contiguous (other strides free);
    ``key_cache`` K blocked [num_blocks, num_kv_heads, head_dim//16, block_size, 16];
    ``value_cache`` V trans-blocked [num_blocks, num_kv_heads, block_size//16, head_dim, 16], or
    V plain [num_blocks, num_kv_heads, head_dim, block_size] with ``v_layout="plain"``; fp8 e4m3
    of the arch's flavour (or uint8 codes); ``block_tables`` [num_seqs, max_blocks] int32;
    ``context_lengths`` [num_seqs] int32; ``key_scale``/``value_scale`` float32 [1] or
    [num_blocks, num_kv_heads, block_size] (> 0); ``softmax_scale`` defaults to
    1/sqrt(head_dim). Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths,
                                       key_scale, value_scale, softmax_scale=softmax_scale, out=out,
                                       arch=arch, v_layout=v_layout)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                   value_scale, *, softmax_scale=None, arch, v_layout="trans_blocked"):
    """float32 torch model of the stage-4 kernel's roundings (arguments as ``paged_decode``);
    returns float32 shaped like ``query``. Stage 2's model plus head_dim 64, per-token scales
    (K's on each score, V's as P weights ``v_scale / max(v_scale)`` before the fp8 rounding)."""
    from pa_tile.cache import from_k_blocked, from_v_plain, from_v_trans_blocked

    fmax, fp8 = fp8_max(arch), fp8_torch_dtype(arch)
    num_seqs, num_q_heads, hd = query.shape
    scale = 1.0 / math.sqrt(hd) if softmax_scale is None else float(softmax_scale)
    decode = lambda x: x.view(torch.uint8).view(fp8).float()  # noqa: E731
    kc = decode(from_k_blocked(key_cache.view(torch.uint8)))
    vraw = value_cache.view(torch.uint8)
    vc = decode(from_v_trans_blocked(vraw) if v_layout == "trans_blocked" else from_v_plain(vraw))
    ks, vs = torch.as_tensor(key_scale,
                             dtype=torch.float32), torch.as_tensor(value_scale, dtype=torch.float32)
    per_token = ks.numel() > 1
    v_norm = float(vs.max()) if per_token else float(vs.reshape(()))
    kvh = kc.shape[1]
    group = num_q_heads // kvh
    out = torch.empty(num_seqs, num_q_heads, hd)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    scale_log2 = f32(scale * LOG2E)  # the launcher passes it as a float32
    for s in range(num_seqs):
        n = int(context_lengths[s])
        q = query[s].float().reshape(kvh, group, hd)
        q8, q_scale, k, v, pages = model_operands(q, kc, vc, block_tables[s], n, fmax, fp8)
        raw = torch.einsum("hgd,htd->hgt", q8, k)
        if per_token:
            kst = ks[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n]
            wt = (vs[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n] / v_norm)[:, None, :]
            raw, c_qk = raw * kst[:, None, :], q_scale * scale_log2
        else:
            wt, c_qk = None, (q_scale * ks.reshape(())) * scale_log2
        res = softmax_model(raw, c_qk, v, fmax, fp8, wt) * v_norm
        out[s] = res.reshape(num_q_heads, hd)
    return out
