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
# # 05 · Phase split, multi-token decode and wide GQA
#
# Chapter 2 decoded one query token for 8 or 16 heads per KV head: exactly one 16-row MFMA
# tile of query rows. Two things in real serving break that:
#
# * **MTP / speculative decode** checks `query_length` = 1..4 draft tokens per sequence at once:
#   the last `query_length` positions of the sequence, each causally masked (query `i` must
#   not see the drafts after it).
# * **Wide GQA**: up to 32 query heads share one KV head.
#
# Both only add *query rows* that read the same K and V pages. So the rows are flattened,
# `row = qi · group + head` (MTP position outer, head inner), and tiled into 16-row
# **M-tiles**: `ceil(query_length · group / 16)` of them, up to 8.
#
# This chapter starts from chapter 2's register-resident design (each wave owns 64 tokens of every
# 256-token tile, turned-around scores, P·V from registers, one four-wave merge after the
# loop) and adds, in the same kernel:
#
# 1. M-tiles, the causal mask of MTP and an optional **sliding window**;
# 2. the **phase split**: on K's registers, every M-tile's scores, row max and fp8 P; then, on
#    V's registers (K's, reused), every M-tile's P·V. So one workgroup carries several M-tiles and
#    reads each K and V byte **once** for all of them, and the query is loaded once per workgroup;
#    and then, because past two M-tiles the register-resident loop runs out of registers, the
#    **head_dim split of P·V** (upstream's): the waves share each tile's row max and P through
#    LDS and each keeps a quarter of the output. Measured, it wins at every M-tile count, so it
#    is the default; the register-resident loop stays as the baseline it is measured against;
# 3. the layouts and options of chapters 3–4: blocked K `[blocks, kv_heads, head_dim/16, block, 16]`,
#    trans-blocked V `[blocks, kv_heads, block/16, head_dim, 16]` (plain V still accepted),
#    head_dim 64, 128 or 256, f16 or bf16 query (strided rows and heads) with output in the query
#    dtype, per-tensor or **per-token** K/V scales;
# 4. a `num_partitions` switch (grid z) that chapter 6 uses for split-K; here we only check
#    the partial results it writes.
#
# Along the way we get the two numerical corner cases right that MTP and windows create: a
# tile in which a row sees *no* token must add exactly nothing, and no row may ever turn into NaN.

# %%
import math

import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, isa, toolchain
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.progress import progress as tqdm

# %% [markdown]
# ## The module
#
# Everything chapter 2 built at the instruction level (buffer loads, the fp8 pack, the
# 16×16×32 MFMA, lane butterflies, LDS helpers) is reused unchanged from
# `pa_tile.stages.s2_register_softmax`; this module only adds what is new. It starts from stage
# 2's register-resident design (each wave owns 64 tokens of every 256-token tile, turned-around
# scores `D[token, row] = K·Qᵀ`, P·V with V as A and P as B so the output fragment is
# `[head-dim, query-row]`, one four-wave merge after the loop) and widens it to:
#
# * query_length 1..4 and query-group sizes 1..32: the `query_length·group` query rows of a
#   (sequence, KV head) are flattened (MTP position outer, head inner) and tiled into 16-row
#   M-tiles; a workgroup runs up to `m_tiles` of them (default: all, so K and V are read once;
#   grid y = KV heads × M-groups) and loads the query once, staged in LDS; the last
#   `query_length` positions are causally masked, with an optional sliding window;
# * the phase split: on K's registers each M-tile's scores, row max and fp8 P in turn, then on V's
#   every M-tile's P·V, so K and V are read once for all of a workgroup's M-tiles; by default P·V
#   is split across the waves by head_dim (upstream's split: a shared row max and P through LDS, a
#   quarter of the output registers; `WIDE_ABOVE` keeps the register-resident loop for
#   comparison);
# * blocked K `[nb, kvh, head_dim//16, block, 16]`, trans-blocked V `[nb, kvh, block//16,
#   head_dim, 16]` (or plain V `[nb, kvh, head_dim, block]`), head_dim 64/128/256, f16/bf16
#   query (any row/head strides, unit channel stride), output in the query dtype;
# * per-tensor `[1]` or per-token `[nb, kvh, block]` float32 K/V scales;
# * `num_partitions` (grid z) > 1 writes per-partition partial results for a reduce kernel.

# %% tags=["export"]
"""Stage 5: phase-split multi-token (MTP) decode and wide GQA.

Stage 2's register-resident kernel widened to query_length 1..4 and groups up to 32 (16-row
M-tiles, causal mask, sliding window) by the phase split and the head_dim split of P·V; blocked
K, trans-blocked or plain V, head_dim 64/128/256, per-token scales, and split-K partials
(``num_partitions``) for stage 6's reduce.
"""

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
    LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, buffer_load, buffer_store, device_code, exchange, exp2, exp_shift, fmax, i64,
    imax, imin, jit_launcher, lane_coords, lds_load, lds_store, mfma, pack_fp8, query_operands, rcp, rsrc,
    max4, row_max, row_reduce, scalar_load, scores, select, splat4, tree_sum, wave_reduce, zero_tail_v,
)

__all__ = ["paged_decode", "paged_decode_partials", "build_launcher", "launch_args", "kernel_args", "plan",
           "LIMITS", "K_LAYOUT", "V_LAYOUT", "PHASE_GROUP", "WIDE_ABOVE", "exchange_slots", "LanePages", "query_rows",
           "tile_range", "stage_scales", "phase_b", "store_stats", "merge_weights", "Spec", "stage_query",
           "score_factors", "lane_scales", "k_scaled", "phase_a", "write_rows", "merge_and_write", "WidePages", "wide_v",
           "wide_scores", "wide_v_max", "wide_v_weight", "wide_pv", "wide_loop", "wide_merge_and_write", "make_kernel",
           "partial_shapes", "check_partial_offsets", "v_with_k", "lds_layout", "workgroup_work", "page_readers",
           "per_token_slots", "resident_loop"]

#: what the stage-5 kernel supports (upstream's tile kernel takes head_dim 64, 128 and 256 too)
LIMITS = problem.Limits(stage="s5", head_dims=(64, 128, 256), block_sizes=(16, 64), groups=None, max_group=32,
                        max_query_length=4, query_dtypes=(torch.float16, torch.bfloat16), k_layouts=("blocked",),
                        v_layouts=("trans_blocked", "plain"), per_token_scales=True, strided_query=True,
                        sliding_window=True, max_partitions=64, max_m_tiles=8)
K_LAYOUT = "k_blocked"  # pa_tile.cache layout names of the caches paged_decode reads
V_LAYOUT = "v_trans_blocked"  # (plain V is accepted too)
NINF = float("-inf")

# %% [markdown]
# ## Query rows and M-tiles: what an M-tile costs
#
# The MFMA output puts one query row in each of a lane's 16 columns, so 16 rows is the unit.
# Every M-tile a workgroup carries reads the same K and V registers, so the more M-tiles per
# workgroup, the fewer times a KV head's pages are read: decode is memory-bound, and bytes are
# its cost. What does each extra M-tile cost? Per lane, loop-resident:
#
# | per M-tile | head_dim 64 | head_dim 128 | head_dim 256 |
# |---|---|---|---|
# | output fragment `O` (`[head_dim, 16 rows]` per wave) | 16 | 32 | 64 |
# | packed P (fp8, B side of P·V; phase A to phase B) | 4 | 4 | 4 |
# | running max, sum, `c_qk` | 3 | 3 | 3 |
#
# plus, one M-tile at a time, its Q operand (read from LDS, where the prologue staged it) and its
# 16 scores. The first line is the price of chapter 2's choice: a wave finishes its own tokens,
# so it accumulates `O` over *all* of head_dim (upstream's kernel instead splits head_dim across
# the waves for P·V, at the price of an LDS round trip and barriers for P every tile). With K
# or V (16/32/64: the loop never holds both, see "Fitting upstream's register budget") and
# addressing on top, two M-tiles at head_dim 128 take ~166 registers, 3 waves per SIMD (the
# occupancy steps are 512 / 8-register granules: ≤ 80 → 6, ≤ 96 → 5, ≤ 128 → 4, ≤ 168 → 3,
# ≤ 256 → 2), better than upstream's 2 with the same rows. Four take ~270: one wave per SIMD,
# short of upstream's 246 registers and 2 waves, and giving the extra M-tiles to more
# workgroups re-reads the KV head's K and V once per workgroup (4.7x the compulsory bytes at
# query_length 4 × group 16). So the kernel ends up with upstream's split of the work, **P·V by
# head_dim** ("The head_dim split of P·V" below): each wave keeps only its quarter of `O`
# (`head_dim/16` registers per M-tile), at the price of P going through LDS with barriers. `plan`
# keeps every M-tile of a KV head in one workgroup (up to 8: 128 rows), so K and V are read once;
# `m_tiles=` caps it, and more M-tiles then go to more workgroups along grid y
# (`kv_heads × m_groups`), each re-reading K and V: measured under "Memory traffic" below.

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
print(format_table([dict(query_length=ql, group=g, rows=p[0], m_tiles=p[1], per_workgroup=p[2], workgroups_per_kv_head=p[3])
                    for ql, g in ((1, 8), (1, 16), (4, 8), (4, 16), (3, 32), (4, 32))
                    for p in [plan(128, g, ql)]]))

# %% [markdown]
# ## Loading the query rows, once per workgroup
#
# Every wave needs every M-tile's query operands, but no byte of the query should be fetched
# twice: wave `m % 4` loads and quantizes M-tile `m` and writes its fp8 operands (and the row's
# scale) to LDS; after one `s_barrier` every wave reads them back, each tile, right before its
# score MFMAs (a `ds_read_b128` per 64 channels, lane-contiguous: conflict free). The same LDS
# later holds the merge's exchange, so the staging costs no LDS of its own.
#
# Within its wave, each M-tile's lane `col` loads row `m·16 + col` of the flattened axis: MTP position
# `qi = row // group`, head `row % group`, at `(seq·query_length + qi)·stride_row + (kv_head·group
# + head)·stride_head` elements, so any row/head strides work (channels must be contiguous).
# The row is quantized to fp8 by its own amax (two butterfly steps across the 4 lanes that
# share the row), exactly as in chapter 2; bf16 is converted with the same code path. Padding
# rows past `query_length·group` read the last real row but quantize to zeros and are never stored.
# The division `row // group` is done with `query_length − 1` compares: `group` need not be a power
# of two, and the wave never needs a 16-bit multiply.

# %% [markdown]
# That is `kernel_lib.query_operands` (chapters 2 and 4) with the row's byte address computed
# from the two strides:

# %%
from pa_tile import kernel_lib  # noqa: E402
from pa_tile.show import source  # noqa: E402

source(kernel_lib.query_operands)

# %% [markdown]
# ## Masks: causal, window, tail — and a tile that adds exactly nothing
#
# Row `qi` sits at position `pos = ctx − query_length + qi` and sees tokens `pos − W < t ≤ pos`
# (`W = sliding_window`, 0 = no window; the convention of `pa_tile.reference`). A lane holds 16
# consecutive tokens of one row, so each bound is one integer per (lane, M-tile): `n_hi` (and
# `n_lo`) in lane-token units, compared against the constants 0..15.
#
# Without a window only tiles that hold a causally hidden or absent token need the mask (a
# wave-uniform branch: one tile for `query_length` 1, at most two otherwise). With a window every
# tile is masked, and whole tiles before the earliest row's window are never loaded.
#
# **The value a masked score gets matters.** The running max starts at `MASKED = −1e30` (finite,
# so `MASKED − MASKED = 0`, never NaN). If masked scores were also set to `MASKED`, a wave whose
# 64 tokens are all invisible to a row would compute `m_new = MASKED` and
# `p = exp2(MASKED − MASKED) = 1` for every masked token: a full-weight garbage token. MTP and
# windows make such spans common (the last query row sees more than the first; a window hides
# whole spans). Masked scores are therefore `−inf`: `exp2(−inf − m) = 0` for any finite `m`, and
# `max(MASKED, −inf) = MASKED` keeps the running max finite. V bytes past the context are also
# zeroed, because `0 · NaN` is NaN inside the MFMA.

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


