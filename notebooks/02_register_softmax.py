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
# # 02 · Register-resident softmax
#
# Chapter 01's kernel stages the scores in LDS for a row-wise softmax, then writes `P` to LDS and
# reads it back transposed so the waves can split head_dim for P·V. Every tile pays three
# barriers and kilobytes of LDS traffic, and that LDS bounds how many workgroups fit on a CU.
# This chapter takes all of it out of the loop with one idea: **turn the tile around**.
#
# **You'll learn**
#
# - to compute `K·Qᵀ` instead of `Q·Kᵀ`, so each lane owns one query head's scores;
# - why the scores' register layout is then exactly P·V's B operand: `P` never leaves the lane;
# - a per-wave online softmax with two cross-lane steps, merged once after the loop
#   (flash-decoding inside one workgroup);
# - the hardware operations under the tile API: buffer loads, scalar loads, `v_readfirstlane`,
#   lane exchanges, `v_cvt_pk_fp8_f32`, the MFMA;
# - what the same idea bought the seed kernel on a real GPU.
#
# **You need** chapter 01 (the MFMA atom's lane layout, the online softmax, the scales), chapter 00
# (buffer loads, SGPRs, occupancy).
#
# **Runs on** the CPU emulator (about two minutes), or a ROCm GPU.
#
# Scope is chapter 01's: f16 query `[num_seqs, num_q_heads, 128]`, one query token, fp8 K/V with
# per-tensor scales (FNUZ on gfx942, OCP on gfx950), plain K and V layouts, block 16 or 64, 8 or
# 16 query heads per KV head.

# %%
import math

import matplotlib.pyplot as plt
import torch

from pa_tile import cache, figures, isa, seed_history, show, toolchain, upstream
from pa_tile.arch import ARCHS, fp8_format

# %% [markdown]
# ## Building blocks
#
# This kernel is written one level below chapter 01's tile API, in the operations the hardware
# has:
#
# | helper | instruction | why here |
# |---|---|---|
# | `buffer_load` | `buffer_load_dword[x4]` | lane offset (VGPR) + wave offset (SGPR) + immediate |
# | `scalar_load` | `s_buffer_load_dword` | context length and scales: one value per wave |
# | `uniform` | `v_readfirstlane_b32` | the wave index, known wave-uniform: kept in SGPRs |
# | `xor_lanes` | `ds_swizzle`/`ds_bpermute` (gfx942), `v_permlane*_swap` (gfx950) | a butterfly step |
# | `mfma` | `v_mfma_f32_16x16x32_fp8_fp8` | 16×16 output, K = 32 fp8 per step |
# | `pack_fp8` | `v_cvt_pk_fp8_f32` ×2 | four f32 to one dword of fp8 codes (the arch's flavour) |
# | `lds_load` / `lds_store` | `ds_read_b128` / `ds_write_b128` | the final merge only |

# %% tags=["export"]
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

import flydsl.expr as fx
from flydsl.expr import gpu, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max, fp8_torch_dtype
from pa_tile.kernel_lib import (
    HEAD_DIM, LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, imin, jit_launcher, lane_coords,
                                mask_tail,
    merge_waves, pv_step, query_operands, rsrc, scalar_load, scores, softmax_model, softmax_step,
                                store_chunks,
    model_operands,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "kernel_args", "numerics_model",
           "LIMITS", "Shared",
           "Workgroup"]

#: what the stage-2 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s2", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))


# %% [markdown]
# The helpers live in the shared kernel library, `pa_tile.kernel_lib`; later chapters import them
# by these names. Each is one hardware operation. The memory side first. `rsrc` builds a buffer
# resource (V#) sized to the tensor, so an offset gone wrong reads 0 instead of another tensor's
# bytes. `buffer_load` takes its address in the instruction's three parts, so loads a constant
# apart share one address register. `scalar_load` fetches one word for the whole wave.
# `lds_store` and `lds_load` serve the final merge.

# %%
from pa_tile import kernel_lib  # noqa: E402
from pa_tile.show import source  # noqa: E402

source(kernel_lib.rsrc, kernel_lib.buffer_load, kernel_lib.scalar_load, kernel_lib.lds_store,
       kernel_lib.lds_load)

# %% [markdown]
# The register side. `uniform` is `v_readfirstlane`: the compiler learns a value is wave-uniform
# and keeps what derives from it in SGPRs. `xor_lanes` is the butterfly step of every cross-lane
# reduction; the backend picks the instruction per arch. `pack_fp8` rounds four f32 to one
# dword of fp8 codes in two conversions. `i64` pairs two dwords into the MFMA's eight-code
# operand, and `mfma` is the instruction.

