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
# # 05 · M-tiles, masks and the phase split
#
# **You'll learn**
#
# * how multi-token decode (MTP) and wide GQA become more query rows, tiled in 16-row M-tiles;
# * why one workgroup takes every M-tile of a KV head, so each K and V byte is read once;
# * the masks (causal, sliding window, context tail) and why a masked score is `-inf`;
# * the phase split: every M-tile's scores on K's registers, then every M-tile's P·V on V's.
#
# **You need** chapter 02 (the turned-around tile: scores `[token, row]`, P·V computed as V·P),
# chapter 04 (blocked K, trans-blocked V) and FlashAttention's online softmax.
#
# **Runs on** the CPU emulator (a few minutes) or a ROCm GPU (MI300 / MI355).

# %% [markdown]
# ## More query rows
#
# Chapter 02 decodes one query token for 8 or 16 heads per KV head: one 16-row MFMA tile.
# Serving breaks that in two ways.
#
# * **MTP / speculative decode** checks `query_length` = 1..8 draft tokens per sequence at once.
#   They are the last `query_length` positions of the sequence. Each is causally masked: query
#   `i` must not see the drafts after it.
# * **Wide GQA**: up to 128 query heads share one KV head (`group · query_length` <= 128 rows).
#
# Both add *query rows* that read the same K and V pages. The rows are flattened,
# `row = qi · group + head` (MTP position outer, head inner), and cut into 16-row **M-tiles**.
# An M-tile plays the role of Triton's `BLOCK_M`: a block of query rows that shares every K and V
# load. One workgroup carries every M-tile of a KV head, up to 8 (128 rows). Decode is bound by
# memory, and this way every K and V byte is read once for all of them.
#
# ## The loop that ships
#
# One tile of 256 tokens, all four waves, two M-tiles (MTP 2 × group 16):

# %%
import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, kernel_lib, show
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.progress import progress as tqdm

figures.head_dim_split_timeline(m_tiles=2, group=4, v_with_k=True)
plt.show()

# %% [markdown]
# Each wave issues its K loads at the top of the tile, its V loads with them wherever the
# registers allow (chapter 06), and the next tile's page ids. Then two phases, ordered by what
# they read:
#
# * **Phase A**, on K's registers: for each M-tile in turn, its scores and their row max.
# * One workgroup barrier: the four waves' row maxes meet.
# * **Phase B**, on V's registers: for each M-tile in turn, the exponentials, fp8 P and P·V.
#
# This chapter builds the rows, the M-tiles, the masks and phase A. Chapter 06 builds phase B:
# why P goes through LDS and why each wave computes P·V for a quarter of head_dim.
#
# **What this loop drops.** Chapter 03 carries the next tile's K in registers (the K prefetch),
# so a tile never waits for K. This loop does not: it issues K and V together at the top of the
# tile, so a tile waits for memory once, as with the prefetch, without holding a second tile's K
# (32 registers per lane at head_dim 128) through both phases. Here registers buy M-tiles. The
# seed kernel measured its own K prefetch on a GPU (FlyDSL PR #825, times quoted in the commit):

# %%
from pa_tile import seed_history  # noqa: E402

prefetch = {s["shape"]["batch"]: s["after_us"] / s["before_us"]
            for s in seed_history.steps("28a3bb1e")}
show.md(seed_history.table("28a3bb1e", "K prefetch added") + f"""

The prefetch bought {100 * (1 - prefetch[16]):.0f} % at batch 16 and cost
{100 * (prefetch[128] - 1):.0f} % at batch 128,
where other waves cover the latency anyway.""")

# %% [markdown]
# ## The module
#
# The chapter's code is `pa_tile.stages.s5_phase_split_mtp`. Its cells are split over two
# chapters: this one, then [chapter 06](06_head_dim_split_pv.ipynb), which finishes the kernel.
# Chapter 02's instruction-level helpers (buffer loads, the fp8 pack, the 16×16×32 MFMA, lane
# butterflies, LDS) come from `kernel_lib`. The kernel also keeps chapter 02's register-resident
# loop, off by default, as the baseline chapter 06 is measured against; its cells are in
# [the register-resident appendix](appendix_register_resident_loop.ipynb).

# %% tags=["export"]
"""Stage 5: multi-token (MTP) decode and wide GQA, by the phase split and the head_dim split of P·V.

Query rows flattened and tiled into 16-row M-tiles (causal mask, sliding window), K and V read once
per workgroup for all of them, P·V split across the waves by head_dim; blocked K, trans-blocked or
plain V, head_dim 64/128/256, per-token scales, and split-K partials (``num_partitions``) for stage
6's reduce. Taught in chapters 05 and 06; the register-resident loop it is measured against (off by
default, ``WIDE_ABOVE``) is in the appendix ``appendix_register_resident_loop``.
"""

import copy
import functools
import math
import operator
import types

import torch