# %%
# the pitfall in four lines of torch: a wave span that one row cannot see
m_run = torch.tensor(-1e30)
for masked_value in (-1e30, float("-inf")):
    s = torch.full((16,), masked_value)
    m_new = torch.maximum(m_run, s.max())
    print(f"masked = {masked_value:>7}: m_new = {m_new.item():.0e}, sum of p = {torch.exp2(s - m_new).sum().item()}")

# %% [markdown]
# ## The phase split
#
# A tile's work per M-tile is: scores (`4·head_dim/32` MFMAs) → row max → exp, pack → P·V
# (`2·head_dim/16` MFMAs). Done M-tile by M-tile, K and V are both needed for every M-tile, so
# both sit in registers for the whole tile. The phase split reorders the work by what it reads:
#
# * **phase A**, on K's registers: for each M-tile in turn, its scores, row max, exponentials
#   and fp8 pack; what survives an M-tile is 4 registers of packed P (and its max, sum and
#   correction), not 16 scores;
# * **phase B**, on V's registers: every M-tile's P·V.
#
# V is issued right after the last M-tile's score MFMAs, the point where K is dead, into K's
# registers; that M-tile's softmax (and the other waves) cover its latency. In upstream's
# kernel, where the four waves share one row max through LDS, the phase split turns one barrier
# per M-tile into one barrier per tile. Here the row max is wave-local (15 in-lane `v_max` and
# two butterfly steps; the lane owns its row), so for up to two M-tiles the loop has **no
# barrier at all** ("The head_dim split of P·V" below trades barriers for registers).
# `sched_barrier`s keep the M-tiles apart: interleaved by the scheduler, their temporaries would
# add up.
#
# Because P·V is `V·P` (V as A, P as B), the output fragment is `[head-dim, query-row]`: the
# row is the lane's column, so the correction `exp2(m_old − m_new)` and the denominator are
# per-lane scalars, and after the merge each lane stores 4 consecutive channels of its row
# (8 bytes) straight to global memory.
#
# Per-token scales: the lane's 16 K scales multiply its 16 scores before the max. V scales cannot
# be applied after P·V (they vary along the contracted axis), so P is multiplied by
# `v_scale[t] / max_wave(v_scale)` before the fp8 pack (keeping P ≤ FP8_MAX) and the tile's P·V
# result by `max_wave(v_scale)`; the denominator sums the unweighted P. The 16 lanes of a row band
# all need the same 16 scales, so each lane loads just **one** K and one V scale (token `lane` of
# the wave's 64, issued first with the tile's K loads; page ids are fetched one tile ahead), the wave
# max of the V scales is a 6-step butterfly, and the K scale and V weight go to a wave-private
# 512-byte LDS slot. Each lane reads its band's values back 4 at a time (`ds_read_b128`, one
# broadcast address per band) exactly where they are used. No barrier: only the wave itself
# touches its slot, and one wave's LDS operations complete in order.
#
# The V-scale max covers only tokens some row can see: a slot past the context (or before the
# earliest row's window) enters it as 0. Cache tails hold finite scales, and counting them shrinks
# the real tokens' weights below 1, so even a lone token's `P = FP8_MAX·w` takes an e4m3 rounding
# (up to 2⁻⁴) that the normalization, which sums the unweighted P, does not cancel: a 1-token
# context was off by up to ~5 % on average before this mask and is now exact up to the f16
# output rounding (the check is under "Does it work?").

# %% [markdown]
# One wave's issue order for two trips of the register-resident loop with two M-tiles per
# workgroup, between the query's staging and the merge: the loop has no workgroup barrier.

# %%
figures.phase_timeline(m_tiles=2, tiles=2)
plt.show()

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
# ## The pieces of a tile
#
# Straight-line helpers the kernel below calls (FlyDSL inlines them: the code is the same as if they
# were written in place). First, where a wave's K, V, scales and page ids are: chapter 4's blocked
# layouts (`kernel_lib.Pages` with `k_blocked`), plus the one per-token scale a lane loads per tile.
# The scores of an M-tile are the library's `scores` on the staged query's operands.

# %% tags=["export"]
class LanePages(Pages):
    """Chapter 4's ``Pages`` (blocked K; trans-blocked or plain V) plus the one per-token scale a
    lane loads per tile: lane ``lane``'s token of the wave's 64, on the page of its V tokens."""

    def __init__(self, bt_rs, k_rs, v_rs, bt_row, last_page, kvh, num_kv_heads, wave, lane, col, grp, *,
                 block_size, head_dim, trans_v):
        super().__init__(bt_rs, k_rs, v_rs, bt_row, last_page, kvh, num_kv_heads, wave, col, grp,
                         block_size=block_size, head_dim=head_dim, k_blocked=True, v_trans=trans_v)
        self.s_tok = col if self.pps > 1 else lane

    def scale(self, rs, page):
        return buffer_load(rs, ((page * self.num_kv_heads + self.kvh) * self.bs + self.s_tok) * 4, 1).bitcast(fx.Float32)


# %% tags=["export"]
def _stage_q(shared, m, lane, ops, q_scale, nh, scales_at):
    for k in range_constexpr(nh):
        pair = fx.Vector.from_elements([ops[2 * k], ops[2 * k + 1]], dtype=fx.Int64)
        lds_store(shared, ((m * nh + k) * WAVE + lane) * 16, pair.bitcast(fx.Float32))
    lds_store(shared, scales_at + (m * WAVE + lane) * 4, fx.Vector.from_elements([q_scale], dtype=fx.Float32))


def _staged_q(shared, m, lane, nh):
    ops = []
    for k in range_constexpr(nh):
        pair = lds_load(shared, ((m * nh + k) * WAVE + lane) * 16, 4).bitcast(fx.Int64)
        ops.extend([pair[0], pair[1]])
    return ops


def _staged_q_scale(shared, m, lane, scales_at):
    return fx.Float32(lds_load(shared, scales_at + (m * WAVE + lane) * 4, 1)[0])


def _pv(o, v_words, p_ops, f4, vmax=None):
    """One M-tile's P·V: d-chunk accumulators ``o[j]`` rescaled by ``f4``, plus V chunk j · P (times
    the wave's V-scale max ``vmax`` with per-token scales)."""
    out = []
    for j in range_constexpr(len(o)):
        w = [fx.Int32(v_words[4 * j + k]) for k in range_constexpr(4)]
        acc = fx.Vector(o[j]) * f4
        acc = mfma(i64(w[0], w[1]), p_ops[0], acc)
        acc = mfma(i64(w[2], w[3]), p_ops[1], acc)
        if const_expr(vmax is not None):
            acc = acc * splat4(vmax)
        out.append(acc)
    return out

# %% [markdown]
# Per-token V weights (the wave's V-scale max over the tokens some row can see, see "The phase
# split"). The merge's exchange is the library's (`kernel_lib.exchange`, chapter 2's
# reduce-scatter with a `slots` count): `WAVES - 1` rounds, each sending `slots` of the d-chunks
# this wave does not keep and adding the ones it receives. Here `slots` is what the LDS the
# query was staged in holds (`exchange_slots` below), so a round may take several passes.

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
# The kernel below calls a few more straight-line pieces. `query_rows`: the (row, MTP
# position, head) of each M-tile's row of this lane, the division by the group done with
# compares. `tile_range`: this workgroup's tiles (a window skips the tiles wholly before every
# row's window; a split takes its partition's range).

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


def tile_range(ctx, part, block_size, ql, window, num_partitions, listed=None):
    """``(last_page, t_start, t_end)``: the sequence's last page and this workgroup's tiles
    (``listed``: the ``(t_start, t_end)`` a work list gave it, kept inside the sequence)."""
    last_page = (ctx - 1) // block_size
    num_tiles = (ctx + (TILE - 1)) // TILE
    first = 0
    if const_expr(window > 0):
        first = imax(ctx - (ql - 1) - window, 0) // TILE  # tiles wholly before every row's window are skipped
    if const_expr(listed is not None):
        return last_page, imax(listed[0], first), imin(listed[1], num_tiles)
    if const_expr(num_partitions > 1):
        tpp = (num_tiles + (num_partitions - 1)) // num_partitions
        return last_page, imax(part * tpp, first), imin(part * tpp + tpp, num_tiles)
    return last_page, fx.Int32(first), num_tiles


# %% [markdown]
# `stage_scales`: per token, the lane's K scale and V weight (`v_scale / vmax`, the wave's max
# over the tokens some row can see) to its wave's LDS slots, once per tile; the M-tiles read
# them back four at a time. `phase_b`: every M-tile's P·V on V's registers, each M-tile's
# accumulators rescaled by its correction (and, per token, by the wave's `vmax`).

# %% tags=["export"]
def stage_scales(sc_lds, sc_k, sc_v, k_sc1, v_sc1, t, wave, lane, ctx, ql, window):
    """This lane's K scale and V weight ``v_scale / vmax`` to its wave's LDS slots; returns ``(vmax,
    1/vmax)``, one factor for all 64 tokens of the wave."""
    v_sc1 = live_v_scale(v_sc1, t, wave, lane, ctx, ql, window)
    vmax, rv = v_max_factors(wave_reduce(v_sc1, fmax))
    lds_store(sc_lds, sc_k + lane * 4, fx.Vector.from_elements([k_sc1], dtype=fx.Float32))
    lds_store(sc_lds, sc_v + lane * 4, fx.Vector.from_elements([v_sc1 * rv], dtype=fx.Float32))
    return vmax, rv


def phase_b(o_all, v_words, p_all, corr_all, per_token=None):
    """Every M-tile's P·V on V's registers (V as A, P as B: O is [d, row]); ``per_token`` is the
    wave's ``(1/vmax, vmax)``."""
    nch = len(o_all) // len(p_all)
    o_next = []
    for m in range_constexpr(len(p_all)):
        fx.rocdl.sched_barrier(0)
        f4 = splat4(corr_all[m] * per_token[0] if const_expr(per_token is not None) else corr_all[m])
        o_next += _pv(o_all[m * nch:(m + 1) * nch], v_words, p_all[m], f4,
                      per_token[1] if const_expr(per_token is not None) else None)
    return o_next


# %% [markdown]
# The merge, per M-tile as chapter 2's `merge_waves`: `store_stats` writes every M-tile's
# (max, sum) of this wave to one table before a single barrier; `merge_weights` reads an
# M-tile's four rows back and scales this wave's accumulators by their weight, ready for
# `exchange`.

# %% tags=["export"]
def store_stats(stats, m_w, l_w, wave, col):
    """Each M-tile's (max, sum) of this wave (the sum over the row's 4 lanes) to the merge's
    table, ``[m-tile][max | sum][row][wave]``."""
    for m in range_constexpr(len(m_w)):
        lw = row_reduce(fx.Float32(l_w[m]), operator.add)
        base = m * 2 * 16 * WAVES
        lds_store(stats, (base + col * WAVES + wave) * 4, fx.Vector.from_elements([fx.Float32(m_w[m])], dtype=fx.Float32))
        lds_store(stats, (base + (16 + col) * WAVES + wave) * 4, fx.Vector.from_elements([lw], dtype=fx.Float32))


