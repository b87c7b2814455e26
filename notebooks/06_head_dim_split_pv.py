# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -all
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # 06 · The head_dim split of P·V
#
# **You'll learn**
#
# * why each wave computes P·V for a quarter of head_dim over all 256 tokens of a tile;
# * how the row max and P cross the four waves through LDS, and what barriers that takes;
# * when a tile's V is issued: with K, wherever the registers allow;
# * what the finished stage costs in registers, waves and LDS, against upstream's kernel.
#
# **You need** [chapter 05](05_phase_split_mtp.ipynb) (M-tiles, masks, the phase split) and
# chapter 02 (the MFMA fragments; P·V computed as V·P, so the output is `[channel, row]`).
#
# **Runs on** the CPU emulator (a few minutes; compiling is most of it) or a ROCm GPU.

# %% [markdown]
# ## Why split P·V by head_dim
#
# In chapter 02 a wave owns 64 tokens of each tile and computes P·V for them over all of
# head_dim. Its output fragment then holds every channel of every row: `head_dim/4` registers per
# lane and M-tile. With M-tiles that adds up:

# %%
import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, isa, seed_history, show, toolchain, upstream
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.progress import progress as tqdm
from pa_tile.stages import s5_phase_split_mtp as s5

o_regs = 128 // 4  # output registers per lane and M-tile at head_dim 128, chapter 02's way
most = s5.LIMITS.max_m_tiles
show.md(f"""
    At head_dim 128 that is {o_regs} registers per M-tile. {most} M-tiles need {most * o_regs} for
    the output alone, and with {most * o_regs} registers a SIMD holds at most
    {isa.occupancy_for('gfx942', most * o_regs).waves_per_simd:.0f} waves (gfx942's steps,
    `pa_tile.arch`), before K, V, P and addressing are counted.""")

# %% [markdown]
# So the waves split P·V the other way. Wave `w` computes, for every M-tile, only its quarter of
# the channels, over **all 256 tokens** of the tile. Its output is `head_dim/16` registers per
# M-tile, a quarter. No wave needs the others' output after the loop, so this drops chapter 02's
# merge of the four waves' outputs (`kernel_lib.exchange`): each wave writes its own channels.
#
# FlashAttention-2 avoids sharing between warps by giving each warp its own query rows. A decode
# tile has too few rows for that, so the waves split the output's columns (head_dim) and share P.
# Upstream's `pa_decode_tile` splits the same way.

# %%
figures.head_dim_split_dataflow(head_dim=128)
plt.show()

# %% [markdown]
# Left: in phase B each wave turns its own 64 tokens' scores into P and writes it to a slab in
# LDS. Right: wave `w` accumulates its two d-chunks (head_dim 128) over all four spans, so it
# reads every wave's P back.
#
# ## The module, continued
#
# This chapter's cells continue chapter 05's in `pa_tile.stages.s5_phase_split_mtp`. They use
# chapter 05's pieces (`LanePages`, `Spec`, `masked_scores`, ...) as the module has them:

# %%
globals().update({k: v for k, v in vars(s5).items() if not k.startswith("__")})

# %% [markdown]
# ## What crosses the waves each tile
#
# Two things.
#
# 1. **The row max.** P of all four waves' tokens meets in one accumulator, so all of it must be
#    exponentiated against one max. In phase A each wave writes its row maxes to a table
#    `[m-tile][row][wave]`. After one barrier every wave reads the row's four back. Every wave
#    then carries the *same* running max, and after the loop only the row sums cross waves.
# 2. **P.** Lane `(col, grp)` of wave `w` multiplies V's tokens `16·grp ..` of every span, so it
#    needs exactly the P that lane `(col, grp)` of each wave computed: the same lane index. P
#    goes through a 4 KB slab `[wave][lane] × 16` bytes: one `ds_write_b128` per lane, four
#    `ds_read_b128` back. Consecutive lanes touch consecutive 16 bytes, so there is no bank
#    conflict and no transposition. One slab serves every M-tile: a barrier after each M-tile's
#    write (its P is there) and one before the next M-tile's write (every wave has read it).
#
# Per-token scales add one more table: the V-scale max becomes the workgroup's, four entries read
# after the max barrier.
#
# **Phase groups.** The scores of the M-tiles of one group stay live across their max barrier;
# K stays live across all groups. `PHASE_GROUP` picks the group size per head_dim from the
# compiled code: at head_dim 64, one M-tile per group keeps 3 waves per SIMD; at 128 and 256,
# groups of four keep K live for less. A tile then has `2 · MT` barriers: one per group for the
# max, one per M-tile for P, one between the M-tiles of a group for the slab.

# %% tags=["export"]
#: M-tiles per phase group of the head_dim split (measured, "Registers and occupancy")
PHASE_GROUP = {64: 1, 128: 4, 256: 4}
#: up to this many M-tiles per workgroup the loop stays register-resident (no barrier); past it
#: P·V is split by head_dim. 0: always split, the measured default ("Registers and occupancy":
#: fewer registers at every M-tile count, and the timing model predicts it faster)
WIDE_ABOVE = 0


def v_with_k(head_dim, block_size, per_token):
    """Whether the head_dim split's loop issues a tile's V right after its K, so the two loads'
    latencies run side by side and a tile waits for memory once, or after the scores, in the
    registers K frees, waiting twice ("When to load V"). With K wherever the extra live V words
    keep the kernel within upstream's register and occupancy figures: all but head_dim 256 and
    per-token scales on 64-token pages (``tests/test_stage5.py`` checks every configuration). Pages
    of 32 and 128 tokens (no upstream figures) follow 64's rule: with per-token scales V with K
    costs a wave at head_dim 128, one query token, against upstream's block-64 figure
    (``tests/test_block_sizes.py`` checks them against the tighter of upstream's block-16 and
    block-64 figures)."""
    return head_dim <= 128 and not (per_token and block_size >= 32)


# %% [markdown]
# ## Where the operands are
#
# Each wave still loads its own span's K (and per-token scales), but V by d-chunk: its `CPW`
# d-chunks of all four spans. The workgroup loads the same V bytes as in chapter 02, `NCH`
# dwordx4 per lane; only who loads which changes. Each lane now needs the page ids of all four
# spans.

