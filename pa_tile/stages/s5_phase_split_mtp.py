# GENERATED from notebooks/05_phase_split_mtp.py, notebooks/06_head_dim_split_pv.py, notebooks/appendix_register_resident_loop.py by `python -m pa_tile._export`.
# Do not edit: change the cells tagged `export` in the notebooks and re-run the export.

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


def row_base(c, seq):
    """The ``query``/``out`` row of sequence ``seq``'s first query: ``seq·QL`` (uniform) or the
    workgroup's ``Q0`` (ragged)."""
    if const_expr(c.RAGGED):
        return c.Q0
    return seq * c.QL


#: a row index whose byte offset is past every query buffer: ragged padding rows read there
PAST_QUERY = 2**30


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
        f4 = splat4(corr_all[m] * per_token[0] if const_expr(per_token is not None)
                    else corr_all[m])
        o_next += _pv(o_all[m * nch:(m + 1) * nch], v_words, p_all[m], f4,
                      per_token[1] if const_expr(per_token is not None) else None)
    return o_next


def store_stats(stats, m_w, l_w, wave, col):
    """Each M-tile's (max, sum) of this wave (the sum over the row's 4 lanes) to the merge's
    table, ``[m-tile][max | sum][row][wave]``."""
    for m in range_constexpr(len(m_w)):
        lw = row_reduce(fx.Float32(l_w[m]), operator.add)
        base = m * 2 * 16 * WAVES
        lds_store(stats, (base + col * WAVES + wave) * 4,
                  fx.Vector.from_elements([fx.Float32(m_w[m])], dtype=fx.Float32))
        lds_store(stats, (base + (16 + col) * WAVES + wave) * 4,
                  fx.Vector.from_elements([lw], dtype=fx.Float32))


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


@device_code
def phase_a(c, st, t, tok, ctx, k_words, pages, v_page, shared, lane, c_qk, hi1, per_token_args,
            c_cap=None):
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
            vmax, rv = stage_scales(sc_lds, sc_k, sc_v, k_sc1, v_sc1, t, wave, lane, ctx, c.QN, c.W)
        if const_expr(c.per_token):
            # 4 scales at a time, not 16 next to V in flight
            s = k_scaled(s, sc_lds, sc_k, grp, fenced=True)
        s = fx.Vector.from_elements(s, dtype=fx.Float32)
        s, v_words = masked_scores(c, s, m, t, tok, ctx, hi1, v_words, zero_v=m == c.MT - 1,
                                   c_cap=None if c_cap is None else c_cap[m])
        mx = fmax(fx.Float32(st[M0 + m]), row_max(s, c_qk[m]))
        v_weight = functools.partial(lane_scales, sc_lds, sc_v,
                                     grp) if const_expr(c.per_token) else None
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


def merge_and_write(c, lds, shared, res, rows, v_scale, outputs, seq, kvh, part, num_kv_heads,
                    wave, lane, col, grp, sinks_rs=None):
    """After the loop: merge the four waves' results (``res``, the loop state), one M-tile at a time
    with ``XS`` d-chunk slots per exchange round, and write each M-tile's rows (with chapter 08's
    sinks and log-sum-exp when on)."""
    O0, M0, L0 = 2, 2 + c.MT * c.NCH, 2 + c.MT * c.NCH + c.MT
    stats = fx.recast_iter(fx.Uint8, lds.stats.ptr)
    store_stats(stats, [res[M0 + m] for m in range_constexpr(c.MT)],
                [res[L0 + m] for m in range_constexpr(c.MT)], wave, col)
    gpu.barrier()  # also: every wave is past its last read of the staged query
    o_rs, mx_rs, sm_rs = output_resources(c, outputs)
    for m in range_constexpr(c.MT):
        o_w = [res[O0 + m * c.NCH + j] for j in range_constexpr(c.NCH)]
        o, mx, total = merge_weights(stats, m, col, res[M0 + m], o_w, v_scale, c.SPLIT)
        lse2 = None
        if const_expr(c.SINKS or c.LSE):
            g, lse2 = finish_row(c, fx.Float32(1.0), mx, total, sinks_rs, kvh * c.G + rows[m][2])
            if const_expr(c.SINKS):
                o = [fx.Vector(x) * splat4(g) for x in o]
        o = exchange(shared, o, wave, lane, c.XS, m < c.MT - 1)
        write_rows(c, o, mx, total, rows[m], seq, kvh, part, wave, grp, num_kv_heads, o_rs, mx_rs,
                   sm_rs, lse2 if const_expr(c.LSE) else None)


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
        p_all, corr_all, m_new, l_next, v_words, pt = phase_a(c, st, t, tok, k.ctx, k_words, pages,
                                                              v_page, k.shared, k.lane, k.c_qk,
                                                              k.hi1, pt_args, k.c_cap)
        # phase B: every M-tile's P·V on V's registers (V as A, P as B: O is [d, row])
        o_next = phase_b([st[O0 + i] for i in range_constexpr(MT * NCH)], v_words, p_all, corr_all,
                         pt)
        res = yield [k_page_next, v_page_next] + o_next + m_new + l_next
    return res