def merge_weights(stats, m, col, m_w, o_w, v_scale, split):
    """M-tile ``m``'s row max and sum over the four waves, and this wave's accumulators ``o_w``
    scaled by its weight ``2^(m_w - max) / sum`` (times ``v_scale`` per tensor; 0 for a row a
    partition of a ``split`` cannot see): ``(o, max, sum)``."""
    base = m * 2 * 16 * WAVES
    m4 = lds_load(stats, (base + col * WAVES) * 4, WAVES)
    l4 = lds_load(stats, (base + (16 + col) * WAVES) * 4, WAVES)
    mx = max4(m4)
    total = fx.Float32(0.0)
    for w in range_constexpr(WAVES):
        total = total + fx.Float32(l4[w]) * exp2(fx.Float32(m4[w]) - mx)
    f = exp2(fx.Float32(m_w) - mx) * rcp(total)
    if const_expr(v_scale is not None):
        f = f * v_scale
    if const_expr(split):
        f = fx.Float32(select(total > 0.0, f, fx.Float32(0.0)))  # empty partition row: 0, not 0·inf
    return [fx.Vector(x) * splat4(f) for x in o_w], mx, total


# %% [markdown]
# The merge's exchange goes through the LDS the query was staged in, so its rounds are sized to
# what that region holds anyway: `exchange_slots` picks the slots per round and the region's size.

# %% tags=["export"]
def exchange_slots(head_dim, m_tiles):
    """d-chunk slots each wave sends per round of the merge, and the bytes of the shared region the
    query staging and the merge take turns in. A round moves ``WAVES·WAVE·16·slots`` bytes; the
    slots per round are as many as fit in what the staged query needs anyway (at least 4 KB), so
    one M-tile at head_dim 128 merges through 4 KB in 6 rounds, not 8 KB in 3."""
    cpw = head_dim // 16 // WAVES
    staged = m_tiles * (16 * head_dim + 4 * WAVE)  # fp8 Q operands + one scale per lane, per M-tile
    room = max(4096, staged)
    slots = cpw
    while slots > 1 and WAVES * WAVE * 16 * slots > room:
        slots //= 2
    return slots, max(staged, WAVES * WAVE * 16 * slots)

# %% [markdown]
# **The specialization.** Every compile-time size the kernel's pieces read comes from one object,
# built once per `build_launcher` call: the problem's shape, the M-tiles per workgroup (`plan`),
# which loop runs (`WIDE`) and the LDS offsets.

# %% tags=["export"]
class Spec:
    """The compile-time constants of one specialization (``build_launcher``'s arguments and what
    follows from them): every piece of the kernel below reads its sizes from here."""

    def __init__(self, arch, block_size, head_dim, group, query_length, q_dtype, per_token, trans_v,
                 sliding_window, num_partitions, m_tiles, work_list=False):
        self.BS, self.HD, self.G, self.QL = block_size, head_dim, group, query_length
        self.W, self.NP, self.per_token, self.trans_v = sliding_window, num_partitions, per_token, trans_v
        # a work list (chapter 6's balanced split) names each workgroup's sequence and tiles; its
        # partials are one slot per workgroup, so a (slot, KV head) holds one partition, not NP
        self.WL = work_list
        self.SPLIT = num_partitions > 1 or work_list
        self.NPW = 1 if work_list else num_partitions
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

# %% [markdown]
# The workgroup's LDS. The head_dim split keeps a row-max table and a slab for P, and no exchange
# after the loop; the register-resident loop's table holds max and sum, and the region the query
# was staged in is reused for the merge's exchange.

# %% tags=["export"]
def lds_layout(c):
    """The LDS of specialization ``c`` (a :class:`Spec`), as a FlyDSL struct."""
    if c.WIDE:
        @fx.struct
        class Wide:
            stats: fx.Array[fx.Float32, c.MT * 16 * WAVES, 16]  # [m-tile][row][wave]: max; after the loop, sum
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
# **The query, once per workgroup.** Wave `m % 4` loads and quantizes M-tile `m` and stages its
# fp8 operands and scale in LDS; after one barrier every wave reads the scales back and folds them
# into the score factor `c_qk`. Q stays out of the loop's registers, and no byte of the query is
# fetched twice. `device_code` (from `kernel_lib`) lets a helper branch on device values
# (`wave == m % 4`) the way a kernel body does.

# %% tags=["export"]
@device_code
def stage_query(c, shared, rows, q_rs, seq, kvh, q_stride_row, q_stride_head, wave, lane, grp, live=None):
    """Each M-tile's query rows to LDS (``live`` False: a work list's empty entry, which walks no
    tile and reads no query)."""
    for m in range_constexpr(c.MT):
        if wave == m % WAVES:
            if const_expr(live is None):
                _stage_rows(c, shared, rows[m], m, q_rs, seq, kvh, q_stride_row, q_stride_head, lane, grp)
            else:
                if live:
                    _stage_rows(c, shared, rows[m], m, q_rs, seq, kvh, q_stride_row, q_stride_head, lane, grp)
    gpu.barrier()


def _stage_rows(c, shared, row, m, q_rs, seq, kvh, q_stride_row, q_stride_head, lane, grp):
    r, qi, g = row
    row_elem = (seq * c.QL + qi) * q_stride_row + (kvh * c.G + g) * q_stride_head
    ops, q_scale = query_operands(q_rs, row_elem, r < c.ROWS, c.FMAX, grp, c.NH, c.QDT)
    _stage_q(shared, m, lane, ops, q_scale, c.NH, c.Q_SCALES)

# %% [markdown]
# The factors, once per workgroup: `score_factors` reads each M-tile's staged scale back into its
# `c_qk`. Per token the K scale cannot be in `c_qk` (it varies along the tile), so `k_scaled`
# multiplies the lane's 16 scores by their tokens' scales, read from the wave's LDS slot 4 at a time.

# %% tags=["export"]
def score_factors(c, shared, lane, scale_log2, k_scale):
    """Each M-tile's factor from raw scores to log2 units: its query scale times the K scale (per
    tensor; per token the K scale is applied token by token) times ``softmax_scale·log2 e``."""
    c_qk = []
    for m in range_constexpr(c.MT):
        q_scale = _staged_q_scale(shared, m, lane, c.Q_SCALES)
        c_qk.append(q_scale * scale_log2 if const_expr(c.per_token) else q_scale * k_scale * scale_log2)
    return c_qk


def lane_scales(sc_lds, base, grp, q):
    """4 of the 16 per-token values of the lane's row band (lane-tokens 4q..4q+3): a broadcast read."""
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
# **Phase A**, M-tile by M-tile on K's registers: scores, the per-token K scales, the mask, row
# max, exp and fp8 pack. V is issued after the last M-tile's score MFMAs, into the registers K
# just freed; that M-tile's softmax (and the other waves) cover its latency. Only tiles that hold
# a causally hidden or absent token pay for the mask (a branch on the tile index).

# %% tags=["export"]
@device_code
def masked_scores(c, s, m, t, tok, ctx, hi1, v_words, zero_v):
    """M-tile ``m``'s scores ``s`` with the tokens its row may not see at -inf, and ``v_words``
    with the bytes of tokens past the context zeroed if ``zero_v`` (the V just loaded; else passed
    through): ``(s, v_words)``. Without a window only tiles holding a causally hidden or absent
    token pay for the mask (a branch)."""
    if const_expr(c.W > 0):
        s = _mask_scores(s, [hi1[m] - tok], [hi1[m] - c.W - tok], 1)
    else:
        if t * TILE + TILE > ctx - c.QL + 1:
            s = _mask_scores(s, [hi1[m] - tok], None, 1)
            if const_expr(zero_v):
                v_words = zero_tail_v(v_words, ctx - tok)
    return s, v_words

# %% [markdown]
# Phase A proper calls it once per M-tile, with a `sched_barrier` between M-tiles so that their
# temporaries do not add up. Per token, the first M-tile also stages the tile's K scales and V
# weights in the wave's LDS slots. What survives an M-tile is its packed P, correction, max and sum.

# %% tags=["export"]
@device_code
def phase_a(c, st, t, tok, ctx, k_words, pages, v_page, shared, lane, c_qk, hi1, per_token_args):
    M0, L0 = 2 + c.MT * c.NCH, 2 + c.MT * c.NCH + c.MT
    if const_expr(c.per_token):
        sc_lds, sc_k, sc_v, k_sc1, v_sc1, wave, grp = per_token_args
    p_all, corr_all, m_new, l_next = [], [], [], []
    v_words = k_words  # a stand-in of the same type until V is issued (the mask branch yields it)
    for m in range_constexpr(c.MT):
        fx.rocdl.sched_barrier(0)  # one M-tile at a time: interleaved, their temporaries add up
        s = scores(k_words, _staged_q(shared, m, lane, c.NH), c.NH)
        if const_expr(m == c.MT - 1):
            fx.rocdl.sched_barrier(0)
            v_words = pages.v(v_page)
        if const_expr(c.per_token and m == 0):
            # one scale per lane -> LDS; the lane's 16 come back as 4 broadcast reads. Only this
            # wave touches its slots, so no barrier (the wave's LDS ops stay in order). Tokens no
            # row can see hold finite scales too; in the wave max they would shrink every real
            # token's weight v_scale/vmax and with it P before its e4m3 rounding: 0 keeps them out.
            vmax, rv = stage_scales(sc_lds, sc_k, sc_v, k_sc1, v_sc1, t, wave, lane, ctx, c.QL, c.W)
        if const_expr(c.per_token):
            s = k_scaled(s, sc_lds, sc_k, grp, fenced=True)  # 4 scales at a time, not 16 next to V in flight
        s = fx.Vector.from_elements(s, dtype=fx.Float32)
        s, v_words = masked_scores(c, s, m, t, tok, ctx, hi1, v_words, zero_v=m == c.MT - 1)
        mx = fmax(fx.Float32(st[M0 + m]), row_max(s, c_qk[m]))
        v_weight = functools.partial(lane_scales, sc_lds, sc_v, grp) if const_expr(c.per_token) else None
        p_ops, p_sum = _exp_pack(s, c_qk[m], mx, c.LOG2_FMAX, v_weight)
        corr = exp2(fx.Float32(st[M0 + m]) - mx)
        l_next.append(fx.Float32(st[L0 + m]) * corr + p_sum)
        if const_expr(c.per_token):
            # sum P before P·V, else the 16 P values live through it next to the weights
            fx.rocdl.sched_barrier(0)
        p_all.append(p_ops)
        corr_all.append(corr)
        m_new.append(mx)
    if const_expr(c.W > 0):
        v_words = zero_tail_v(v_words, ctx - tok)
    return p_all, corr_all, m_new, l_next, v_words, (rv, vmax) if const_expr(c.per_token) else None


# %% [markdown]
# **The output.** After the merge each wave holds `CPW` 16-channel chunks of every row of an
# M-tile. Unsplit, it writes them in the query's dtype; a split-K partition writes float32
# partials and, from one lane group of wave 0, the row's max and sum.

