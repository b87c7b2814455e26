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

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.compiler.kernel_function import CompilationContext
from flydsl.expr import arith, const_expr, gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max, fp8_torch_dtype
from pa_tile.kernel_lib import (
    HEAD_DIM, LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, buffer_load, buffer_store, i64, imin, lane_coords,
    mask_tail, merge_waves, mfma, pv_step, query_operands, rsrc, scalar_load, softmax_step,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "kernel_args", "numerics_model", "LIMITS"]

#: what the stage-2 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s2", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))


@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch) specialization."""
    BS, G = block_size, group
    FMAX = fp8_max(arch)
    LOG2_FMAX = math.log2(FMAX)
    PAGE_BYTES = BS * HEAD_DIM  # one (page, kv head) slab of K or V
    PAGES_PER_SPAN = SPAN // BS  # 4 (block 16) or 1 (block 64)

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, 2 * 16 * WAVES, 16]  # [max | sum][head][wave]
        xchg: fx.Array[fx.Float32, WAVES * 2 * WAVE * 4, 16]  # [sender][2 slots][lane] x f32x4

    @flyc.kernel(known_block_size=(WAVES * WAVE, 1, 1))
    def pa_decode_s2(
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
        # col: MFMA column = this lane's query head (and the A-operand row it loads); grp: row band
        tid, wave, lane, col, grp = lane_coords()
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, o_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables, out))
        ctx = scalar_load(context_lengths, seq)
        k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
        v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        head0 = seq * (num_kv_heads * G) + kvh * G  # first query row of this group

        q_ops, q_scale = query_operands(q_rs, head0 + imin(col, G - 1), col < G, FMAX, grp)
        c_qk = q_scale * k_scale * scale_log2

        # ---- addressing that stays fixed for the whole loop
        last_page = (ctx - 1) // BS
        num_tiles = (ctx + (TILE - 1)) // TILE
        bt_row = seq * max_blocks
        if const_expr(PAGES_PER_SPAN > 1):
            k_lane = (col % 4) * HEAD_DIM + grp * 16  # within the page of K rows `col // 4`
            v_lane = col * BS  # within page `grp`: channel row `col`, all 16 slots
        else:
            k_lane = ((col // 4) * 16 + col % 4) * HEAD_DIM + grp * 16
            v_lane = col * BS + grp * 16
        chunk_off = [((j + 2 * wave) % 8) * (16 * BS) for j in range_constexpr(8)]
        k_page_j = col // 4 if PAGES_PER_SPAN > 1 else 0  # which page of the span holds this lane's K rows
        v_page_j = grp if PAGES_PER_SPAN > 1 else 0  # ... and its 16 V tokens

        def page_id(tile, j):
            """Page id of page j of this wave's span in `tile`, clamped to the sequence's last page."""
            idx = imin(tile * (TILE // BS) + wave * PAGES_PER_SPAN + j, last_page)
            return buffer_load(bt_rs, (bt_row + idx) * 4, 1)

        def slab(page):
            return (page * num_kv_heads + kvh) * PAGE_BYTES  # byte offset of (page, kv head)

        def load_k(page):
            voff = slab(page) + k_lane
            words = []
            for a in range_constexpr(4):
                for h in range_constexpr(2):
                    # rows 4a.. of the lane's K rows, channels 16·grp (+64 for h = 1)
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

        # Page ids are read one tile ahead, so the loads at the top of an iteration never
        # wait on a block-table read.
        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        state = [page_id(0, k_page_j), page_id(0, v_page_j)] + [zero4] * 8 + [fx.Float32(MASKED), fx.Float32(0.0)]
        for t, st in range(0, num_tiles, 1, init=state):
            t = fx.Int32(t)
            k_page, v_page = st[0], st[1]
            o = [st[2 + j] for j in range_constexpr(8)]
            m_old, l_old = st[10], st[11]
            k_words = load_k(k_page)
            v_words = load_v(v_page)  # in flight during Q·Kᵀ and the softmax
            k_page_next = page_id(t + 1, k_page_j)  # clamped: always a page of this sequence
            v_page_next = page_id(t + 1, v_page_j)
            # keep all of the tile's loads ahead of its math: left alone, the scheduler would
            # issue V only after K has landed, paying two memory latencies per tile
            fx.rocdl.sched_barrier(0)

            # Q·Kᵀ turned around: s[4a + i] = wave-token 16·grp + 4a + i, head col
            s = []
            for a in range_constexpr(4):
                acc = zero4
                for h in range_constexpr(2):
                    for half in range_constexpr(2):
                        w0 = (2 * a + h) * 4 + 2 * half
                        acc = mfma(i64(k_words[w0], k_words[w0 + 1]), q_ops[2 * h + half], acc)
                s.extend([acc[i] for i in range_constexpr(4)])
            s = fx.Vector.from_elements(s, dtype=fx.Float32)

            n_valid = ctx - (t * TILE + wave * SPAN + grp * 16)  # of this lane's 16 tokens
            if t + 1 == num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)

            p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, c_qk, LOG2_FMAX)
            o = pv_step(o, v_words, p_ops, corr)
            res = yield [k_page_next, v_page_next] + o + [m_new, l_new]

        lds = fx.SharedAllocator().allocate(Shared).peek()
        o0, o1 = merge_waves(
            [res[2 + j] for j in range_constexpr(8)], fx.Float32(res[10]), fx.Float32(res[11]),
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
            pa_decode_s2(
                out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                num_kv_heads, max_blocks, scale_log2,
            ).launch(grid=(num_seqs, num_kv_heads, 1), block=(WAVES * WAVE, 1, 1), stream=stream)

    return launch


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, out=None, arch=None):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel,
    ``pa_tile.toolchain.compile_isa(launcher, *args, arch=arch)`` shows its assembly."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out)
    return build_launcher(p.block_size, p.group, p.arch), args, p.arch


def kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, out):
    """The launcher's arguments for a validated problem ``p`` (chapter 3's kernel takes the same)."""
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    return (problem.output(p, query, out), query.contiguous(), key_cache.view(torch.uint8),
            value_cache.view(torch.uint8), block_tables, context_lengths, ks, vs,
            p.num_seqs, p.num_kv_heads, p.max_blocks, p.scale_log2)


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
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
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                   softmax_scale=None, arch):
    """float32 torch model of the stage-2 kernel's roundings (same arguments as ``paged_decode``);
    returns a float32 tensor shaped like ``query``. CPU only; loops over sequences and tiles."""
    fmax, fp8 = fp8_max(arch), fp8_torch_dtype(arch)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else float(softmax_scale)
    ks, vs = float(torch.as_tensor(key_scale).reshape(())), float(torch.as_tensor(value_scale).reshape(()))
    num_seqs, num_q_heads, _ = query.shape
    _, kvh, bs, _ = key_cache.shape
    group = num_q_heads // kvh
    kc = key_cache.view(torch.uint8).view(fp8).float()
    vc = value_cache.view(torch.uint8).view(fp8).float().transpose(2, 3)  # -> [blocks, kvh, bs, 128]
    out = torch.empty(num_seqs, num_q_heads, HEAD_DIM)
    for s in range(num_seqs):
        n = int(context_lengths[s])
        pages = block_tables[s, : -(-n // bs)].long()
        k = kc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, HEAD_DIM)[:, :n]
        v = vc[pages].permute(1, 0, 2, 3).reshape(kvh, -1, HEAD_DIM)[:, :n]
        q = query[s].float().reshape(kvh, group, HEAD_DIM)
        amax = q.abs().amax(-1, keepdim=True).clamp_min(1e-20)
        q8 = (q * (fmax / amax)).to(fp8).float()
        # the kernel's float32 order: (amax * f32(1/fmax)) * ks * f32(scale * log2 e)
        x = torch.einsum("hgd,htd->hgt", q8, k) * ((amax * (1.0 / fmax)) * ks * (scale * LOG2E))
        m = torch.full((kvh, group, WAVES), MASKED)
        l = torch.zeros(kvh, group, WAVES)
        o = torch.zeros(kvh, group, WAVES, HEAD_DIM)
        for t0 in range(0, n, TILE):
            for w in range(WAVES):
                lo, hi = t0 + w * SPAN, min(t0 + (w + 1) * SPAN, n)
                if hi <= lo:
                    continue
                xw = x[..., lo:hi]
                m_new = torch.maximum(m[..., w], xw.amax(-1))
                corr = torch.exp2(m[..., w] - m_new)
                p = torch.exp2(xw - (m_new - math.log2(fmax))[..., None])
                l[..., w] = l[..., w] * corr + p.sum(-1)
                o[..., w, :] = o[..., w, :] * corr[..., None] + p.to(fp8).float() @ v[:, lo:hi]
                m[..., w] = m_new
        f = torch.exp2(m - m.amax(-1, keepdim=True))
        res = (o * f[..., None]).sum(2) / (l * f).sum(-1)[..., None] * vs
        out[s] = res.reshape(num_q_heads, HEAD_DIM)
    return out
