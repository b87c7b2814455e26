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
# Chapter 1 built a readable decode kernel: the four waves of a workgroup split the tile's
# tokens for Q·Kᵀ, staged the scores in LDS for a row-wise softmax, wrote the fp8
# probabilities P to LDS and read them back transposed so that the waves could split
# head-dim for P·V. Every tile paid for several barriers and kilobytes of LDS traffic, and
# the LDS it needed bounded how many workgroups fit on a CU.
#
# This chapter removes all of it from the loop. Three ideas do the work:
#
# 1. **Turn the scores around.** Compute `D[token, head] = K·Qᵀ` instead of `Q·Kᵀ`. In the
#    MFMA output a lane owns one *column*, so every lane now owns one query head and a few
#    tokens: the softmax reductions over tokens become a register reduce plus two
#    cross-lane steps.
# 2. **Let each wave finish its own tokens.** The P that comes out of step 1 is already in
#    the register layout the P·V MFMA wants as its B operand, so a wave multiplies its own
#    64 tokens of P by its own 64 tokens of V. No LDS round trip, no barrier; each wave keeps
#    its own running max, sum and `O` in registers for the whole loop (flash-decoding inside
#    one workgroup).
# 3. **Merge once.** After the loop the four waves combine their `(max, sum, O)`: 8.5 KB of
#    LDS, used once.
#
# Scope is chapter 1's: f16 query `[num_seqs, num_q_heads, 128]`, one query token, fp8 K/V
# with per-tensor scales (FNUZ on gfx942, OCP on gfx950), K cache `[blocks, kv_heads, block, 128]`,
# V cache `[blocks, kv_heads, 128, block]`, block 16 or 64, 8 or 16 query heads per KV head.

# %%
import math

import matplotlib.pyplot as plt
import torch

from pa_tile import cache, figures, isa, toolchain
from pa_tile.arch import ARCHS, fp8_format

# %% [markdown]
# ## Building blocks
#
# This kernel is written one level below chapter 1's tile API, with the operations the
# hardware has:
#
# | helper | instruction | why here |
# |---|---|---|
# | `buffer_load` | `buffer_load_dword[x4]` | per-lane byte offset (VGPR) + per-wave offset (SGPR) + 12-bit immediate; K and V rows are 16 bytes per lane |
# | `scalar_load` | `s_buffer_load_dword` | context length and scales: one value per wave |
# | `uniform` | `v_readfirstlane_b32` | tells the compiler the wave index is wave-uniform, so everything derived from it is scalar |
# | `xor_lanes` | `ds_swizzle` / `ds_bpermute` (gfx942), `v_permlane*_swap` (gfx950) | the butterfly step of a reduction across lanes |
# | `mfma` | `v_mfma_f32_16x16x32_fp8_fp8` | 16×16 output, K = 32 fp8 per step |
# | `pack_fp8` | `v_cvt_pk_fp8_f32` ×2 | four f32 → one dword of fp8 codes (the format is the arch's) |
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
    HEAD_DIM, LOG2E, MASKED, SPAN, TILE, WAVE, WAVES, Pages, imin, jit_launcher, lane_coords, mask_tail,
    merge_waves, pv_step, query_operands, rsrc, scalar_load, scores, softmax_model, softmax_step, store_chunks,
    model_operands,
)

__all__ = ["paged_decode", "build_launcher", "launch_args", "kernel_args", "numerics_model", "LIMITS", "Shared",
           "Workgroup"]

#: what the stage-2 kernel supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s2", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))


# %% [markdown]
# These helpers are the shared kernel library, `pa_tile.kernel_lib`: every later chapter
# imports them by these names. Each is one hardware operation. First the memory side: `rsrc`
# describes a tensor to the buffer instructions, sized to the tensor itself, so that an offset
# gone wrong reads 0 instead of another tensor's bytes; `buffer_load` takes its address in the
# three parts the instruction adds up (per-lane VGPR, per-wave SGPR, immediate), so loads a
# constant apart share one address register; `scalar_load` fetches one word for the whole wave.
# `lds_store` and `lds_load` move f32 vectors to and from LDS, which only the final merge uses.

