# GENERATED from notebooks/04_blocked_layouts.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebook and re-run the export.

"""Stage 4: blocked K/V cache layouts, a conflict-free merge, and the widened scope.

Stage 3's pipelined kernel reading K blocked ``[num_blocks, kv_heads, head_dim//16, block_size, 16]``
and V trans-blocked ``[num_blocks, kv_heads, block_size//16, head_dim, 16]`` (or V plain
``[num_blocks, kv_heads, head_dim, block_size]`` with ``v_layout="plain"``). Scope: block_size 16/64,
head_dim 64/128, f16 or bf16 query (output in the query's dtype; the query may be strided, e.g. a
slice of a fused QKV tensor, as long as its last dim is contiguous), 8 or 16 query heads per KV
head, fp8 e4m3 K/V of the arch's flavour, per-tensor ``[1]`` or per-token
``[num_blocks, kv_heads, block_size]`` float32 scales.
"""

import functools
import math

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.compiler.kernel_function import CompilationContext
from flydsl.expr import arith, const_expr, gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max, fp8_torch_dtype
from pa_tile.kernel_lib import (
    LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, buffer_load, buffer_store, exp2, fmax, i64, imax, imin, lane_coords,
    lds_load, lds_store, mfma, pack_fp8, pv_step, quantize_query, rcp, rsrc, scalar_load, select, splat4, tree_sum,
    xor_lanes,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "numerics_model", "LIMITS", "V_LAYOUTS"]

#: what the stage-4 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s4", head_dims=(64, 128), block_sizes=(16, 64), groups=(8, 16),
                        query_dtypes=(torch.float16, torch.bfloat16), k_layouts=("blocked",),
                        v_layouts=("trans_blocked", "plain"), per_token_scales=True, strided_query=True)
V_LAYOUTS = LIMITS.v_layouts
STATS_STRIDE = 5  # words per head row of the merge's (max, sum) table: 4 waves + 1 pad (see the notebook)


def _to_f32(words, qdt):
    """4 dwords of f16/bf16 bits -> 8 float32."""
    return words.bitcast(fx.BFloat16 if qdt == "bf16" else fx.Float16).to(fx.Float32)


def _query_operands(q_rs, row_byte, valid, fp8_max, grp, halves, qdt):
    """Stage 2's query quantization for ``halves`` = head_dim // 64 channel halves and either 16-bit dtype.

    ``ops[2h + k]``: channels ``16(grp + 4h) + 8k .. +8`` of the row at byte ``row_byte``, as fp8 codes.
    """
    vals = []
    for h in range_constexpr(halves):
        for k in range_constexpr(2):
            vals.append(_to_f32(buffer_load(q_rs, row_byte + 32 * (grp + 4 * h), 4, offset=16 * k), qdt))
    return quantize_query(vals, valid, fp8_max)


def _mask_tail(s, v_words, n_valid):
    """Stage 2's tail mask for any number of V words (4 per d-chunk)."""
    ninf = fx.Float32(float("-inf"))
    s = fx.Vector.from_elements(
        [fx.Float32(select(n_valid > i, fx.Float32(s[i]), ninf)) for i in range_constexpr(16)], dtype=fx.Float32
    )
    masks = []
    for k in range_constexpr(4):
        keep = imax(imin(n_valid - 4 * k, 4), 0)
        partial = (fx.Int32(1) << (keep * 8 % 32)) - 1
        masks.append(fx.Int32(select(keep > 3, fx.Int32(-1), partial)))
    n = v_words.numel
    return s, fx.Vector.from_elements([fx.Int32(v_words[i]) & masks[i % 4] for i in range_constexpr(n)], dtype=fx.Int32)