# %% tags=["export"]
class WidePages(LanePages):
    """``LanePages`` for the head_dim split: the wave's own span's K (and per-token scales) as
    before, and the V bytes of its ``CPW`` d-chunks in all four spans, lane ``(col, grp)`` loading
    in each span the tokens that lane ``(col, grp)`` of the span's wave scores."""

    def __init__(self, *a, cpw, **kw):
        super().__init__(*a, **kw)
        self.cpw = cpw
        # bytes between d-chunks
        self.v_chunk = 16 * (16 if kw["trans_v"] or self.bs == 16 else self.bs)

    def v_page_ids(self, tile):
        """Page ids of the lane's V tokens in each of the tile's four spans (clamped like
        ``page_id``)."""
        ids = []
        for sp in range_constexpr(WAVES):
            if const_expr(sp > 0 and self.span_page(sp) == self.span_page(sp - 1)):
                ids.append(ids[-1])  # block 128: two spans, one page
                continue
            idx = imin(tile * (TILE // self.bs) + self.span_page(sp) + self.v_j, self.last_page)
            ids.append(buffer_load(self.bt_rs, (self.bt_row + idx) * 4, 1))
        return ids

    def own(self, ids):
        """This wave's own span's page id, of the four (the page of its per-token scales)."""
        page = ids[0]
        for sp in range_constexpr(1, WAVES):
            page = fx.Int32(select(self.wave == sp, ids[sp], page))
        return page

    def v_spans(self, ids):
        """The V words ``[span][slot][4]``, flat: slot ``s`` is d-chunk ``CPW·wave + s``."""
        out = []
        for sp in range_constexpr(WAVES):
            if const_expr(self.pps > 0):
                voff = self.slab(ids[sp]) + self.v_lane
            else:  # block 128: span sp starts span_start(sp) tokens into its page
                voff = self.slab(ids[sp]) + (self.v_lane0 + self.v_tokens_at(self.span_start(sp)))
            for s in range_constexpr(self.cpw):
                v = buffer_load(self.v_rs, voff, 4,
                                soffset=(self.cpw * self.wave + s) * self.v_chunk)
                out.extend([v[k] for k in range_constexpr(4)])
        return fx.Vector.from_elements(out, dtype=fx.Int32)


# %% [markdown]
# The tile's V words, and on the tile that holds the context's end, the bytes past it zeroed span
# by span (`0 · NaN` is NaN inside the MFMA).

# %% tags=["export"]
@device_code
def wide_v(c, wp, v_ids, t, ctx, grp):
    """The wave's V words of tile ``t``, bytes of tokens past the context zeroed span by span."""
    v_all = wp.v_spans(v_ids)
    if const_expr(c.W > 0):
        v_all = _zero_tail_spans(c, v_all, t, ctx, grp)
    else:
        if t * TILE + TILE > ctx:
            v_all = _zero_tail_spans(c, v_all, t, ctx, grp)
    return v_all


def _zero_tail_spans(c, v_all, t, ctx, grp):
    n = c.CPW * 4
    words = []
    for sp in range_constexpr(WAVES):
        part = fx.Vector.from_elements([v_all[sp * n + i] for i in range_constexpr(n)],
                                       dtype=fx.Int32)
        z = zero_tail_v(part, ctx - (t * TILE + sp * SPAN + grp * 16))
        words.extend([z[i] for i in range_constexpr(n)])
    return fx.Vector.from_elements(words, dtype=fx.Int32)


# %% [markdown]
# ## Phase A, one group of M-tiles
#
# Chapter 05's scores, per-token K scales and masks, then the wave's row max to the table. Per
# token, the V scales' wave max goes to its table here too; after the barrier every lane turns
# its scale into the weight `v_scale / max_workgroup(v_scale)`.

# %% tags=["export"]
@device_code
def wide_scores(c, ms, t, tok, ctx, k_words, shared, stats, lane, col, wave, c_qk, hi1, pt,
                c_cap=None):
    """M-tiles ``ms``: their masked raw scores (kept for phase B) and this wave's row max of each
    to the max table ``[m-tile][row][wave]`` (``c_cap``: the factors a soft-cap takes, chapter
    08)."""
    s_all = []
    for m in ms:
        fx.rocdl.sched_barrier(0)
        s = scores(k_words, _staged_q(shared, m, lane, c.NH), c.NH)
        if const_expr(c.per_token):
            sc_lds, sc_k, grp = pt
            s = k_scaled(s, sc_lds, sc_k, grp, fenced=False)
        s, _ = masked_scores(c, fx.Vector.from_elements(s, dtype=fx.Float32), m, t, tok, ctx, hi1,
                             k_words, zero_v=False, c_cap=None if c_cap is None else c_cap[m])
        lds_store(stats, ((m * 16 + col) * WAVES + wave) * 4,
                  fx.Vector.from_elements([row_max(s, c_qk[m])], dtype=fx.Float32))
        s_all.append(s)
    return s_all


# %% tags=["export"]
def wide_v_max(c, sc_lds, v_sc1, t, wave, lane, ctx):
    """The lane's live V scale (``live_v_scale``); its wave's max to the V-max table."""
    v_sc1 = live_v_scale(v_sc1, t, wave, lane, ctx, c.QN, c.W)
    lds_store(sc_lds, (c.SC_FLOATS + wave) * 4,
              fx.Vector.from_elements([wave_reduce(v_sc1, fmax)], dtype=fx.Float32))
    return v_sc1


def wide_v_weight(c, sc_lds, sc_v, v_sc1, lane):
    """After the max barrier: the workgroup's V-scale max and the lane's weight to its slot;
    ``(1/vmax, vmax)``."""
    vmax, rv = v_max_factors(max4(lds_load(sc_lds, c.SC_FLOATS * 4, WAVES)))
    lds_store(sc_lds, sc_v + lane * 4, fx.Vector.from_elements([v_sc1 * rv], dtype=fx.Float32))
    return rv, vmax


# %% [markdown]
# ## Phase B, one M-tile at a time
#
# The workgroup's row max from the table, P of the wave's own tokens into the slab, the barrier,
# and P·V of the wave's d-chunks over the four spans: V as A, P of span `sp` as B, 8 MFMAs per
# d-chunk.

# %% tags=["export"]
def wide_pv(c, ms, st, s_all, v_all, stats, pslab, lane, col, wave, c_qk, pt):
    """M-tiles ``ms``: ``(o, m, l)`` after this tile (``l``: this lane's share of the row sum)."""
    O0 = 1 + WAVES
    M0, L0 = O0 + c.MT * c.CPW, O0 + c.MT * c.CPW + c.MT
    v_weight = rv = vmax = None
    if const_expr(c.per_token):
        sc_lds, sc_v, grp, rv, vmax = pt
        v_weight = functools.partial(lane_scales, sc_lds, sc_v, grp)
    o_all, m_all, l_all = [], [], []
    for i, m in enumerate(ms):
        fx.rocdl.sched_barrier(0)
        m4 = lds_load(stats, (m * 16 + col) * WAVES * 4, WAVES)
        mx = fmax(fx.Float32(st[M0 + m]), max4(m4))
        p_ops, p_sum = _exp_pack(s_all[i], c_qk[m], mx, c.LOG2_FMAX, v_weight)
        corr = exp2(fx.Float32(st[M0 + m]) - mx)
        lds_store(pslab, (wave * WAVE + lane) * 16,
                  fx.Vector.from_elements(p_ops, dtype=fx.Int64).bitcast(fx.Float32))
        gpu.barrier()  # every wave's P of this M-tile is in the slab
        ps = [lds_load(pslab, (sp * WAVE + lane) * 16,
                       4).bitcast(fx.Int64) for sp in range_constexpr(WAVES)]
        f4 = splat4(corr * rv if const_expr(c.per_token) else corr)
        for s in range_constexpr(c.CPW):
            acc = fx.Vector(st[O0 + m * c.CPW + s]) * f4
            for sp in range_constexpr(WAVES):
                w = [fx.Int32(v_all[(sp * c.CPW + s) * 4 + k]) for k in range_constexpr(4)]
                acc = mfma(i64(w[0], w[1]), ps[sp][0], acc)
                acc = mfma(i64(w[2], w[3]), ps[sp][1], acc)
            if const_expr(c.per_token):
                acc = acc * splat4(vmax)
            o_all.append(acc)
        if const_expr(i < len(ms) - 1):
            gpu.barrier()  # every wave has read the slab (a next group's max barrier does this too)
        m_all.append(mx)
        l_all.append(fx.Float32(st[L0 + m]) * corr + p_sum)
    return o_all, m_all, l_all


# %% [markdown]
# ## The loop, and when V is issued
#
# A tile waits for memory before its scores (K) and before its P·V (V). Issued right after K,
# V's latency runs alongside K's and the tile waits once. That keeps V's words in registers
# through phase A. The split's output is a quarter, so this fits upstream's register and
# occupancy figures everywhere but two cases, `v_with_k` above: head_dim 256, and per-token
# scales on 64-token pages. There V is issued after the first group's scores, into the registers
# K's last reads free. (The model's comparison of the two orders is in
# [the appendix](appendix_register_resident_loop.ipynb).) The seed kernel measured the same move
# on a GPU:

# %%
show.md(seed_history.table("f5cf69ab", "V load hoisted before QK"))

# %% [markdown]
# The loop carries the next tile's K page and four V page ids, and per M-tile its `O`, max and
# sum. After it, the max is already the workgroup's: only the row sums cross waves (through the
# max table, now free), and each wave writes its own d-chunks.

# %% tags=["export"]
@device_code
def wide_loop(c, k, wp, t_start, t_end, first_pages):
    """The main loop of the head_dim split (``k``: the kernel's per-workgroup values;
    ``first_pages``: tile ``t_start``'s K and four V page ids); returns its final state ``[k page,
    4 V pages, O, m, l]``."""
    MT = c.MT
    state = list(first_pages)
    state += [fx.Vector.filled(4, 0.0, fx.Float32)] * (MT * c.CPW)
    state += [fx.Float32(MASKED)] * MT + [fx.Float32(0.0)] * MT
    for t, st in range(t_start, t_end, 1, init=state):
        t = fx.Int32(t)
        v_ids = [st[1 + sp] for sp in range_constexpr(WAVES)]
        pt_a = pt_b = None
        if const_expr(c.per_token):
            own = wp.own(v_ids)
            k_sc1, v_sc1 = wp.scale(k.ks_rs, own), wp.scale(k.vs_rs, own)  # the oldest loads
        k_words = wp.k(st[0])
        if const_expr(c.V_WITH_K):
            # V in flight with K: one wait a tile, not two
            v_all = wide_v(c, wp, v_ids, t, k.ctx, k.grp)
        k_next, v_next = wp.page_id(t + 1, wp.k_j), wp.v_page_ids(t + 1)
        fx.rocdl.sched_barrier(0)
        tok = t * TILE + k.wave * SPAN + k.grp * 16  # the lane's first token
        if const_expr(c.per_token):
            lds_store(k.sc_lds, k.sc_k + k.lane * 4,
                      fx.Vector.from_elements([k_sc1], dtype=fx.Float32))
            v_sc1 = wide_v_max(c, k.sc_lds, v_sc1, t, k.wave, k.lane, k.ctx)
            pt_a = (k.sc_lds, k.sc_k, k.grp)
        o_all, m_all, l_all = [], [], []
        for g0 in range_constexpr(0, MT, c.MB):
            ms = list(range(g0, min(g0 + c.MB, MT)))
            s_all = wide_scores(c, ms, t, tok, k.ctx, k_words, k.shared, k.stats, k.lane, k.col,
                                k.wave, k.c_qk, k.hi1, pt_a, k.c_cap)
            if const_expr(g0 == 0 and not c.V_WITH_K):
                fx.rocdl.sched_barrier(0)
                v_all = wide_v(c, wp, v_ids, t, k.ctx, k.grp)  # V after the first group's scores
            gpu.barrier()  # every wave's row maxes (and V-scale max) are in the tables
            if const_expr(g0 == 0 and c.per_token):
                rv, vmax = wide_v_weight(c, k.sc_lds, k.sc_v, v_sc1, k.lane)
                pt_b = (k.sc_lds, k.sc_v, k.grp, rv, vmax)
            o_g, m_g, l_g = wide_pv(c, ms, st, s_all, v_all, k.stats, k.pslab, k.lane, k.col,
                                    k.wave, k.c_qk, pt_b)
            o_all, m_all, l_all = o_all + o_g, m_all + m_g, l_all + l_g
        res = yield [k_next] + v_next + o_all + m_all + l_all
    return res


# %% tags=["export"]
def wide_merge_and_write(c, k, res, rows, v_scale, outputs, part, num_kv_heads):
    """The four waves' row sums, and each wave's d-chunks of every M-tile written."""
    O0 = 1 + WAVES
    M0, L0 = O0 + c.MT * c.CPW, O0 + c.MT * c.CPW + c.MT
    for m in range_constexpr(c.MT):
        lw = row_reduce(fx.Float32(res[L0 + m]), operator.add)
        lds_store(k.stats, ((m * 16 + k.col) * WAVES + k.wave) * 4,
                  fx.Vector.from_elements([lw], dtype=fx.Float32))
    gpu.barrier()
    o_rs, mx_rs, sm_rs = output_resources(c, outputs)
    for m in range_constexpr(c.MT):
        l4 = lds_load(k.stats, (m * 16 + k.col) * WAVES * 4, WAVES)
        total = (fx.Float32(l4[0]) + fx.Float32(l4[1])) + (fx.Float32(l4[2]) + fx.Float32(l4[3]))
        f = rcp(total)
        if const_expr(v_scale is not None):
            f = f * v_scale
        if const_expr(c.SPLIT):
            # empty partition row: 0, not 0·inf
            f = fx.Float32(select(total > 0.0, f, fx.Float32(0.0)))
        lse2 = None
        if const_expr(c.SINKS or c.LSE):  # chapter 08
            f, lse2 = finish_row(c, f, fx.Float32(res[M0 + m]), total, k.sinks_rs,
                                 k.kvh * c.G + rows[m][2])
        o = [fx.Vector(res[O0 + m * c.CPW + s]) * splat4(f) for s in range_constexpr(c.CPW)]
        write_rows(c, o, fx.Float32(res[M0 + m]), total, rows[m], k.slot, k.kvh, part, k.wave,
                   k.grp, num_kv_heads, o_rs, mx_rs, sm_rs, lse2 if const_expr(c.LSE) else None)


# %% [markdown]
# **The output.** Each wave holds `CPW` 16-channel chunks of every row. Unsplit, it writes them
# in the query's dtype. A split-K partition writes float32 partials and, from one lane group of
# wave 0, the row's max and sum.

# %% tags=["export"]
@device_code
def write_rows(c, o, mx, total, row, seq, kvh, part, wave, grp, num_kv_heads, o_rs, mx_rs, sm_rs,
               lse2=None):
    r, qi, g = row
    if r < c.LIVE:
        for s in range_constexpr(c.CPW):
            d0 = (c.CPW * wave + s) * 16 + grp * 4
            if const_expr(not c.SPLIT):
                out_row = (row_base(c, seq) + qi) * (num_kv_heads * c.G) + kvh * c.G + g
                buffer_store(o[s].to(c.QDT).bitcast(fx.Int32), o_rs, (out_row * c.HD + d0) * 2)
            else:
                prow = ((seq * num_kv_heads + kvh) * c.NPW + part) * c.ROWS + r
                buffer_store(o[s].bitcast(fx.Int32), o_rs, (prow * c.HD + d0) * 4)
        if const_expr(c.SPLIT):
            if wave == 0:
                if grp == 0:
                    prow = ((seq * num_kv_heads + kvh) * c.NPW + part) * c.ROWS + r
                    buffer_store(fx.Float32(mx * (1.0 / LOG2E)).bitcast(fx.Int32), mx_rs, prow * 4)
                    buffer_store(fx.Float32(total * (1.0 / c.FMAX)).bitcast(fx.Int32), sm_rs,
                                 prow * 4)
        if const_expr(lse2 is not None):  # the row's log-sum-exp (chapter 08), natural log
            if wave == 0:
                if grp == 0:
                    out_row = (row_base(c, seq) + qi) * (num_kv_heads * c.G) + kvh * c.G + g
                    buffer_store(fx.Float32(lse2 * (1.0 / LOG2E)).bitcast(fx.Int32), mx_rs,
                                 out_row * 4)


def output_resources(c, outputs):
    """Buffer resources ``(out, max, sum)`` of the kernel's ``outputs``: unsplit ``(out, lse)``,
    the lse only when written (``c.LSE``); split ``(pout, pmax, psum)``."""
    if const_expr(c.SPLIT):
        return tuple(rsrc(t) for t in outputs)
    return rsrc(outputs[0]), rsrc(outputs[1]) if const_expr(c.LSE) else None, None


# %% [markdown]
# ## The kernel
#
# The workgroup's LDS: the max table, the staged query, the P slab and the per-token scales. (The
# second struct is the register-resident baseline's, in the appendix.)

# %% tags=["export"]
def lds_layout(c):
    """The LDS of specialization ``c`` (a :class:`Spec`), as a FlyDSL struct."""
    if c.WIDE:
        @fx.struct
        class Wide:
            # [m-tile][row][wave]: max; after the loop, sum
            stats: fx.Array[fx.Float32, c.MT * 16 * WAVES, 16]
            shared: fx.Array[fx.Float32, c.SHARED_BYTES // 4, 16]  # the staged query
            pslab: fx.Array[fx.Float32, WAVES * WAVE * 4, 16]  # [wave][lane] x 16 fp8 P codes
            # per token: [wave][K scale | V weight][token], then [wave] V-scale maxes
            scales: fx.Array[fx.Float32, c.SC_FLOATS + WAVES if c.per_token else 4, 16]

        return Wide

    @fx.struct
    class Shared:
        stats: fx.Array[fx.Float32, c.MT * 2 * 16 * WAVES, 16]  # [m-tile][max | sum][row][wave]
        # before the loop: the staged query ([m-tile][K chunk pair][lane] x 16 fp8 codes, then
        # [m-tile][lane] scales); after it: the merge's exchange, [sender][slot][lane] x f32x4
        shared: fx.Array[fx.Float32, c.SHARED_BYTES // 4, 16]
        scales: fx.Array[fx.Float32, c.SC_FLOATS, 16]

    return Shared


# %% [markdown]
# Which work a workgroup does: its sequence, KV head and M-group from the block ids, and its
# partition from grid z (or, with chapter 07's work list, the entry it was handed).

# %% tags=["export"]
@device_code
def workgroup_work(c, work_list):
    """``(seq, slot, kvh, mgrp, part, listed, live)`` of this workgroup: ``slot`` is where its
    partials go; with a work list (``c.WL``) workgroup x does entry x, ``(sequence, first tile,
    end tile, 0)``: ``listed`` is that tile range and ``live`` is False for an empty entry (past
    the batch's last chunk), which reads no query."""
    seq, by = fx.Int32(gpu.block_id("x")), fx.Int32(gpu.block_id("y"))
    part = fx.Int32(gpu.block_id("z"))
    kvh, mgrp = by // c.MG, by % c.MG
    slot, listed, live = seq, None, None
    if const_expr(c.WL):
        seq = scalar_load(work_list, slot * 4)
        listed = (scalar_load(work_list, slot * 4 + 1), scalar_load(work_list, slot * 4 + 2))
        live = listed[0] < listed[1]
    return seq, slot, kvh, mgrp, part, listed, live


def ragged_rows(c, query_start_loc, seq, rows, live):
    """A ragged workgroup's ``(c, rows, live)``: the spec for its sequence's rows
    ``loc[seq] .. loc[seq+1]`` (``Spec.for_sequence``, two scalar loads), each padding row's
    position clamped to the sequence's last query (its causal bound stays inside the context;
    it is zeroed and not written), and ``live`` False for a sequence without queries, which then
    stages no query."""
    q0 = scalar_load(query_start_loc, seq)
    qn = scalar_load(query_start_loc, seq + 1) - q0
    rows = [(r, imax(imin(qi, qn - 1), 0), g) for r, qi, g in rows]
    has_rows = qn > 0
    return c.for_sequence(q0, qn), rows, has_rows if live is None else live & has_rows


# %% [markdown]
# The lane's page readers, and the first tile's page ids issued before the query is staged.
# Their latency then runs alongside the query's, not after the staging barrier: one wait less per
# workgroup, which chapter 07's short workgroups each pay.

# %% tags=["export"]
@device_code
def page_readers(c, bt_rs, k_rs, v_rs, seq, max_blocks, last_page, kvh, num_kv_heads, wave, lane,
                 col, grp, t_start):
    """``(pages, wp, first_pages)``: the lane's ``LanePages``, its ``WidePages`` for the head_dim
    split (else None), and tile ``t_start``'s K and V page ids (four V ids for the split)."""
    pages = LanePages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave,
                      lane, col, grp, block_size=c.BS, head_dim=c.HD, trans_v=c.trans_v)
    wp = None
    if const_expr(c.WIDE):
        wp = WidePages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave,
                       lane, col, grp, block_size=c.BS, head_dim=c.HD, trans_v=c.trans_v, cpw=c.CPW)
        first_pages = [wp.page_id(t_start, wp.k_j)] + wp.v_page_ids(t_start)
    else:
        first_pages = [pages.page_id(t_start, pages.k_j), pages.page_id(t_start, pages.v_j)]
    return pages, wp, first_pages


# %% [markdown]
# The scales: per token, the scale buffers and this wave's LDS slots for its 64 K scales and 64 V
# weights; per tensor, the two scales, read once.

# %% tags=["export"]
def per_token_slots(k, lds, key_scale, value_scale, wave):
    """Add the K/V scale buffers (``ks_rs``, ``vs_rs``), the scales' LDS (``sc_lds``) and this
    wave's slots in it (``sc_k``: its 64 K scales, then ``sc_v``: its 64 V weights) to ``k``."""
    k.ks_rs, k.vs_rs = rsrc(key_scale), rsrc(value_scale)
    k.sc_lds = fx.recast_iter(fx.Uint8, lds.scales.ptr)
    k.sc_k = wave * (2 * WAVE * 4)
    k.sc_v = k.sc_k + WAVE * 4


def tensor_scales(c, key_scale, value_scale):
    """The per-tensor K and V scales, ``(None, None)`` with per-token scales."""
    if const_expr(c.per_token):
        return None, None
    return (scalar_load(key_scale, 0).bitcast(fx.Float32),
            scalar_load(value_scale, 0).bitcast(fx.Float32))


# %% [markdown]
# The kernel, put together: the workgroup's work and buffers, the first page ids, the query
# staged and its score factors, the loop, the row sums, and the output.

# %% tags=["export"]
def make_kernel(c):
    """The kernel function of specialization ``c`` (a :class:`Spec`): ragged query rows
    (``c.RAGGED``) take ``query_start_loc`` as a last argument, so the other arguments keep their
    kernarg offsets and a uniform specialization's code does not change."""
    Shared = lds_layout(c)

    def pa_decode_s5(
        out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor, query: fx.Tensor,
        key_cache: fx.Tensor, value_cache: fx.Tensor, block_tables: fx.Tensor,
        context_lengths: fx.Tensor, work_list: fx.Tensor, key_scale: fx.Tensor,
        value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
        q_stride_row: fx.Int32, q_stride_head: fx.Int32, scale_log2: fx.Float32, sinks: fx.Tensor,
    ):
        decode_workgroup(c, Shared, out, pmax, psum, pout, query, key_cache, value_cache,
                         block_tables, context_lengths, work_list, key_scale, value_scale,
                         num_kv_heads, max_blocks, q_stride_row, q_stride_head, scale_log2, sinks)

    def pa_decode_s5_ragged(
        out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor, query: fx.Tensor,
        key_cache: fx.Tensor, value_cache: fx.Tensor, block_tables: fx.Tensor,
        context_lengths: fx.Tensor, work_list: fx.Tensor, key_scale: fx.Tensor,
        value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
        q_stride_row: fx.Int32, q_stride_head: fx.Int32, scale_log2: fx.Float32, sinks: fx.Tensor,
        query_start_loc: fx.Tensor,
    ):
        decode_workgroup(c, Shared, out, pmax, psum, pout, query, key_cache, value_cache,
                         block_tables, context_lengths, work_list, key_scale, value_scale,
                         num_kv_heads, max_blocks, q_stride_row, q_stride_head, scale_log2, sinks,
                         query_start_loc)

    return pa_decode_s5_ragged if c.RAGGED else pa_decode_s5


# %% [markdown]
# Both kernel signatures share one body: a workgroup's work and buffers, the first page ids, the
# query staged and its score factors, the loop, the row sums, and the output.

# %% tags=["export"]
def decode_workgroup(c, Shared, out, pmax, psum, pout, query, key_cache, value_cache, block_tables,
                     context_lengths, work_list, key_scale, value_scale, num_kv_heads, max_blocks,
                     q_stride_row, q_stride_head, scale_log2, sinks, query_start_loc=None):
    """One workgroup of the kernel (its arguments; ``Shared``: ``lds_layout(c)``)."""
    # col: MFMA column = this lane's query row in an M-tile; grp: its 16 tokens of the wave's 64
    tid, wave, lane, col, grp = lane_coords()
    seq, slot, kvh, mgrp, part, listed, live = workgroup_work(c, work_list)
    q_rs, k_rs, v_rs, bt_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables))
    ctx = scalar_load(context_lengths, seq)
    lds = fx.SharedAllocator().allocate(Shared).peek()
    shared = fx.recast_iter(fx.Uint8, lds.shared.ptr)
    rows = query_rows(mgrp, col, c.MT, c.ROWS, c.QL, c.G)
    if const_expr(c.RAGGED):  # from here on c.QN, c.Q0, c.LIVE are this sequence's
        c, rows, live = ragged_rows(c, query_start_loc, seq, rows, live)
    k_scale, v_scale = tensor_scales(c, key_scale, value_scale)
    last_page, t_start, t_end = tile_range(ctx, part, c.BS, c.QN, c.W, c.NP, listed)
    if const_expr(c.RAGGED):
        t_end = fx.Int32(select(c.QN > 0, t_end, t_start))  # no queries: no K or V is loaded
    # the first tile's page ids go out before the query is staged: their wait overlaps Q's
    pages, wp, first_pages = page_readers(c, bt_rs, k_rs, v_rs, seq, max_blocks, last_page, kvh,
                                          num_kv_heads, wave, lane, col, grp, t_start)
    stage_query(c, shared, rows, q_rs, seq, kvh, q_stride_row, q_stride_head, wave, lane, grp,
                live)
    c_qk, c_cap = score_factors(c, shared, lane, scale_log2, k_scale)
    # causal bound of each row: query qi sits at ctx - QN + qi and sees tokens <= it
    hi1 = [ctx - (c.QN - 1) + rows[m][1] for m in range_constexpr(c.MT)]
    k = types.SimpleNamespace(shared=shared, lane=lane, col=col, wave=wave, grp=grp, seq=seq,
                              slot=slot, kvh=kvh, ctx=ctx, c_qk=c_qk, hi1=hi1, c_cap=c_cap,
                              sinks_rs=rsrc(sinks) if const_expr(c.SINKS) else None)
    if const_expr(c.per_token):
        per_token_slots(k, lds, key_scale, value_scale, wave)
    # unsplit, pmax is the log-sum-exp out (c.LSE)
    outputs = (out, pmax) if const_expr(not c.SPLIT) else (pout, pmax, psum)
    if const_expr(c.WIDE):  # P·V split by head_dim (chapter 06)
        k.stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
        k.pslab = fx.recast_iter(fx.Uint8, lds.pslab.ptr)
        res = wide_loop(c, k, wp, t_start, t_end, first_pages)
        wide_merge_and_write(c, k, res, rows, v_scale, outputs, part, num_kv_heads)
        return
    res = resident_loop(c, k, pages, t_start, t_end, first_pages)  # the appendix's baseline
    merge_and_write(c, lds, shared, res, rows, v_scale, outputs, slot, kvh, part, num_kv_heads,
                    wave, lane, col, grp, k.sinks_rs)