import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max
from pa_tile.kernel_lib import (
    LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, buffer_load, buffer_store, device_code,
    exchange, exp2, exp_shift, fmax, i64, imax, imin, jit_launcher, lane_coords, lds_load,
    lds_store, mfma, pack_fp8, query_operands, rcp, rsrc, max4, row_max, row_reduce, scalar_load,
    scores, select, splat4, tree_sum, wave_reduce, zero_tail_v,
)
from pa_tile.serving_math import finish_row, soft_capped


# %% tags=["export"]
__all__ = ["paged_decode", "paged_decode_partials", "build_launcher", "launch_args", "kernel_args",
           "plan", "LIMITS", "K_LAYOUT", "V_LAYOUT", "PHASE_GROUP", "WIDE_ABOVE", "exchange_slots",
           "LanePages", "query_rows", "tile_range", "stage_scales", "phase_b", "store_stats",
           "merge_weights", "Spec", "stage_query", "score_factors", "lane_scales", "k_scaled",
           "phase_a", "write_rows", "merge_and_write", "WidePages", "wide_v", "wide_scores",
           "wide_v_max", "wide_v_weight", "wide_pv", "wide_loop", "wide_merge_and_write",
           "make_kernel", "partial_shapes", "check_partial_offsets", "v_with_k", "lds_layout",
           "workgroup_work", "page_readers", "per_token_slots", "resident_loop", "row_base",
           "PAST_QUERY", "ragged_rows"]

#: what the stage-5 kernel supports (upstream's tile kernel takes head_dim 64, 128 and 256 too)
LIMITS = problem.Limits(stage="s5", head_dims=(64, 128, 256), block_sizes=(16, 32, 64, 128),
                        groups=None, max_group=128, max_query_length=8,
                        query_dtypes=(torch.float16, torch.bfloat16), k_layouts=("blocked",),
                        v_layouts=("trans_blocked", "plain"), per_token_scales=True,
                        strided_query=True, sliding_window=True, max_partitions=64, max_m_tiles=8,
                        max_rows=8 * 16)  # a KV head's rows fill at most max_m_tiles M-tiles
K_LAYOUT = "k_blocked"  # pa_tile.cache layout names of the caches paged_decode reads
V_LAYOUT = "v_trans_blocked"  # (plain V is accepted too)
NINF = float("-inf")


# %% [markdown]
# ## Query rows and M-tiles
#
# The MFMA's output holds one query row in each of 16 columns, so 16 rows is the unit. `plan`
# keeps every M-tile of a KV head in one workgroup, up to 8. `m_tiles=` caps that; the extra
# M-tiles then go to more workgroups along grid y (`kv_heads × m_groups`), and each of those
# reads the KV head's K and V again.