# %%
from pa_tile import kernel_lib  # noqa: E402
from pa_tile.show import source  # noqa: E402

source(kernel_lib.rsrc, kernel_lib.buffer_load, kernel_lib.scalar_load, kernel_lib.lds_store, kernel_lib.lds_load)

# %% [markdown]
# Then the register side. `uniform` is `v_readfirstlane`: the wave index every lane already
# agrees on, now known to the compiler as wave-uniform, so what is computed from it stays in
# SGPRs. `xor_lanes` is the butterfly step of every cross-lane reduction (the backend picks the
# instruction per arch). `pack_fp8` rounds four f32 to one dword of fp8 codes in two
# conversions (the second fills the high half), `i64` pairs two such dwords into the eight-code
# operand the MFMA takes, and `mfma` is the instruction itself.

# %%
source(kernel_lib.uniform, kernel_lib.xor_lanes, kernel_lib.pack_fp8, kernel_lib.i64, kernel_lib.mfma)

# %% [markdown]
# ## Turning the scores around
#
# `v_mfma_f32_16x16x32_fp8_fp8` computes a 16×16 block `D = A·B + C` with `A` 16×32 and
# `B` 32×16. Lane `l` of the wave holds (with `c = l % 16`, `g = l // 16`):
#
# ```
#   A: row c,      k = 8g .. 8g+7      (one i64: 8 fp8 codes)
#   B: k = 8g .. 8g+7, column c        (one i64)
#   D: rows 4g .. 4g+3, column c       (four f32)
# ```
#
# A lane's results all sit in **one column**. Chapter 1 put query heads on the rows
# (`Q·Kᵀ`), so a head's 16 scores were spread over 16 lanes. Here K is the A operand and Qᵀ
# the B operand, so rows are tokens and column `c` is query head `c`: a lane holds 4 scores
# of *its own head* per MFMA. Heads 8..15 of a group of 8 are zero padding.
#
# Which 16 tokens make up the rows of an MFMA is our choice, and so is which 32 head-dim
# channels make up one k-step, as long as A and B agree. Two choices pay off:
#
# * **k-steps:** lane `(c, g)` loads 16 contiguous bytes of a K row at channel
#   `16·(g + 4h)` for `h = 0, 1`: one `dwordx4` gives two k-steps. Q uses the same
#   channel order, so the dot product is unchanged.
# * **token rows:** MFMA row `r` of token chunk `a` (a = 0..3) is wave-token
#   `16·(r // 4) + 4a + r % 4`. Then lane group `g` ends up holding scores for wave-tokens
#   `16g .. 16g+15` — 16 *consecutive* tokens, 4 per MFMA — which is what P·V wants below.
#
# ```
#   wave span: 64 tokens = 4 groups x 16          QK output of chunk a (one MFMA block):
#   g=0: tok 0..15   (lanes  0..15)                 rows 4g..4g+3 -> tokens 16g+4a .. 16g+4a+3
#   g=1: tok 16..31  (lanes 16..31)                 column c      -> query head c
#   g=2: tok 32..47  (lanes 32..47)
#   g=3: tok 48..63  (lanes 48..63)
# ```
#
# The query is quantized per head: each lane loads 32 of its head's 128 f16 values (the same
# channels its K loads cover), the four lanes of a head agree on `amax` with two
# `xor_lanes` steps, and `q_scale = amax / FP8_MAX` is folded into the score scale.

# %% [markdown]
# The same fragments drawn out: the number in a cell is the lane that holds it. A lane's
# four scores and its four outputs sit in one column, i.e. belong to one query head.

# %%
figures.mfma_ownership(chunk=0, d_chunk=0)
plt.show()

# %%
source(kernel_lib.query_operands, kernel_lib.quantize_query)

# %% [markdown]
# With K and Q in these registers, the turned-around Q·Kᵀ of a tile is four token chunks of
# four MFMAs each (two k-steps per channel half), `scores`:

# %%
source(kernel_lib.scores)