# %% [markdown]
# `build_launcher` caches one launcher per specialization. With `num_partitions` > 1 (the split
# of flash-decoding; chapter 07 merges the partitions), workgroup z handles tiles
# `[z·tpp, min((z+1)·tpp, num_tiles))`, `tpp = ceil(num_tiles / num_partitions)`. It writes
# partials instead of `out`:
#
# * `pmax`, `psum`: `[num_seqs, num_kv_heads, num_partitions, rows]` float32, the partition's row
#   max of `softmax_scale · q·k` in natural-log units and `Σ exp(score − pmax)`;
# * `pout`: `[..., rows, head_dim]` float32, the partition's *normalized* output `Σ p·v / Σ p`,
#   V scales applied.
#
# The loop keeps the max in log2 units; `write_rows` divides it by `log2 e` on the way out.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(arch, block_size, head_dim, group, query_length, q_dtype="f16", per_token=False,
                   trans_v=True, sliding_window=0, num_partitions=1, m_tiles=None, work_list=False,
                   sinks=False, soft_cap=0.0, lse=False, ragged=False):
    """The ``@flyc.jit`` launcher for one specialization (every argument is a compile-time constant;
    the partials of a split are described above; ``work_list``: chapter 6's balanced split;
    ``sinks``, ``soft_cap``, ``lse``: chapter 08's serving math; ``ragged``: rows from a trailing
    ``query_start_loc``, ``query_length`` their bound)."""
    c = Spec(arch, block_size, head_dim, group, query_length, q_dtype, per_token, trans_v,
             sliding_window, num_partitions, m_tiles, work_list, sinks, soft_cap, lse, ragged)
    # launch(out, pmax, psum, pout, query, ..., value_scale, num_seqs, num_kv_heads, ...,
    #        scale_log2, stream)
    return jit_launcher(make_kernel(c), grid_yz=lambda a: (a["num_kv_heads"] * c.MG, c.NP))