def _softmax_step(s, m_old, l_old, c_qk, log2_fp8_max, p_weight=None):
    """Stage 2's online-softmax step; ``p_weight`` (16 per-token factors in [0, 1]) scales P
    after the sum and before the fp8 rounding: per-token V scales."""
    s_max = fx.Float32(s[0])
    for i in range_constexpr(1, 16):
        s_max = fmax(s_max, fx.Float32(s[i]))
    m_tile = s_max * c_qk
    m_tile = fmax(m_tile, xor_lanes(m_tile, 16))
    m_tile = fmax(m_tile, xor_lanes(m_tile, 32))
    m_new = fmax(m_old, m_tile)
    corr = exp2(m_old - m_new)
    shift = m_new - log2_fp8_max
    p = [exp2(fx.Float32(s[i]) * c_qk - shift) for i in range_constexpr(16)]
    l_new = l_old * corr + tree_sum(p)
    if const_expr(p_weight is not None):
        p = [p[i] * fx.Float32(p_weight[i]) for i in range_constexpr(16)]
    words = [pack_fp8(p[4 * a], p[4 * a + 1], p[4 * a + 2], p[4 * a + 3]) for a in range_constexpr(4)]
    return [i64(words[0], words[1]), i64(words[2], words[3])], corr, m_new, l_new