# %% tags=["export"]
@device_code
def write_rows(c, o, mx, total, row, seq, kvh, part, wave, grp, num_kv_heads, o_rs, mx_rs, sm_rs):
    r, qi, g = row
    if r < c.ROWS:
        for s in range_constexpr(c.CPW):
            d0 = (c.CPW * wave + s) * 16 + grp * 4
            if const_expr(not c.SPLIT):
                out_row = (seq * c.QL + qi) * (num_kv_heads * c.G) + kvh * c.G + g
                buffer_store(o[s].to(c.QDT).bitcast(fx.Int32), o_rs, (out_row * c.HD + d0) * 2)
            else:
                prow = ((seq * num_kv_heads + kvh) * c.NPW + part) * c.ROWS + r
                buffer_store(o[s].bitcast(fx.Int32), o_rs, (prow * c.HD + d0) * 4)
        if const_expr(c.SPLIT):
            if wave == 0:
                if grp == 0:
                    prow = ((seq * num_kv_heads + kvh) * c.NPW + part) * c.ROWS + r
                    buffer_store(fx.Float32(mx * (1.0 / LOG2E)).bitcast(fx.Int32), mx_rs, prow * 4)
                    buffer_store(fx.Float32(total * (1.0 / c.FMAX)).bitcast(fx.Int32), sm_rs, prow * 4)


def merge_and_write(c, lds, shared, res, rows, v_scale, outputs, seq, kvh, part, num_kv_heads, wave, lane, col,
                    grp):
    """After the loop: merge the four waves' results (``res``, the loop state), one M-tile at a time
    with ``XS`` d-chunk slots per exchange round, and write each M-tile's rows."""
    O0, M0, L0 = 2, 2 + c.MT * c.NCH, 2 + c.MT * c.NCH + c.MT
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    store_stats(stats, [res[M0 + m] for m in range_constexpr(c.MT)], [res[L0 + m] for m in range_constexpr(c.MT)],
                wave, col)
    gpu.barrier()  # also: every wave is past its last read of the staged query
    o_rs, mx_rs, sm_rs = (rsrc(outputs[0]), None, None) if const_expr(not c.SPLIT) else tuple(rsrc(t) for t in outputs)
    for m in range_constexpr(c.MT):
        o_w = [res[O0 + m * c.NCH + j] for j in range_constexpr(c.NCH)]
        o, mx, total = merge_weights(stats, m, col, res[M0 + m], o_w, v_scale, c.SPLIT)
        o = exchange(shared, o, wave, lane, c.XS, m < c.MT - 1)
        write_rows(c, o, mx, total, rows[m], seq, kvh, part, wave, grp, num_kv_heads, o_rs, mx_rs, sm_rs)


# %% [markdown]
# ## The head_dim split of P·V
#
# Past two M-tiles the output fragments are what the register-resident loop cannot give back:
# `head_dim/4` registers per M-tile in every lane, because each wave accumulates `O` over all of
# head_dim for its own 64 tokens. Upstream's kernel splits the other way for P·V, and so do we
# (by default at every M-tile count: "Registers and occupancy" below measures both): wave `w`
# computes, for every M-tile, only the `CPW` 16-channel d-chunks `CPW·w ..` (the ones it would
# have kept after the merge), over **all 256 tokens** of the tile. Its `O` is
# `head_dim/16` registers per M-tile, a quarter. Phase A (scores on K's registers) is unchanged;
# what the split costs is sharing two things across the waves every tile:
#
# 1. **The row max.** P of all four waves' tokens now meets in one accumulator, so all of it
#    must be exponentiated against one max. Each wave writes its row maxes to a table
#    `[m-tile][row][wave]`, one barrier, and every wave reads the row's four back: every wave then
#    carries the *same* running max, and after the loop only the sums are merged. There is no
#    exchange of `O` at all: each wave already owns its channels.
# 2. **P.** Lane `(col, grp)` of wave `w` multiplies V's tokens `16·grp ..` of every span, so it
#    needs exactly the P that lane `(col, grp)` of each wave computed: the same lane index. P goes
#    through a 4 KB slab `[wave][lane] × 16` bytes: one `ds_write_b128` per lane, four
#    `ds_read_b128` back, consecutive lanes on consecutive 16 bytes (no bank conflict, no
#    transposition). One slab serves every M-tile: a barrier after each M-tile's write (its P is
#    there) and one before the next M-tile's write (every wave has read it).
#
# V: wave `w` loads its `CPW` d-chunks of each of the four spans, `4·CPW` = `NCH` dwordx4 per lane,
# chapter 2's count: the workgroup loads the same V bytes, only who loads which changes (and each
# lane needs the page ids of all four spans, 3 more 4-byte loads per tile). Per-token scales: the
# V-scale max becomes the workgroup's, through a 4-entry table read after the same barrier.
#
# Phase groups: the scores of the M-tiles of one group stay live across their max barrier, K
# across all groups. `PHASE_GROUP` (measured in "Registers and occupancy" below): at head_dim 64
# one M-tile per group fits 3 waves per SIMD; at 128 and 256 four per group keep K live for less.
# Either way a tile has `2·MT` barriers: one per group for the max, one per M-tile for P, one
# between M-tiles of a group for the slab.

# %%
figures.head_dim_split_timeline(m_tiles=4)
plt.show()

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
    per-token scales on 64-token pages (``tests/test_stage5.py`` checks every configuration)."""
    return head_dim <= 128 and not (per_token and block_size == 64)

# %% [markdown]
# Where the head_dim split's operands are: each wave still loads its own span's K (and per-token
# scales), but V by d-chunk: its `CPW` d-chunks of all four spans, so each lane needs the page ids
# of all four spans.

# %% tags=["export"]
class WidePages(LanePages):
    """``LanePages`` for the head_dim split: the wave's own span's K (and per-token scales) as
    before, and the V bytes of its ``CPW`` d-chunks in all four spans, lane ``(col, grp)`` loading
    in each span the tokens that lane ``(col, grp)`` of the span's wave scores."""

    def __init__(self, *a, cpw, **kw):
        super().__init__(*a, **kw)
        self.cpw = cpw
        self.v_chunk = 16 * (16 if kw["trans_v"] or self.bs == 16 else self.bs)  # bytes between d-chunks

    def v_page_ids(self, tile):
        """Page ids of the lane's V tokens in each of the tile's four spans (clamped like ``page_id``)."""
        ids = []
        for sp in range_constexpr(WAVES):
            idx = imin(tile * (TILE // self.bs) + sp * self.pps + self.v_j, self.last_page)
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
            voff = self.slab(ids[sp]) + self.v_lane
            for s in range_constexpr(self.cpw):
                v = buffer_load(self.v_rs, voff, 4, soffset=(self.cpw * self.wave + s) * self.v_chunk)
                out.extend([v[k] for k in range_constexpr(4)])
        return fx.Vector.from_elements(out, dtype=fx.Int32)

# %% [markdown]
# The tile's V words, and (on the tile holding the context's end) the bytes past it zeroed span by
# span: a page's unused slots may hold NaN codes, and 0·NaN is NaN inside the MFMA.

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
        part = fx.Vector.from_elements([v_all[sp * n + i] for i in range_constexpr(n)], dtype=fx.Int32)
        z = zero_tail_v(part, ctx - (t * TILE + sp * SPAN + grp * 16))
        words.extend([z[i] for i in range_constexpr(n)])
    return fx.Vector.from_elements(words, dtype=fx.Int32)

# %% [markdown]
# Phase A for a group of M-tiles: chapter 5's scores, per-token K scales and masks, then the
# wave's row max to the table instead of straight into the exponentials. Per token, the V scales'
# wave max goes to its table here too, and after the barrier every lane turns its scale into the
# weight `v_scale / max_workgroup(v_scale)`.

# %% tags=["export"]
@device_code
def wide_scores(c, ms, t, tok, ctx, k_words, shared, stats, lane, col, wave, c_qk, hi1, pt):
    """M-tiles ``ms``: their masked raw scores (kept for phase B) and this wave's row max of each
    to the max table ``[m-tile][row][wave]``."""
    s_all = []
    for m in ms:
        fx.rocdl.sched_barrier(0)
        s = scores(k_words, _staged_q(shared, m, lane, c.NH), c.NH)
        if const_expr(c.per_token):
            sc_lds, sc_k, grp = pt
            s = k_scaled(s, sc_lds, sc_k, grp, fenced=False)
        s, _ = masked_scores(c, fx.Vector.from_elements(s, dtype=fx.Float32), m, t, tok, ctx, hi1, k_words, zero_v=False)
        lds_store(stats, ((m * 16 + col) * WAVES + wave) * 4,
                  fx.Vector.from_elements([row_max(s, c_qk[m])], dtype=fx.Float32))
        s_all.append(s)
    return s_all

# %% [markdown]
# Per token, the V scales: their wave max to the table in phase A, the weight after the barrier.

# %% tags=["export"]
def wide_v_max(c, sc_lds, v_sc1, t, wave, lane, ctx):
    """The lane's live V scale (``live_v_scale``); its wave's max to the V-max table."""
    v_sc1 = live_v_scale(v_sc1, t, wave, lane, ctx, c.QL, c.W)
    lds_store(sc_lds, (c.SC_FLOATS + wave) * 4, fx.Vector.from_elements([wave_reduce(v_sc1, fmax)], dtype=fx.Float32))
    return v_sc1


def wide_v_weight(c, sc_lds, sc_v, v_sc1, lane):
    """After the max barrier: the workgroup's V-scale max and the lane's weight to its slot;
    ``(1/vmax, vmax)``."""
    vmax, rv = v_max_factors(max4(lds_load(sc_lds, c.SC_FLOATS * 4, WAVES)))
    lds_store(sc_lds, sc_v + lane * 4, fx.Vector.from_elements([v_sc1 * rv], dtype=fx.Float32))
    return rv, vmax

# %% [markdown]
# Phase B, one M-tile at a time: the workgroup's row max from the table, P of the wave's own
# tokens into the slab, the barrier, and P·V of the wave's d-chunks over the four spans (V as A,
# P of span `sp` as B: 8 MFMAs per d-chunk instead of 2).

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
        lds_store(pslab, (wave * WAVE + lane) * 16, fx.Vector.from_elements(p_ops, dtype=fx.Int64).bitcast(fx.Float32))
        gpu.barrier()  # every wave's P of this M-tile is in the slab
        ps = [lds_load(pslab, (sp * WAVE + lane) * 16, 4).bitcast(fx.Int64) for sp in range_constexpr(WAVES)]
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
# The loop of the head_dim split, and after it the merge: the max is already the workgroup's, so
# only the row sums cross waves (through the max table, now free), and each wave writes its own
# d-chunks with chapter 5's `write_rows`.

# %% tags=["export"]
@device_code
def wide_loop(c, k, wp, t_start, t_end, first_pages):
    """The main loop of the head_dim split (``k``: the kernel's per-workgroup values; ``first_pages``:
    tile ``t_start``'s K and four V page ids); returns its final state ``[k page, 4 V pages, O, m, l]``."""
    MT = c.MT
    state = list(first_pages)
    state += [fx.Vector.filled(4, 0.0, fx.Float32)] * (MT * c.CPW) + [fx.Float32(MASKED)] * MT + [fx.Float32(0.0)] * MT
    for t, st in range(t_start, t_end, 1, init=state):
        t = fx.Int32(t)
        v_ids = [st[1 + sp] for sp in range_constexpr(WAVES)]
        pt_a = pt_b = None
        if const_expr(c.per_token):
            own = wp.own(v_ids)
            k_sc1, v_sc1 = wp.scale(k.ks_rs, own), wp.scale(k.vs_rs, own)  # the oldest loads
        k_words = wp.k(st[0])
        if const_expr(c.V_WITH_K):
            v_all = wide_v(c, wp, v_ids, t, k.ctx, k.grp)  # V in flight with K: one wait a tile, not two
        k_next, v_next = wp.page_id(t + 1, wp.k_j), wp.v_page_ids(t + 1)
        fx.rocdl.sched_barrier(0)
        tok = t * TILE + k.wave * SPAN + k.grp * 16  # the lane's first token
        if const_expr(c.per_token):
            lds_store(k.sc_lds, k.sc_k + k.lane * 4, fx.Vector.from_elements([k_sc1], dtype=fx.Float32))
            v_sc1 = wide_v_max(c, k.sc_lds, v_sc1, t, k.wave, k.lane, k.ctx)
            pt_a = (k.sc_lds, k.sc_k, k.grp)
        o_all, m_all, l_all = [], [], []
        for g0 in range_constexpr(0, MT, c.MB):
            ms = list(range(g0, min(g0 + c.MB, MT)))
            s_all = wide_scores(c, ms, t, tok, k.ctx, k_words, k.shared, k.stats, k.lane, k.col, k.wave, k.c_qk,
                                k.hi1, pt_a)
            if const_expr(g0 == 0 and not c.V_WITH_K):
                fx.rocdl.sched_barrier(0)
                v_all = wide_v(c, wp, v_ids, t, k.ctx, k.grp)  # V after the first group's scores
            gpu.barrier()  # every wave's row maxes (and V-scale max) are in the tables
            if const_expr(g0 == 0 and c.per_token):
                rv, vmax = wide_v_weight(c, k.sc_lds, k.sc_v, v_sc1, k.lane)
                pt_b = (k.sc_lds, k.sc_v, k.grp, rv, vmax)
            o_g, m_g, l_g = wide_pv(c, ms, st, s_all, v_all, k.stats, k.pslab, k.lane, k.col, k.wave, k.c_qk, pt_b)
            o_all, m_all, l_all = o_all + o_g, m_all + m_g, l_all + l_g
        res = yield [k_next] + v_next + o_all + m_all + l_all
    return res

# %% [markdown]
# The merge after the loop, and the output.

# %% tags=["export"]
def wide_merge_and_write(c, k, res, rows, v_scale, outputs, part, num_kv_heads):
    """The four waves' row sums, and each wave's d-chunks of every M-tile written."""
    O0 = 1 + WAVES
    M0, L0 = O0 + c.MT * c.CPW, O0 + c.MT * c.CPW + c.MT
    for m in range_constexpr(c.MT):
        lw = row_reduce(fx.Float32(res[L0 + m]), operator.add)
        lds_store(k.stats, ((m * 16 + k.col) * WAVES + k.wave) * 4, fx.Vector.from_elements([lw], dtype=fx.Float32))
    gpu.barrier()
    o_rs, mx_rs, sm_rs = (rsrc(outputs[0]), None, None) if const_expr(not c.SPLIT) else tuple(rsrc(t) for t in outputs)
    for m in range_constexpr(c.MT):
        l4 = lds_load(k.stats, (m * 16 + k.col) * WAVES * 4, WAVES)
        total = (fx.Float32(l4[0]) + fx.Float32(l4[1])) + (fx.Float32(l4[2]) + fx.Float32(l4[3]))
        f = rcp(total)
        if const_expr(v_scale is not None):
            f = f * v_scale
        if const_expr(c.SPLIT):
            f = fx.Float32(select(total > 0.0, f, fx.Float32(0.0)))  # empty partition row: 0, not 0·inf
        o = [fx.Vector(res[O0 + m * c.CPW + s]) * splat4(f) for s in range_constexpr(c.CPW)]
        write_rows(c, o, fx.Float32(res[M0 + m]), total, rows[m], k.slot, k.kvh, part, k.wave, k.grp, num_kv_heads,
                   o_rs, mx_rs, sm_rs)

# %% [markdown]
# **The kernel**, in four more pieces and then put together. First, which work a workgroup does:
# its sequence, KV head and M-group from the block ids and its partition from grid z, or, with
# chapter 6's work list, the entry it was handed.

# %% tags=["export"]
@device_code
def workgroup_work(c, work_list):
    """``(seq, slot, kvh, mgrp, part, listed, live)`` of this workgroup: ``slot`` is where its
    partials go; with a work list (``c.WL``) workgroup x does entry x, ``(sequence, first tile,
    end tile, 0)``: ``listed`` is that tile range and ``live`` is False for an empty entry (past
    the batch's last chunk), which reads no query."""
    seq, by, part = fx.Int32(gpu.block_id("x")), fx.Int32(gpu.block_id("y")), fx.Int32(gpu.block_id("z"))
    kvh, mgrp = by // c.MG, by % c.MG
    slot, listed, live = seq, None, None
    if const_expr(c.WL):
        seq = scalar_load(work_list, slot * 4)
        listed = (scalar_load(work_list, slot * 4 + 1), scalar_load(work_list, slot * 4 + 2))
        live = listed[0] < listed[1]
    return seq, slot, kvh, mgrp, part, listed, live

# %% [markdown]
# The lane's page readers, and the first tile's page ids issued before the query is staged: their
# latency runs alongside the query's instead of after the staging barrier (one memory wait less
# per workgroup; chapter 6's short workgroups pay it once each).

# %% tags=["export"]
@device_code
def page_readers(c, bt_rs, k_rs, v_rs, seq, max_blocks, last_page, kvh, num_kv_heads, wave, lane, col, grp,
                 t_start):
    """``(pages, wp, first_pages)``: the lane's ``LanePages``, its ``WidePages`` for the head_dim
    split (else None), and tile ``t_start``'s K and V page ids (four V ids for the split)."""
    pages = LanePages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave, lane, col,
                      grp, block_size=c.BS, head_dim=c.HD, trans_v=c.trans_v)
    wp = None
    if const_expr(c.WIDE):
        wp = WidePages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave, lane, col, grp,
                       block_size=c.BS, head_dim=c.HD, trans_v=c.trans_v, cpw=c.CPW)
        first_pages = [wp.page_id(t_start, wp.k_j)] + wp.v_page_ids(t_start)
    else:
        first_pages = [pages.page_id(t_start, pages.k_j), pages.page_id(t_start, pages.v_j)]
    return pages, wp, first_pages