# %% [markdown]
# ## Entry points and validation
#
# `paged_decode` validates every argument (a TypeError or ValueError naming it) before anything
# is compiled, infers `query_length` from `query.shape[0] / num_seqs` unless given, and picks the
# V layout from its rank and the scale kind from its shape. `paged_decode_partials` is the
# split-K half that chapter 07 uses.

# %% tags=["export"]
def kernel_args(p, first, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, sinks=None, query_start_loc=None):
    """The launcher's arguments for a validated problem ``p``: ``first`` is ``(out, pmax, psum,
    pout)`` (the unsplit kernel writes only ``out``; a split writes only the partials). The work
    list's place holds ``context_lengths`` again: only chapter 07's balanced split reads one; the
    sinks' place (chapter 08) holds ``key_scale`` when there are none: only ``p.sinks`` reads it.
    A ragged problem's ``query_start_loc`` goes last."""
    return tuple(first) + (
        query, key_cache.view(torch.uint8), value_cache.view(torch.uint8), block_tables,
        context_lengths, context_lengths, key_scale, value_scale, p.num_seqs, p.num_kv_heads,
        p.max_blocks, query.stride(0), query.stride(1), p.scale_log2,
        key_scale if sinks is None else sinks,
    ) + ((query_start_loc,) if p.ragged else ())


