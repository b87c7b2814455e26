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
# # 04 · Blocked cache layouts, a conflict-free merge, and the full scope
#
# Chapter 03's kernel reads a plain K cache `[blocks, kv_heads, block, head_dim]` and a plain V
# cache `[blocks, kv_heads, head_dim, block]`. The caches serving engines keep are **blocked**.
# This chapter reads them, removes the one LDS bank conflict left in the kernel, and widens the
# scope to what the finished kernel serves.
#
# **You'll learn**
#
# * the blocked K and trans-blocked V layouts, and how a lane finds its 16 bytes in them;
# * what they change in a wave's loads: the same 128-byte lines, fewer lines for each group of
#   4 lanes the vector-memory addresser serves together;
# * what the same change bought the seed kernel on a GPU, and what pa_tile's model assumes;
# * why the merge's `(max, sum)` table conflicts 2-way, and the padding that removes it;
# * the widened scope: block 16/64, head_dim 64/128, f16/bf16, per-token scales, strided query.
#
# **You need** chapter 02 (lane `(c, g)`, V·P), chapter 03 (raw `dwordx4` loads, the pipelined
# loop, the 128-byte line figure).
#
# **Runs on** the CPU emulator (about 3 minutes) or a ROCm GPU (MI300 / MI355; seconds).
#
# ## The layouts
#
# ```
# K blocked        [num_blocks, kv_heads, head_dim//16, block_size, 16]
#                  K[b, h, t, d] at [b, h, d//16, t, d%16]
# V trans-blocked  [num_blocks, kv_heads, block_size//16, head_dim, 16]
#                  V[b, h, t, d] at [b, h, t//16, d, t%16]
# ```
#
# Both put the 16 bytes one lane loads (16 channels of a token for K, 16 tokens of a channel for
# V) next to the 16 bytes of the neighbouring token (K) or channel (V).


# %%
import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from IPython.display import display

from pa_tile import backend, cache, figures, isa, seed_history, show, toolchain
from pa_tile.arch import ARCHS, INFO, fp8_format
from pa_tile.emu import launch as emu_launch
from pa_tile.emu.memory import LINE_BYTES, AddressTrace, Trace, coalescing_lines, format_table


# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"


# %% [markdown]
# ## What a wave's load touches
#
# A wave's `dwordx4` asks for 64 lanes × 16 bytes = 1 KiB. The vector L1 and the L2 fetch
# 128-byte lines on both targets (CDNA3 and CDNA4 white papers), so 8 lines is the fewest.
# Before that, the CU's vector-memory addresser takes the request apart: AMD's performance
# documentation (rocprofiler-compute) gives it 64 bytes of request a clock, 4 lanes of a
# `dwordx4`. Trace one tile (256 tokens, block 16, group 8, gfx942) of chapter 03's kernel on
# the plain layouts and of this chapter's on the blocked ones, and count, per whole-wave load,
# the lines it touches and the (4-lane group, line) pairs:


# %% tags=["nbval-ignore-output"]
from pa_tile.stages import s3_raw_loads as s3  # noqa: E402
from pa_tile.stages import s4_blocked_layouts as s4  # noqa: E402

EMU = backend.current_backend() == "emu"  # traces are recorded only by the emulator
NO_TRACE = "ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)"
one = cache.make_case(1, 8, 1, 128, 16, 256, fp8_format="fnuz", pad_block_id=-1)