# %%
source(kernel_lib.uniform, kernel_lib.xor_lanes, kernel_lib.pack_fp8, kernel_lib.i64,
       kernel_lib.mfma)

# %% [markdown]
# ## Turning the scores around
#
# `v_mfma_f32_16x16x32_fp8_fp8` computes `D = A·B + C`, `A` 16×32, `B` 32×16, `D` 16×16. Lane
# `l` holds, with `c = l % 16` and `g = l // 16`:
#
# ```
#   A: row c,      k = 8g .. 8g+7      (one i64: 8 fp8 codes)
#   B: k = 8g .. 8g+7, column c        (one i64)
#   D: rows 4g .. 4g+3, column c       (four f32)
# ```
#
# A lane's results sit in **one column**. Chapter 01 put query heads on the rows (`Q·Kᵀ`), so a
# head's scores were spread over 16 lanes. Here K is the A operand and Qᵀ the B operand. Rows
# are tokens and column `c` is query head `c`: a lane holds 4 scores of *its own head* per MFMA.
# Heads 8..15 of a group of 8 are zero padding.
#
# Which 16 tokens form an MFMA's rows is our choice, and so is which 32 channels form a k-step,
# as long as A and B agree. Two choices pay off:
#
# * **k-steps:** lane `(c, g)` loads 16 contiguous bytes of a K row at channel `16·(g + 4h)`,
#   `h = 0, 1`: one `dwordx4` gives two k-steps. Q uses the same channel order, so the dot
#   product is unchanged.
# * **token rows:** MFMA row `r` of token chunk `a` (`a = 0..3`) is wave-token
#   `16·(r // 4) + 4a + r % 4`. Then lane group `g` holds the scores of wave-tokens
#   `16g .. 16g+15`: 16 *consecutive* tokens, 4 per MFMA. That is what P·V wants below.
#
# The query is quantized per head. Each lane loads 32 of its head's 128 f16 values (the channels
# its K loads cover); the four lanes of a head agree on `amax` in two `xor_lanes` steps; and
# `q_scale = amax / FP8_MAX` is folded into the score scale.

# %% [markdown]
# The whole wave's dataflow in one picture. Colour is the lane group `g`; one lane is marked.
# Read it left to right, top to bottom: the K bytes each lane loads (the A operand), the scores
# (a column per head), the same registers reused as P·V's B operand, the V bytes (P·V's A
# operand), and the output (a column per head again).

# %%
figures.wave_dataflow(lane=21)
plt.show()

# %%
source(kernel_lib.query_operands, kernel_lib.quantize_query)

# %% [markdown]
# With K and Q in these registers, a tile's turned-around Q·Kᵀ is four token chunks of four
# MFMAs each (two k-steps per channel half), `scores`:

# %%
source(kernel_lib.scores)

# %% [markdown]
# ## Where the bytes come from
#
# A tile is 256 tokens; wave `w` owns tokens `64w .. 64w+63`. Tiles start on page boundaries, so
# a wave's span is exactly 4 pages (block 16) or 1 page (block 64).
#
# * **K** (`[page, kv_head, slot, 128]`): for token chunk `a`, lane `(c, g)` reads 16 bytes of
#   the K row of wave-token `16·(c // 4) + 4a + c % 4`, at channels `16g` and `16g + 64`. A
#   lane's 8 loads hit one page: one address register, different immediate offsets. One
#   instruction reads 64 bytes of each of 16 token rows, half of each row's 128-byte line; the
#   instruction for the other channel half reads the other half.
# * **V** (`[page, kv_head, 128, slot]`, tokens contiguous: V stored transposed, as
#   FlashAttention kernels feed it to a matrix unit): P·V's A operand for channel row `c` of
#   d-chunk `j` and k-slice `g` is V at channel `16j + c`, tokens `16g .. 16g+15`. That is 16
#   contiguous bytes: one `dwordx4` covers both k-steps of the wave's 64 tokens.
# * **page ids**: lane `(c, g)` needs the page of its K rows (`c // 4`) and of its V tokens
#   (`g`): two per-lane `buffer_load_dword`s per tile (block 64: every lane reads the same entry).
#
# Pages past the sequence's last page are clamped to it, as in chapter 01.
#
# `Pages` holds this addressing: the per-lane offsets (fixed for the loop), the per-wave scalar
# offsets of the d-chunks, and the loads. Its strides (`k_row`, `k_chunk`) and V-layout flag are
# what chapter 04's blocked layouts change. First its constructor, run once before the loop:

# %%
source(kernel_lib.Pages.__init__)

# %% [markdown]
# Then what runs every tile. `page_id` reads one block-table entry per lane. `k` and `v` issue
# the lane's loads from one address register each (`slab` places the page and KV head): the K
# loads differ only in immediate offsets, the V loads only in the d-chunk's scalar offset. A
# tile's 16 loads cost two address computations.

# %%
source(kernel_lib.Pages.page_id, kernel_lib.Pages.slab, kernel_lib.Pages.k, kernel_lib.Pages.v)

# %% [markdown]
# ## The online softmax, per wave and in registers
#
# Lane `(c, g)` holds 16 raw fp8 dot products `S` for head `c`, wave-tokens `16g + 4a + i`. With
# `c_qk = q_scale · k_scale · softmax_scale · log2(e)` (log2 e folded into the scale, as in
# chapter 01) the base-2 logits are `x = c_qk · S`, and per tile:
#
# ```
#   m_tile = max over the lane's 16 scores, then over lanes g (xor 16, xor 32)
#   m_new  = max(m_old, m_tile);   corr = 2^(m_old - m_new)
#   p'     = 2^(x - m_new + log2 FP8_MAX)          in (0, FP8_MAX]: fp8-ready
#   l      = l · corr + Σ p'        (lane-partial; a head's 4 lanes are summed at the end)
#   O      = O · corr + V·P'
# ```
#
# Scaling P by `FP8_MAX` before rounding spends fp8's full range on it; the factor cancels in
# `O / l`. The shift carries a margin of `|m_new|·2^-21` (`exp_shift`), which keeps the top P at
# or below `FP8_MAX` at any score magnitude. The max needs its cross-lane steps every tile (a
# head's lanes must share `m` within one MFMA); the sum waits until the end.
#
# Only the last tile can hold tokens past the context, so only it is masked: its scores become
# `-inf` before the max and its V bytes are zeroed. This is Triton's and FlashAttention's
# "mask only the boundary tile".

# %% [markdown]
# The row max across a head's four lanes: the two `xor_lanes` steps of `row_reduce`
# (`wave_reduce` is the same over all 64 lanes, six steps):

# %%
figures.softmax_butterfly(head=0)
plt.show()

# %% [markdown]
# `row_reduce` runs those two steps for any combining `op`. `row_max` takes the max over the
# lane's own 16 scores in registers first, then the two cross-lane steps on one value. It scales
# once, after the max: with `c > 0` the max commutes with the scaling.

# %%
source(kernel_lib.row_reduce, kernel_lib.wave_reduce, kernel_lib.row_max)

# %% [markdown]
# The last tile's masking. `mask_tail` sends the scores at or past the context to `-inf`;
# `zero_tail_v` clears those tokens' V bytes. V arrives four tokens per dword, so the mask is one
# AND per word, with masks built once from the lane's count of valid tokens.

# %%
source(kernel_lib.mask_tail, kernel_lib.zero_tail_v)

# %% [markdown]
# The per-tile step, the equations above line for line. `exp_shift` is the shift with its
# margin. `tree_sum` adds the 16 P pairwise, a chain of 4 dependent adds instead of 16. The P are
# packed to fp8 four at a time into the two B operands of P·V.

# %%
source(kernel_lib.tree_sum, kernel_lib.exp_shift, kernel_lib.softmax_step)

# %% [markdown]
# ## P·V straight from registers
#
# For `O[d, head] = V·P` the A operand is V (rows are channels) and the B operand is P (column is
# head). Lane `(c, g)` must supply P for head `c` at k-slice `8g .. 8g+7` of each k-step. With the
# token order chosen above, k-step 0 is wave-tokens `16g .. 16g+7` and k-step 1 is
# `16g+8 .. 16g+15`: exactly the 16 probabilities this lane computed. **P never leaves the lane.**
#
# Each wave accumulates all 128 channels of `O` for its own tokens: 8 d-chunks × 4 f32 = 32
# registers, rescaled by `corr` before each tile's MFMAs. The output `O[d = 16j + 4g + i, head c]`
# again puts one head per lane column, the scores' head, so `corr` is a per-lane scalar.
#
# Register slot `j` of wave `w` holds d-chunk `(j + 2w) mod 8`. The rotation is free (a per-wave
# scalar offset of the V loads) and lets the merge move compile-time register slots.

# %%
source(kernel_lib.pv_step)