# %% [markdown]
# Per token, the scale buffers and this wave's LDS slots for the tile's 64 K scales and 64 V
# weights, added to `k`, the kernel's per-workgroup values that both loops read.

# %% tags=["export"]
def per_token_slots(k, lds, key_scale, value_scale, wave):
    """Add the K/V scale buffers (``ks_rs``, ``vs_rs``), the scales' LDS (``sc_lds``) and this
    wave's slots in it (``sc_k``: its 64 K scales, then ``sc_v``: its 64 V weights) to ``k``."""
    k.ks_rs, k.vs_rs = rsrc(key_scale), rsrc(value_scale)
    k.sc_lds = fx.recast_iter(fx.Uint8, lds.scales.ptr)
    k.sc_k = wave * (2 * WAVE * 4)
    k.sc_v = k.sc_k + WAVE * 4

# %% [markdown]
# The register-resident main loop (the baseline the head_dim split is measured against): per
# tile the loads (per-token scales first, then K, then the next tile's page ids), phase A, phase
# B; the next tile's page ids are carried in the loop state.

# %% tags=["export"]
@device_code
def resident_loop(c, k, pages, t_start, t_end, first_pages):
    """The register-resident main loop (``k``: the kernel's per-workgroup values; ``first_pages``:
    tile ``t_start``'s K and V page ids); returns its final state ``[k page, v page, O, m, l]``."""
    MT, NCH = c.MT, c.NCH
    zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
    state = list(first_pages)
    state += [zero4] * (MT * NCH) + [fx.Float32(MASKED)] * MT + [fx.Float32(0.0)] * MT
    O0 = 2
    for t, st in range(t_start, t_end, 1, init=state):
        t = fx.Int32(t)
        k_page, v_page = st[0], st[1]
        pt_args = None
        if const_expr(c.per_token):
            k_sc1 = pages.scale(k.ks_rs, v_page)  # issued first: the oldest loads, waited for first
            v_sc1 = pages.scale(k.vs_rs, v_page)
            pt_args = (k.sc_lds, k.sc_k, k.sc_v, k_sc1, v_sc1, k.wave, k.grp)
        k_words = pages.k(k_page)
        k_page_next = pages.page_id(t + 1, pages.k_j)
        v_page_next = pages.page_id(t + 1, pages.v_j)
        fx.rocdl.sched_barrier(0)  # K (and scales, page ids) ahead of phase A
        tok = t * TILE + k.wave * SPAN + k.grp * 16  # the lane's first token
        p_all, corr_all, m_new, l_next, v_words, pt = phase_a(c, st, t, tok, k.ctx, k_words, pages, v_page,
                                                              k.shared, k.lane, k.c_qk, k.hi1, pt_args)
        # phase B: every M-tile's P·V on V's registers (V as A, P as B: O is [d, row])
        o_next = phase_b([st[O0 + i] for i in range_constexpr(MT * NCH)], v_words, p_all, corr_all, pt)
        res = yield [k_page_next, v_page_next] + o_next + m_new + l_next
    return res

# %% [markdown]
# The kernel, put together: the workgroup's work and buffers, the first page ids, the query
# staged and its score factors, then one of the two main loops and its merge of the four waves,
# one M-tile at a time, and the output.

# %% tags=["export"]
def make_kernel(c):
    """The kernel function of specialization ``c`` (a :class:`Spec`)."""
    Shared = lds_layout(c)

    def pa_decode_s5(
        out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
        query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor, block_tables: fx.Tensor,
        context_lengths: fx.Tensor, work_list: fx.Tensor, key_scale: fx.Tensor, value_scale: fx.Tensor,
        num_kv_heads: fx.Int32, max_blocks: fx.Int32, q_stride_row: fx.Int32, q_stride_head: fx.Int32,
        scale_log2: fx.Float32,
    ):
        # col: MFMA column = this lane's query row within an M-tile; grp: its 16 tokens of the wave's 64
        tid, wave, lane, col, grp = lane_coords()
        seq, slot, kvh, mgrp, part, listed, live = workgroup_work(c, work_list)
        q_rs, k_rs, v_rs, bt_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables))
        ctx = scalar_load(context_lengths, seq)
        lds = fx.SharedAllocator().allocate(Shared).peek()
        shared = fx.recast_iter(fx.Uint8, lds.shared.ptr)
        rows = query_rows(mgrp, col, c.MT, c.ROWS, c.QL, c.G)
        k_scale = v_scale = None
        if const_expr(not c.per_token):
            k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
            v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        last_page, t_start, t_end = tile_range(ctx, part, c.BS, c.QL, c.W, c.NP, listed)
        # the first tile's page ids go out before the query is staged: their wait overlaps the query's
        pages, wp, first_pages = page_readers(c, bt_rs, k_rs, v_rs, seq, max_blocks, last_page, kvh, num_kv_heads,
                                              wave, lane, col, grp, t_start)
        stage_query(c, shared, rows, q_rs, seq, kvh, q_stride_row, q_stride_head, wave, lane, grp, live)
        c_qk = score_factors(c, shared, lane, scale_log2, k_scale)
        # causal bound of each row: query qi sits at ctx - QL + qi and sees tokens <= it
        hi1 = [ctx - (c.QL - 1) + rows[m][1] for m in range_constexpr(c.MT)]
        k = types.SimpleNamespace(shared=shared, lane=lane, col=col, wave=wave, grp=grp, seq=seq, slot=slot,
                                  kvh=kvh, ctx=ctx, c_qk=c_qk, hi1=hi1)
        if const_expr(c.per_token):
            per_token_slots(k, lds, key_scale, value_scale, wave)
        outputs = (out,) if const_expr(not c.SPLIT) else (pout, pmax, psum)
        if const_expr(c.WIDE):  # P·V split by head_dim ("The head_dim split of P·V")
            k.stats, k.pslab = fx.recast_iter(fx.Uint8, lds.stats.ptr), fx.recast_iter(fx.Uint8, lds.pslab.ptr)
            res = wide_loop(c, k, wp, t_start, t_end, first_pages)
            wide_merge_and_write(c, k, res, rows, v_scale, outputs, part, num_kv_heads)
            return
        res = resident_loop(c, k, pages, t_start, t_end, first_pages)
        merge_and_write(c, lds, shared, res, rows, v_scale, outputs, slot, kvh, part, num_kv_heads, wave, lane, col, grp)

    return pa_decode_s5