# %% tags=["export"]
def plan(head_dim, group, query_length, m_tiles=None):
    """``(rows, m_tiles_total, m_tiles_per_workgroup, m_groups)`` for a problem shape.

    A workgroup takes at most ``m_tiles`` M-tiles (default: all of them, up to
    ``LIMITS.max_m_tiles``) and reads K and V once for all of them; more M-tiles go to more
    workgroups along grid y, and each of those reads the KV head's K and V again.
    """
    rows = query_length * group
    total = -(-rows // 16)
    cap = LIMITS.max_m_tiles if m_tiles is None else m_tiles
    groups = -(-total // cap)
    per_wg = -(-total // groups)  # spread evenly: 3 M-tiles -> 2 + 2 (one padding tile), not 2 + 1
    return rows, total, per_wg, groups


# %%
print(format_table([dict(query_length=ql, group=g, rows=p[0], m_tiles=p[1], per_workgroup=p[2],
                         workgroups_per_kv_head=p[3])
                    for ql, g in ((1, 8), (1, 16), (4, 8), (4, 16), (3, 32), (4, 32))
                    for p in [plan(128, g, ql)]]))

# %% [markdown]
# What an M-tile costs, per lane, for the whole loop: its share of the output (`head_dim/16`
# registers once chapter 06 splits P·V), 4 registers of packed P, and its running max, sum and
# score factor. Its 16 scores live only from phase A to its exponentials in phase B. So an extra
# M-tile costs its share of the output and a handful of registers more.
#
# Each lane finds its row from its MFMA column `col`: row `m·16 + col` of the flattened axis,
# MTP position `qi = row // group`, head `row % group`. The division is `query_length − 1`
# compares, so `group` need not be a power of two. Padding rows past `query_length · group` read
# the last real row, quantize to zeros, and are never stored.

# %% tags=["export"]
def query_rows(mgrp, col, mt, rows_total, ql, group):
    """``(r, qi, g)`` per M-tile: the lane's flattened row (MTP position outer, head inner), its
    position and head; padding rows past ``rows_total`` read the last real one."""
    rows = []
    for m in range_constexpr(mt):
        r = (mgrp * mt + m) * 16 + col
        rc = imin(r, rows_total - 1)  # padding rows read a real row, quantized to zeros
        qi = fx.Int32(0)
        for k in range_constexpr(1, ql):  # rc // G without a division (G need not be a power of 2)
            qi = qi + fx.Int32(select(rc >= k * group, fx.Int32(1), fx.Int32(0)))
        rows.append((r, qi, rc - qi * group))
    return rows


# %% [markdown]
# ## The query, once per workgroup
#
# Every wave needs every M-tile's query operands, but no query byte should be fetched twice.
# Wave `m % 4` loads and quantizes M-tile `m`, then writes its fp8 operands and the row's scale
# to LDS. After one `s_barrier`, every wave reads them back in each tile, right before its score
# MFMAs: one `ds_read_b128` per 64 channels, lane-contiguous, so conflict free. Q stays out of
# the loop's registers.
#
# A row's address comes from two strides, so any row and head strides work (channels must be
# contiguous). The row is quantized to fp8 by its own amax, as in chapter 02. That is
# `kernel_lib.query_operands`:

# %%
show.source(kernel_lib.query_operands)

# %% [markdown]
# The staging, and the reads back. `device_code` (from `kernel_lib`) lets a helper branch on a
# device value (`wave == m % 4`) the way a kernel body does.

# %% tags=["export"]
def _stage_q(shared, m, lane, ops, q_scale, nh, scales_at):
    for k in range_constexpr(nh):
        pair = fx.Vector.from_elements([ops[2 * k], ops[2 * k + 1]], dtype=fx.Int64)
        lds_store(shared, ((m * nh + k) * WAVE + lane) * 16, pair.bitcast(fx.Float32))
    lds_store(shared, scales_at + (m * WAVE + lane) * 4,
              fx.Vector.from_elements([q_scale], dtype=fx.Float32))


def _staged_q(shared, m, lane, nh):
    ops = []
    for k in range_constexpr(nh):
        pair = lds_load(shared, ((m * nh + k) * WAVE + lane) * 16, 4).bitcast(fx.Int64)
        ops.extend([pair[0], pair[1]])
    return ops


def _staged_q_scale(shared, m, lane, scales_at):
    return fx.Float32(lds_load(shared, scales_at + (m * WAVE + lane) * 4, 1)[0])


# %% tags=["export"]
@device_code
def stage_query(c, shared, rows, q_rs, seq, kvh, q_stride_row, q_stride_head, wave, lane, grp,
                live=None):
    """Each M-tile's query rows to LDS (``live`` False: a work list's empty entry, which walks no
    tile and reads no query)."""
    for m in range_constexpr(c.MT):
        if wave == m % WAVES:
            if const_expr(live is None):
                _stage_rows(c, shared, rows[m], m, q_rs, seq, kvh, q_stride_row, q_stride_head,
                            lane, grp)
            else:
                if live:
                    _stage_rows(c, shared, rows[m], m, q_rs, seq, kvh, q_stride_row, q_stride_head,
                                lane, grp)
    gpu.barrier()


def _stage_rows(c, shared, row, m, q_rs, seq, kvh, q_stride_row, q_stride_head, lane, grp):
    r, qi, g = row
    row_elem = (row_base(c, seq) + qi) * q_stride_row + (kvh * c.G + g) * q_stride_head
    if const_expr(c.RAGGED):
        # a padding row loads nothing: 2^30 elements is a byte offset past every query buffer
        # (``describe`` keeps them under 2^31 bytes), where a buffer load returns 0
        row_elem = fx.Int32(select(r < c.LIVE, row_elem, fx.Int32(PAST_QUERY)))
    ops, q_scale = query_operands(q_rs, row_elem, r < c.LIVE, c.FMAX, grp, c.NH, c.QDT)
    _stage_q(shared, m, lane, ops, q_scale, c.NH, c.Q_SCALES)


# %% [markdown]
# After the barrier each M-tile's staged scale goes into its score factor `c_qk`, which turns raw
# scores into log2 units (`softmax_scale · log2 e` folded in, so the softmax uses `exp2`, as
# FlashAttention and Triton kernels do). A per-token K scale varies along the tile, so it cannot
# be in `c_qk`; `k_scaled` multiplies the lane's 16 scores by their tokens' scales instead.

# %% tags=["export"]
def score_factors(c, shared, lane, scale_log2, k_scale):
    """Each M-tile's factor from raw scores to log2 units: its query scale times the K scale (per
    tensor; per token the K scale is applied token by token) times ``softmax_scale·log2 e``.
    Returns ``(c_qk, c_cap)``: with a soft-cap (chapter 08) the factors go to the cap
    (``c_cap``), whose scores come out in log2 units, and ``c_qk`` is 1; else ``c_cap`` is None."""
    c_qk = []
    for m in range_constexpr(c.MT):
        q_scale = _staged_q_scale(shared, m, lane, c.Q_SCALES)
        c_qk.append(q_scale * scale_log2 if const_expr(c.per_token)
                    else q_scale * k_scale * scale_log2)
    if const_expr(c.CAP > 0):
        return [fx.Float32(1.0)] * c.MT, c_qk
    return c_qk, None


def lane_scales(sc_lds, base, grp, q):
    """4 of the 16 per-token values of the lane's row band (lane-tokens 4q..4q+3): a broadcast
    read."""
    return lds_load(sc_lds, base + grp * 64 + 16 * q, 4)


def k_scaled(s, sc_lds, sc_k, grp, fenced):
    """The lane's 16 scores ``s`` (a list, scaled in place) times their per-token K scales, read 4
    at a time; ``fenced``: a ``sched_barrier`` before each read, so the 16 scales are never all
    live at once (the register-resident loop has V in flight here)."""
    for q in range_constexpr(4):
        if const_expr(fenced):
            fx.rocdl.sched_barrier(0)
        k4 = lane_scales(sc_lds, sc_k, grp, q)
        for i in range_constexpr(4):
            s[4 * q + i] = s[4 * q + i] * fx.Float32(k4[i])
    return s


# %% [markdown]
# ## Masks: causal, window, tail
#
# Row `qi` sits at position `pos = ctx − query_length + qi`. It sees tokens `pos − W < t ≤ pos`
# (`W = sliding_window`; 0 means no window; the convention of `pa_tile.reference`). A lane holds
# 16 consecutive tokens of one row, so each bound is one integer per lane and M-tile, compared
# against the constants 0..15.
#
# **Only boundary tiles pay for the mask**, as in FlashAttention's and Triton's causal kernels.
# Without a window, a tile needs the mask only if it holds a causally hidden token or one past
# the context: one tile at `query_length` 1, at most two otherwise. The kernel branches on the
# tile index (the same for the whole wave), so full tiles run the unmasked code. With a window
# every tile is masked, and tiles wholly before the earliest row's window are never loaded
# (`tile_range`).

# %% tags=["export"]
def tile_range(ctx, part, block_size, ql, window, num_partitions, listed=None):
    """``(last_page, t_start, t_end)``: the sequence's last page and this workgroup's tiles
    (``listed``: the ``(t_start, t_end)`` a work list gave it, kept inside the sequence)."""
    last_page = (ctx - 1) // block_size
    num_tiles = (ctx + (TILE - 1)) // TILE
    first = 0
    if const_expr(window > 0):
        # tiles wholly before every row's window are skipped
        first = imax(ctx - (ql - 1) - window, 0) // TILE
    if const_expr(listed is not None):
        return last_page, imax(listed[0], first), imin(listed[1], num_tiles)
    if const_expr(num_partitions > 1):
        tpp = (num_tiles + (num_partitions - 1)) // num_partitions
        return last_page, imax(part * tpp, first), imin(part * tpp + tpp, num_tiles)
    return last_page, fx.Int32(first), num_tiles


# %% [markdown]
# **The value a masked score gets matters.** The running max starts at `MASKED = −1e30`: finite,
# so `MASKED − MASKED = 0`, never NaN. Suppose masked scores were `MASKED` too. A wave whose 64
# tokens are all hidden from a row would get `m_new = MASKED` and `p = exp2(0) = 1` for every
# hidden token: full-weight garbage. MTP and windows make such spans common. So masked scores are
# `−inf`: `exp2(−inf − m) = 0` for any finite `m`, and `max(MASKED, −inf) = MASKED` keeps the
# running max finite. The pitfall in four lines of torch:

# %%
m_run = torch.tensor(-1e30)
for masked_value in (-1e30, float("-inf")):
    s = torch.full((16,), masked_value)
    m_new = torch.maximum(m_run, s.max())
    total = torch.exp2(s - m_new).sum().item()
    print(f"masked = {masked_value:>7}: m_new = {m_new.item():.0e}, sum of p = {total}")

# %% tags=["export"]
def _mask_scores(s_all, n_hi, n_lo, mt):
    """Scores of tokens a row may not see -> -inf. ``s_all[16m + i]`` is lane-token ``i`` of
    M-tile ``m``; row ``m`` sees lane-tokens ``n_lo[m] <= i < n_hi[m]`` (``n_lo`` None: no
    lower bound). -inf, not MASKED: exp2(-inf - m) is 0 even when m is still MASKED."""
    ninf = fx.Float32(NINF)
    out = []
    for m in range_constexpr(mt):
        for i in range_constexpr(16):
            keep = n_hi[m] > i
            if const_expr(n_lo is not None):
                keep = keep & (n_lo[m] <= i)
            out.append(fx.Float32(select(keep, fx.Float32(s_all[16 * m + i]), ninf)))
    return fx.Vector.from_elements(out, dtype=fx.Float32)


# %% [markdown]
# `masked_scores` applies it to one M-tile, behind the tile-index branch. V bytes past the
# context are zeroed as well: a page's unused slots may hold NaN codes, and `0 · NaN` is NaN
# inside the MFMA.

# %% tags=["export"]
@device_code
def masked_scores(c, s, m, t, tok, ctx, hi1, v_words, zero_v, c_cap=None):
    """M-tile ``m``'s scores ``s`` with the tokens its row may not see at -inf, and ``v_words``
    with the bytes of tokens past the context zeroed if ``zero_v`` (the V just loaded; else passed
    through): ``(s, v_words)``. Without a window only tiles holding a causally hidden or absent
    token pay for the mask (a branch). With a soft-cap (``c.CAP``, chapter 08) every score is
    capped first, from its factor ``c_cap`` to log2 units; the scores are then in log2 units."""
    if const_expr(c.CAP > 0):
        s = fx.Vector.from_elements(soft_capped([s[i] for i in range_constexpr(16)], c_cap, c.CAP),
                                    dtype=fx.Float32)
    if const_expr(c.W > 0):
        s = _mask_scores(s, [hi1[m] - tok], [hi1[m] - c.W - tok], 1)
    else:
        if t * TILE + TILE > ctx - c.QL + 1:
            s = _mask_scores(s, [hi1[m] - tok], None, 1)
            if const_expr(zero_v):
                v_words = zero_tail_v(v_words, ctx - tok)
    return s, v_words


# %% [markdown]
# **Per-token scales.** Each lane loads one K and one V scale per tile (token `lane` of the
# wave's 64) and writes them to a wave-private LDS slot; a lane reads its row band's 16 back,
# four at a time, where they are used. No barrier: only the wave touches its slot, and a wave's
# LDS operations complete in order. V scales vary along the contracted axis, so they cannot be
# applied after P·V. P is multiplied by `v_scale[t] / vmax` before the fp8 pack (keeping
# `P ≤ FP8_MAX`) and the tile's P·V by `vmax`. Tokens no row sees enter `vmax` as 0: a cache
# tail's finite scales would otherwise shrink every real token's weight, and with it P before its
# e4m3 rounding.

# %% tags=["export"]
def live_v_scale(v_sc1, t, wave, lane, ctx, ql, window):
    """This lane's V scale of tile ``t``, or 0 for a token no row sees (past the context, or before
    every row's window), so it stays out of the V-scale max and gets weight 0."""
    span0 = t * TILE + wave * SPAN
    live = lane < ctx - span0
    if const_expr(window > 0):
        live = live & (lane >= ctx - (ql - 1) - window - span0)
    return fx.Float32(select(live, v_sc1, fx.Float32(0.0)))


def v_max_factors(vmax):
    """``(vmax, 1/vmax)`` of a V-scale max, the factors around P·V."""
    # no live token (or only ~0 scales) gives 1, not rcp(tiny): O is rescaled by rv·vmax every
    # tile and O·1e30 could overflow
    vmax = fx.Float32(select(vmax > 1e-30, vmax, fx.Float32(1.0)))
    return vmax, rcp(vmax)


# %% [markdown]
# ## The phase split
#
# Per M-tile a tile's work is: scores (`4 · head_dim/32` MFMAs), row max, exponentials and fp8
# pack, P·V (`2 · head_dim/16` MFMAs per wave). Done M-tile by M-tile, K and V are both needed
# for every M-tile, so both sit in registers for the whole tile. The phase split reorders the
# work by what it reads:
#
# * **phase A** reads K: every M-tile's scores, masks and row max. After the last M-tile's score
#   MFMAs, K's registers are free.
# * **phase B** reads V: every M-tile's exponentials, pack and P·V.
#
# The row max is shared by the four waves through LDS (chapter 06). With the split, that costs one
# barrier per group of M-tiles instead of one per M-tile; upstream's kernel splits for the same
# reason. `sched_barrier`s (compiler fences, not waits) keep the M-tiles apart: if the scheduler
# interleaved them, their temporaries would add up.
#
# The exponentials and the pack, shared by every M-tile: `P = 2^(s·c − m + log2 FP8_MAX)`, so the
# row's largest P is `FP8_MAX` exactly, packed four to a word as the B operand of P·V.

# %% tags=["export"]
def _exp_pack(s, c, m_new, log2_fp8_max, v_weight):
    """P = 2^(s·c - m_new + log2 FP8_MAX) (largest = FP8_MAX), its lane sum, and P (times the
    per-token V weights ``v_weight(a)`` of lane-tokens 4a..4a+3, if any) packed as the two P·V B
    operands."""
    shift = exp_shift(m_new, log2_fp8_max)  # with the margin that keeps the top P finite
    p = [exp2(fx.Float32(s[i]) * c - shift) for i in range_constexpr(16)]
    total = tree_sum(list(p))
    words = []
    for a in range_constexpr(4):
        q = p[4 * a:4 * a + 4]
        if const_expr(v_weight is not None):
            # four weights at a time, fenced: hoisted, all 16 would sit next to the 16 P values
            fx.rocdl.sched_barrier(0)
            w = v_weight(a)
            q = [q[i] * fx.Float32(w[i]) for i in range_constexpr(4)]
        words.append(pack_fp8(q[0], q[1], q[2], q[3]))
    return [i64(words[0], words[1]), i64(words[2], words[3])], total


# %% [markdown]
# Where a wave's K, V, scales and page ids are: chapter 04's blocked layouts
# (`kernel_lib.Pages` with `k_blocked`), plus the one per-token scale a lane loads per tile.

# %% tags=["export"]
class LanePages(Pages):
    """Chapter 4's ``Pages`` (blocked K; trans-blocked or plain V) plus the one per-token scale a
    lane loads per tile: lane ``lane``'s token of the wave's 64, on the page of its V tokens."""

    def __init__(self, bt_rs, k_rs, v_rs, bt_row, last_page, kvh, num_kv_heads, wave, lane, col,
                 grp, *, block_size, head_dim, trans_v):
        super().__init__(bt_rs, k_rs, v_rs, bt_row, last_page, kvh, num_kv_heads, wave, col, grp,
                         block_size=block_size, head_dim=head_dim, k_blocked=True, v_trans=trans_v)
        if self.bs in (16, 64):
            self.s_tok = col if self.pps > 1 else lane
        else:
            # the lane's token of the span on page v_j: lane % 32 (block 32), or past the span's
            # start in a page of two spans (block 128)
            self.s_tok = lane % 32 if self.bs == 32 else lane + self.span_start()

    def scale(self, rs, page):
        return buffer_load(rs, ((page * self.num_kv_heads + self.kvh) * self.bs + self.s_tok) * 4,
                           1).bitcast(fx.Float32)


# %% [markdown]
# **The specialization.** Every compile-time size the pieces read comes from one object, built
# once per `build_launcher` call: the shape, the M-tiles per workgroup (`plan`), the loop
# (`WIDE`, chapter 06) and the LDS offsets.

# %% tags=["export"]
class Spec:
    """The compile-time constants of one specialization (``build_launcher``'s arguments and what
    follows from them): every piece of the kernel below reads its sizes from here."""

    def __init__(self, arch, block_size, head_dim, group, query_length, q_dtype, per_token, trans_v,
                 sliding_window, num_partitions, m_tiles, work_list=False, sinks=False,
                 soft_cap=0.0, lse=False, ragged=False):
        self.BS, self.HD, self.G, self.QL = block_size, head_dim, group, query_length
        self.W, self.NP = sliding_window, num_partitions
        self.per_token, self.trans_v = per_token, trans_v
        # a work list (chapter 6's balanced split) names each workgroup's sequence and tiles; its
        # partials are one slot per workgroup, so a (slot, KV head) holds one partition, not NP
        self.WL = work_list
        self.SPLIT = num_partitions > 1 or work_list
        self.NPW = 1 if work_list else num_partitions
        # the serving math (chapter 08): the soft-cap is applied to every score; a split leaves
        # sinks and the log-sum-exp to the reduce, which sees the whole row
        self.CAP = float(soft_cap)
        self.SINKS, self.LSE = sinks and not self.SPLIT, lse and not self.SPLIT
        self.ROWS, _, self.MT, self.MG = plan(head_dim, group, query_length, m_tiles)
        self.QDT = fx.BFloat16 if q_dtype == "bf16" else fx.Float16
        self.FMAX = fp8_max(arch)
        self.LOG2_FMAX = math.log2(self.FMAX)
        self.NH = head_dim // 64  # 64-channel halves of a K row: K chunks grp and grp + 4
        self.NCH = head_dim // 16  # 16-channel d-chunks of the output
        self.CPW = self.NCH // WAVES  # d-chunks each wave owns after the merge
        self.WIDE = self.MT > WIDE_ABOVE  # P·V split by head_dim, P through LDS (its section)
        self.V_WITH_K = self.WIDE and v_with_k(head_dim, block_size, per_token)
        self.MB = PHASE_GROUP[head_dim]  # M-tiles per phase group of the head_dim split
        self.XS, self.SHARED_BYTES = exchange_slots(head_dim, self.MT)
        if self.WIDE:  # no exchange after the loop: the shared region holds only the staged query
            self.SHARED_BYTES = self.MT * (16 * head_dim + 4 * WAVE)
        self.Q_SCALES = self.MT * self.NH * WAVE * 16  # byte offset of the staged query scales
        self.SC_FLOATS = WAVES * 2 * WAVE if per_token else 4  # [wave][K scale | V weight][token]
        # ragged query rows (``query_start_loc``): QL is the bound on a sequence's rows; the
        # workgroup's own count QN, first row Q0 and live rows LIVE come from ``for_sequence``
        self.RAGGED = ragged
        self.QN, self.Q0, self.LIVE = query_length, None, self.ROWS

    def for_sequence(self, q0, qn):
        """This spec with one workgroup's ragged rows: sequence rows ``q0 .. q0 + qn`` of
        ``query``/``out``, ``qn`` <= QL (device values); its ``qn·G`` flattened rows are live."""
        c = copy.copy(self)
        c.Q0, c.QN, c.LIVE = q0, qn, qn * self.G
        return c


# %% [markdown]
# Where a sequence's rows start in `query` and `out`: at `seq · query_length`, or, with ragged
# query rows (chapter 08), wherever `query_start_loc` says.

# %% tags=["export"]
def row_base(c, seq):
    """The ``query``/``out`` row of sequence ``seq``'s first query: ``seq·QL`` (uniform) or the
    workgroup's ``Q0`` (ragged)."""
    if const_expr(c.RAGGED):
        return c.Q0
    return seq * c.QL


#: a row index whose byte offset is past every query buffer: ragged padding rows read there
PAST_QUERY = 2**30


# %% [markdown]
# ## Does it work?
#
# The kernel is finished in chapter 06; here it runs as the package has it. The compiled gfx942 /
# gfx950 code runs in the emulator against the float32 reference, on ragged contexts (1, 17, 256,
# 1027; raised to `query_length` where needed) with shuffled pages and `-1` in unused block-table
# entries. Every element must be within the fp8 bound (`case.error_bound()`, as in chapter 02);
# `of_bound` is the worst error over its bound.

# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %%
from pa_tile.stages import s5_phase_split_mtp as s5  # noqa: E402


def make(arch, bs, hd, g, ql, scales="per-tensor", qdt=torch.float16,
         contexts=cache.RAGGED_CONTEXTS, seed=1, device=None):
    """A case on ``device`` (default: where kernels run here)."""
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g, 1, hd, bs, ctx, query_length=ql,
                           fp8_format=fp8_format(arch), scales=scales, query_dtype=qdt, seed=seed,
                           pad_block_id=-1, device=device)


def inputs(case, trans_v=True):
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    return (case.query, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale,
            case.v_scale)

# %% tags=["nbval-ignore-output"]
CONFIGS = [  # block, head_dim, group, query_length, scales, query dtype, trans V, window, m_tiles
    (16, 128, 8, 1, "per-tensor", torch.float16, True, 0, None),
    (64, 64, 16, 4, "per-tensor", torch.bfloat16, True, 0, None),
    (16, 64, 32, 3, "per-token", torch.float16, False, 0, 2),
    (64, 128, 8, 4, "per-token", torch.bfloat16, True, 0, 2),
    (16, 128, 5, 2, "per-tensor", torch.float16, True, 100, None),
    (64, 64, 16, 2, "per-token", torch.float16, False, 37, 4),
    (16, 256, 8, 2, "per-token", torch.bfloat16, True, 0, None),
    (64, 256, 4, 1, "per-tensor", torch.float16, False, 50, None),
]
rows = []
for arch in backend.runnable_archs():
    for bs, hd, g, ql, sc, qdt, tv, w, mt in tqdm(CONFIGS, desc=f"run {arch}"):
        case = make(arch, bs, hd, g, ql, sc, qdt)
        out = s5.paged_decode(*inputs(case, tv), sliding_window=w, m_tiles=mt, arch=arch).cpu()
        ok, of_bound, mean_err = case.check(out, sliding_window=w)
        rows.append(dict(arch=arch, block=bs, head_dim=hd, group=g, ql=ql, scales=sc,
                         q="bf16" if qdt == torch.bfloat16 else "f16", v="trans" if tv else "plain",
                         window=w, m_tiles=plan(hd, g, ql, mt)[2], of_bound=round(of_bound, 2),
                         ok=ok))
print(format_table(rows))
assert all(r["ok"] for r in rows)

# %% [markdown]
# ### A row that sees almost nothing
#
# A window of one token: each of the 4 query rows sees only its own position. Three of the four
# waves see nothing for any row, and each row's one token gets `P = FP8_MAX` exactly. The output
# must be that token's V row, to the last bit of the f16 rounding.

# %%
case = make(backend.default_arch(), 16, 128, 8, 4, contexts=[600], seed=7)
out = s5.paged_decode(*inputs(case), sliding_window=1).float().cpu()
v = cache.dequantize(case.v_cache, case.fp8_format, case.v_scale).float().cpu()
want = torch.stack([v[int(case.block_tables[0, t // 16]), 0, t % 16] for t in range(596, 600)])
print("max |out - v[own token]| =", float((out - want[:, None, :]).abs().max()),
      " finite:", bool(torch.isfinite(out).all()))
torch.testing.assert_close(out, want[:, None, :].expand_as(out), rtol=2**-10, atol=0)

# %% [markdown]
# ### Short contexts with per-token scales
#
# Contexts 1, 2 and 17 on both arches: the mean error of each sequence, and the 1-token
# sequence against its V row. Its token is the only live one in the V-scale max, so its weight
# is 1 and `P = FP8_MAX`, exactly as with a per-tensor scale.

# %% tags=["nbval-ignore-output"]
short = []
for arch in backend.runnable_archs():
    for bs, hd, g in ((16, 128, 8), (64, 64, 1)):
        case = make(arch, bs, hd, g, 1, "per-token", contexts=[1, 2, 17])
        out = s5.paged_decode(*inputs(case), arch=arch).float().cpu()
        err = (out - case.reference().float().cpu()).abs()
        v = cache.dequantize(case.v_cache, case.fp8_format, case.v_scale).float().cpu()
        torch.testing.assert_close(out[0], v[int(case.block_tables[0, 0]), 0, 0].expand(g, -1),
                                   rtol=2**-10, atol=0)
        short.append(dict(arch=arch, block=bs, head_dim=hd, group=g,
                          **{f"mean_err_ctx{n}": f"{float(e):.4f}"
                     for n, e in zip((1, 2, 17), err.mean((1, 2)))},
                          mean_err_all=f"{float(err.mean()):.4f}"))
print(format_table(short))

# %% [markdown]
# ## K and V read once per workgroup
#
# What the M-tiles in one workgroup buy is bytes. One sequence of 1027 tokens, head_dim 128,
# block 16, per-tensor scales, gfx942: the bytes loaded (each wave instruction's distinct bytes,
# summed) against the compulsory bytes (the context's K and V rounded up to 256-token tiles once,
# the query, one page id per page). Three plans: one M-tile per workgroup, two, and the default
# (all of them). Below 1: the kernel stops at the last page, the compulsory count at the tile.

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402
from pa_tile.perf import tracing  # noqa: E402
from pa_tile.perf.roofline import DecodeShape  # noqa: E402

SHAPES = [(1, 8), (1, 32), (2, 16), (3, 16), (4, 16), (4, 32)]  # (query_length, group)
PLANS = {"one M-tile per workgroup": 1, "two per workgroup": 2, "all in one (default)": None}
ratios = {name: [] for name in PLANS}
if backend.current_backend() == "emu":
    for ql, g in tqdm(SHAPES, desc="trace"):
        case = make("gfx942", 16, 128, g, ql, contexts=[1027], qdt=torch.bfloat16)
        shape = DecodeShape(batch=1, context=1027, num_q_heads=g, num_kv_heads=1, head_dim=128,
                            block_size=16, query_length=ql)
        for name, mt in PLANS.items():
            trace = Trace("gfx942")
            with emu_launch.launch_options(trace=trace):
                s5.paged_decode(*inputs(case), m_tiles=mt, arch="gfx942")
            ratios[name].append(tracing.report_from_trace(trace, "s5",
                                                          shape=shape).traffic()["vs_compulsory"])
    figures.traffic_bars([f"ql {ql} · group {g}\n{plan(128, g, ql)[1]} M-tiles" for ql,
                          g in SHAPES], ratios,
                         title="Bytes loaded per call against the compulsory bytes (emulator, "
                               "gfx942)")
    plt.show()
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% tags=["nbval-ignore-output"]
one, dflt = ratios["one M-tile per workgroup"], ratios["all in one (default)"]
most = plan(128, SHAPES[-1][1], SHAPES[-1][0])[1]  # M-tiles of the last shape traced
show.md(f"""
    With one M-tile per workgroup, every extra 16 query rows re-read the KV head's K and V: at
    {most} M-tiles the call loads {one[-1] if one else 0:.2f}× the compulsory bytes. The default
    plan stays at {min(dflt or [0]):.2f}–{max(dflt or [0]):.2f}× for every shape: each byte
    once, up to 128 rows. `tests/test_traffic.py` pins these figures on the upstream test grid's
    shape.""" if dflt else
        "(the traffic figures are the emulator's: see the committed notebook)")

# %% [markdown]
# ## What you built
#
# ```text
# grid (sequence, KV head × M-group, partition); 4 waves; lane = (col: query row, grp: 16 tokens)
# rows = query_length · group, flattened (MTP position outer, head inner); 16-row M-tiles
# prologue: wave m % 4 loads M-tile m's query rows, quantizes to fp8 -> LDS; s_barrier
#           c_qk[m] = q_scale[m] · k_scale · softmax_scale · log2 e
# for tile t in this workgroup's tiles (window: tiles before every row's window skipped):
#     issue K (own 64 tokens), V, per-token scales, next tile's page ids
#     phase A, on K's registers, for each M-tile m:
#         s = K · Q[m] from LDS              # scores [token, row]
#         if boundary tile: s = -inf where causal / window / tail hides the token
#         row max of s -> LDS table          # chapter 06
#     s_barrier
#     phase B, on V's registers, for each M-tile m:
#         m_new = max(m_old, the 4 waves' row maxes);  p = exp2(s·c_qk - m_new + log2 FP8_MAX)
#         P -> fp8 -> LDS;  O[m] = O[m]·exp2(m_old - m_new) + V · P     # chapter 06
# after the loop: the four waves' row sums; O / sum -> out (query dtype) or split-K partials
# ```
#
# Next, [chapter 06](06_head_dim_split_pv.ipynb): phase B, the head_dim split of P·V. The
# register-resident loop it replaces is in [its appendix](appendix_register_resident_loop.ipynb).

# %% tags=["nbval-ignore-output"]
def last_ratio(plan_name):
    return f"{ratios[plan_name][-1]:.2f}" if ratios[plan_name] else "emulator only"



show.measured({
    f"worst error / fp8 bound, {len(rows)} checks": f"{max(r['of_bound'] for r in rows):.2f}",
    f"bytes / compulsory, {most} M-tiles, 1 per workgroup": last_ratio("one M-tile per workgroup"),
    f"bytes / compulsory, {most} M-tiles in one workgroup": last_ratio("all in one (default)"),
})