# %% [markdown]
# ## Where the bytes come from
#
# A tile is 256 tokens; wave `w` owns tokens `64w .. 64w+63` of it. Tiles start on page
# boundaries, so a wave's span is exactly 4 pages (block 16) or 1 page (block 64):
#
# * **K** (`[page, kv_head, slot, 128]`): lane `(c, g)` reads, for each token chunk `a`,
#   16 bytes of the K row of wave-token `16·(c // 4) + 4a + c % 4` at channels
#   `16g` and `16g + 64`. All 8 loads of a lane hit one page, so they share one address
#   register and differ only in the immediate offset. Each instruction touches 16 rows ×
#   64 bytes: sixteen fully used 64-byte segments.
# * **V** (`[page, kv_head, 128, slot]`, tokens contiguous): the P·V A operand for channel
#   row `c` of d-chunk `j` and k-slice `g` is V at channel `16j + c`, tokens `16g .. 16g+15`
#   — 16 contiguous bytes, one `dwordx4` covering both k-steps of the wave's 64 tokens.
# * **page ids**: lane `(c, g)` needs the page of its K rows (`c // 4`) and of its V tokens
#   (`g`): two per-lane `buffer_load_dword`s from the block table per tile (for block 64 all
#   lanes of a wave read the same entry).
#
# Pages past the sequence's last page are clamped to the last page: their tokens are masked
# anyway, and the kernel never reads a block-table entry the sequence does not own.
#
# `Pages` holds this addressing: the per-lane offsets (fixed for the loop), the per-wave
# scalar offsets of the d-chunks, and the loads. Its two strides (`k_row`, `k_chunk`) and the
# V-layout flag are what chapter 4's blocked layouts change. The class is shown in two parts;
# first its constructor, which computes everything that stays fixed for the loop once, before it:

# %%
source(kernel_lib.Pages.__init__)

# %% [markdown]
# Then what runs every tile. `page_id` reads one block-table entry per lane, the page of the
# lane's K rows or of its V tokens, clamped as described above. `k` and `v` issue the lane's
# loads from a single address register each (`slab` places the (page, KV head) in the cache):
# the K loads differ only in their immediate offsets, the V loads only in the d-chunk's scalar
# offset, so a tile's 16 loads cost two address computations.

# %%
source(kernel_lib.Pages.page_id, kernel_lib.Pages.slab, kernel_lib.Pages.k, kernel_lib.Pages.v)

# %% [markdown]
# ## The online softmax, per wave and in registers
#
# Lane `(c, g)` holds 16 raw fp8 dot products `S` for head `c`, wave-tokens
# `16g + 4a + i`. With `c_qk = q_scale · k_scale · softmax_scale · log2(e)` the scores in
# log2 units are `x = c_qk · S`, and per tile:
#
# ```
#   m_tile = max over the lane's 16 scores, then over lanes g (xor 16, xor 32)
#   m_new  = max(m_old, m_tile);   corr = 2^(m_old - m_new)
#   p'     = 2^(x - m_new + log2 FP8_MAX)          in (0, FP8_MAX]: fp8-ready
#   l      = l · corr + Σ p'        (lane-partial; the 4 lanes of a head are summed once, at the end)
#   O      = O · corr + V·P'
# ```
#
# Scaling P by `FP8_MAX` before rounding it to fp8 spends the format's full range on it; the
# factor cancels in `O / l`. The shift carries one more term, a margin of `|m_new|·2^-21`
# (`exp_shift`): the max is rounded once while each exponent is one fused multiply-add, so
# without it the top P of a row with very large scores could land a hair past `FP8_MAX`,
# which the fp8 conversion turns into NaN. The max needs its cross-lane steps every tile (all lanes of a
# head must use the same `m` in one MFMA); the sum does not.
#
# Only the last tile can hold tokens past the context. There the raw scores become `-inf`
# before the max, and the matching V bytes are zeroed: a page's unused slots may hold stale
# codes (even NaN codes), and `0 · NaN` is NaN inside the MFMA.

# %% [markdown]
# The row max across the four lanes of a head, the two `xor_lanes` steps of `row_reduce`
# (`row_max` in `softmax_step`; `wave_reduce` is the same over all 64 lanes, six steps):