# %% [markdown]
# `build_launcher` caches one launcher per specialization. With `num_partitions` > 1, workgroup
# z handles tiles `[z·tpp, min((z+1)·tpp, num_tiles))`, `tpp = ceil(num_tiles / num_partitions)`,
# and writes partial results instead of `out`: `pmax`/`psum` [num_seqs, num_kv_heads,
# num_partitions, rows] float32 (the partition's row max of `softmax_scale·q·k` in natural-log
# units, and `Σ exp(score - pmax)`) and `pout` [..., rows, head_dim] float32 (the partition's
# *normalized* output `Σ p·v / Σ p`, V scales applied). A partition with no visible token for a
# row writes pmax = MASKED/ln 2 (about -6.9e29, a finite -inf), psum = 0, pout = 0.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(arch, block_size, head_dim, group, query_length, q_dtype="f16", per_token=False,
                   trans_v=True, sliding_window=0, num_partitions=1, m_tiles=None, work_list=False):
    """The ``@flyc.jit`` launcher for one specialization (every argument is a compile-time constant;
    the partials of a split are described above; ``work_list``: chapter 6's balanced split)."""
    c = Spec(arch, block_size, head_dim, group, query_length, q_dtype, per_token, trans_v, sliding_window,
             num_partitions, m_tiles, work_list)
    # launch(out, pmax, psum, pout, query, ..., value_scale, num_seqs, num_kv_heads, ..., scale_log2, stream)
    return jit_launcher(make_kernel(c), grid_yz=lambda a: (a["num_kv_heads"] * c.MG, c.NP))


# %% [markdown]
# ## Entry points and validation
#
# `paged_decode` validates every argument (TypeError/ValueError naming it) before anything is
# compiled, infers `query_length` from `query.shape[0] / num_seqs` unless given, picks the V
# layout from its rank and the scale kind from its shape. `paged_decode_partials` is the
# split-K half used by chapter 6.

# %% tags=["export"]
def kernel_args(p, first, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale):
    """The launcher's arguments for a validated problem ``p``: ``first`` is ``(out, pmax, psum, pout)``
    (the unsplit kernel writes only ``out``; a split writes only the partials). The work list's
    place holds ``context_lengths`` again: only chapter 6's balanced split reads one."""
    return tuple(first) + (
        query, key_cache.view(torch.uint8), value_cache.view(torch.uint8), block_tables, context_lengths,
        context_lengths, key_scale, value_scale, p.num_seqs, p.num_kv_heads, p.max_blocks, query.stride(0),
        query.stride(1), p.scale_log2,
    )


def check_partial_offsets(p, slots, m_tiles=None, *, split=""):
    """Refuse a split whose partial outputs (``slots`` per KV head, each ``rows x head_dim`` float32)
    reach past the kernel's 32-bit byte offsets. ``split`` names it in the error."""
    rows = plan(p.head_dim, p.group, p.query_length, m_tiles)[0]
    if slots * p.num_kv_heads * rows * p.head_dim * 4 >= 2**31:
        raise ValueError(f"num_partitions: {split or f'{slots} partial slots'} needs partial outputs beyond the "
                         "kernel's 32-bit byte offsets; use fewer partitions")
    return rows


def partial_shapes(p, num_partitions, m_tiles=None):
    """Shapes of ``(pmax, psum, pout)`` for a split into ``num_partitions``; a split whose byte offsets
    would not fit the kernel's 32 bits is refused."""
    rows = check_partial_offsets(p, p.num_seqs * num_partitions, m_tiles,
                                 split=f"{num_partitions} partitions of {p.num_seqs} sequences")
    stats = (p.num_seqs, p.num_kv_heads, num_partitions, rows)
    return stats, stats, stats + (p.head_dim,)


def _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, softmax_scale,
              query_length, sliding_window, arch, num_partitions, m_tiles):
    problem.int_option(num_partitions, "num_partitions", 1, LIMITS.max_partitions)
    if m_tiles is not None:
        problem.int_option(m_tiles, "m_tiles", 1, LIMITS.max_m_tiles)
    return problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                            limits=LIMITS, softmax_scale=softmax_scale, query_length=query_length,
                            sliding_window=sliding_window, arch=arch)


def launcher_for(p, num_partitions=1, m_tiles=None, work_list=False):
    """The compiled-once launcher for a validated problem."""
    return build_launcher(p.arch, p.block_size, p.head_dim, p.group, p.query_length, p.q_dtype, p.per_token,
                          p.v_layout == "trans_blocked", p.sliding_window, num_partitions, m_tiles, work_list)


# %% [markdown]
# The two entry points build on one `launch_args`: validate, allocate the outputs (or the
# partials of a split), and hand the compiled-once launcher to the launch boundary.

# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, query_length=None, sliding_window=0, out=None, arch=None,
                num_partitions=1, m_tiles=None):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel,
    ``pa_tile.toolchain.compile_isa(launcher, *args, arch=arch)`` shows its assembly. With
    ``num_partitions`` > 1 the partial buffers are ``args[1:4]`` and ``out`` is unused."""
    p = _describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                  softmax_scale, query_length, sliding_window, arch, num_partitions, m_tiles)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    if num_partitions > 1:
        shapes = partial_shapes(p, num_partitions, m_tiles)
        first = (torch.empty(1, dtype=query.dtype, device=query.device),) + tuple(
            torch.empty(s, dtype=torch.float32, device=query.device) for s in shapes)
    else:
        d = torch.empty(1, dtype=torch.float32, device=query.device)
        first = (problem.output(p, query, out), d, d, d)
    args = kernel_args(p, first, query, key_cache, value_cache, block_tables, context_lengths, ks, vs)
    return launcher_for(p, num_partitions, m_tiles), args, p.arch

# %% [markdown]
# The entry point launches what `launch_args` returns and hands back the output.

# %% tags=["export"]
def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, query_length=None, sliding_window=0, out=None, arch=None, m_tiles=None):
    """fp8 paged decode attention with MTP and GQA; returns ``out`` (shaped and typed like ``query``).

    ``query`` [num_seqs·query_length, num_q_heads, 64|128|256] f16/bf16 (row ``s·query_length + i`` is
    query ``i`` of sequence ``s``; rows and heads may be strided); ``key_cache`` blocked
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
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, query_length=query_length,
                                       sliding_window=sliding_window, out=out, arch=arch, m_tiles=m_tiles)
    launching.launch(launcher, args, arch=arch)
    return args[0]


def paged_decode_partials(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                          num_partitions, softmax_scale=None, query_length=None, sliding_window=0, arch=None,
                          m_tiles=None):
    """The split-K half of chapter 6: ``(pmax, psum, pout)`` of each of ``num_partitions``
    partitions (layouts and empty-partition values: the notes before ``build_launcher``)."""
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, query_length=query_length,
                                       sliding_window=sliding_window, arch=arch, num_partitions=num_partitions,
                                       m_tiles=m_tiles)
    launching.launch(launcher, args, arch=arch)
    return args[1], args[2], args[3]


# %% [markdown]
# ## Does it work?
#
# The compiled gfx942 / gfx950 code runs in the emulator against the float32 reference on the
# ragged contexts (1, 17, 256, 1027; raised to `query_length` where needed) with shuffled pages and
# `-1` in unused block-table entries, across the widened scope. Checked as in chapter 2: every
# element within the fp8 bound (`case.error_bound()`; per-token V scales round P·v_scale/vmax
# once, inside P's 2⁻⁴). `of_bound` is the worst error over its bound.

# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %%
def make(arch, bs, hd, g, ql, scales="per-tensor", qdt=torch.float16, contexts=cache.RAGGED_CONTEXTS, seed=1,
         device=None):
    """A case on ``device`` (default: where kernels run here; "cpu" for compile-only cells)."""
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g, 1, hd, bs, ctx, query_length=ql, fp8_format=fp8_format(arch), scales=scales,
                           query_dtype=qdt, seed=seed, pad_block_id=-1, device=device)


def inputs(case, trans_v=True):
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    return (case.query, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale, case.v_scale)

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
        out = paged_decode(*inputs(case, tv), sliding_window=w, m_tiles=mt, arch=arch).cpu()
        ok, of_bound, mean_err = case.check(out, sliding_window=w)
        rows.append(dict(arch=arch, block=bs, head_dim=hd, group=g, query_len=ql, scales=sc, q=str(qdt)[6:],
                         v="trans" if tv else "plain", window=w, m_tiles=plan(hd, g, ql, mt)[2],
                         of_bound=round(of_bound, 2), mean_err=f"{mean_err:.4f}", ok=ok))
print(format_table(rows))
assert all(r["ok"] for r in rows)

# %% [markdown]
# ### A row that sees nothing in most of the tile
#
# A window of one token: each of the 4 query rows sees only its own position, so three of the
# four waves see nothing for any row, and every row's only token gets `P = FP8_MAX` exactly.
# The output must be that token's V row, to the last bit of the f16 rounding.