def check_partial_offsets(p, slots, m_tiles=None, *, split=""):
    """Refuse a split whose partial outputs (``slots`` per KV head, each ``rows x head_dim``
    float32) reach past the kernel's 32-bit byte offsets. ``split`` names it in the error."""
    rows = plan(p.head_dim, p.group, p.query_length, m_tiles)[0]
    if slots * p.num_kv_heads * rows * p.head_dim * 4 >= 2**31:
        what = split or f"{slots} partial slots"
        raise ValueError(f"num_partitions: {what} needs partial outputs beyond the kernel's 32-bit "
                         "byte offsets; use fewer partitions")
    return rows


def partial_shapes(p, num_partitions, m_tiles=None):
    """Shapes of ``(pmax, psum, pout)`` for a split into ``num_partitions``; a split whose byte
    offsets would not fit the kernel's 32 bits is refused."""
    rows = check_partial_offsets(p, p.num_seqs * num_partitions, m_tiles,
                                 split=f"{num_partitions} partitions of {p.num_seqs} sequences")
    stats = (p.num_seqs, p.num_kv_heads, num_partitions, rows)
    return stats, stats, stats + (p.head_dim,)


# %% tags=["export"]
def _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
              softmax_scale, query_length, sliding_window, arch, num_partitions, m_tiles,
              query_start_loc=None):
    problem.int_option(num_partitions, "num_partitions", 1, LIMITS.max_partitions)
    if m_tiles is not None:
        problem.int_option(m_tiles, "m_tiles", 1, LIMITS.max_m_tiles)
    return problem.describe(query, key_cache, value_cache, block_tables, context_lengths,
                            key_scale, value_scale, limits=LIMITS, softmax_scale=softmax_scale,
                            query_length=query_length, sliding_window=sliding_window, arch=arch,
                            query_start_loc=query_start_loc)