# %%
figures.softmax_butterfly(head=0)
plt.show()

# %% [markdown]
# In code, `row_reduce` is those two steps for any combining `op` (max here, the sum at the
# merge). `row_max` does the cheap part first: the max over the lane's own 16 scores in
# registers, then the two cross-lane steps on one value. It scales once, after the max: with
# `c > 0` the max commutes with the scaling.

# %%
source(kernel_lib.row_reduce, kernel_lib.wave_reduce, kernel_lib.row_max)

# %% [markdown]
# The last tile's masking. `mask_tail` sends the scores of tokens at or past the context to
# `-inf` before the max, and `zero_tail_v` clears those tokens' V bytes. V arrives packed, four
# tokens per dword, so the mask works on whole bytes of each dword: one AND per word, with
# masks computed once from the lane's count of valid tokens.

# %%
source(kernel_lib.mask_tail, kernel_lib.zero_tail_v)

# %% [markdown]
# The per-tile step itself, the equations above line for line. `exp_shift` is the shift with
# its margin; `tree_sum` adds the 16 P pairwise, a chain of 4 dependent adds instead of 16; the
# P are packed to fp8 four at a time into the two B operands of P·V.

# %%
source(kernel_lib.tree_sum, kernel_lib.exp_shift, kernel_lib.softmax_step)

# %% [markdown]
# ## P·V straight from registers
#
# For `O[d, head] = V·P` the A operand is V (rows = channels) and the B operand is P
# (column = head). Lane `(c, g)` must supply P for head `c` at k-slice `8g .. 8g+7` of each
# k-step: with the token order chosen above, k-step 0 is wave-tokens `16g .. 16g+7` and
# k-step 1 is `16g+8 .. 16g+15` — exactly the 16 probabilities this lane just computed.
# So P never leaves the lane. Each wave accumulates all 128 channels of `O` for its own
# tokens: 8 d-chunks × 4 f32 = 32 registers, rescaled by `corr` before each tile's MFMAs.
# The output layout, `O[d = 16j + 4g + i, head c]`, again puts one head per lane column,
# the same head as the scores, so `corr` is a per-lane scalar.
#
# One more choice prepares the merge: register slot `j` of wave `w` holds d-chunk
# `(j + 2w) mod 8`. The rotation costs nothing (it is a per-wave scalar offset of the V
# loads) and makes the exchange below move compile-time register slots.

# %%
source(kernel_lib.pv_step)

# %% [markdown]
# ## Merging the four waves
#
# After the loop wave `w` holds `(m_w, l_w, O_w)` per head, over its quarter of the tokens.
# The result is
#
# $$ o = \frac{\sum_w 2^{m_w - m}\, O_w}{\sum_w 2^{m_w - m}\, l_w}\cdot \text{v\_scale}, \qquad m = \max_w m_w .$$
#
# 1. Each wave sums `l` over its 4 lanes per head, writes `(m_w, l_w)` to LDS (512 bytes);
#    after a barrier every lane reads all four and scales its `O_w` by its weight.
# 2. A reduce-scatter in three rounds: in round `r` wave `w` writes slots `2r, 2r+1` (the
#    d-chunks wave `(w+r) mod 4` owns) to its 2 KB LDS slot, and adds what wave
#    `(w-r) mod 4` wrote into its own slots 0 and 1. After three rounds wave `w` holds
#    d-chunks `2w, 2w+1` summed over all waves, and stores them (f16, 8 bytes per lane).
#
# A wave that saw no token of the context (wave `w` when the context has at most `64·w`
# tokens) keeps `m_w = MASKED` and `l_w = 0`: its weight `2^(MASKED - m)` is 0 and it drops out.
#
# Step 1 is `merge_waves`. Every lane reads all four `(m_w, l_w)` of its head from the table and
# computes `m`, the total and its own weight itself, so step 1 needs one barrier and no
# broadcast; `max4` is the max of the four as a balanced tree. It ends by handing the weighted
# `O` to step 2:

# %%
source(kernel_lib.max4, kernel_lib.merge_waves)

# %% [markdown]
# Step 2 is `exchange`, the reduce-scatter. A round is a store, a barrier and a load-and-add;
# the barrier at the end of a round (all but the last) is there because the next round
# overwrites the slots just read. `store_chunks` then writes the wave's two summed d-chunks as
# f16.

# %%
source(kernel_lib.exchange, kernel_lib.store_chunks)

# %% [markdown]
# ## The kernel, in three pieces
#
# One workgroup of 4 waves per (sequence, KV head). What the workgroup fixes before its loop
# is one object, `Workgroup`: the lane's coordinates, the buffer resources (V#s, four SGPRs
# each), the context length and the scales (scalar loads), the query quantized into its four
# Q·Kᵀ operands (8 registers, held for the whole loop), `c_qk`, and the lane's `Pages`. Its
# methods are the per-tile math, written with the building blocks above: the scores and the
# count of the lane's tokens inside the context; the softmax step and P·V; after the loop the
# merge and the f16 stores. Chapter 3 reuses the whole object with a different loop.

# %% tags=["export"]
@fx.struct
class Shared:
    """The merge's LDS (the kernel's only LDS): 8.5 KB, used once."""
    stats: fx.Array[fx.Float32, 2 * 16 * WAVES, 16]  # [max | sum][head][wave]
    xchg: fx.Array[fx.Float32, WAVES * 2 * WAVE * 4, 16]  # [sender][2 slots][lane] x f32x4


# %% [markdown]
# `Shared` above is the only LDS the kernel declares: the merge's row statistics and the exchange
# slots, 8.5 KB, touched once after the loop. `Workgroup` below fixes everything that does not
# change from tile to tile, so the loop body is four method calls.

# %% tags=["export"]
class Workgroup:
    """What one workgroup fixes before its loop, and its per-tile math (runs while tracing)."""

    def __init__(self, out, query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, num_kv_heads, max_blocks, scale_log2, *, block_size, group, fp8_max):
        G = group
        self.log2_fmax = math.log2(fp8_max)
        # col: MFMA column = this lane's query head (and the A-operand row it loads); grp: row band
        tid, wave, lane, col, grp = self.tid, self.wave, self.lane, self.col, self.grp = lane_coords()
        seq = fx.Int32(gpu.block_id("x"))
        kvh = fx.Int32(gpu.block_id("y"))
        q_rs, k_rs, v_rs, bt_rs, self.o_rs = (rsrc(t) for t in (query, key_cache, value_cache, block_tables, out))
        self.ctx = ctx = scalar_load(context_lengths, seq)
        k_scale = scalar_load(key_scale, 0).bitcast(fx.Float32)
        self.v_scale = scalar_load(value_scale, 0).bitcast(fx.Float32)
        self.head0 = head0 = seq * (num_kv_heads * G) + kvh * G  # first query row of this group
        self.q_ops, q_scale = query_operands(q_rs, (head0 + imin(col, G - 1)) * HEAD_DIM, col < G, fp8_max, grp)
        self.c_qk = q_scale * k_scale * scale_log2
        last_page = (ctx - 1) // block_size
        self.num_tiles = (ctx + (TILE - 1)) // TILE
        self.pages = Pages(bt_rs, k_rs, v_rs, seq * max_blocks, last_page, kvh, num_kv_heads, wave, col, grp,
                           block_size=block_size)

    def tile_scores(self, t, k_words):
        """Tile ``t``'s 16 raw scores of this lane, and how many of its 16 tokens are in the context."""
        s = fx.Vector.from_elements(scores(k_words, self.q_ops), dtype=fx.Float32)
        return s, self.ctx - (t * TILE + self.wave * SPAN + self.grp * 16)

    def softmax_pv(self, s, v_words, o, m_old, l_old):
        """The online-softmax step and P·V: the new ``(o, m, l)``."""
        p_ops, corr, m_new, l_new = softmax_step(s, m_old, l_old, self.c_qk, self.log2_fmax)
        return pv_step(o, v_words, p_ops, corr), m_new, l_new

    def merge(self, o, m, l):
        """After the loop: the four waves' results combined; this wave's two d-chunks, normalized."""
        lds = fx.SharedAllocator().allocate(Shared).peek()
        return merge_waves(o, fx.Float32(m), fx.Float32(l), self.v_scale, lds, self.wave, self.lane, self.col)

    def store(self, mine):
        """This lane's share of its head's output row, f16 (only for the group's real heads)."""
        store_chunks(self.o_rs, mine, (self.head0 + self.col) * (HEAD_DIM * 2), self.wave, self.grp)