# %%
case = make(backend.default_arch(), 16, 128, 8, 4, contexts=[600], seed=7)
out = paged_decode(*inputs(case), sliding_window=1).float().cpu()
v = cache.dequantize(case.v_cache, case.fp8_format, case.v_scale).float().cpu()
want = torch.stack([v[int(case.block_tables[0, t // 16]), 0, t % 16] for t in range(596, 600)])
print("max |out - v[own token]| =", float((out - want[:, None, :]).abs().max()),
      " finite:", bool(torch.isfinite(out).all()))
torch.testing.assert_close(out, want[:, None, :].expand_as(out), rtol=2**-10, atol=0)

# %% [markdown]
# ### Short contexts with per-token scales
#
# Contexts 1, 2 and 17 on both arches: the mean error of each sequence, and the 1-token sequence
# against its V row. Its token is the only live one in the V-scale max, so its weight is 1 and
# `P = FP8_MAX`, exactly as per tensor. (Before the tail slots were kept out of the max this row
# read 0.03–0.05 on gfx950.)

# %% tags=["nbval-ignore-output"]
short = []
for arch in backend.runnable_archs():
    for bs, hd, g in ((16, 128, 8), (64, 64, 1)):
        case = make(arch, bs, hd, g, 1, "per-token", contexts=[1, 2, 17])
        out = paged_decode(*inputs(case), arch=arch).float().cpu()
        err = (out - case.reference().float().cpu()).abs()
        v = cache.dequantize(case.v_cache, case.fp8_format, case.v_scale).float().cpu()
        torch.testing.assert_close(out[0], v[int(case.block_tables[0, 0]), 0, 0].expand(g, -1), rtol=2**-10, atol=0)
        short.append(dict(arch=arch, block=bs, head_dim=hd, group=g, **{f"mean_err_ctx{n}": f"{float(e):.4f}"
                     for n, e in zip((1, 2, 17), err.mean((1, 2)))}, mean_err_all=f"{float(err.mean()):.4f}"))
print(format_table(short))

# %% [markdown]
# ## Registers and occupancy against M-tiles per workgroup
#
# Measured on the compiled code (gfx942, block 16, bf16, trans-blocked V, query_length 4, group 16 =
# 4 M-tiles), both designs: one, two or four M-tiles per workgroup (4, 2 or 1 workgroups per KV
# head), in the register-resident loop (compiled with `WIDE_ABOVE` raised for the comparison) and
# with P·V split by head_dim (the default).

# %%
def compiled(arch, bs, hd, g, ql, scales="per-tensor", m_tiles=None, stage=5):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, g, 1, hd, bs, 20, query_length=ql, fp8_format=fp8_format(arch), scales=scales,
                           query_dtype=torch.bfloat16, device="cpu")
    launcher, args, arch = launch_args(*inputs(case), m_tiles=m_tiles, arch=arch)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))


def register_resident(*args, **kw):
    """``compiled`` with the register-resident loop at every M-tile count (a comparison, not a default)."""
    global WIDE_ABOVE
    WIDE_ABOVE = LIMITS.max_m_tiles
    build_launcher.cache_clear()
    try:
        return compiled(*args, **kw)
    finally:
        WIDE_ABOVE = 0
        build_launcher.cache_clear()


reg_rows = []
for hd in (64, 128, 256):
    for mt in (1, 2, 4):
        row = dict(head_dim=hd, m_tiles_per_wg=mt, workgroups_per_kv_head=plan(hd, 16, 4, mt)[3])
        for name, build in (("resident", register_resident), ("split", compiled)):
            st = build("gfx942", 16, hd, 16, 4, m_tiles=mt)
            assert st.scratch_bytes == 0
            row.update({f"{name}_vgpr": st.vgpr_unified, f"{name}_waves": isa.occupancy(st, "gfx942").waves_per_simd,
                        f"{name}_lds": st.lds_bytes, f"{name}_barriers": st.main_loop.families.get("barrier", 0)})
        reg_rows.append(row)
print(format_table(reg_rows))

# %% [markdown]
# In the register-resident loop each extra M-tile costs ~36–90 registers: its output fragment,
# packed P and stats; four at head_dim 128 need ~270, one wave per SIMD, which is why that loop
# stopped at two M-tiles and gave the others more workgroups (each re-reading K and V). Split by
# head_dim, the output is a quarter and the registers are fewer at **every** M-tile count: four
# M-tiles take ~210 at head_dim 128 (2 waves per SIMD; upstream: 246 / 2) and ~165 at 64 (3
# waves; upstream: 171 / 2), and one M-tile at head_dim 256 fits 3 waves instead of 2. The price
# is `2·MT` barriers per tile and 2–4 KB more LDS (the P slab; all within upstream's LDS). The
# timing model (chapter 7) predicts the split faster too, at small and large batch alike (stage 6
# on MI300X at one and two M-tiles, batch 3 to 128: 5–20 % faster, predicted): so it is the
# default at every M-tile count. `PHASE_GROUP` came from this table too: one M-tile per phase
# group at head_dim 64 was the step from 2 waves per SIMD to 3 (~175 registers with four per
# group).
#
# ## Against the upstream tile kernel
#
# The recorded figures of FlyDSL's `pa_decode_tile` (`pa_tile/data/upstream_pa_decode_tile_isa.md`,
# read by `pa_tile.upstream`; bf16 query, trans-blocked V, one partition) next to this kernel with
# its default plan, for gfx942 (`tests/test_stage5.py` checks all 96 configurations of both arches):
# the figure shows each configuration's margin over upstream, the table the configurations quoted
# in this chapter (block 16, group 16, per-tensor scales).

# %%
from pa_tile import upstream  # noqa: E402

UP942 = {  # (block, head_dim, query_length, group, per_token) -> (VGPR+AGPR, waves/SIMD, LDS), upstream, gfx942
    (r["block"], r["head_dim"], r["query_len"], r["group"], int(r["per_token"])): (r["vgpr"], r["occ"], r["lds"])
    for r in upstream.tile_isa_figures() if r["arch"] == "gfx942"
}
up_rows = []
for (bs, hd, ql, g, tok), (uv, uo, ul) in tqdm(UP942.items(), desc="compile"):
    st = compiled("gfx942", bs, hd, g, ql, "per-token" if tok else "per-tensor")
    occ = isa.occupancy(st, "gfx942").waves_per_simd
    up_rows.append(dict(block=bs, head_dim=hd, query_len=ql, group=g, scales="token" if tok else "tensor",
                        vgpr=st.vgpr_unified, upstream_vgpr=uv, waves=occ, upstream_waves=uo,
                        lds=st.lds_bytes, upstream_lds=ul, spill=st.vgpr_spill + st.scratch_bytes,
                        meets=("yes" if st.vgpr_unified <= uv and occ >= uo and st.lds_bytes <= ul else "NO")))
figures.upstream_margins(up_rows, [("VGPR+AGPR", "vgpr", "upstream_vgpr", False),
                                   ("waves/SIMD", "waves", "upstream_waves", True), ("LDS bytes", "lds", "upstream_lds", False)],
                         marker="block", title="This kernel against upstream's pa_decode_tile, gfx942: each configuration's margin")
plt.show()
print(format_table([r for r in up_rows if (r["block"], r["group"], r["scales"]) == (16, 16, "tensor")]))
print(sum(r["meets"] == "yes" for r in up_rows), "of", len(up_rows), "meet or beat upstream",
      f"(ROCm/FlyDSL {upstream.UPSTREAM_COMMIT[:8]}, compiled here with flydsl {upstream.FLYDSL_VERSION})")
assert all(r["meets"] == "yes" and r["spill"] == 0 for r in up_rows)

# %% [markdown]
# Registers, occupancy and LDS meet or beat upstream in all 48 configurations (all 96 with gfx950),
# like for like: with four M-tiles (`query_length` 4, group 16) both keep all four in one
# workgroup and read K and V once, and both split P·V by head_dim. Before that split the
# register-resident loop had to get under upstream's budget on its own, and the first version of
# this chapter was **short on 19 of the 64 configurations**. How it got there is the next
# section: its three changes (V after phase A, P summed before P·V, per-token scales through
# LDS) are in the split's loop too.
#
# ## Fitting upstream's register budget
#
# The register-resident loop, one M-tile, head_dim 128. Upstream splits head_dim across the waves
# for P·V, so its output fragment is a quarter of ours (8 registers against 32); that loop keeps
# chapter 2's wave-private `O` and has to win the 24 registers back elsewhere. Where the peak was,
# per lane:
#
# | live at the peak | first version | now |
# |---|---|---|
# | `O` (head_dim/16 · 4) | 32 | 32 |
# | K (in phase A) | 32 | 32 in phase A only |
# | V (loaded with K, in flight during phase A) | 32 | 32 in phase B only, in K's registers |
# | Q, 16 scores | 8 + 16 | 8 + 16 |
# | 16 P values after the pack (summed only after the P·V MFMAs) | 16 | 0: summed first |
# | per-token: 16 K scales + 16 V scales per lane | 32 | 1 + 1 (the rest in LDS, 4 read at a time) |
#
# Three changes, all in the loop body above:
#
# 1. **V after phase A.** V used to be issued with K so that its latency hid behind phase A; that
#    put K, V, O and Q all in registers at once. Issued right after the score MFMAs, V lands in
#    the registers K just freed; the row max, exp and pack (and the other waves: the kernel keeps
#    4 per SIMD) cover its latency.
# 2. **Sum P before P·V** (per-token scales). LLVM scheduled the denominator's adds after the
#    MFMAs, keeping all 16 exponentials alive through them; a `sched_barrier` after the sum ends
#    them at the pack. (Per tensor that order costs no register and saves some waits: left alone.)
# 3. **Per-token scales through LDS.** A lane needs the 16 scales of its row band, which the 16
#    lanes of the band used to load (and hold) redundantly. Now each lane loads one, the wave
#    writes them to its own LDS slot, and each lane reads 4 at a time right where they are used,
#    fenced by `sched_barrier`s so the compiler cannot hoist all four reads into the peak.
#
# Effect on the 19 configurations that were short (gfx942 and gfx950, `query_length` 1, one M-tile;
# combined VGPR+AGPR and waves per SIMD; the "before" column was measured on the first version
# of this chapter):
#
# | arch | block | head_dim | group | scales | before | now | upstream |
# |---|---|---|---|---|---|---|---|
# | gfx942 | 16 | 64 | 8 | token | 102 / 4 | 86 / 5 | 98 / 4 |
# | gfx942 | 16 | 64 | 16 | token | 102 / 4 | 86 / 5 | 100 / 4 |
# | gfx942 | 16 | 128 | 8 | tensor | 124 / 4 | 116 / 4 | 122 / 4 |
# | gfx942 | 16 | 128 | 8 | token | 146 / 3 | 122 / 4 | 134 / 3 |
# | gfx942 | 16 | 128 | 16 | tensor | 124 / 4 | 116 / 4 | 118 / 4 |
# | gfx942 | 16 | 128 | 16 | token | 146 / 3 | 122 / 4 | 134 / 3 |
# | gfx942 | 64 | 64 | 8 | token | 102 / 4 | 82 / 5 | 100 / 4 |
# | gfx942 | 64 | 128 | 8 | tensor | 122 / 4 | 114 / 4 | 118 / 4 |
# | gfx942 | 64 | 128 | 8 | token | 145 / 3 | 120 / 4 | 126 / 4 |
# | gfx942 | 64 | 128 | 16 | token | 145 / 3 | 120 / 4 | 128 / 4 |
# | gfx950 | 16 | 64 | 8 | token | 102 / 4 | 86 / 5 | 99 / 4 |
# | gfx950 | 16 | 64 | 16 | token | 102 / 4 | 86 / 5 | 97 / 4 |
# | gfx950 | 16 | 128 | 8 | tensor | 124 / 4 | 114 / 4 | 120 / 4 |
# | gfx950 | 16 | 128 | 8 | token | 140 / 3 | 122 / 4 | 134 / 3 |
# | gfx950 | 16 | 128 | 16 | tensor | 124 / 4 | 114 / 4 | 120 / 4 |
# | gfx950 | 16 | 128 | 16 | token | 140 / 3 | 122 / 4 | 134 / 3 |
# | gfx950 | 64 | 128 | 8 | token | 140 / 3 | 118 / 4 | 126 / 4 |
# | gfx950 | 64 | 128 | 16 | tensor | 122 / 4 | 112 / 4 | 120 / 4 |
# | gfx950 | 64 | 128 | 16 | token | 140 / 3 | 118 / 4 | 128 / 4 |
#
# All 64 head_dim 64/128 configurations now met or beat upstream (the live table above is gfx942;
# `tests/test_stage5.py` checks both arches). Per-token scales now cost 6 registers over
# per-tensor instead of 22, and 2 KB of LDS (LDS does not bound occupancy here). (The table is
# history: staging the query in LDS later took Q's 8 registers out of the loop too, and the
# live table above is the current kernel.) The price is
# latency: V's loads are no longer hidden behind phase A, and the scales take an LDS round trip.
# The next section puts a number on that price and takes most of it back.
#
# ## When to load V
#
# The head_dim split's loop inherited the order above: K at the top of the iteration, V after the
# score MFMAs. A tile then waits for memory twice in series, for K before the scores and for V
# before P·V, and at decode batch sizes nothing covers either wait: 16 sequences of one KV head are
# 16 workgroups (split, a few hundred of a few tiles each), about one per CU, one wave per SIMD. Issued
# right after K, V's latency runs alongside K's and a tile waits once. It costs V's words in
# registers through the scores, but the split's P·V holds only a quarter of the output, so that
# fits upstream's register and occupancy figures everywhere except head_dim 256 and per-token
# scales on 64-token pages (`v_with_k`; the live table of the previous section is this kernel).
#
# Both orders, compiled and emulated, walked by the timing model of chapter 7 (its walker replays
# each wave's instructions with the published latencies; which blocks a tile runs comes from the
# emulator's count of every line): registers, waves per SIMD, memory latencies one tile waits out
# in series, and the predicted time of this stage and of chapter 6's finished kernel at the shape
# every chapter ends with (MI300X; a model, not a measurement).

# %% tags=["nbval-ignore-output"]
import contextlib  # noqa: E402

from pa_tile.perf import model, speedup  # noqa: E402
from pa_tile.stages import s5_phase_split_mtp as s5_package  # noqa: E402


@contextlib.contextmanager
def v_after_scores():
    """The package's stage 5 (and chapter 6's kernel, built on it) with V issued after the scores."""
    keep = s5_package.v_with_k
    s5_package.v_with_k = lambda *a: False
    s5_package.build_launcher.cache_clear()
    try:
        yield
    finally:
        s5_package.v_with_k = keep
        s5_package.build_launcher.cache_clear()


if backend.current_backend() == "emu":  # the model's samples are emulator traces
    order_rows = []
    for name, order in (("after the scores", v_after_scores), ("with K (default)", contextlib.nullcontext)):
        with order():
            smp = model.sample_stage("s5", speedup.HEADLINE, "gfx942")
            code = model.kernel_code(smp.main_asm, hw="mi300x", line_counts=smp.line_per_tile)
            row = dict(V=name, vgpr=code.vgpr_unified, waves_per_simd=code.workgroups_per_cu,
                       latencies_per_tile=f"{code.latency_exposures:.2f}")
            for stage in ("s5", "s6"):
                row[f"{stage}_predicted_us"] = f"{model.predict_stage(stage, speedup.HEADLINE, 'mi300x').predicted_us:.0f}"
        order_rows.append(row)
    print(format_table(order_rows))
else:
    print("skipped on a GPU: the model samples its kernels in the emulator")

# %% [markdown]
# One latency a tile instead of two, for ten more registers at this configuration and no lost
# wave. The model predicts the same order faster where latency bounds the launch and no slower
# where HBM bandwidth does, with per-token scales too, where it costs a wave per SIMD (4 to 3,
# still upstream's figure): `tests/test_partition_choice.py` pins that verdict at 16 × 16k,
# 128 × 4k and 1024 × 2k tokens, so `v_with_k` takes it wherever it fits. Head_dim 256
# keeps V after the scores: its 64 V words with K would exceed upstream's register figure or drop
# a wave.
#
# The same reasoning moves the first tile's page ids ahead of the query's staging: issued after
# the staging barrier, as the loop's own prefetch of the next tile's ids is, they made a
# workgroup's first tile wait for them before it could even address K. Issued before the query's
# loads, their latency runs alongside the query's (`first_pages` in `make_kernel` above). One wait a
# workgroup rather than a tile, but chapter 6 splits a sequence into workgroups of a few tiles,
# and each of them pays it.

# %% [markdown]
# ## head_dim 256
#
# Upstream's tile kernel compiles head_dim 256 too (its figures are in the table above); nothing in
# this one is specific to 128 either. A K row is
# `head_dim/64` pairs of 16-channel chunks per lane (4 at 256), V `head_dim/16` d-chunks (16), and
# after the merge each wave stores `head_dim/64` chunks of 16 channels. What it costs with the
# default plan (block 16 and 64, gfx942, bf16 query; `query_length` 4 × group 16 is four M-tiles,
# split by head_dim):

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

# %% [markdown]
# K and V double per lane (32 → 64, one at a time) and so does the wave's quarter of `O` (8 →
# 16), so one M-tile's peak grows by about 45 registers to 140–168: **3 waves per SIMD** (upstream:
# 2), no spill, 8.7–10.8 KB of LDS. (The register-resident loop, whose `O` doubles 32 → 64, needed
# 176–190 and ran 2.) Four M-tiles need ~275: one wave per SIMD, as upstream (388 registers), with
# K and V read once. The emulator check against the reference is in the correctness table above
# and in `tests/test_stage5.py`.
#
# ## What it compiles to, against chapter 2
#
# Same problem for both (block 16, head_dim 128, group 8, one query token, f16, per-tensor): chapter
# 2 with its plain layouts, this chapter with blocked K and trans-blocked V.

# %%
from pa_tile.stages import s2_register_softmax as s2  # noqa: E402

case = make("gfx942", 16, 128, 8, 1, contexts=[20], device="cpu")  # compile only
l2, a2, _ = s2.launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
                           case.k_scale, case.v_scale, arch="gfx942")
st2 = isa.IsaStats.from_asm(toolchain.compile_isa(l2, *a2, arch="gfx942"))
l5, a5, _ = launch_args(*inputs(case), arch="gfx942")
st5 = isa.IsaStats.from_asm(toolchain.compile_isa(l5, *a5, arch="gfx942"))
print(isa.diff(st2, st5, labels=("stage 2", "stage 5"), mnemonics=False, compact=True))  # rows that changed

# %% [markdown]
# 16 registers fewer and 2 KB less LDS, for 143 more instructions in the loop: the mask compares
# (only on the masked tiles, behind a wave-uniform branch), two `ds_read_b128` of the staged Q
# (which took Q's 8 registers out of the loop), and the head_dim split's sharing: the row max
# to the max table and back, P to the slab and four spans' P back, two barriers, and four more
# page-id loads (each lane needs the V page of every span). The global K and V loads are the same
# 16 dwordx4 per lane; the P·V MFMAs the same 32 per tile (8 per d-chunk over 256 tokens instead
# of 2 per d-chunk over 64). Outside the loop the merge is only the row sums' (no exchange of
# `O`): 4 barriers per call against stage 2's 6.
#
# ## Memory traffic
#
# ### One tile
#
# One sequence of exactly one tile (256 tokens), block 16, head_dim 128, `query_length` 2, group 8
# (one M-tile of 16 rows), per-token scales, on gfx942, traced by the emulator: before, in and after
# the loop, one row per kind of access (the lines of one instruction that move the same bytes and
# touch the same segments together), its figures per execution (one wave instruction).

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

if backend.current_backend() == "emu":
    case = make("gfx942", 16, 128, 8, 2, "per-token", contexts=[256])
    trace = Trace("gfx942")
    with emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace):
        paged_decode(*inputs(case), arch="gfx942")
    print(trace.grouped_table(phases=isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# Per lane and tile: 8 `buffer_load_dwordx4` of K (4 token rows × 2 channel halves) and 8 of V
# (the wave's 2 d-chunks in each of the 4 spans), each wave instruction touching exactly the 16 fully
# used 64-byte segments of its 1 KB; five page-id loads (the K page, the V page of each span); the
# M-tile's Q operands, 2 `ds_read_b128` from the staged query; the row max to the max table
# (`ds_write_b32`) and the four waves' back (`ds_read_b128`); P to the slab (`ds_write_b128`) and
# the four spans' P back (4 `ds_read_b128`), conflict free; and the per-token scales: one
# `buffer_load_dword` each for K and V (every lane its own token: 4 fully used segments), written
# to the wave's LDS slot and read back 4 at a time (`ds_read_b128`; the 16 lanes of a row band
# read one address, a broadcast). The one bank conflict is the max table's write (and the row
# sums' after the loop): the 16 rows' words `4·row + wave` fall on 8 banks twice, 8 cycles per
# tile. The prologue's query loads (4 executions: one wave, one M-tile) touch twice the minimum
# segments (each 64-byte segment is split between two lanes' channel chunks).
#
# ### K and V read once per workgroup
#
# Over a whole call, what the phase split buys is bytes. One sequence of 1027 tokens, head_dim 128,
# block 16, per tensor, gfx942: bytes loaded (each wave instruction's distinct bytes, summed)
# against the compulsory bytes (K/V of the context rounded up to 256-token tiles once, the query,
# one page id per page), with one M-tile per workgroup, with two (this chapter's earlier
# default), and with the default plan (every M-tile in one workgroup, P·V split by head_dim).
# Below 1: the kernel stops at the last page, the compulsory count at the tile.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import tracing  # noqa: E402
from pa_tile.perf.roofline import DecodeShape  # noqa: E402

SHAPES = [(1, 8), (1, 32), (2, 16), (3, 16), (4, 16), (4, 32)]  # (query_length, group)
if backend.current_backend() == "emu":
    ratios = {"one M-tile per workgroup": [], "two per workgroup (earlier default)": [], "default plan": []}
    for ql, g in tqdm(SHAPES, desc="trace"):
        case = make("gfx942", 16, 128, g, ql, contexts=[1027], qdt=torch.bfloat16)
        shape = DecodeShape(batch=1, context=1027, num_q_heads=g, num_kv_heads=1, head_dim=128, block_size=16,
                            query_length=ql)
        for name, mt in zip(ratios, (1, 2, None)):
            trace = Trace("gfx942")
            with emu_launch.launch_options(trace=trace):
                paged_decode(*inputs(case), m_tiles=mt, arch="gfx942")
            ratios[name].append(tracing.report_from_trace(trace, "s5", shape=shape).traffic()["vs_compulsory"])
    figures.traffic_bars([f"ql {ql} · group {g}\n{plan(128, g, ql)[1]} M-tiles" for ql, g in SHAPES], ratios,
                         title="Bytes loaded per call against the compulsory bytes (emulator, gfx942)")
    plt.show()
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# With one M-tile per workgroup every extra 16 query rows cost a full re-read of the KV head's K
# and V: 2x at two M-tiles, 4x at four, 8x at eight. Two per workgroup halve that. The default
# plan reads every byte once for any row count up to 128 (MTP 4 at group 32): every M-tile in
# one workgroup, P·V split by head_dim. `tests/test_traffic.py` pins
# these figures on the upstream test grid's shape (3 sequences of 1027 tokens, `query_length` 1–4,
# group 8–32, both scale kinds and arches).

# %% [markdown]
# ## Predicted time against stage 4 (a model, not a measurement)
#
# Even, predicted, at this shape: both loops wait out one memory latency per tile, stage 4 by
# carrying the next tile's K in registers (chapter 3's prefetch), stage 5 by issuing V with K
# ("When to load V"; issued after the scores, as this chapter first had it, the stage was
# predicted 1.7x slower than stage 4 here). What stage 5's tile adds, the head_dim split's two
# barriers and LDS exchange and four spans' page ids, is short against a latency. What the phase
# split buys is not in this shape: stage 4 cannot run multi-token decode or groups beyond 16 at
# all, and this chapter's M-tiles read K and V once however many query rows share them (the
# traffic figure above).

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

print(speedup.report("s5", "s4"))

# %% [markdown]
# ## What is left for chapter 6
#
# * `num_partitions > 1` already writes partial results (`paged_decode_partials`, tested against a
#   torch computation of the partial softmax statistics); chapter 6 adds the reduce kernel and
#   the partition heuristic.
# * Every upstream register, occupancy and LDS target is met here, and K and V are read once for
#   every row count; head_dim 256 runs at 2 waves per SIMD with one M-tile (see above for what 3
#   would take).
