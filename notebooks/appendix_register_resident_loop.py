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
# # Appendix · The register-resident loop, and how stage 5 got here
#
# Chapters [05](05_phase_split_mtp.ipynb) and [06](06_head_dim_split_pv.ipynb) describe the loop
# that ships: the phase split, with P·V split across the waves by head_dim. This appendix keeps
# what that design is measured against and how it was reached:
#
# * the **register-resident loop**: chapter 02's design (each wave owns 64 tokens of a tile and
#   accumulates P·V over all of head_dim, one four-wave merge after the loop) with the phase
#   split. It is still in the stage module, off by default: `WIDE_ABOVE` (chapter 06) is the
#   M-tile count up to which it runs, 0;
# * the two designs' registers, waves and LDS, compiled side by side;
# * the first version's register budget against upstream's, and the three changes that fitted it;
# * V issued after the scores, the order the loop first had, against V with K (the model's
#   comparison).
#
# Runs on the CPU emulator (a few minutes) or a ROCm GPU (the model cell needs the emulator).

# %%
import contextlib

import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, isa, show, toolchain
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.stages import s5_phase_split_mtp as s5

# the module's names, as its cells (chapters 05 and 06, then these) share them
globals().update({k: v for k, v in vars(s5).items() if not k.startswith("__")})

# %% [markdown]
# ## The loop, M-tile by M-tile against the phase split
#
# One wave, two trips of the register-resident loop with two M-tiles. Without the phase split
# (top) K and V are in registers together for the whole tile. With it (bottom) phase A runs on
# K's registers, V is issued after the last M-tile's scores into the registers K frees, and
# phase B runs on V's. The row max is wave-local here (the lane owns its row), so the loop has no
# workgroup barrier at all.

# %%
figures.phase_timeline(m_tiles=2, tiles=2)
plt.show()

# %% [markdown]
# ## Its pieces
#
# One M-tile's P·V on V's registers, with the output over all of head_dim (`NCH` d-chunks):

# %% tags=["export"]
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
# Per token: the lane's K scale and V weight to its wave's LDS slots, with the wave's V-scale
# max (the head_dim split takes the workgroup's instead). Phase B: every M-tile's P·V.

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
        f4 = splat4(corr_all[m] * per_token[0] if const_expr(per_token is not None)
                    else corr_all[m])
        o_next += _pv(o_all[m * nch:(m + 1) * nch], v_words, p_all[m], f4,
                      per_token[1] if const_expr(per_token is not None) else None)
    return o_next


# %% [markdown]
# The merge after the loop, per M-tile as chapter 02's `merge_waves`: every M-tile's (max, sum)
# to one table before a single barrier, then each M-tile's weights.

# %% tags=["export"]
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


# %% [markdown]
# The merge's exchange goes through the LDS the query was staged in, so its rounds are sized to
# what that region holds anyway.

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
# Phase A: M-tile by M-tile on K's registers, with the row max wave-local; V issued after the last
# M-tile's scores.

# %% tags=["export"]
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


# %% tags=["export"]
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


# %% [markdown]
# The loop: per tile the loads (per-token scales first, then K, then the next tile's page ids),
# phase A, phase B.

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
        p_all, corr_all, m_new, l_next, v_words, pt = phase_a(c, st, t, tok, k.ctx, k_words, pages,
                                                              v_page, k.shared, k.lane, k.c_qk,
                                                              k.hi1, pt_args, k.c_cap)
        # phase B: every M-tile's P·V on V's registers (V as A, P as B: O is [d, row])
        o_next = phase_b([st[O0 + i] for i in range_constexpr(MT * NCH)], v_words, p_all, corr_all,
                         pt)
        res = yield [k_page_next, v_page_next] + o_next + m_new + l_next
    return res


# %% [markdown]
# ## Registers against M-tiles per workgroup, both loops
#
# gfx942, block 16, bf16, trans-blocked V, `query_length` 4, group 16 (four M-tiles), with one,
# two or four M-tiles per workgroup. The resident loop is compiled by raising `WIDE_ABOVE` in the
# package module for the call.

# %%
def compiled(arch, bs, hd, g, ql, scales="per-tensor", m_tiles=None, resident=False):
    case = cache.make_case(1, g, 1, hd, bs, 20, query_length=ql, fp8_format=fp8_format(arch),
                           scales=scales, query_dtype=torch.bfloat16, device="cpu")
    ins = (case.query, case.k_blocked(), case.v_trans_blocked(), case.block_tables,
           case.context_lengths, case.k_scale, case.v_scale)
    keep = s5.WIDE_ABOVE
    s5.WIDE_ABOVE = s5.LIMITS.max_m_tiles if resident else keep
    s5.build_launcher.cache_clear()
    try:
        launcher, args, arch = s5.launch_args(*ins, m_tiles=m_tiles, arch=arch)
        return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))
    finally:
        s5.WIDE_ABOVE = keep
        s5.build_launcher.cache_clear()


reg_rows = []
for hd in (64, 128, 256):
    for mt in (1, 2, 4):
        row = dict(head_dim=hd, m_tiles=mt)
        for name, resident in (("resident", True), ("split", False)):
            st = compiled("gfx942", 16, hd, 16, 4, m_tiles=mt, resident=resident)
            row.update({f"{name}_vgpr": st.vgpr_unified,
                        f"{name}_waves": isa.occupancy(st, "gfx942").waves_per_simd,
                        f"{name}_lds": st.lds_bytes})
        reg_rows.append(row)