# %% [markdown]
# The kernel is then the loop. It carries, per lane, only `O` (32 registers), `m`, `l` and
# the page ids of the next tile. Each iteration issues all of its K and V loads first (16
# `dwordx4` per lane), reads the next tile's page ids, and computes. V lands while Q·Kᵀ and
# the softmax run; K's latency is hidden by the other waves, of which there are many: see
# the register count below. (Prefetching the next tile's K into registers, as chapter 1
# does, costs 32 registers per lane and one wave per SIMD of occupancy; with no barrier in
# the loop, other waves are the cheaper way to cover the latency.) Only the last tile can
# hold tokens past the context, so only it pays for `mask_tail`: the branch is a scalar
# compare, the same for the whole workgroup.
#
# `jit_launcher` (in `pa_tile.kernel_lib`) makes the `@flyc.jit` launcher every stage has:
# the kernel's arguments plus `num_seqs` and a stream, one workgroup per (sequence, KV head).

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch) specialization."""

    def pa_decode_s2(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32, scale_log2: fx.Float32):
        wg = Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
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
# Same contract as every stage: validate everything first (a `TypeError`/`ValueError` that
# names the argument, before anything is compiled or launched), then launch one
# specialization per (block size, group size, arch). The arch decides the fp8 flavour, so a
# cache of the other flavour is an error rather than a silent reinterpretation.

# %% tags=["export"]
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


# %% [markdown]
# ## The kernel's arithmetic, written out
#
# Against a float32 reference the kernel is only as good as fp8 allows (the query and P are
# rounded to e4m3). To check the kernel itself much more tightly, `numerics_model` does in
# torch exactly the roundings the kernel does, in the same places: Q to fp8 per head,
# scores in log2 units, a separate online softmax per wave over its 64 tokens of each tile,
# P scaled by `FP8_MAX` and rounded to fp8, the sum over unrounded P, the 4-way merge.
# The kernel must match it up to float32 summation order and f16 output rounding.
#
# "In the same places" includes how each exponent is formed: the kernel computes `s·c - shift`
# as one fma, so the model computes it with one rounding too (in float64, where the product of
# two floats is exact), not `s·c` rounded and then shifted. The two differ by up to an ulp of
# the row max, which is enough to flip the fp8 code of a heavy token's P now and then.
#
# The operands first: `model_operands` gathers a sequence's K and V through its block table and
# quantizes the query rows as the kernel does, including the float32 order of the scale
# (`amax · f32(1/FP8_MAX)`, not `amax / FP8_MAX`, which can differ in the last bit):

# %%
source(kernel_lib.model_operands)

# %% [markdown]
# The per-wave softmax and the merge are the library's `softmax_model`, which chapter 4's model
# shares. It loops over tiles and waves as the kernel does and leaves only the order of the
# sums to torch (the kernel must match it up to that order):

# %%
source(kernel_lib.softmax_model)

# %% tags=["export"]
def numerics_model(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                   softmax_scale=None, arch):
    """float32 torch model of the stage-2 kernel's roundings (same arguments as ``paged_decode``);
    returns a float32 tensor shaped like ``query``. CPU only; loops over sequences and tiles."""
    fmax, fp8 = fp8_max(arch), fp8_torch_dtype(arch)
    scale = 1.0 / math.sqrt(HEAD_DIM) if softmax_scale is None else float(softmax_scale)
    ks, vs = float(torch.as_tensor(key_scale).reshape(())), float(torch.as_tensor(value_scale).reshape(()))
    num_seqs, num_q_heads, _ = query.shape
    kvh = key_cache.shape[1]
    group = num_q_heads // kvh
    kc = key_cache.view(torch.uint8).view(fp8).float()
    vc = value_cache.view(torch.uint8).view(fp8).float().transpose(2, 3)  # -> [blocks, kvh, bs, 128]
    out = torch.empty(num_seqs, num_q_heads, HEAD_DIM)
    for s in range(num_seqs):
        q = query[s].float().reshape(kvh, group, HEAD_DIM)
        q8, q_scale, k, v, _ = model_operands(q, kc, vc, block_tables[s], int(context_lengths[s]), fmax, fp8)
        c_qk = q_scale * ks * (scale * LOG2E)  # the kernel's float32 order
        res = softmax_model(torch.einsum("hgd,htd->hgt", q8, k), c_qk, v, fmax, fp8) * vs
        out[s] = res.reshape(num_q_heads, HEAD_DIM)
    return out


# %% [markdown]
# ## Does it work?
#
# The compiled gfx942 / gfx950 code runs in the emulator on cases with ragged contexts
# (1 token, a partial first page, exactly one tile, five tiles with 3 tokens in the last) and
# shuffled pages whose unused block-table entries are `-1` (a stray read would fault).
#
# How close must it be to the float32 reference? As close as fp8 arithmetic allows, element by
# element (`pa_tile.reference.fp8_error_bound`; `case.error_bound()` on a test case). The kernel
# rounds the query to e4m3 per head: that moves the scores, and the bound does not guess by how
# much but computes it, as the reference run on the kernel's own query. It rounds each P to
# e4m3 (relative error ≤ 2⁻⁴, 3 mantissa bits) yet sums the unrounded P, so an output
# `Σ p_t v_t / Σ p_t` moves by at most 2⁻⁴ of the attention-weighted `Σ w_t |v_t|`. Add float32
# slack (2⁻⁸ of the same), P codes below e4m3's normal range, and the f16 output rounding. A row
# that sees one or two tokens gets a wide bound (2⁻⁴ of its `|v|`), a long row a narrow one
# (2⁻⁴ of the mean `|v|`, ~0.05 here). The table has one row per (arch, block, group): the worst
# `err / bound` of its four sequences and the context that has it, with `ok` for all four.
# Against `numerics_model` the kernel must agree to about one f16 ulp.

# %% tags=["nbval-ignore-output"]
from pa_tile import backend  # noqa: E402

print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %% tags=["nbval-ignore-output"]
from pa_tile.emu.memory import format_table  # noqa: E402
from pa_tile.stages.s2_register_softmax import numerics_model, paged_decode  # noqa: E402


def check(arch, block_size, group, contexts=(1, 17, 256, 1027), num_kv_heads=2, seed=1):
    case = cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, 128, block_size, list(contexts),
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
                ok=bool((err <= bound).all()), err_vs_model=f"{float((got - model).abs().max()):.1e}")


# one row per (arch, block, group): the worst of its four sequences
table = [check(arch, bs, g) for arch in backend.runnable_archs() for bs in (16, 64) for g in (8, 16)]
print(format_table(table))
print(f"{len(table)} configurations x 4 contexts: {'all' if all(r['ok'] for r in table) else 'NOT all'} "
      f"{4 * len(table)} sequences within the bound, worst err / bound {max(r['of_bound'] for r in table):.2f}")
assert all(r["ok"] for r in table)

# %% [markdown]
# ## What it compiles to, against chapter 1
#
# Static facts of both stages' code for block 16, group 8.

# %%
from pa_tile.stages import s1_tile_qk  # noqa: E402
from pa_tile.stages.s2_register_softmax import launch_args  # noqa: E402


def isa_stats(stage, arch, block_size=16, group=8):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, group, 1, 128, block_size, 17, fp8_format=fp8_format(arch), device="cpu")
    stage_launch_args = s1_tile_qk.launch_args if stage == 1 else launch_args  # one contract for both
    launch, args, _ = stage_launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables,
                                        case.context_lengths, case.k_scale, case.v_scale, arch=arch)
    return isa.IsaStats.from_asm(toolchain.compile_isa(launch, *args, arch=arch))


stats = {(s, arch): isa_stats(s, arch) for s in (1, 2) for arch in ARCHS}
# the rows that changed on either arch, and the headline facts
print(isa.diff_side_by_side({arch: (stats[1, arch], stats[2, arch]) for arch in ARCHS}, labels=("stage 1", "stage 2")))

# %%
def loop_row(stage, arch):
    st = stats[stage, arch]
    occ = isa.occupancy(st, arch)
    fam = st.main_loop.families
    return dict(stage=stage, arch=arch, vgpr=st.vgpr_unified, lds=st.lds_bytes,
                waves_per_simd=occ.waves_per_simd, bound_by="+".join(occ.bound_by),
                loop_instr=st.main_loop_instructions, loop_ds=fam.get("ds", 0),
                loop_barriers=fam.get("barrier", 0), loop_valu=fam.get("valu", 0), loop_mfma=fam.get("mfma", 0))


print(format_table([loop_row(s, a) for a in ARCHS for s in (1, 2)]))

# %% [markdown]
# What each change removed:
#
# * **Scores turned around** → the per-tile LDS staging of scores and the row max/sum
#   exchange are gone: a head's reductions are 15 in-lane `v_max`/`v_add` plus two
#   cross-lane steps (`ds_swizzle` + `ds_bpermute` on gfx942, which move data between
#   lanes without touching LDS memory; `v_permlane32_swap`/`permlane16_swap` on gfx950),
#   and the sum needs none until the end.
# * **P·V from registers, per wave** → the fp8 P tile in LDS, its write/read and both
#   barriers of every tile are gone; the loop has no `s_barrier` at all, so the four waves
#   drift freely and hide each other's memory latency.
# * **Merge once** → the LDS that remains (8.5 KB: 512 B of max/sum, 8 KB exchange) is
#   touched once per workgroup, after the loop.
#
# The upstream kernel this walkthrough retraces reported, at this point of its history,
# LDS 15360 B and VGPR+AGPR 152, i.e. 3 workgroups per CU on gfx942. This stage needs
# 8704 B of LDS and at most 128 registers (the table above), so **4 workgroups per CU**
# (4 waves per SIMD) on both gfx942 and gfx950, now bound by registers. The loop's live set
# is this tile's K (32) and V (32), `O` (32), Q (8) and 16 scores: 120 before temporaries.
# What it gave up to fit is a software prefetch of the next tile's K (32 more registers,
# one wave per SIMD less); with no barrier in the loop, the other waves on the SIMD cover
# the memory latency instead.

# %% [markdown]
# ## Memory traffic of one tile
#
# One sequence of exactly one tile (256 tokens, block 16, group 8) on gfx942, traced by the
# emulator: every memory instruction, before, in and after the loop, with its bytes, the 64-byte
# segments it touched (and the fewest possible), and LDS bank conflicts (the merge only). One
# row per kind of access: the lines of one instruction that move the same bytes and touch the
# same segments are counted together (`lines`; `execs` = executions by all waves).

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

if backend.current_backend() == "emu":
    case = cache.make_case(1, 8, 1, 128, 16, 256, fp8_format="fnuz", pad_block_id=-1)
    trace = Trace("gfx942")
    with emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace):
        paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
                     case.k_scale, case.v_scale, arch="gfx942")
    # prologue / loop / epilogue: the lines before, in and after the main loop of the code that ran
    print(trace.grouped_table(phases=isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)))
else:
    print("ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")

# %% [markdown]
# ## Predicted time against stage 1 (a model, not a measurement)
#
# The register-resident softmax removes stage 1's LDS round trips between the two products, and
# the model's walk of the loop now waits out one memory latency per tile where stage 1's waited
# out about five. That is nearly all of the predicted gain, and it is the least certain
# figure of the walkthrough: stage 1's side lies outside the model's calibrated regime (the
# caution printed below the table), where it over-predicted, so the true gain is likely smaller.

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

print(speedup.report("s2", "s1"))