def _merge_waves(o, m_w, l_w, v_scale, lds, wave, lane, col, stride):
    """Stage 2's merge for ``len(o) // 4`` d-chunks per wave, with the (max, sum) table's head
    rows ``stride`` words apart. Returns this wave's d-chunks, normalized."""
    per = len(o) // WAVES
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    xchg = fx.recast_iter(fx.Uint8, lds.xchg.ptr)
    l_w = l_w + xor_lanes(l_w, 16)
    l_w = l_w + xor_lanes(l_w, 32)
    lds_store(stats, (col * stride + wave) * 4, fx.Vector.from_elements([m_w], dtype=fx.Float32))
    lds_store(stats, ((16 + col) * stride + wave) * 4, fx.Vector.from_elements([l_w], dtype=fx.Float32))
    gpu.barrier()
    if const_expr(stride % 4 == 0):
        m4 = lds_load(stats, col * stride * 4, WAVES)
        l4 = lds_load(stats, (16 + col) * stride * 4, WAVES)
        m4, l4 = [fx.Float32(m4[w]) for w in range(WAVES)], [fx.Float32(l4[w]) for w in range(WAVES)]
    else:  # rows are not 16-byte aligned any more: four 4-byte reads each
        m4 = [fx.Float32(lds_load(stats, (col * stride + w) * 4, 1)[0]) for w in range(WAVES)]
        l4 = [fx.Float32(lds_load(stats, ((16 + col) * stride + w) * 4, 1)[0]) for w in range(WAVES)]
    m = fmax(fmax(m4[0], m4[1]), fmax(m4[2], m4[3]))
    total = fx.Float32(0.0)
    for w in range_constexpr(WAVES):
        total = total + l4[w] * exp2(m4[w] - m)
    o = [x * splat4(exp2(m_w - m) * v_scale * rcp(total)) for x in o]
    for r in range_constexpr(1, WAVES):
        for s in range_constexpr(per):
            lds_store(xchg, ((wave * per + s) * WAVE + lane) * 16, o[per * r + s])
        gpu.barrier()
        src = (wave + (WAVES - r)) % WAVES
        for s in range_constexpr(per):
            o[s] = o[s] + lds_load(xchg, ((src * per + s) * WAVE + lane) * 16, 4)
        if const_expr(r < WAVES - 1):
            gpu.barrier()
    return o[:per]


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, head_dim: int, group: int, arch: str, q_dtype: str = "f16",
                   per_token: bool = False, v_layout: str = "trans_blocked", stats_stride: int = STATS_STRIDE):
    """The ``@flyc.jit`` launcher for one specialization (``stats_stride=4``: the unpadded merge table)."""
    if stats_stride < WAVES:
        raise ValueError(f"stats_stride: at least {WAVES} words (one per wave), got {stats_stride}")
    BS, HD, G, PT, VT = block_size, head_dim, group, bool(per_token), v_layout == "trans_blocked"
    FMAX = fp8_max(arch)
    LOG2_FMAX = math.log2(FMAX)
    PAGE_BYTES = BS * HD
    PPS = SPAN // BS  # pages per wave span
    NJ = HD // 16  # d-chunks of O
    PER = NJ // WAVES  # d-chunks each wave stores
    HALVES = HD // 64  # 64-channel halves of a K row / of the query
    ODT = fx.BFloat16 if q_dtype == "bf16" else fx.Float16

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, 2 * 16 * stats_stride, 16]
        xchg: fx.Array[fx.Float32, WAVES * PER * WAVE * 4, 16]

    @flyc.kernel(known_block_size=(WAVES * WAVE, 1, 1))
    def pa_decode_s4(
        out: fx.Tensor,
        query: fx.Tensor,
        key_cache: fx.Tensor,
        value_cache: fx.Tensor,
        block_tables: fx.Tensor,
        context_lengths: fx.Tensor,
        key_scale: fx.Tensor,
        value_scale: fx.Tensor,
        v_norm: fx.Tensor,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        q_seq_stride: fx.Int32,
        q_head_stride: fx.Int32,
        scale_log2: fx.Float32,
    ):
        tid, wave, lane, col, grp = lane_coords()
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, o_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables, out))
        ctx = scalar_load(context_lengths, seq)
        v_scale = scalar_load(v_norm, 0).bitcast(fx.Float32)  # per token: the largest V scale
        q_row = (seq * q_seq_stride + (kvh * G + imin(col, G - 1)) * q_head_stride) * 2
        q_ops, q_scale = _query_operands(q_rs, q_row, col < G, FMAX, grp, HALVES, q_dtype)
        if const_expr(PT):
            c_qk = q_scale * scale_log2  # K's scale multiplies each score instead
            ks_rs, vs_rs = rsrc(key_scale), rsrc(value_scale)
            inv_vnorm = rcp(v_scale)
        else:
            c_qk = q_scale * scalar_load(key_scale, 0).bitcast(fx.Float32) * scale_log2

        last_page = (ctx - 1) // BS
        num_tiles = (ctx + (TILE - 1)) // TILE
        bt_row = seq * max_blocks
        # the lane's first K slot (token 16·(col//4) + col%4 of the span) and V/scale token group
        k_slot = col % 4 if const_expr(PPS > 1) else (col // 4) * 16 + col % 4
        k_lane = (grp * BS + k_slot) * 16  # K blocked: (d//16, slot) rows of 16 bytes
        v_group = 0 if const_expr(PPS > 1) else grp  # slot // 16 of the lane's 16 V tokens
        if const_expr(VT):
            v_lane = (v_group * HD + col) * 16  # V trans-blocked: (slot//16, channel) rows of 16 tokens
            chunk_off = [((j + PER * wave) % NJ) * 256 for j in range_constexpr(NJ)]
        else:
            v_lane = col * BS + v_group * 16  # V plain: channel rows of block_size tokens
            chunk_off = [((j + PER * wave) % NJ) * (16 * BS) for j in range_constexpr(NJ)]
        s_lane = v_group * 16 * 4  # the lane's 16 per-token scales, bytes into the (page, head) row
        k_page_j = col // 4 if const_expr(PPS > 1) else 0
        v_page_j = grp if const_expr(PPS > 1) else 0

        def page_id(tile, j):
            idx = imin(tile * (TILE // BS) + wave * PPS + j, last_page)
            return buffer_load(bt_rs, (bt_row + idx) * 4, 1)

        def slab(page):
            return (page * num_kv_heads + kvh) * PAGE_BYTES

        def load_k(page):
            voff = slab(page) + k_lane
            words = []
            for a in range_constexpr(4):
                for h in range_constexpr(HALVES):
                    v = buffer_load(k_rs, voff, 4, soffset=h * 4 * BS * 16, offset=a * 64)
                    words.extend([v[i] for i in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def load_v(page):
            voff = slab(page) + v_lane
            words = []
            for j in range_constexpr(NJ):
                v = buffer_load(v_rs, voff, 4, soffset=chunk_off[j])
                words.extend([v[k] for k in range_constexpr(4)])
            return fx.Vector.from_elements(words, dtype=fx.Int32)

        def load_scales(rs, page):
            voff = ((page * num_kv_heads + kvh) * BS) * 4 + s_lane
            vals = []
            for k in range_constexpr(4):
                v = buffer_load(rs, voff, 4, offset=16 * k).bitcast(fx.Float32)
                vals.extend([v[i] for i in range_constexpr(4)])
            return vals

        def tile_math(t, k_words, v_words, v_page, o, m_old, l_old):
            s = []
            for a in range_constexpr(4):
                acc = fx.Vector.filled(4, 0.0, fx.Float32)
                for h in range_constexpr(HALVES):
                    for half in range_constexpr(2):
                        w0 = (HALVES * a + h) * 4 + 2 * half
                        acc = mfma(i64(k_words[w0], k_words[w0 + 1]), q_ops[2 * h + half], acc)
                s.extend([acc[i] for i in range_constexpr(4)])
            p_weight = None
            if const_expr(PT):
                ks = load_scales(ks_rs, v_page)  # s[4a + i] is token 16·grp + 4a + i: scale 4a + i
                s = [fx.Float32(s[i]) * fx.Float32(ks[i]) for i in range_constexpr(16)]
                p_weight = [fx.Float32(x) * inv_vnorm for x in load_scales(vs_rs, v_page)]
            s = fx.Vector.from_elements(s, dtype=fx.Float32)
            n_valid = ctx - (t * TILE + wave * SPAN + grp * 16)
            if t + 1 == num_tiles:
                s, v_words = _mask_tail(s, v_words, n_valid)
            p_ops, corr, m_new, l_new = _softmax_step(s, m_old, l_old, c_qk, LOG2_FMAX, p_weight)
            return pv_step(o, v_words, p_ops, corr), m_new, l_new

        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        state = ([load_k(page_id(0, k_page_j)), page_id(1, k_page_j), page_id(0, v_page_j)]
                 + [zero4] * NJ + [fx.Float32(MASKED), fx.Float32(0.0)])
        for t, st in range(0, num_tiles, 1, init=state):
            t = fx.Int32(t)
            k_words, k_page_next, v_page = st[0], st[1], st[2]
            o = [st[3 + j] for j in range_constexpr(NJ)]
            m_old, l_old = st[3 + NJ], st[4 + NJ]
            v_words = load_v(v_page)
            k_words_next = load_k(k_page_next)
            carry = [k_words_next, page_id(t + 2, k_page_j), page_id(t + 1, v_page_j)]
            fx.rocdl.sched_barrier(0)
            o, m_new, l_new = tile_math(t, k_words, v_words, v_page, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]

        lds = fx.SharedAllocator().allocate(Shared).peek()
        mine = _merge_waves([res[3 + j] for j in range_constexpr(NJ)], fx.Float32(res[3 + NJ]),
                            fx.Float32(res[4 + NJ]), v_scale, lds, wave, lane, col, stats_stride)
        if col < G:
            row = (seq * (num_kv_heads * G) + kvh * G + col) * (HD * 2)
            for s in range_constexpr(PER):
                buffer_store(mine[s].to(ODT).bitcast(fx.Int32), o_rs, row + ((PER * wave + s) * 16 + grp * 4) * 2)

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
        v_norm: fx.Tensor,
        num_seqs: fx.Int32,
        num_kv_heads: fx.Int32,
        max_blocks: fx.Int32,
        q_seq_stride: fx.Int32,
        q_head_stride: fx.Int32,
        scale_log2: fx.Float32,
        stream: fx.Stream = fx.Stream(None),
    ):
        with CompilationContext.compile_hints({"fastmath": arith.FastMathFlags.contract}):
            pa_decode_s4(
                out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, v_norm,
                num_kv_heads, max_blocks, q_seq_stride, q_head_stride, scale_log2,
            ).launch(grid=(num_seqs, num_kv_heads, 1), block=(WAVES * WAVE, 1, 1), stream=stream)

    return launch


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch, v_layout=v_layout)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    # per token, P is weighted by v_scale / max(v_scale) <= 1 so that it stays in fp8 range
    v_norm = vs.amax().reshape(1) if p.per_token else vs
    out = problem.output(p, query, out)
    launcher = build_launcher(p.block_size, p.head_dim, p.group, p.arch, p.q_dtype, p.per_token, p.v_layout)
    args = (
        out, query, key_cache.view(torch.uint8), value_cache.view(torch.uint8),
        block_tables, context_lengths, ks, vs, v_norm,
        p.num_seqs, p.num_kv_heads, p.max_blocks, query.stride(0), query.stride(1), p.scale_log2,
    )
    return launcher, args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, out=None, arch=None, v_layout="trans_blocked"):
    """fp8 paged decode attention; returns ``out`` (shaped like ``query``, in the query's dtype).

    ``query`` [num_seqs, num_q_heads, 64|128] f16/bf16, last dim contiguous (other strides free);
    ``key_cache`` K blocked [num_blocks, num_kv_heads, head_dim//16, block_size, 16];
    ``value_cache`` V trans-blocked [num_blocks, num_kv_heads, block_size//16, head_dim, 16], or V plain
    [num_blocks, num_kv_heads, head_dim, block_size] with ``v_layout="plain"``; fp8 e4m3 of the arch's
    flavour (or uint8 codes); ``block_tables`` [num_seqs, max_blocks] int32; ``context_lengths``
    [num_seqs] int32; ``key_scale``/``value_scale`` float32 [1] or [num_blocks, num_kv_heads,
    block_size] (> 0); ``softmax_scale`` defaults to 1/sqrt(head_dim). Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch, v_layout=v_layout)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                   softmax_scale=None, arch, v_layout="trans_blocked"):
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
    ks, vs = torch.as_tensor(key_scale, dtype=torch.float32), torch.as_tensor(value_scale, dtype=torch.float32)
    per_token = ks.numel() > 1
    v_norm = float(vs.max()) if per_token else float(vs.reshape(()))
    _, kvh, bs, _ = kc.shape
    group = num_q_heads // kvh
    out = torch.empty(num_seqs, num_q_heads, hd)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    scale_log2 = f32(scale * LOG2E)  # ... scores (and so P's fp8 codes) round alike
    for s in range(num_seqs):
        n = int(context_lengths[s])
        pages = block_tables[s, : -(-n // bs)].long()
        k = kc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, hd)[:, :n]
        v = vc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, hd)[:, :n]
        q = query[s].float().reshape(kvh, group, hd)
        amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-20)
        q8 = (q * (fmax / amax)).to(fp8).float()
        q_scale = amax * f32(1.0 / fmax)  # the kernel's order of float32 operations, so that
        raw = torch.einsum("hgd,htd->hgt", q8, k)
        if per_token:
            kst = ks[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n]
            wt = (vs[pages].permute(1, 0, 2).reshape(kvh, -1)[:, :n] / v_norm)[:, None, :]
            x = (raw * kst[:, None, :]) * (q_scale * scale_log2)
        else:
            wt = torch.ones(1)
            x = raw * ((q_scale * ks.reshape(())) * scale_log2)
        m = torch.full((kvh, group, WAVES), MASKED)
        l = torch.zeros(kvh, group, WAVES)
        o = torch.zeros(kvh, group, WAVES, hd)
        for t0 in range(0, n, TILE):
            for w in range(WAVES):
                lo, hi = t0 + w * SPAN, min(t0 + (w + 1) * SPAN, n)
                if hi <= lo:
                    continue
                m_new = torch.maximum(m[..., w], x[..., lo:hi].amax(-1))
                corr = torch.exp2(m[..., w] - m_new)
                p = torch.exp2(x[..., lo:hi] - (m_new - math.log2(fmax))[..., None])
                l[..., w] = l[..., w] * corr + p.sum(-1)
                pw = p * (wt[..., lo:hi] if per_token else 1.0)
                o[..., w, :] = o[..., w, :] * corr[..., None] + pw.to(fp8).float() @ v[:, lo:hi]
                m[..., w] = m_new
        f = torch.exp2(m - m.amax(-1, keepdim=True))
        res = (o * f[..., None]).sum(2) / (l * f).sum(-1)[..., None] * v_norm
        out[s] = res.reshape(num_q_heads, hd)
    return out