# %% [markdown]
# ## Merging the four waves
#
# After the loop wave `w` holds `(m_w, l_w, O_w)` per head, over its quarter of the tokens. The
# result is flash-decoding's merge:
#
# $$ o = \frac{\sum_w 2^{m_w - m}\, O_w}{\sum_w 2^{m_w - m}\, l_w}\cdot \text{v\_scale}, \qquad m = \max_w m_w .$$
#
# 1. Each wave sums `l` over a head's 4 lanes and writes `(m_w, l_w)` to LDS. After a barrier
#    every lane reads all four and scales its `O_w` by its weight.
# 2. A reduce-scatter in three rounds. In round `r` wave `w` writes slots `2r, 2r+1` (the
#    d-chunks wave `(w+r) mod 4` owns) to its LDS slot, and adds what wave `(w-r) mod 4` wrote
#    into its own slots. After three rounds wave `w` holds d-chunks `2w, 2w+1` summed over all
#    waves and stores them as f16.
#
# A wave that saw no token of the context keeps `m_w = MASKED` and `l_w = 0`: its weight
# `2^(MASKED - m)` is 0 and it drops out.
#
# Step 1 is `merge_waves`. Every lane computes `m`, the total and its own weight from the
# table, so the step needs one barrier and no broadcast; `max4` is a balanced max of four.

# %%
source(kernel_lib.max4, kernel_lib.merge_waves)

# %% [markdown]
# Step 2 is `exchange`. A round is a store, a barrier and a load-and-add. The barrier ending a
# round (all but the last) is there because the next round overwrites the slots just read.
# `store_chunks` writes the wave's two summed d-chunks as f16.

# %%
source(kernel_lib.exchange, kernel_lib.store_chunks)

# %% [markdown]
# ## The kernel, in three pieces
#
# One workgroup of 4 waves per (sequence, KV head). `Shared` is the only LDS the kernel
# declares: the merge's statistics and exchange slots, touched once after the loop.

# %% tags=["export"]
@fx.struct
class Shared:
    """The merge's LDS (the kernel's only LDS): 8.5 KB, used once."""
    stats: fx.Array[fx.Float32, 2 * 16 * WAVES, 16]  # [max | sum][head][wave]
    xchg: fx.Array[fx.Float32, WAVES * 2 * WAVE * 4, 16]  # [sender][2 slots][lane] x f32x4


# %% [markdown]
# `Workgroup` is what the workgroup fixes before its loop: the lane's coordinates, the buffer
# resources (four SGPRs each), the context length and scales (scalar loads), the quantized
# query's four Q·Kᵀ operands (8 registers for the whole loop), `c_qk`, and the lane's `Pages`.
# Its methods are the per-tile math and, after the loop, the merge and the f16 stores. Chapter
# 03 reuses the whole object with a different loop.

# %% tags=["export"]
class Workgroup:
    """What one workgroup fixes before its loop, and its per-tile math (runs while tracing)."""

    def __init__(self, out, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, num_kv_heads, max_blocks, scale_log2, *, block_size, group, fp8_max):
        G = group
        self.log2_fmax = math.log2(fp8_max)
        # col: MFMA column = this lane's query head (and the A-operand row it loads); grp: row band
        tid, wave, lane, col, grp = lane_coords()
        self.tid, self.wave, self.lane, self.col, self.grp = tid, wave, lane, col, grp
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        tensors = (query, key_cache, value_cache, block_tables, out)
        q_rs, k_rs, v_rs, bt_rs, self.o_rs = (rsrc(t) for t in tensors)
        self.ctx = ctx = scalar_load(context_lengths, seq)
        k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
        self.v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        self.head0 = head0 = seq * (num_kv_heads * G) + kvh * G  # first query row of this group
        self.q_ops, q_scale = query_operands(q_rs, (head0 + imin(col, G - 1)) * HEAD_DIM, col < G,
                                             fp8_max, grp)
        self.c_qk = q_scale * k_scale * scale_log2
        last_page = (ctx - 1) // block_size
        self.num_tiles = (ctx + (TILE - 1)) // TILE
        self.pages = Pages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave,
                           col, grp, block_size=block_size)

    def tile_scores(self, t, k_words):
        """Tile ``t``'s 16 raw scores of this lane, and how many of its tokens are in context."""
        s = fx.Vector.from_elements(scores(k_words, self.q_ops), dtype=fx.Float32)
        return s, self.ctx - (t * TILE + self.wave * SPAN + self.grp * 16)

    def softmax_pv(self, s, v_words, o, m_old, l_old):
        """The online-softmax step and P·V: the new ``(o, m, l)``."""
        p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, self.c_qk, self.log2_fmax)
        return pv_step(o, v_words, p_ops, corr), m_new, l_new

    def merge(self, o, m, l):
        """After the loop: the four waves' results combined; this wave's 2 d-chunks, normalized."""
        lds = fx.SharedAllocator().allocate(Shared).peek()
        return merge_waves(o, fx.Float32(m), fx.Float32(l), self.v_scale, lds, self.wave,
                           self.lane, self.col)

    def store(self, mine):
        """This lane's share of its head's output row, f16 (only for the group's real heads)."""
        store_chunks(self.o_rs, mine, (self.head0 + self.col) * (HEAD_DIM * 2), self.wave, self.grp)