print(format_table(reg_rows))

# %%
fewer = [r for r in reg_rows if r["split_vgpr"] < r["resident_vgpr"]]
more_waves = [r for r in reg_rows if r["split_waves"] > r["resident_waves"]]
close = max(r["split_vgpr"] - r["resident_vgpr"] for r in reg_rows)
at4 = sorted(r["resident_waves"] for r in reg_rows if r["m_tiles"] == 4)
show.md(f"""
    In the register-resident loop each extra M-tile adds its whole output fragment: at four M-tiles
    it runs {at4[0]:.0f}–{at4[-1]:.0f} waves per SIMD, and giving the extra M-tiles to more
    workgroups re-reads K and V (chapter 05's traffic figure). Split by head_dim,
    {len(fewer)} of the {len(reg_rows)} shapes take fewer registers and {len(more_waves)} gain a
    wave; the others are within {close} registers and lose none. The split costs `2 · MT`
    barriers per tile and the P slab's LDS. It is the default at every M-tile count.""")

# %% [markdown]
# ## Fitting upstream's register budget (history)
#
# Before the head_dim split, the register-resident loop had to get under upstream's budget on its
# own. The first version was short on 19 of the 64 head_dim 64/128 configurations. Where the peak
# was, per lane, one M-tile at head_dim 128:
#
# | live at the peak | first version | after the three changes |
# |---|---|---|
# | `O` (head_dim/16 · 4) | 32 | 32 |
# | K (in phase A) | 32 | 32 in phase A only |
# | V (loaded with K, in flight during phase A) | 32 | 32 in phase B only, in K's registers |
# | Q, 16 scores | 8 + 16 | 8 + 16 |
# | 16 P values after the pack (summed only after the P·V MFMAs) | 16 | 0: summed first |
# | per-token: 16 K scales + 16 V scales per lane | 32 | 1 + 1 (the rest in LDS, 4 read at a time) |
#
# The three changes, all still in the register-resident loop (the head_dim split keeps the second
# and third, and issues V with K wherever its registers allow: chapter 06):
#
# 1. **V after phase A.** Issued with K, V's latency hid behind phase A, but K, V, O and Q were all
#    in registers at once. Issued after the score MFMAs, V lands in the registers K just freed.
# 2. **Sum P before P·V** (per-token scales). LLVM scheduled the denominator's adds after the
#    MFMAs, keeping all 16 exponentials alive through them; a `sched_barrier` after the sum ends
#    them at the pack.
# 3. **Per-token scales through LDS.** Each lane loads one scale, the wave writes them to its own
#    LDS slot, and each lane reads 4 at a time where they are used.
#
# The 19 configurations, as recorded then (VGPR+AGPR / waves per SIMD; `query_length` 1, one
# M-tile). These are history: the query has since moved to LDS and the kernel to the head_dim
# split, so the current figures are chapter 06's.
#
# | arch | block | head_dim | group | scales | first version | after the changes | upstream |
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
# ## V after the scores, against V with K (a dropped order)
#
# The head_dim split's loop inherited change 1: K at the top of the iteration, V after the score
# MFMAs. A tile then waits for memory twice in series. At decode batch sizes nothing covers
# either wait (16 sequences of one KV head are 16 workgroups, about one per CU). Chapter 06
# issues V with K wherever the registers allow (`v_with_k`). Both orders, compiled, emulated and
# walked by the timing model of chapter 09 (MI300X; a model, not a measurement): registers,
# waves, memory latencies one tile waits out in series, and the PREDICTED time of this stage and
# of chapter 07's finished kernel at the shape every chapter ends with.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import model, speedup  # noqa: E402


@contextlib.contextmanager
def v_after_scores():
    """The package's stage 5 (and chapter 07's kernel, built on it) with V issued after the
    scores."""
    keep = s5.v_with_k
    s5.v_with_k = lambda *a: False
    s5.build_launcher.cache_clear()
    try:
        yield
    finally:
        s5.v_with_k = keep
        s5.build_launcher.cache_clear()


if backend.current_backend() == "emu":  # the model's samples are emulator traces
    order_rows = []
    for name, order in (("after the scores", v_after_scores),
                        ("with K (default)", contextlib.nullcontext)):
        with order():
            smp = model.sample_stage("s5", speedup.HEADLINE, "gfx942")
            code = model.kernel_code(smp.main_asm, hw="mi300x", line_counts=smp.line_per_tile)
            row = dict(V=name, vgpr=code.vgpr_unified, waves_per_simd=code.workgroups_per_cu,
                       latencies_per_tile=f"{code.latency_exposures:.2f}")
            for stage in ("s5", "s6"):
                us = model.predict_stage(stage, speedup.HEADLINE, "mi300x").predicted_us
                row[f"{stage}_PREDICTED_us"] = f"{us:.0f}"
        order_rows.append(row)
    print(format_table(order_rows))
else:
    print("skipped on a GPU: the model samples its kernels in the emulator")

# %% [markdown]
# One latency a tile instead of two, for a few more registers and no lost wave at this
# configuration. `tests/test_partition_choice.py` pins the model's verdict at 16 × 16k,
# 128 × 4k and 1024 × 2k tokens. Head_dim 256 keeps V after the scores: its V words with K
# would exceed upstream's register figure or drop a wave.