def launcher_for(p, num_partitions=1, m_tiles=None, work_list=False):
    """The compiled-once launcher for a validated problem (a split's partial kernel is the same
    with or without sinks and the log-sum-exp: the reduce adds them)."""
    unsplit = num_partitions == 1 and not work_list
    return build_launcher(p.arch, p.block_size, p.head_dim, p.group, p.query_length, p.q_dtype,
                          p.per_token, p.v_layout == "trans_blocked", p.sliding_window,
                          num_partitions, m_tiles, work_list, p.sinks and unsplit, p.soft_cap,
                          p.lse and unsplit, p.ragged)


# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *, softmax_scale=None, query_length=None, sliding_window=0, out=None,
                arch=None, num_partitions=1, m_tiles=None, query_start_loc=None):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel,
    ``pa_tile.toolchain.compile_isa(launcher, *args, arch=arch)`` shows its assembly. With
    ``num_partitions`` > 1 the partial buffers are ``args[1:4]`` and ``out`` is unused."""
    p = _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                  value_scale, softmax_scale, query_length, sliding_window, arch, num_partitions,
                  m_tiles, query_start_loc)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    if num_partitions > 1:
        shapes = partial_shapes(p, num_partitions, m_tiles)
        first = (torch.empty(1, dtype=query.dtype, device=query.device),) + tuple(
            torch.empty(s, dtype=torch.float32, device=query.device) for s in shapes)
    else:
        d = torch.empty(1, dtype=torch.float32, device=query.device)
        first = (problem.output(p, query, out), d, d, d)
    args = kernel_args(p, first, query, key_cache, value_cache, block_tables, context_lengths, ks,
                       vs, query_start_loc=query_start_loc)
    return launcher_for(p, num_partitions, m_tiles), args, p.arch


# %% tags=["export"]
def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *, softmax_scale=None, query_length=None, sliding_window=0, out=None,
                 arch=None, m_tiles=None):
    """fp8 paged decode attention with MTP and GQA; returns ``out`` (shaped and typed like
    ``query``).

    ``query`` [num_seqs·query_length, num_q_heads, 64|128|256] f16/bf16 (row
    ``s·query_length + i`` is query ``i`` of sequence ``s``; rows and heads may be strided);
    ``key_cache`` blocked
    [num_blocks, num_kv_heads, head_dim//16, block_size, 16]; ``value_cache`` trans-blocked
    [num_blocks, num_kv_heads, block_size//16, head_dim, 16] or plain [num_blocks, num_kv_heads,
    head_dim, block_size]; fp8 e4m3 of the arch (or uint8 codes); ``block_tables`` [num_seqs,
    max_blocks] int32; ``context_lengths`` [num_seqs] int32 (query_length .. max_blocks·block_size);
    float32 scales (> 0), both [1] or both [num_blocks, num_kv_heads, block_size]; ``query_length``
    defaults to rows / num_seqs; ``sliding_window`` as in ``pa_tile.reference`` (0: none);
    ``m_tiles`` caps the 16-row M-tiles per workgroup (default: all of them, so K and V are read
    once; P·V is split by head_dim across the waves).
    Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale, value_scale,
                                       softmax_scale=softmax_scale, query_length=query_length,
                                       sliding_window=sliding_window, out=out, arch=arch,
                                       m_tiles=m_tiles)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def paged_decode_partials(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                          value_scale, *, num_partitions, softmax_scale=None, query_length=None,
                          sliding_window=0, arch=None, m_tiles=None):
    """The split-K half of chapter 07: ``(pmax, psum, pout)`` of each of ``num_partitions``
    partitions (layouts and empty-partition values: the notes before ``build_launcher``)."""
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale, value_scale,
                                       softmax_scale=softmax_scale, query_length=query_length,
                                       sliding_window=sliding_window, arch=arch,
                                       num_partitions=num_partitions, m_tiles=m_tiles)
    launching.launch(launcher, args, arch=arch)
    return args[1], args[2], args[3]


# %% [markdown]
# ## Does it work?
#
# Chapter 05 checks the kernel across its scope. Here, the cells of this notebook, run as they
# stand, on two shapes per arch: four M-tiles with per-token scales, and head_dim 256.

# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %%
def make(arch, bs, hd, g, ql, scales="per-tensor", contexts=cache.RAGGED_CONTEXTS, device=None):
    """A case on ``device`` (default: where kernels run here; "cpu" for compile-only cells)."""
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g, 1, hd, bs, ctx, query_length=ql,
                           fp8_format=fp8_format(arch), scales=scales, query_dtype=torch.bfloat16,
                           seed=1, pad_block_id=-1, device=device)


def inputs(case):
    return (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables,
            case.context_lengths, case.k_scale, case.v_scale)

# %% tags=["nbval-ignore-output"]
checks = []  # both arches here; one on a GPU
for arch in backend.runnable_archs():
    for bs, hd, g, ql, sc in ((16, 128, 16, 4, "per-token"), (64, 256, 8, 2, "per-tensor")):
        case = make(arch, bs, hd, g, ql, sc)
        ok, of_bound, _ = case.check(paged_decode(*inputs(case), arch=arch).cpu())
        checks.append(dict(arch=arch, block=bs, head_dim=hd, group=g, query_len=ql, scales=sc,
                           of_bound=round(of_bound, 2), ok=ok))
print(format_table(checks))
assert all(r["ok"] for r in checks)

# %% [markdown]
# A partition that sees no token of a row writes `psum = 0`, `pout = 0` and a finite stand-in for
# −inf as `pmax`. A window of one token on a 600-token context, split in two: the first
# partition's tiles all lie before the window.

# %%
case = make(backend.default_arch(), 16, 128, 8, 1, contexts=[600])
pmax, psum, pout = paged_decode_partials(*inputs(case), num_partitions=2, sliding_window=1)
empty = float(pmax[0, 0, 0, 0])
assert empty == float(torch.tensor(MASKED / LOG2E, dtype=torch.float32))
assert float(psum[0, 0, 0].abs().max()) == 0 and float(pout[0, 0, 0].abs().max()) == 0
show.md(f"""The empty partition's `pmax` is {empty:.4g}: `MASKED / log2 e` = `MASKED · ln 2`,
    the loop's initial max (`MASKED` = {MASKED:.0e}) converted to natural-log units like any
    other row max.""")