# %% [markdown]
# The kernel is the loop. Per lane it carries only `O` (32 registers), `m`, `l` and the next
# tile's page ids. Each iteration issues all of its K and V loads first (16 `dwordx4` per lane),
# reads the next tile's page ids, then computes. V lands while Q·Kᵀ and the softmax run. K's
# latency is covered by the other waves on the SIMD: with no barrier in the loop they drift
# freely. Chapter 03 adds a prefetch of the next tile's K into registers. Only the last tile pays
# for `mask_tail`; the branch is a scalar compare, the same for the whole workgroup.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch) specialization."""

    def pa_decode_s2(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
                     scale_log2: fx.Float32):
        wg = Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths,
                       key_scale, value_scale,
                       num_kv_heads, max_blocks, scale_log2, block_size=block_size, group=group,
                       fp8_max=fp8_max(arch))
        pages = wg.pages
        # Page ids are read one tile ahead, so the loads at the top of an iteration never
        # wait on a block-table read.
        zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
        state = [pages.page_id(0, pages.k_j), pages.page_id(0, pages.v_j)] + [zero4] * 8
        for t, st in range(0, wg.num_tiles, 1, init=state + [fx.Float32(MASKED), fx.Float32(0.0)]):
            t = fx.Int32(t)
            k_page, v_page = st[0], st[1]
            o = [st[2 + j] for j in range_constexpr(8)]
            m_old, l_old = st[10], st[11]
            k_words = pages.k(k_page)
            v_words = pages.v(v_page)  # in flight during Q·Kᵀ and the softmax
            k_page_next = pages.page_id(t + 1, pages.k_j)  # clamped: always a page of this sequence
            v_page_next = pages.page_id(t + 1, pages.v_j)
            # keep all of the tile's loads ahead of its math: left alone, the scheduler would
            # issue V only after K has landed, paying two memory latencies per tile
            fx.rocdl.sched_barrier(0)
            s, n_valid = wg.tile_scores(t, k_words)
            if t + 1 == wg.num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            o, m_new, l_new = wg.softmax_pv(s, v_words, o, m_old, l_old)
            res = yield [k_page_next, v_page_next] + o + [m_new, l_new]

        # `store` is taken out of `wg` first: a method of `wg` called inside a traced `if` would
        # make FlyDSL carry `wg` through the branch as a value
        mine, store = wg.merge([res[2 + j] for j in range_constexpr(8)], res[10], res[11]), wg.store
        if wg.col < group:
            store(mine)

    # launch(out, query, ..., value_scale, num_seqs, num_kv_heads, max_blocks, scale_log2, stream)
    return jit_launcher(pa_decode_s2)


# %% [markdown]
# ## The launcher
#
# The stage contract: validate everything first (a `TypeError`/`ValueError` naming the
# argument), then launch one specialization per (block size, group size, arch). The arch decides
# the fp8 flavour, so a cache of the other flavour is an error, not a silent reinterpretation.

# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *,
                softmax_scale=None, out=None, arch=None):
    """``(launcher, args, arch)`` after validation: ``launcher(*args)`` runs the kernel,
    ``pa_tile.toolchain.compile_isa(launcher, *args, arch=arch)`` shows its assembly."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                       value_scale, out)
    return build_launcher(p.block_size, p.group, p.arch), args, p.arch


def kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, out):
    """The launcher's arguments for a validated problem ``p`` (chapter 3's kernel uses them too)."""
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    return (problem.output(p, query, out), query.contiguous(), key_cache.view(torch.uint8),
            value_cache.view(torch.uint8), block_tables, context_lengths, ks, vs,
            p.num_seqs, p.num_kv_heads, p.max_blocks, p.scale_log2)


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *,
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
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch)
    launching.launch(launcher, args, arch=arch)
    return args[0]


# %% [markdown]
# ## The kernel's arithmetic, written out
#
# Against a float32 reference the kernel is only as good as fp8 allows. To check the kernel
# itself more tightly, `numerics_model` does in torch the roundings the kernel does, in the same
# places: Q to fp8 per head, base-2 logits, a separate online softmax per wave over its 64
# tokens of each tile, P scaled by `FP8_MAX` and rounded to fp8, the sum over unrounded P, the
# 4-way merge. The kernel must match it up to float32 summation order and f16 output rounding.
#
# "In the same places" includes each exponent: the kernel forms `s·c - shift` as one fma, so the
# model rounds once too (in float64, where the product is exact). The operands first:
# `model_operands` gathers K and V through the block table and quantizes the query in the
# kernel's float32 order.

# %%
source(kernel_lib.model_operands)

# %% [markdown]
# The per-wave softmax and the merge are the library's `softmax_model`, which chapter 04's model
# shares:

# %%
source(kernel_lib.softmax_model)

# %% tags=["export"]
def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                   value_scale, *,
                   softmax_scale=None, arch):
    """float32 torch model of the stage-2 kernel's roundings (same arguments as ``paged_decode``);
    returns a float32 tensor shaped like ``query``. CPU only; loops over sequences and tiles."""
    fmax, fp8 = fp8_max(arch), fp8_torch_dtype(arch)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else float(softmax_scale)
    ks = float(torch.as_tensor(key_scale).reshape(()))
    vs = float(torch.as_tensor(value_scale).reshape(()))
    num_seqs, num_q_heads, _ = query.shape
    kvh = key_cache.shape[1]
    group = num_q_heads // kvh
    kc = key_cache.view(torch.uint8).view(fp8).float()
    # -> [blocks, kvh, bs, 128]
    vc = value_cache.view(torch.uint8).view(fp8).float().transpose(2, 3)
    out = torch.empty(num_seqs, num_q_heads, HEAD_DIM)
    for s in range(num_seqs):
        q = query[s].float().reshape(kvh, group, HEAD_DIM)
        q8, q_scale, k, v, _ = model_operands(q, kc, vc, block_tables[s], int(context_lengths[s]),
                                              fmax, fp8)
        c_qk = q_scale * ks * (scale * LOG2E)  # the kernel's float32 order
        res = softmax_model(torch.einsum("hgd,htd->hgt", q8, k), c_qk, v, fmax, fp8) * vs
        out[s] = res.reshape(num_q_heads, HEAD_DIM)
    return out


# %% [markdown]
# ## Does it work?
#
# The compiled code runs on ragged contexts (1 token, a partial first page, exactly one tile,
# five tiles with 3 tokens in the last) with shuffled pages and `-1` in unused block-table
# entries.
#
# The bound is what fp8 arithmetic allows, element by element (`pa_tile.reference.fp8_error_bound`,
# `case.error_bound()`). It runs the reference on the kernel's own fp8 query, so the query's
# rounding is computed, not guessed. Each P is rounded to e4m3 (relative error ≤ 2⁻⁴) while the
# sum uses unrounded P, so an output moves by at most 2⁻⁴ of the attention-weighted `Σ w_t |v_t|`.
# Float32 slack, subnormal P codes and the f16 output rounding complete it. Each table row is one
# (arch, block, group): the worst `err / bound` of its four sequences. Against `numerics_model`
# the kernel agrees to about one f16 ulp.

# %% tags=["nbval-ignore-output"]
from pa_tile import backend  # noqa: E402

print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %% tags=["nbval-ignore-output"]
from pa_tile.emu.memory import format_table  # noqa: E402
from pa_tile.stages.s2_register_softmax import numerics_model, paged_decode  # noqa: E402


def check(arch, block_size, group, contexts=(1, 17, 256, 1027), num_kv_heads=2, seed=1):
    case = cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, 128, block_size,
                           list(contexts),
                           fp8_format=fp8_format(arch), seed=seed, pad_block_id=-1)
    args = (case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)
    got = paged_decode(*args, arch=arch).cpu()
    ref, bound = case.error_bound(out_dtype=got.dtype)
    got = got.float()
    model = numerics_model(*(x.cpu() for x in args), arch=arch).float()
    err = (got - ref).abs()
    of_bound = (err / bound).flatten(1).amax(1)  # per sequence
    worst = int(of_bound.argmax())
    return dict(arch=arch, block=block_size, group=group, err_vs_ref=round(float(err.max()), 4),
                of_bound=round(float(of_bound[worst]), 2), at_context=contexts[worst],
                ok=bool((err <= bound).all()),
                err_vs_model=f"{float((got - model).abs().max()):.1e}")


# one row per (arch, block, group): the worst of its four sequences
table = [check(arch, bs, g) for arch in backend.runnable_archs()
         for bs in (16, 64) for g in (8, 16)]
print(format_table(table))
print(f"{len(table)} configurations x 4 contexts: "
      f"{'all' if all(r['ok'] for r in table) else 'NOT all'} "
      f"{4 * len(table)} sequences within the bound, "
      f"worst err / bound {max(r['of_bound'] for r in table):.2f}")
assert all(r["ok"] for r in table)

# %% [markdown]
# ## What it compiles to, against chapter 01
#
# Static facts of both stages' code for block 16, group 8: the rows that changed, then the loop.

# %%
from pa_tile.stages import s1_tile_qk  # noqa: E402
from pa_tile.stages.s2_register_softmax import launch_args  # noqa: E402


def isa_stats(stage, arch, block_size=16, group=8):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, group, 1, 128, block_size, 17, fp8_format=fp8_format(arch),
                           device="cpu")
    # one contract for both
    stage_launch_args = s1_tile_qk.launch_args if stage == 1 else launch_args
    launch, args, _ = stage_launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables,
                                        case.context_lengths, case.k_scale, case.v_scale, arch=arch)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launch, *args, arch=arch))


stats = {(s, arch): isa_stats(s, arch) for s in (1, 2) for arch in ARCHS}
# the rows that changed on either arch, and the headline facts
print(isa.diff_side_by_side({arch: (stats[1, arch], stats[2, arch]) for arch in ARCHS},
                            labels=("stage 1", "stage 2")))

# %%
def loop_row(stage, arch):
    st = stats[stage, arch]
    occ = isa.occupancy(st, arch)
    fam = st.main_loop.families
    return dict(stage=stage, arch=arch, vgpr=st.vgpr_unified, lds=st.lds_bytes,
                waves=occ.waves_per_simd, bound_by="+".join(occ.bound_by),
                loop_instr=st.main_loop_instructions, loop_ds=fam.get("ds", 0),
                loop_barriers=fam.get("barrier", 0), loop_mfma=fam.get("mfma", 0))


rows = [loop_row(s, a) for a in ARCHS for s in (1, 2)]
print(format_table(rows))
s2 = {r["arch"]: r for r in rows if r["stage"] == 2}
up = upstream.tile_isa_figure("gfx942", 16, 128, 1, 8, per_token=False)
EXCHANGES = ("ds_swizzle_b32", "ds_bpermute_b32", "v_permlane16_swap_b32_e32",
             "v_permlane32_swap_b32_e32")
exchanges = {a: ", ".join(f"{stats[2, a].count(m)} `{m}`" for m in EXCHANGES
                          if stats[2, a].count(m)) for a in ARCHS}
show.md(f"""
Lane exchanges in stage 2, gfx942: {exchanges['gfx942']};
gfx950: {exchanges['gfx950']}.