def whole_wave_loads(trace, t):
    """Lane offsets from tensor ``t``'s start of each load of it by all 64 lanes, none repeated
    (the clamped prefetch past the context repeats addresses: left out)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    return [a - lo for m, a in trace.addresses
            if a.size == 64 and np.unique(a).size == 64 and ((a >= lo) & (a < hi)).all()]


def pairs(off, nbytes=16, group=4):
    """(4-lane group, 128-byte line) pairs of one load: the addresser clocks the model counts."""
    return len({(lane // group, b // LINE_BYTES) for lane, o in enumerate(off)
                for b in (o, o + nbytes - 1)})


# %% tags=["nbval-ignore-output"]
def load_rows(stage, trace, tensors):
    rows = []
    for name, t in tensors.items():
        loads = whole_wave_loads(trace, t)
        lines = [coalescing_lines(a.astype(np.uint64), np.ones(64, bool), 16) for a in loads]
        rows.append(dict(stage=stage, tensor=name, loads=len(loads),
                         lines_per_load=sum(lines) / len(loads),
                         fewest=64 * 16 // LINE_BYTES,
                         group_line_pairs=sum(pairs(a) for a in loads) / len(loads)))
    return rows


def traced(module, k, v):
    trace = AddressTrace("gfx942")
    with emu_launch.launch_options(trace=trace):
        module.paged_decode(one.query, k, v, one.block_tables, one.context_lengths, one.k_scale,
                            one.v_scale, arch="gfx942")
    return trace


if EMU:
    k3, v3, k4, v4 = one.k_cache, one.v_plain(), one.k_blocked(), one.v_trans_blocked()
    trace3, trace4 = traced(s3, k3, v3), traced(s4, k4, v4)
    loads = load_rows("3 plain", trace3, dict(K=k3, V=v3)) + load_rows("4 blocked", trace4,
                                                                       dict(K=k4, V=v4))
    print(format_table(loads, floatfmt="g"))
else:
    print(NO_TRACE)


# %% [markdown]
# Where one K load's lanes fall, for each layout (rows are 128-byte lines, boxes one lane's 16
# bytes, colours the lane group `g` of chapter 02):


# %% tags=["nbval-ignore-output"]
if EMU:
    figures.lane_lines({"stage 3, plain K": whole_wave_loads(trace3, k3)[0],
                        "stage 4, blocked K": whole_wave_loads(trace4, k4)[0]})
    plt.show()
else:
    print(NO_TRACE)


# %% tags=["nbval-ignore-output"]
if EMU:
    by = {(r["stage"], r["tensor"]): r for r in loads}
    p3, p4 = by["3 plain", "K"], by["4 blocked", "K"]
    v3 = by["3 plain", "V"]
    display(show.md(f"""
    Both K layouts touch {p3["lines_per_load"]:g} lines per load, half of each: the wave's next
    load reads the other half (chapter 03). They differ in the groups. In the plain layout, lanes
    `c .. c+3` are 4 tokens, rows a line apart, so a 4-lane group touches 4 lines:
    {p3["group_line_pairs"]:g} pairs a load. In the blocked layout, the same 4 lanes read 64
    contiguous bytes of one line: {p4["group_line_pairs"]:g} pairs. V touches
    {v3["lines_per_load"]:g} lines and {v3["group_line_pairs"]:g} pairs a load in both layouts at
    block 16."""))


# %% [markdown]
# ### What it is worth
#
# The memory system fetches the same lines either way, so the emulator sees no difference in
# traffic. What differs is the addresser's work. pa_tile's timing model **ASSUMES** that each
# 4-lane group costs the addresser one clock per line it touches. AMD's documentation gives the
# rate, 64 bytes of request a clock, not this form (`pa_tile.perf.model.TA_BYTES_PER_CLK`). On
# that assumption, stage 3's K loads cost 4 times the addresser clocks of stage 4's, and the
# addresser sits on the path every tile waits out. That is where the model's predicted gain
# (closing box) comes from. No pa_tile measurement on a GPU confirms it yet.
#
# The seed kernel switched its V cache to a blocked layout in one commit and timed it:


# %%
show.md(seed_history.table("ecbc2d6b", "blocked V-cache layout"))


# %% [markdown]
# This is evidence that the layout matters on real hardware, not a measurement of pa_tile's
# kernel: the seed's loads before that commit are not stage 3's. A GPU run of
# `python -m pa_tile bench` on stages 3 and 4 settles it for this kernel.
#
# The blocked layouts also make the count independent of a clever lane mapping. Any mapping that
# puts neighbouring tokens (K) or channels (V) on neighbouring lanes reads whole 64-byte runs,
# whatever head_dim and block size are.
#
# ## Addressing
#
# Within the slab of one (page, KV head), `PAGE = block_size · head_dim` bytes:
#
# * **K blocked**: element `(t, d)` at `((d // 16) · block + t) · 16 + d % 16`. Lane `(c, g)`
#   needs, for token chunk `a` and half `h`, token `slot(c) + 4a` at channels `16(g + 4h) ..`.
#   That is byte `(g · block + slot(c)) · 16` (per lane, fixed for the loop) `+ 64a`
#   (an immediate) `+ h · 64 · block`. For block 64 the last term is 4096, which does not fit
#   the 12-bit immediate: the compiler adds it into a second address register. `slot(c)` is
#   `c % 4` (block 16: page `c // 4` of the wave's span) or `16(c // 4) + c % 4` (block 64).
# * **V trans-blocked**: element `(t, d)` at `((t // 16) · head_dim + d) · 16 + t % 16`.
#   Lane `(c, g)` needs channel `16j + c`, tokens `16g .. 16g+15`: byte
#   `(tg · head_dim + c) · 16 + 256 j`, with `tg = 0` (block 16: page `g`) or `g` (block 64).
#   The d-chunk offset `256 j` is the same for the whole wave: a scalar offset.
# * **Per-token scales** `[blocks, kv_heads, block]` float32: the 16 scales of tokens
#   `16g .. 16g+15` are 64 contiguous bytes, 4 `dwordx4` for K and 4 for V, in V's page.
#
# ## Per-token scales, head_dim 64, bf16, strided query
#
# * **K per token** multiplies each raw score before the max (`x = S · k_scale[t] · c`). It
#   cannot be folded into one factor, as the per-tensor scale is.
# * **V per token** weights each probability: `O = Σ p_t v_scale[t] V_t / Σ p_t`. The kernel
#   multiplies P by `w_t = v_scale[t] / max(v_scale)` ≤ 1 *after* the sum and *before* the fp8
#   rounding, so P stays in the fp8 range. It multiplies the result by `max(v_scale)`, one torch
#   reduction on the device at launch (no host synchronization).
# * **head_dim 64**: one 64-channel half per K row and query (2 k-steps instead of 4) and 4
#   d-chunks of O, so each wave stores one d-chunk after the merge instead of two.
# * **bf16**: the query is read as raw dwords and bitcast to bf16 before widening. The output
#   is rounded to the query's dtype.
# * **Strided query**: the kernel takes the query's sequence and head strides (in elements) as
#   arguments, so a slice of a fused QKV tensor is read in place. Only the last dimension must be
#   contiguous (16-byte loads of a row).


# %% [markdown]
# ## The kernel
#
# Stage 3's kernel with the blocked addressing and the widened scope. Nothing of chapter 02's
# building blocks is rewritten: they live in `pa_tile.kernel_lib` and take, as parameters,
# what this chapter changes. `Pages` takes the layouts (`k_blocked`, `v_trans`): a K row's
# slots are 16 bytes apart and its 16-channel chunks `16·block` bytes apart, instead of
# `head_dim` and 16, so the same two strides place every K load; V's d-chunks are 256 bytes
# apart in the trans-blocked layout.


# %% tags=["export"]
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


# %% [markdown]
# The layouts enter `Pages` only in its constructor, which turns `k_blocked` and `v_trans` into
# the two K strides, the lane's V offset and the d-chunks' scalar offsets, once before the loop:


# %%
from pa_tile import kernel_lib  # noqa: E402
from pa_tile.show import source  # noqa: E402

source(kernel_lib.Pages.__init__)


# %% [markdown]
# The loads are chapter 02's, unchanged: they read only those fields, `k` stepping by `k_row`
# and `k_chunk` in immediate offsets, `v` by the chunk offsets in SGPRs. (`page_id` and
# `slab` do not depend on the layout.)


# %%
source(kernel_lib.Pages.k, kernel_lib.Pages.v)


# %% [markdown]
# `query_operands` and `scores` take the number of 64-channel halves (1 at head_dim 64) and
# the query's 16-bit dtype:


# %%
source(kernel_lib.query_operands, kernel_lib.scores)


# %% [markdown]
# `softmax_step` takes the per-token P weights `p_weight`, multiplied in after the sum and
# before the fp8 rounding: the sum `l` stays unweighted, as the formula for per-token V
# scales above wants, and the weights (≤ 1) keep P inside the fp8 range. `mask_tail` and
# `pv_step` already work for any number of d-chunks.


# %%
source(kernel_lib.softmax_step)


# %% [markdown]
# `merge_waves` takes the stride of the (max, sum) table's head rows (`stride`, in words). The
# library's default, 4, is the unpadded table of chapters 02 and 03; this stage passes its
# `stats_stride`, 5 by default: the padding that removes a bank conflict, explained below.


# %%
source(kernel_lib.merge_waves)


# %% [markdown]
# Its exchange is `kernel_lib.exchange`, unchanged here; the finished kernel runs it with fewer slots per
# round (`slots`), sized to the LDS region it reuses for it.


# %%
source(kernel_lib.exchange)


# %% [markdown]
# Per-token scales are what the kernel adds to the building blocks. A lane's 16 tokens' scales
# are 64 contiguous bytes in the (page, KV head) row of its V tokens: four `dwordx4` for K's
# scales and four for V's, from the same page id as V. `ScaledPages` is `Pages` with that load.


# %% tags=["export"]
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


# %% [markdown]
# The merge's LDS: the (max, sum) table, `2 · 16` head rows of `stats_stride` words, and the
# exchange's slots, one d-chunk group per wave and lane.


# %% tags=["export"]
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


# %% [markdown]
# The kernel reads its compile-time sizes from one namespace per specialization (chapter 05 turns
# it into a class, `Spec`): the merge's LDS and its table stride, the block, head and group sizes,
# the scale kind, the V layout, fp8's range, the d-chunks of O and the 64-channel halves of K.


# %% tags=["export"]
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


# %% [markdown]
# The setup's one choice, the scale kind: per tensor the score factor `c_qk` holds K's scale; per
# token it does not (each score is multiplied by its token's K scale), and the tile's scores read
# the two scale buffers and `1/max(v_scale)` instead.


# %% tags=["export"]
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


# %% [markdown]
# Where the lane's K, V and per-token scales are (`ScaledPages` on the blocked layouts), and what
# chapter 03's pipelined loop carries into its first trip: tile 0's K, already loaded, tile 1's K
# page and tile 0's V page, then the empty softmax state.


# %% tags=["export"]
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


# %% [markdown]
# The kernel: the setup (the query read through its two strides, the score scale), chapter 03's
# pipelined loop, the merge with the padded table and the stores in the query's dtype. Per token,
# V's scales become P's weights `v_scale / max(v_scale)`, with the max passed in as `v_norm`.


# %% tags=["export"]
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


# %% [markdown]
# One launcher per specialization, cached.


# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, head_dim: int, group: int, arch: str, q_dtype: str = "f16",
                   per_token: bool = False, v_layout: str = "trans_blocked",
                   stats_stride: int = STATS_STRIDE):
    """The ``@flyc.jit`` launcher for one specialization (``stats_stride=4``: the unpadded merge
    table)."""
    spec = kernel_spec(block_size, head_dim, group, arch, q_dtype, per_token, v_layout,
                       stats_stride)
    return jit_launcher(make_kernel(spec))


# %% [markdown]
# ## The launcher
#
# Validation names the argument (TypeError/ValueError) before anything is compiled; one
# specialization per (block, head_dim, group, arch, query dtype, scale kind, V layout).


# %% tags=["export"]
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


# %% [markdown]
# ## The kernel's arithmetic, written out
#
# Chapter 02's torch model of the roundings, extended to the widened scope.


# %% tags=["export"]
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


# %% [markdown]
# ## The merge's bank conflict, and the padding that removes it
#
# The only LDS in the kernel is the final merge (chapter 02): a `(max, sum)` table and an
# exchange buffer. The trace of chapter 03's kernel for the tile above:


# %% tags=["nbval-ignore-output"]
def lds_rows(trace):
    return [
        dict(mnemonic=r["mnemonic"], line=r["line"], executions=r["executions"],
             max_degree=r["max_degree"], conflict_cycles=r["conflict_cycles"])
        for r in trace.summary() if r["space"] == "lds"
    ]


print(format_table(lds_rows(trace3)) if EMU else NO_TRACE)


# %% [markdown]
# The write of the `(max, sum)` table conflicts 2-way. Its layout is `[max | sum][head][wave]`:
# head rows of 4 words, and lane `(c, g)` writes word `4c + wave`. On gfx942 a 4-byte access is
# served 32 lanes at a time over 32 banks of 4 bytes (`pa_tile.emu.memory` cites the
# measurements). Lanes `0..31` write heads `0..15`; lanes `c` and `c+16` write the same word, a
# broadcast, not a conflict. Their banks are `(4c + wave) mod 32`, so heads `c` and `c + 8` hit
# the same bank. The fix pads each head row to 5 words. The banks `(5c + wave) mod 32` for
# `c = 0..15` are all different: 5 is odd, hence invertible mod 32. gfx950 has 64 banks, but
# the emulator **ASSUMES** it serves 4-byte writes as gfx942 does (32 lanes over 32 banks); no
# document or measurement found says otherwise. The price: rows are no longer 16-byte aligned,
# so a head's four values are read back with two `ds_read2_b32` instead of one
# `ds_read_b128`, once per workgroup. The exchange buffer is already conflict-free.


# %%
figures.lds_banks(strides=(4, s4.STATS_STRIDE), banks=32)
plt.show()


# %% [markdown]
# Measured by the emulator's bank model, for both strides on both archs:


# %% tags=["nbval-ignore-output"]
def lds_trace(arch, stride, head_dim=128):
    case = cache.make_case(1, 16, 1, head_dim, 16, 256, fp8_format=fp8_format(arch),
                           pad_block_id=-1)
    launcher, args, _ = s4.launch_args(case.query, case.k_blocked(), case.v_trans_blocked(),
                                       case.block_tables, case.context_lengths, case.k_scale,
                                       case.v_scale, arch=arch)
    launcher = s4.build_launcher(16, head_dim, 16, arch, "f16", False, "trans_blocked", stride)
    trace = Trace(arch)
    with emu_launch.launch_options(trace=trace), toolchain.target_arch(arch):
        launcher(*args)
    return trace


merge_rows = []
for arch in ARCHS if EMU else ():
    for stride in (4, s4.STATS_STRIDE):
        lds = [r for r in lds_trace(arch, stride).accesses() if r["space"] == "lds"]
        merge_rows.append(dict(arch=arch, head_row_words=stride, lds_accesses=len(lds),
                               max_degree=max(r["conflict_degree"] for r in lds),
                               conflict_cycles=sum(r["conflict_cycles"] for r in lds)))
print(format_table(merge_rows) if EMU else NO_TRACE)


# %% [markdown]
# ## Does it work?
#
# The widened matrix on both archs: block 16/64 × head_dim 64/128 × {f16 per-tensor, f16
# per-token, bf16 per-token} on trans-blocked V, plus bf16 per-tensor on plain V; contexts 1,
# 17, 256, 1027, shuffled pages, `-1` in unused block-table entries. Checked as in chapter 02:
# against the float32 reference within the fp8 bound (`case.error_bound()`), and against
# `numerics_model` (the same roundings in torch) `2·10⁻⁴ + 1 ulp` of the output dtype. One row
# per (arch, block, head_dim); the four middle columns are the worst `err / bound` of each
# (query dtype, scales, V layout) combination over its four contexts, `err_vs_ref` the largest
# error of the row.


# %% tags=["nbval-ignore-output"]
def check(arch, block_size, head_dim, q_dtype, scales, v_layout, contexts=(1, 17, 256, 1027)):
    case = cache.make_case(len(contexts), 8, 1, head_dim, block_size, list(contexts),
                           fp8_format=fp8_format(arch), seed=1, pad_block_id=-1,
                           query_dtype=q_dtype, scales=scales)
    v = case.v_trans_blocked() if v_layout == "trans_blocked" else case.v_plain()
    args = (case.query, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale,
            case.v_scale)
    got = s4.paged_decode(*args, arch=arch, v_layout=v_layout).cpu()
    ref, bound = case.error_bound(out_dtype=got.dtype)
    model = s4.numerics_model(*(x.cpu() for x in args), arch=arch, v_layout=v_layout).float()
    ulp = 2.0**-7 if q_dtype == torch.bfloat16 else 2.0**-10
    err = (got.float() - ref).abs()
    as_model = bool(((got.float() - model).abs() <= 2e-4 + ulp * model.abs()).all())
    return dict(out_is_query=got.dtype == q_dtype, err_vs_ref=float(err.max()),
                of_bound=float((err / bound).max()), ok=bool((err <= bound).all()),
                matches_model=as_model)


combos = {"f16 tensor": (torch.float16, "per-tensor", "trans_blocked"),
          "f16 token": (torch.float16, "per-token", "trans_blocked"),
          "bf16 token": (torch.bfloat16, "per-token", "trans_blocked"),
          "bf16 plain-V": (torch.bfloat16, "per-tensor", "plain")}
table, cases = [], []
for arch, bs, hd in [(a, bs, hd) for a in backend.runnable_archs() for bs in (16, 64)
                     for hd in (64, 128)]:
    res = {name: check(arch, bs, hd, *c) for name, c in combos.items()}  # one row per config
    cases += res.values()
    table.append(dict(arch=arch, block=bs, head_dim=hd,
                      **{name: r["of_bound"] for name, r in res.items()},
                      err_vs_ref=round(max(r["err_vs_ref"] for r in res.values()), 4),
                      ok=all(r["ok"] for r in res.values()),
                      as_model=all(r["matches_model"] for r in res.values())))
print("worst err / bound per (query dtype, scales, V layout):")
print(format_table(table))
good = [all(r[k] for k in ("ok", "matches_model", "out_is_query")) for r in cases]
print(f"{len(cases)} cases: {sum(good)} within the bound, matching numerics_model, "
      "output in the query's dtype")
assert all(good)


# %% [markdown]
# On chapter 03's scope (f16, head_dim 128, per-tensor) the output is **bit-identical** to
# chapter 03's kernel, for both V layouts: the layouts change addresses, not arithmetic. And a
# query that is a slice of a fused QKV tensor gives the same output as its contiguous copy:


# %%
arch = backend.default_arch()  # the GPU's, or the emulator's
case = cache.make_case(3, 16, 2, 128, 16, [1, 300, 1027], fp8_format=fp8_format(arch),
                       pad_block_id=-1)
same = {}
want = s3.paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables,
                       case.context_lengths, case.k_scale, case.v_scale)
for v_layout, v in (("trans_blocked", case.v_trans_blocked()), ("plain", case.v_plain())):
    got = s4.paged_decode(case.query, case.k_blocked(), v, case.block_tables, case.context_lengths,
                          case.k_scale, case.v_scale, v_layout=v_layout)
    same[f"stage 3 == stage 4 ({v_layout} V)"] = torch.equal(got, want)
qkv = torch.zeros(3, 16 + 2 * 2, 128, dtype=torch.float16,
                  device=case.query.device)  # [q | k | v heads]
qkv[:, :16] = case.query
q_view = qkv[:, :16]
got = s4.paged_decode(q_view, case.k_blocked(), case.v_trans_blocked(), case.block_tables,
                      case.context_lengths, case.k_scale, case.v_scale)
same[f"strided query {tuple(q_view.stride())} == contiguous"] = torch.equal(got, want)
for check_name, equal in same.items():
    print(f"{check_name}: {equal}")
assert all(same.values())


# %% [markdown]
# ## What it compiles to
#
# Against chapter 03 (block 16, group 8, head_dim 128, f16, per-tensor), then the resources
# across the scope.


# %%
def compile4(arch, block_size=16, head_dim=128, group=8, q_dtype=torch.float16, scales="per-tensor",
             v_layout="trans_blocked"):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, group, 1, head_dim, block_size, 17, fp8_format=fp8_format(arch),
                           query_dtype=q_dtype, scales=scales, device="cpu")
    v = case.v_trans_blocked() if v_layout == "trans_blocked" else case.v_plain()
    launcher, args, arch = s4.launch_args(case.query, case.k_blocked(), v, case.block_tables,
                                          case.context_lengths, case.k_scale, case.v_scale,
                                          arch=arch, v_layout=v_layout)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))


def compile3(arch):
    case = cache.make_case(1, 8, 1, 128, 16, 17, fp8_format=fp8_format(arch), device="cpu")
    launcher, args, arch = s3.launch_args(case.query, case.k_cache, case.v_plain(),
                                          case.block_tables, case.context_lengths, case.k_scale,
                                          case.v_scale, arch=arch)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))


# the rows that changed on either arch, and the headline facts
print(isa.diff_side_by_side({arch: (compile3(arch), compile4(arch)) for arch in ARCHS},
                            labels=("stage 3", "stage 4")))


# %%
rows = []
for arch in ARCHS:
    for bs, hd, qd, sc in ((16, 128, torch.float16, "per-tensor"),
                           (64, 128, torch.bfloat16, "per-token"),
                           (16, 64, torch.float16, "per-tensor"),
                           (64, 64, torch.bfloat16, "per-token")):
        st = compile4(arch, bs, hd, 16, qd, sc)
        occ = isa.occupancy(st, arch)
        rows.append(dict(arch=arch, block=bs, head_dim=hd, query=str(qd)[6:], scales=sc,
                         vgpr=st.vgpr_unified, lds=st.lds_bytes,
                         waves_per_simd=occ.waves_per_simd,
                         loop_instr=st.main_loop_instructions,
                         dwordx4=st.load_widths.get("buffer", {}).get("dwordx4", 0)))
print(format_table(rows))


# %%
res = {(x["arch"], x["head_dim"], x["scales"]): x for x in rows}


def most_vgprs(waves, arch="gfx942"):
    """The most registers a lane may use for ``waves`` waves per SIMD (whole granules)."""
    a = INFO[arch]
    return a.vgprs_per_lane // waves // a.vgpr_granule * a.vgpr_granule


t942, t950 = res["gfx942", 128, "per-tensor"], res["gfx950", 128, "per-tensor"]
h942, h950 = res["gfx942", 64, "per-tensor"], res["gfx950", 64, "per-tensor"]
pt = res["gfx942", 128, "per-token"]
show.md(f"""
* At head_dim 128 per tensor the kernel holds {t942["vgpr"]} VGPRs on gfx942 and {t950["vgpr"]}
  on gfx950: chapter 03's carried K, {t942["waves_per_simd"]:g} waves per SIMD.