# %% [markdown]
# ## Registers, waves and LDS
#
# Compiled for gfx942 (block 16, bf16 query, trans-blocked V, `query_length` 4, group 16 = four
# M-tiles), with one, two or four M-tiles per workgroup:

# %%
def compiled(arch, bs, hd, g, ql, scales="per-tensor", m_tiles=None):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = make(arch, bs, hd, g, ql, scales, contexts=[20], device="cpu")
    launcher, args, arch = launch_args(*inputs(case), m_tiles=m_tiles, arch=arch)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))


reg_rows = []
for hd in (64, 128, 256):
    for mt in (1, 2, 4):
        st = compiled("gfx942", 16, hd, 16, 4, m_tiles=mt)
        assert st.scratch_bytes == 0
        reg_rows.append(dict(head_dim=hd, m_tiles_per_wg=mt,
                             workgroups_per_kv_head=plan(hd, 16, 4, mt)[3], vgpr=st.vgpr_unified,
                             waves=isa.occupancy(st, "gfx942").waves_per_simd, lds=st.lds_bytes,
                             barriers_in_loop=st.main_loop.families.get("barrier", 0)))
print(format_table(reg_rows))

# %%
four = {r["head_dim"]: r for r in reg_rows if r["m_tiles_per_wg"] == 4}
show.md(f"""
    Four M-tiles in one workgroup take {four[128]['vgpr']} registers at head_dim 128
    ({four[128]['waves']:.0f} waves per SIMD) and {four[64]['vgpr']} at 64
    ({four[64]['waves']:.0f} waves). The
    barriers in the loop are `2 · MT`. The P slab costs LDS, within upstream's figures (next).
    The register-resident loop needs far more past two M-tiles:
    [the appendix](appendix_register_resident_loop.ipynb) compiles both.""")

# %% [markdown]
# ## Against upstream's tile kernel
#
# FlyDSL's `pa_decode_tile` is the yardstick (chapter 00). Its recorded figures
# (`pa_tile/data/upstream_pa_decode_tile_isa.md`, read by `pa_tile.upstream`; bf16 query,
# trans-blocked V, one partition) beside this kernel's default plan, for gfx942
# (`tests/test_stage5.py` checks both arches). The figure shows each configuration's margin; the
# table, the configurations with block 16, group 16 and per-tensor scales.

# %%
# (block, head_dim, query_length, group, per_token) -> (VGPR+AGPR, waves/SIMD, LDS), upstream
UP942 = {
    (r["block"], r["head_dim"], r["query_len"], r["group"], int(r["per_token"])): (r["vgpr"],
                                                                                   r["occ"],
                                                                                   r["lds"])
    for r in upstream.tile_isa_figures() if r["arch"] == "gfx942"
}
up_rows = []
for (bs, hd, ql, g, tok), (uv, uo, ul) in tqdm(UP942.items(), desc="compile"):
    st = compiled("gfx942", bs, hd, g, ql, "per-token" if tok else "per-tensor")
    occ = isa.occupancy(st, "gfx942").waves_per_simd
    up_rows.append(dict(block=bs, head_dim=hd, query_len=ql, group=g,
                        scales="token" if tok else "tensor", vgpr=st.vgpr_unified,
                        upstream_vgpr=uv, waves=occ, upstream_waves=uo, lds=st.lds_bytes,
                        upstream_lds=ul, spill=st.vgpr_spill + st.scratch_bytes,
                        meets="yes" if st.vgpr_unified <= uv and occ >= uo and st.lds_bytes <= ul
                        else "NO"))
figures.upstream_margins(up_rows, [("VGPR+AGPR", "vgpr", "upstream_vgpr", False),
                                   ("waves/SIMD", "waves", "upstream_waves", True),
                                   ("LDS bytes", "lds", "upstream_lds", False)], marker="block",
                         title="This kernel against upstream's pa_decode_tile, gfx942: each "
                               "configuration's margin")
plt.show()
SHORT = dict(block="block", head_dim="hd", query_len="ql", group="group", vgpr="vgpr",
             upstream_vgpr="up_vgpr", waves="waves", upstream_waves="up_waves", lds="lds",
             upstream_lds="up_lds", meets="meets")
print(format_table([{v: r[k] for k, v in SHORT.items()} for r in up_rows
                    if (r["block"], r["group"], r["scales"]) == (16, 16, "tensor")]))
print(sum(r["meets"] == "yes" for r in up_rows), "of", len(up_rows), "meet or beat upstream",
      f"(ROCm/FlyDSL {upstream.UPSTREAM_COMMIT[:8]}, compiled here with flydsl "
      f"{upstream.FLYDSL_VERSION})")
assert all(r["meets"] == "yes" and r["spill"] == 0 for r in up_rows)

# %% [markdown]
# Like for like: with four M-tiles (`query_length` 4, group 16) both kernels keep all four in one
# workgroup, read K and V once, and split P·V by head_dim.
#
# ## head_dim 256
#
# Nothing in the kernel is specific to head_dim 128. A K row is `head_dim/64` pairs of 16-channel
# chunks per lane, V `head_dim/16` d-chunks, and each wave stores `head_dim/64` chunks of every
# row. The default plan, gfx942, bf16 query:

# %%
hd_rows = []
for bs in (16, 64):
    for ql, g in ((1, 8), (4, 16)):
        for sc in ("per-tensor", "per-token"):
            row = dict(block=bs, query_len=ql, group=g, scales=sc[4:])
            for hd in (128, 256):
                st = compiled("gfx942", bs, hd, g, ql, sc)
                row[f"vgpr_{hd}"] = st.vgpr_unified
                row[f"waves_{hd}"] = isa.occupancy(st, "gfx942").waves_per_simd
                row[f"lds_{hd}"] = st.lds_bytes
                assert st.vgpr_spill == 0 and st.scratch_bytes == 0
            hd_rows.append(row)
print(format_table(hd_rows))

# %%
one_mt = [r for r in hd_rows if r["query_len"] == 1]
four_mt = [r for r in hd_rows if r["query_len"] == 4]
up256 = [r for r in up_rows if r["head_dim"] == 256]


def span(rows, key, fmt="{}"):
    lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


show.md(f"""
    K and V double per lane (one at a time) and so does the wave's quarter of `O`. With one
    M-tile the peak is {span(one_mt, 'vgpr_256')} registers:
    {span(one_mt, 'waves_256', '{:.0f}')} waves per SIMD, no spill, {span(one_mt, 'lds_256')} bytes
    of LDS. Four M-tiles take {span(four_mt, 'vgpr_256')} registers,
    {span(four_mt, 'waves_256', '{:.0f}')} wave per SIMD, with K and V read once. Upstream at
    head_dim 256: {span(up256, 'upstream_vgpr')} registers,
    {span(up256, 'upstream_waves', '{:.0f}')} waves per SIMD.""")

# %% [markdown]
# ## What it compiles to, against chapter 02
#
# The same problem for both (block 16, head_dim 128, group 8, one query token, f16, per-tensor):
# chapter 02 with its plain layouts, this stage with blocked K and trans-blocked V.

# %%
from pa_tile.stages import s2_register_softmax as s2  # noqa: E402

# compile only
case = cache.make_case(1, 8, 1, 128, 16, 20, fp8_format=fp8_format("gfx942"), device="cpu")
l2, a2, _ = s2.launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables,
                           case.context_lengths, case.k_scale, case.v_scale, arch="gfx942")