Stage 2 needs {s2['gfx942']['lds']:,} B of LDS and {s2['gfx942']['vgpr']} registers on gfx942
({s2['gfx950']['vgpr']} on gfx950): **{s2['gfx942']['waves']:g} waves per SIMD** on gfx942 and
{s2['gfx950']['waves']:g} on gfx950, bound by {s2['gfx942']['bound_by']}. Its loop has
{s2['gfx942']['loop_barriers']} barriers. Upstream's finished `pa_decode_tile` at this
configuration (trans-blocked V; compiled, see chapter 00) needs {up['vgpr']} registers and
{up['lds']:,} B of LDS: {up['occ']} waves per SIMD.
""")

# %% [markdown]
# What the turned-around tile removed:
#
# * **the scores' LDS round trip**: a head's reductions are 15 in-lane `v_max`/`v_add` plus two
#   cross-lane steps (`ds_swizzle` + `ds_bpermute` on gfx942, which move data between lanes
#   without LDS memory; `v_permlane32_swap`/`v_permlane16_swap` on gfx950);
# * **P's LDS round trip and the loop's barriers**: the four waves drift freely and hide each
#   other's memory latency;
# * **most of the LDS**: what remains is the merge's, touched once per workgroup.

# %% [markdown]
# ## Memory traffic of one tile
#
# One sequence of exactly one tile (256 tokens, block 16, group 8) on gfx942, traced by the
# emulator: every memory instruction before, in and after the loop. Per execution: bytes, the
# 128-byte lines touched and the fewest possible, or the worst LDS bank-conflict degree. Lines of
# one instruction that access memory alike are merged (`execs`: executions by all waves).

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

COLUMNS = {"phase": "phase", "mnemonic": "mnemonic", "lines": "instrs", "executions": "execs",
           "bytes_per_exec": "B/exec", "lines_128B_per_exec": "lines/exec",
           "min_lines_128B_per_exec": "min lines/exec",
           "max_degree": "conflict degree"}
traffic = []
if backend.current_backend() == "emu":
    case = cache.make_case(1, 8, 1, 128, 16, 256, fp8_format="fnuz", pad_block_id=-1)
    trace = Trace("gfx942")
    with emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace):
        paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables,
                     case.context_lengths, case.k_scale, case.v_scale, arch="gfx942")
    # prologue / loop / epilogue: the lines before, in and after the main loop of the code that ran
    phases = isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)
    traffic = trace.grouped_summary(phases=phases, merge_scalar=True)
    print(format_table(traffic, list(COLUMNS), headers=COLUMNS))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# ## What the same idea bought the seed kernel
#
# Upstream's tile kernel took the same two steps on a real GPU. Commit `260fc774` spread the
# softmax's second phase over all 64 lanes; commit `8ada08f6` turned the tile around ("token=M").
# These times are MEASURED by upstream, not by pa_tile; the paragraph under the table says what
# is assumed.

# %%
seed = [r for r in seed_history.rows("260fc774", "8ada08f6") if r["measured"].endswith("µs")]
show.md(seed_history.markdown_table(seed) + "\n\n" + seed_history.attribution())

# %% [markdown]
# ## What you built
#
# ```
# paged_decode_s2(q, K, V, block_tables, ctx):     # grid (seq, kv_head); 4 waves
#     lane (c, g) = (lane % 16, lane // 16)          # c: the lane's query head
#     Qops, c_qk = quantize(q[head c])               # 8 registers, whole loop
#     m, l, O[8 d-chunks] = MASKED, 0, 0             # this lane's head, this wave's tokens
#     for tile in range(ceil(ctx / 256)):            # wave w: tokens 64w .. 64w+63
#         Kw = 8 x dwordx4 of K                      # page ids read one tile ahead
#         Vw = 8 x dwordx4 of V                      # in flight during K·Qᵀ
#         S = K·Qᵀ: 16 MFMAs                         # head c, tokens 16g .. 16g+15
#         if last tile: mask S, zero V's tail        # the boundary tile only
#         m2 = max(m, row_max(S * c_qk))             # 2 xor_lanes steps
#         corr = exp2(m - m2); P = exp2(S*c_qk - m2 + log2 FP8_MAX)
#         l = l*corr + tree_sum(P)
#         O = O*corr + V·fp8(P): 16 MFMAs            # P is the B operand: no LDS
#         m = m2
#     merge the 4 waves' (m, l, O) through LDS       # once
#     store f16 O / l
# ```
#
# The PREDICTED times below are the timing model's (`pa_tile.perf`), not a GPU's. Stage 1 lies
# outside the regime the model is calibrated on (it waits out several memory latencies a tile in
# series), where it has over-predicted, so read the gain as an upper estimate.
#
# Next: chapter 03 pipelines the loop, loading the next tile's K while this one computes.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

# the model samples its kernels in the emulator: no prediction where this runs on a GPU
emu = backend.current_backend() == "emu"
pred = {s.gpu: s for s in speedup.predicted_steps("s2", "s1")} if emu else {}
loop_loads = [r for r in traffic
              if r.get("phase") == "loop" and r["mnemonic"] == "buffer_load_dwordx4"]
waves = {s: isa.occupancy(stats[s, "gfx942"], "gfx942").waves_per_simd for s in (1, 2)}
lines = ", ".join(f"{r['lines_128B_per_exec']:g} ({r['min_lines_128B_per_exec']:g})"
                  for r in loop_loads)
predicted = " / ".join(f"{pred[g].us:.0f} µs ({pred[g].previous_us:.0f})"
                       for g in ("MI300X", "MI355X")) if pred else "emulator only"
show.measured({
    "VGPRs, stage 1 -> 2 (gfx942)": f"{stats[1, 'gfx942'].vgpr_unified} -> {s2['gfx942']['vgpr']}",
    "waves per SIMD, stage 1 -> 2 (gfx942)":
        f"{waves[1]:g} -> {waves[2]:g}",
    "LDS / barriers in the loop": f"{s2['gfx942']['lds']:,} B / {s2['gfx942']['loop_barriers']}",
    "K/V loads in the loop: 128-byte lines per execution (min)":
        lines or "emulator only",
    "PREDICTED stage 2 (stage 1), b16 × 16k, MI300X / MI355X (model)":
        predicted,
})