* head_dim 64 halves K, V and O: {h942["vgpr"]} registers on gfx942
  ({h942["waves_per_simd"]:g} waves), {h950["vgpr"]} on gfx950 ({h950["waves_per_simd"]:g}).
  {most_vgprs(5)} registers is the most 5 waves allow.
* Per-token scales add the 16 K scales and 16 P weights of a lane's tokens: {pt["vgpr"]}
  registers at head_dim 128 (block 64, bf16), {pt["waves_per_simd"]:g} waves per SIMD. That
  cost is measured here, not optimized.""")


# %% [markdown]
# ## Memory traffic of one tile
#
# The full trace of this chapter's kernel for the one-tile case above, before, in and after the
# loop. The lines of one instruction that access memory alike share a row.


# %% tags=["nbval-ignore-output"]
if EMU:
    with emu_launch.record_launches() as launched:  # traced again, for the code that ran
        trace4 = traced(s4, k4, v4)
    phases = isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)
    print(trace4.grouped_table(phases=phases))
else:
    print(NO_TRACE)


# %% tags=["nbval-ignore-output"]
if EMU:
    summary = trace4.grouped_summary(phases=phases)
    lds = [g for g in summary if g["space"] == "lds"]
    x4 = [g for g in summary if g["mnemonic"] == "buffer_load_dwordx4"]
    half = [g for g in x4 if g["lines_128B_per_exec"] > g["min_lines_128B_per_exec"]]
    display(show.md(f"""
    Every K and V byte arrives by `buffer_load_dwordx4`. The K rows touch
    {half[0]["lines_128B_per_exec"]} lines per {half[0]["bytes_per_exec"]} bytes, half of each
    line per load, as in chapter 03. The LDS accesses (the merge) reach a worst conflict degree
    of {max(g["max_degree"] for g in lds)}: none."""))


# %% [markdown]
# ## What you built
#
# ```
# paged_decode_s4(q, K_blocked, V_trans_blocked, block_tables, ctx, scales):
#     lane (c, g) = (lane % 16, lane // 16)           # grid (seq, kv_head); 4 waves
#     q rows read through (seq, head) strides; f16 or bf16
#     Qops, c_qk = quantize(q[head c])                 # per tensor: c_qk holds K's scale
#     K: lane reads 16 B at (g·block + slot(c))·16 + 64a   # a 4-lane group: 64 B of one line
#     V: lane reads 16 B at (tg·head_dim + c)·16 + 256j    # j: scalar offset
#     Kw = K(tile 0)
#     for tile in range(ceil(ctx / 256)):              # chapter 03's pipelined loop
#         Vw, Kn = V(tile), K(tile + 1)                # + per-token scales, from V's page
#         S = K·Qᵀ (2 or 4 k-steps)                    # head_dim 64 or 128
#         if per token: S *= k_scale[t]; w = v_scale[t] / max(v_scale)
#         if last tile: mask S, zero V's tail
#         m2 = max(m, row_max(S * c_qk)); P = exp2(S*c_qk - m2 + log2 FP8_MAX)
#         l = l*corr + sum(P); O = O*corr + V·fp8(P * w)
#         m, Kw = m2, Kn
#     merge the 4 waves through LDS: (max, sum) rows of 5 words   # no bank conflict
#     store O / l · max(v_scale) in the query's dtype
# ```
#
# Next, [chapter 05](05_phase_split_mtp.ipynb): more query rows (MTP, wide GQA) in M-tiles, and
# the masks.


# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

# the model samples its kernels in the emulator: no prediction where this runs on a GPU
pred = {s.gpu: s for s in speedup.predicted_steps("s4", "s3")} if EMU else {}
k_pairs = (f'{p3["group_line_pairs"]:g} -> {p4["group_line_pairs"]:g}' if EMU
           else "emulator only")
degree = {x["head_row_words"]: x["max_degree"] for x in merge_rows if x["arch"] == "gfx942"}
show.measured({
    "(4-lane group, line) pairs per K load, stage 3 -> 4": k_pairs,
    "merge table's worst LDS conflict, 4 -> 5 words a row (gfx942)":
        f"{degree[4]} -> {degree[s4.STATS_STRIDE]}" if degree else "emulator only",
    "VGPRs at head_dim 128 / 64 (gfx942)": f'{t942["vgpr"]} / {h942["vgpr"]}',
    "PREDICTED, ASSUMED addresser, b16 x 16k, MI300X / MI355X":
        f'{pred["MI300X"].us:.0f} / {pred["MI355X"].us:.0f} µs (stage 3: '
        f'{pred["MI300X"].previous_us:.0f} / {pred["MI355X"].previous_us:.0f})' if pred
        else "emulator only",
})