st2 = isa.IsaStats.from_asm(toolchain.compile_isa(l2, *a2, arch="gfx942"))
l5, a5, _ = launch_args(*inputs(case), arch="gfx942")
st5 = isa.IsaStats.from_asm(toolchain.compile_isa(l5, *a5, arch="gfx942"))
# rows that changed
print(isa.diff(st2, st5, labels=("stage 2", "stage 5"), mnemonics=False, compact=True))

# %%
show.md(f"""
    {st2.vgpr_unified - st5.vgpr_unified} registers fewer and {st2.lds_bytes - st5.lds_bytes}
    bytes less LDS, for {st5.main_loop_instructions - st2.main_loop_instructions} more
    instructions in the loop: the mask compares (only on boundary tiles, behind a branch), the
    staged Q read from LDS (which took Q's registers out of the loop), and the head_dim split's
    sharing: the row max to the table and back, P to the slab and four spans' P back, two
    barriers, and the V page ids of every span. The global K and V loads and the P·V MFMAs are
    as many as chapter 02's; only which wave does which changes. After the loop only the row
    sums are merged: {st5.families.get('barrier', 0)} barriers in the kernel against stage 2's
    {st2.families.get('barrier', 0)}.""")

# %% [markdown]
# ## One tile's memory accesses
#
# One sequence of exactly one tile (256 tokens), block 16, head_dim 128, `query_length` 2, group 8
# (one M-tile), per-token scales, gfx942, traced by the emulator. One row per kind of access,
# before, in and after the loop, its figures per execution (one wave instruction). Global
# accesses are counted in the 128-byte lines both targets fetch (CDNA3 / CDNA4 white papers).

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

grouped = []
if backend.current_backend() == "emu":
    case = make("gfx942", 16, 128, 8, 2, "per-token", contexts=[256])
    trace = Trace("gfx942")
    with emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace):
        paged_decode(*inputs(case), arch="gfx942")
    phases = isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)
    grouped = trace.grouped_summary(phases=phases, merge_scalar=True)
    print(format_table([dict(phase=r["phase"], mnemonic=r["mnemonic"], lines=r["lines"],
                             execs=r["executions"], B_per_exec=r["bytes_per_exec"],
                             lines128=r.get("lines_128B_per_exec", ""),
                             min_lines128=r.get("min_lines_128B_per_exec", ""),
                             conflict=r.get("max_degree", ""), cycles=r.get("conflict_cycles", ""))
                        for r in grouped]))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% tags=["nbval-ignore-output"]
def access(phase, mnemonic, **kw):
    return [r for r in grouped if r.get("phase") == phase and r["mnemonic"] == mnemonic
            and all(r.get(k) == v for k, v in kw.items())]


if grouped:
    kv = access("loop", "buffer_load_dwordx4")
    few, many = sorted({r["lines_128B_per_exec"] for r in kv}), kv[0]["min_lines_128B_per_exec"]
    conflicts = "".join(  # one bullet per access, indented like the text below (show.md dedents)
        f"\n    * {r['phase']} `{r['mnemonic']}`: degree {r['max_degree']}, "
        f"{r['conflict_cycles']} cycles"
        for r in grouped if r["space"] == "lds" and r["max_degree"] > 1)
    text = f"""
    In the loop, K and V are {sum(r['lines'] for r in kv)} `buffer_load_dwordx4` per lane, in two
    groups of {kv[0]['lines']}. Each wave instruction moves {kv[0]['bytes_per_exec']} bytes, {many}
    128-byte lines' worth; one group touches {few[0]} lines, the other {few[-1]}. V's 16 lanes of
    a token group read 256 contiguous bytes: whole lines. Chapter 04's blocked K gives 4 lanes 64
    contiguous bytes per 256-byte chunk: half a line each, so K touches twice the lines of its
    bytes. The staged Q, the max table, the slab and the per-token scales are LDS traffic. LDS
    accesses with a bank conflict (gfx942's measured phase model; on gfx950 the emulator
    *assumes* writes are served as on gfx942, which no source states):
    {conflicts}"""
else:
    text = "(the trace is the emulator's: see the committed notebook)"
show.md(text)

# %% [markdown]
# The conflicted write is the max table's (and the row sums' after the loop): the 16 rows' words
# `4 · row + wave` fall on 8 of gfx942's 32 banks (CDNA3 ISA guide), two rows to a bank.

# %% [markdown]
# ## What you built
#
# ```text
# grid (sequence, KV head × M-group, partition); 4 waves; lane = (col: query row, grp: 16 tokens)
# prologue: first tile's page ids; query rows -> fp8 -> LDS (wave m % 4 stages M-tile m); s_barrier
# for tile t:
#     issue K (own 64 tokens), V (own d-chunks of all 4 spans, with K where registers allow),
#           per-token scales, next tile's K page and 4 V page ids
#     for each phase group of M-tiles:
#         phase A: s[m] = masked K · Q[m];  row max of s[m] -> LDS max table [m][row][wave]
#         s_barrier                                          # the 4 waves' maxes are in
#         phase B, for each M-tile m of the group:
#             m_new = max(m_old, 4 maxes);  P = fp8(exp2(s[m]·c_qk - m_new + log2 FP8_MAX))
#             P -> slab[wave][lane];  s_barrier               # every wave's P is in
#             for each own d-chunk j: O[m][j] = O[m][j]·exp2(m_old - m_new)
#                                            + sum over spans sp: V[sp][j] · slab[sp][lane]
#             s_barrier (before the next M-tile's P)
# after the loop: row sums of the 4 waves via LDS; s_barrier
#     each wave: O[m][own d-chunks] / sum -> out (query dtype) or split-K partials
# ```
#
# Its figures at block 16, head_dim 128, group 8, `query_length` 1, bf16 query, just below. After
# them, what the timing model (chapter 09) predicts for this stage against stage 4 at the shape
# every chapter ends with: a model, not a measurement. Both loops wait out one memory latency per
# tile (stage 4 by its K prefetch, this stage by issuing V with K), so they tie there. What M-tiles
# buy is not in that shape: stage 4 cannot run multi-token decode or groups beyond 16 at all.

# %%
st_final = compiled("gfx942", 16, 128, 8, 1)
st_final950 = compiled("gfx950", 16, 128, 8, 1)
show.measured({
    "VGPR+AGPR, gfx942 / gfx950": f"{st_final.vgpr_unified} / {st_final950.vgpr_unified}",
    "waves per SIMD, gfx942 / gfx950": f"{isa.occupancy(st_final, 'gfx942').waves_per_simd:.0f} / "
                                       f"{isa.occupancy(st_final950, 'gfx950').waves_per_simd:.0f}",
    "LDS bytes per workgroup": st_final.lds_bytes,
    "configurations meeting upstream's registers, waves and LDS (gfx942)":
        f"{sum(r['meets'] == 'yes' for r in up_rows)} of {len(up_rows)}",
})

# %% tags=["nbval-ignore-output"]
import textwrap  # noqa: E402

from pa_tile.perf import speedup  # noqa: E402

if backend.current_backend() == "emu":
    steps = speedup.predicted_steps("s5", "s4")
    notes = speedup.report("s5", "s4").splitlines()[len(steps) + 3:]  # the same predictions, cached
    print("PREDICTED by pa_tile.perf.model (a model, not a measurement)\nshape:", steps[0].shape)
    print(format_table([dict(GPU=st.gpu, s5_us=f"{st.us:.0f}", s4_us=f"{st.previous_us:.0f}",
                             s5_vs_s4=f"{st.speedup:.2f}x", bound=st.bound,
                             latencies_per_tile=f"{st.serial_latencies:.1f}") for st in steps]))
    print("\n".join(textwrap.fill(line, 100) for line in notes))
else:
    print(speedup.report("s5", "s4"))
