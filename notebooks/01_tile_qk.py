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
# # 01 · A readable tile kernel: Q·Kᵀ, online softmax, P·V
#
# The first attention kernel, written with FlyDSL's tile API: buffer tensors, `zipped_divide`,
# a tiled MMA on the fp8 16×16×32 MFMA, `fx.gemm`, tiled copies and `fx.gather`. It is correct
# and complete, not fast. Later chapters change it one idea at a time.
#
# **You'll learn**
#
# - how one MFMA instruction spreads its operands over a wave's 64 lanes;
# - how a tiled MMA splits a tile over four waves, and why P must change owner through LDS;
# - paging as virtual memory: a layout over back-to-back pages, translated by the block table;
# - where the query's, K's and V's scales go, and why the softmax uses `exp2`;
# - how to read a kernel's memory traffic in 128-byte lines and LDS bank conflicts.
#
# **You need** chapter 00 (FlyDSL idioms, layouts, the glossary) and FlashAttention's online
# softmax.
#
# **Runs on** the CPU emulator (about two minutes: both archs, eight configurations), or a ROCm
# GPU.
#
# The work split:
#
# * one **workgroup of 4 waves (256 threads) per (sequence, KV head)**. Its query rows are the
#   GQA group (8 or 16 heads), padded to the MFMA's 16 rows;
# * a loop over **256-token tiles** with an **online softmax** (running max, running sum,
#   rescaled output), FlashAttention's, so one pass covers any context length;
# * per tile: `S = Q·Kᵀ` (the waves split the tokens), scores to LDS, a row-wise softmax (16
#   threads per query row), fp8 `P` to LDS, then `O = O·corr + P·V` (the waves split head_dim).
#
# Scope: an f16 query `[num_seqs, num_q_heads, 128]`, one query token, fp8 e4m3 K/V with
# per-tensor scales (FNUZ on gfx942, OCP on gfx950). K cache `[num_blocks, kv_heads, block_size,
# 128]`, V cache `[num_blocks, kv_heads, 128, block_size]` (`pa_tile.cache.to_v_plain`). Block
# size 16 or 64; 8 or 16 query heads per KV head.

# %% tags=["export"]
"""Stage 1: fp8 paged-attention decode written with FlyDSL's tile/layout API.

One workgroup of 4 waves per (sequence, kv head) walks the context in 256-token tiles with an
online softmax. Per tile: ``S = Q·Kᵀ`` on a tiled fp8 MFMA (the waves split the tokens), K
gathered page by page through the block table; scores staged in LDS for a row-wise softmax;
fp8 probabilities ``P`` through LDS; ``O = O·corr + P·V`` (the waves split head-dim).

Layouts (see ``pa_tile.cache``): query ``[num_seqs, num_q_heads, 128]`` f16; K cache
``[num_blocks, num_kv_heads, block_size, 128]``; V cache ``[num_blocks, num_kv_heads, 128,
block_size]``; fp8 e4m3 codes (``float8_e4m3fnuz`` on gfx942, ``float8_e4m3fn`` on gfx950, or
uint8); per-tensor float32 scales ``[1]``; ``block_size`` 16 or 64; 8 or 16 query heads per kv head.
"""

import functools
import math

import torch

import flydsl.expr as fx
from flydsl.expr import range_constexpr
from flydsl.expr.typing import ReductionOp, T

from pa_tile import launching, problem
from pa_tile.arch import fp8_format, fp8_max
from pa_tile.kernel_lib import jit_launcher

__all__ = [
    "paged_decode",
    "launch_args",
    "build_launcher",
    "HEAD_DIM",
    "TILE_TOKENS",
    "FX_FP8",
    "LIMITS",
]

# %% [markdown]
# ## Sizes, and the fp8 flavour of each GPU
#
# gfx942's MFMA reads e4m3 **FNUZ** codes (largest value 240); gfx950's reads **OCP** e4m3
# (largest 448). The kernel is compiled per arch with the matching FlyDSL element type. The same
# constant `FP8_MAX` scales the query and the probabilities into fp8 range.

# %% tags=["export"]
HEAD_DIM = 128  # channels per head (the only head size stage 1 supports)
TILE_TOKENS = 256  # tokens per trip of the main loop
NUM_WAVES = 4  # waves per workgroup
WAVE_SIZE = 64  # lanes per wave on CDNA
MMA_ROWS = 16  # query rows per workgroup: the MFMA's M (a GQA group of 8 is padded to 16)
ROW_THREADS = 16  # threads sharing one query row in the row-wise phases (16 rows x 16 = 256)
LOG2E = 1.4426950408889634
#: what stage 1 supports (``pa_tile.problem.describe`` enforces it)
LIMITS = problem.Limits(stage="s1", head_dims=(HEAD_DIM,), block_sizes=(16, 64), groups=(8, 16))

# FlyDSL's element type for each fp8 flavour (which flavour an arch reads: pa_tile.arch)
FX_FP8 = {"fnuz": fx.Float8E4M3FNUZ, "ocp": fx.Float8E4M3FN}

# %% [markdown]
# ## The MFMA atom: which lane holds what
#
# `v_mfma_f32_16x16x32_fp8_fp8` multiplies a 16×32 fp8 block `A` by the transpose of a 16×32
# fp8 block `B` into a 16×16 f32 block `C`, on one wave. Each lane supplies 8 fp8 values of `A`
# and of `B` (one 64-bit register pair) and receives 4 values of `C`:
#
# * `A[m, k]`: lane `m + 16·(k // 8)`, byte `k % 8`. Lane `l` holds row `l % 16`, columns
#   `8·(l // 16) … +7`;
# * `B[n, k]`: the same, with `n` for `m`;
# * `C[m, n]`: lane `n + 16·(m // 4)`, register `m % 4`. Lane `l` holds column `l % 16`, rows
#   `4·(l // 16) … +3`.
#
# FlyDSL knows this as the atom's thread-value layouts (CuTe's `TV` layouts).
# `make_fragment_A/B/C` and `make_tiled_copy_A/B/C` derive every register fragment and copy from
# it, so the kernel never spells the lane arithmetic out. The drawing shows the lane at each
# element.

# %%
import matplotlib.pyplot as plt
import numpy as np

from pa_tile import figures


def atom_lanes():
    a = np.zeros((16, 32), int)  # lane owning A[m, k] (B[n, k] is the same picture)
    for m in range(16):
        for k in range(32):
            a[m, k] = m + 16 * (k // 8)
    c = np.zeros((16, 16), int)  # lane owning C[m, n]
    for m in range(16):
        for n in range(16):
            c[m, n] = n + 16 * (m // 4)
    return a, c


figures.mfma_atom(*atom_lanes())
plt.show()

# %% [markdown]
# ## One tiled MMA for both products
#
# `make_tiled_mma(atom, (1, 4, 1))` repeats the atom over the 4 waves along **N**. One step is
# a 16×64×32 block; wave `w` owns output columns `16w … 16w+15` of every 64. `fx.gemm` loops it
# over whatever fragment shapes it is given.
#
# * **Q·Kᵀ**: `A = Q` (16 rows × 128 channels), `B = K` (256 tokens × 128 channels), `C = S`
#   (16 × 256). N is tokens: wave `w` scores tokens `64j + 16w … +15`, `j = 0…3`. It contracts
#   the 128 channels in 4 steps of 32: 16 MFMAs per wave.
# * **P·V**: `A = P` (16 × 256 tokens), `B = V` (128 channels × 256 tokens), `C = O` (16 × 128).
#   N is head_dim: wave `w` produces channels `64j + 16w … +15`, `j = 0, 1`. It contracts the
#   256 tokens in 8 steps of 32: 16 MFMAs per wave.
#
# The waves split different axes in the two products, so `P` changes owner in between. Each wave
# holds the scores of *its* tokens, but P·V needs every token's `P` in every wave. That
# transposition goes through LDS: the scores on the way out, `P` on the way back.

# %% tags=["export"]
def make_tiled_mma(fp8):
    """The fp8 16x16x32 MFMA repeated over the 4 waves along N: a (16, 64, 32) tile per step.

    Q·Kᵀ: N is tokens, so each wave owns 16 of every 64 tokens. P·V: N is channels, so each
    wave owns 16 of every 64 channels. Both contract over K in steps of 32.
    """
    atom = fx.make_mma_atom(fx.rocdl.MFMA(16, 16, 32, fp8))
    return fx.make_tiled_mma(atom, fx.make_layout((1, NUM_WAVES, 1), (0, 1, 0)))


# %%
figures.wave_split(TILE_TOKENS, HEAD_DIM)
plt.show()

# %% [markdown]
# ## Paging as virtual memory
#
# A tile's 256 tokens live in `256 / block_size` scattered pages. The kernel describes a tile as
# if its pages were stored back to back, a **virtual layout**. It translates each virtual offset
# `v` the way an MMU does: virtual page `v // page`, offset `v % page`, physical page from the
# block table.
#
# * K page (one KV head): `[block_size, 128]`, channels contiguous. Virtual tile:
#   `((block_size, pages), 128) : ((128, page), 1)`, chapter 00's notation.
# * V page: `[128, block_size]`, tokens contiguous. Virtual tile:
#   `(128, (block_size, pages)) : (block_size, (1, page))`.
#
# A *counting tensor* is a view whose "memory" is its own layout: its element is
# `layout(coordinate)`. Partitioned by the MMA's B-operand copy, it gives each thread the virtual
# offset of each 8-byte piece it loads. `fx.gather` loads the pieces from the physical offsets
# straight into the MFMA's B fragment. A piece (8 tokens of a channel for V, 8 channels of a
# token for K) never crosses a page, because 16 divides the block size.
#
# Pages past a sequence's last page are clamped to it. The block table is never read past the
# sequence's own pages, and the tokens those pages bring in are masked.

# %% tags=["export"]
def counting(layout):
    """A tensor with no memory behind it: its element at a coordinate is ``layout(coordinate)``."""
    return fx.make_view(fx.make_int_tuple(0), layout)


def k_virtual_layout(block_size):
    """(token, channel) of a K tile -> offset, as if the tile's pages were stored back to back."""
    page = block_size * HEAD_DIM
    pages = TILE_TOKENS // block_size
    return fx.make_layout(((block_size, pages), HEAD_DIM), ((HEAD_DIM, page), 1))


def v_virtual_layout(block_size):
    """(channel, token) of a V tile -> offset, its pages ([HEAD_DIM, block_size]) back to back."""
    page = block_size * HEAD_DIM
    pages = TILE_TOKENS // block_size
    return fx.make_layout((HEAD_DIM, (block_size, pages)), (block_size, (1, page)))


def physical_offsets(virtual, tile, block_table_row, last_page, num_kv_heads, kv_head, block_size):
    """Translate virtual tile offsets into cache offsets (in fp8 elements) through the block table.

    ``virtual`` holds the virtual offset of the first element of each piece this thread loads.
    A sequence's pages past ``last_page`` are clamped to it, so no stray block-table entry is
    ever read; the tokens they bring in are masked by the caller.
    """
    page = block_size * HEAD_DIM
    pages_per_tile = TILE_TOKENS // block_size
    v = virtual.load()
    offsets = []
    for i in range_constexpr(v.numel):
        logical_page = fx.min(tile * pages_per_tile + v[i] // page, last_page)
        physical_page = fx.Int32(block_table_row[logical_page])
        offsets.append((physical_page * num_kv_heads + kv_head) * page + v[i] % page)
    frag = fx.make_fragment_like(virtual, fx.Int32)
    frag.store(fx.Vector.from_elements(offsets, dtype=fx.Int32))
    return frag


# %%
def translate(v, block_table_row, block_size, kv_head=0, num_kv_heads=1, tile=0):
    """The same translation in plain Python, for one virtual K offset."""
    page = block_size * HEAD_DIM
    logical = tile * (TILE_TOKENS // block_size) + v // page
    return (block_table_row[logical] * num_kv_heads + kv_head) * page + v % page


# a sequence's pages (block_size 16): tokens 0-15 in page 7, 16-31 in page 2, ...
row = [7, 2, 9, 4]
for token, channel in [(0, 0), (15, 127), (16, 0), (40, 8)]:
    v = token * HEAD_DIM + channel  # virtual K offset: the tile's rows back to back
    print(f"token {token:2d} channel {channel:3d}: virtual {v:5d} "
          f"-> page {row[v // (16 * HEAD_DIM)]}, "
          f"cache offset {translate(v, row, 16)}")

# %% [markdown]
# ## The query: fp8 per row, and where every scale goes
#
# The MFMA takes fp8 on both sides, so the f16 query is quantized with one scale per row (query
# head): `q ≈ q8 · a/FP8_MAX`, `a = max|q|` of the row, `q8 = rne(q · FP8_MAX/a)`. With
# `k = k8 · k_scale`, the logit of row `r`, token `t` is
#
# $$\mathrm{softmax\_scale}\cdot q_r\cdot k_t \approx
#   \underbrace{\tfrac{a_r}{\mathrm{FP8\_MAX}}\cdot k_{\text{scale}}\cdot\mathrm{softmax\_scale}\cdot\log_2 e}_{\text{row factor}}
#   \cdot (q8_r\cdot k8_t)\;/\;\log_2 e$$
#
# One multiply by a per-row constant turns a raw fp8 dot product into a base-2 logit. The
# softmax then uses `exp2`, one instruction. This is the trick of FlashAttention-2 and Triton's
# fused-attention tutorial: `log2 e` folded into the scale. The probabilities `p ∈ [0, 1]` are
# stored as `fp8(p · FP8_MAX)` to use all of fp8's range, and `v = v8 · v_scale`, so
#
# $$o_r = \frac{\sum_t \mathrm{fp8}(p_{rt}\,\mathrm{FP8\_MAX})\, v8_t}{\sum_t p_{rt}}\cdot
#   \frac{v_{\text{scale}}}{\mathrm{FP8\_MAX}}$$
#
# with the last factor applied once, after the loop. The running sum uses the unrounded `p`.
#
# In the row-wise phases thread `t` owns row `t // 16` and the `t % 16`-th sixteenth of it. A
# row is 16 adjacent lanes of one wave, so a row reduction is four xor-shuffle steps.

# %% tags=["export"]
def row_split_copy(atom, rows, values_per_thread):
    """A tiled copy where thread ``t`` owns row ``t // 16``, elements ``(t % 16) * v ... + v``."""
    return fx.make_tiled_copy_tv(
        atom,
        fx.make_ordered_layout((rows, ROW_THREADS), order=(1, 0)),
        fx.make_ordered_layout((1, values_per_thread), order=(1, 0)),
    )


def row_allreduce(x, combine):
    """Combine a value over the 16 adjacent lanes that share a query row (xor butterfly)."""
    for step in (8, 4, 2, 1):
        x = combine(x, x.shuffle_xor(step, WAVE_SIZE))
    return x


def to_fp8(values, fp8):
    """f32 vector (length a multiple of 4) -> fp8 codes, round to nearest even, in hardware."""
    words = []
    for i in range_constexpr(values.numel // 4):
        lo = fx.rocdl.cvt_pk_fp8_f32(T.i32, values[4 * i], values[4 * i + 1], fx.Int32(0), False)
        words.append(fx.rocdl.cvt_pk_fp8_f32(T.i32, values[4 * i + 2], values[4 * i + 3], lo, True))
    return fx.Vector.from_elements(words, dtype=fx.Int32).bitcast(fp8)


def rcp(x):
    """1/x with one v_rcp_f32 (about 1 ulp), instead of an IEEE division sequence."""
    return fx.Float32(fx.rocdl.rcp(T.f32, x))


# %% [markdown]
# ## The online softmax, tile by tile
#
# Per row the loop carries the running max `m` (base-2 logits), the running sum `l` and the
# unnormalized output `O`. A tile with logits `x_t` does
#
# $$m' = \max(m, \max_t x_t),\quad p_t = 2^{x_t - m'},\quad c = 2^{m - m'},\quad
#   l' = l\,c + \textstyle\sum_t p_t,\quad O' = O\,c + P\cdot V.$$
#
# `m` starts at `-inf`, so the first tile's correction is `c = 0`. Every tile the loop visits
# holds a token of the context, so `m'` is finite from then on and `p_t ≤ 1`. Tokens past the
# context get `x_t = -inf`, so `p_t = 0`. Their V codes are zeroed too: a cache slot past the
# context may hold a NaN code, and `0·NaN = NaN` inside the MFMA. This kernel masks every tile;
# chapter 02 masks only the last.

# %% tags=["export"]
def zero_tokens_past(frag, first_token, n_valid):
    """Zero the fp8 codes of tokens >= ``n_valid`` in a V fragment made of 8-token pieces.

    ``first_token[i]`` is the first token of piece ``i``; a piece is one 64-bit word, masked
    bytewise (the last valid piece of the context may be partial).
    """
    n = first_token.numel
    keep_bytes = [fx.max(fx.min(n_valid - first_token[i], 8), 0) for i in range_constexpr(n)]
    keep_bytes = fx.Vector.from_elements(keep_bytes, dtype=fx.Int32)
    ones = fx.Vector.filled(n, 1, fx.Int64)
    mask = (keep_bytes >= 8).select(fx.Vector.filled(n, -1, fx.Int64),
                                    (ones << (keep_bytes * 8).to(fx.Int64)) - 1)
    frag.store((frag.load().bitcast(fx.Int64) & mask).bitcast(frag.element_type))


# %% [markdown]
# ## The kernel
#
# Four parts: (1) quantize the group's query rows into LDS; (2) build the tiled MMA, its operand
# copies and the per-thread index tensors, all loop-invariant; (3) loop over tiles, carrying
# `(m, l, O)`; (4) normalize and store the group's rows.
#
# LDS holds the fp8 query (2 KB), one tile of f32 scores (16 KB), one tile of fp8 `P` (4 KB) and
# 16 per-row floats. Each tile has three barriers: scores written, then softmax; `P` written,
# then P·V; P·V done, then the next tile may overwrite.
#
# Each part is a function; FlyDSL traces through it as if it were written in place. Part 1:
# thread `t` owns row `t // 16` and 8 of its 128 channels. The row's amax meets across its 16
# threads, the codes go to LDS through 64-bit copies, and the row factor turns a raw fp8 score
# into log2 units.

# %% tags=["export"]
def quantize_query(query, seq, kv_head, tid, row, group_size, fp8, fp8_max_, sQ, log2_scale,
                   k_scale):
    """Part 1: this kv head's query rows to fp8 in LDS ``sQ``, one scale per row; returns the
    thread's row factor (raw score -> log2 units)."""
    q_groups = fx.zipped_divide(query[seq, None, None], (group_size, HEAD_DIM))
    q_rows = fx.slice(q_groups, (None, (kv_head, 0)))
    q_atom = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), fx.Float16)
    # threads past the group's rows re-read them (a valid address) and zero them below
    q_src = row_split_copy(q_atom, group_size,
                           8).get_slice(tid % (group_size * ROW_THREADS)).partition_S(q_rows)
    q_frag = fx.make_fragment_like(q_src)
    fx.copy(q_atom, q_src, q_frag)
    q = q_frag.load().to(fx.Float32)
    # rows 8-15 of a group of 8: padding
    q = (row < group_size).select(q, fx.Vector.filled_like(q, 0.0))
    q_amax = row_allreduce(fx.absf(q).reduce(ReductionOp.MAX), fx.maxnumf)
    q_codes = to_fp8(q * (fx.Float32(fp8_max_) * rcp(fx.maxnumf(q_amax, fx.Float32(1e-30)))), fp8)
    lds64 = fx.make_copy_atom(fx.UniversalCopy64b(), fp8)
    sq_dst = row_split_copy(lds64, MMA_ROWS, 8).get_slice(tid).partition_D(sQ)
    sq_frag = fx.make_fragment_like(sq_dst)
    sq_frag.store(q_codes)
    fx.copy(lds64, sq_frag, sq_dst)
    # see "where every scale goes"
    row_factor = q_amax * fx.Float32(log2_scale / fp8_max_) * k_scale
    fx.gpu.barrier()
    return row_factor


# %% [markdown]
# Part 2 is everything the loop reuses. The tiled MMA, and per operand a copy of the thread's
# share: A (Q or P) from LDS; B (K or V) gathered from the cache, 8 bytes per piece; C (the
# scores) to LDS. Q's fragment stays in registers for the whole loop. Counting tensors give each
# piece its virtual offset and first token. `Tiles` holds all of it; its methods are a tile's
# three phases.

# %% tags=["export"]
class Tiles:
    """Part 2 (loop-invariant operand copies and index tensors) and the phases of part 3."""

    def __init__(self, fp8, tid, block_size, group_size, sQ, sS, sP, block_tables, seq, kv_head,
                 context_len, out):
        chunk = TILE_TOKENS // ROW_THREADS  # scores per thread in the softmax phase
        self.tiled_mma = make_tiled_mma(fp8)
        self.thr_mma = thr_mma = self.tiled_mma.thr_slice(tid)
        # the operand copies: A (Q or P) from LDS, B (K or V) from the cache, C (scores) to LDS
        self.lds64 = fx.make_copy_atom(fx.UniversalCopy64b(), fp8)
        self.a_copy = fx.make_tiled_copy_A(self.lds64, self.tiled_mma).get_slice(tid)
        self.gather64 = fx.make_copy_atom(fx.rocdl.BufferCopy64b(), fp8)
        self.b_copy = fx.make_tiled_copy_B(self.gather64, self.tiled_mma).get_slice(tid)
        self.s32 = fx.make_copy_atom(fx.UniversalCopy32b(), fx.Float32)
        self.c_copy = fx.make_tiled_copy_C(self.s32, self.tiled_mma).get_slice(tid)
        self.q_mma = thr_mma.make_fragment_A(sQ)  # Q stays in registers for the whole loop
        fx.copy(self.lds64, self.a_copy.partition_S(sQ), self.a_copy.retile(self.q_mma))
        self.k_layout = k_virtual_layout(block_size)
        self.v_layout = v_virtual_layout(block_size)
        # one offset per 8-byte piece; token_of: V tile coordinate -> token
        self.k_virtual = self.b_copy.partition_S(counting(self.k_layout))[(0, None), None, None]
        self.v_virtual = self.b_copy.partition_S(counting(self.v_layout))[(0, None), None, None]
        token_of = counting(fx.make_layout((HEAD_DIM, TILE_TOKENS), (0, 1)))
        v_first_token = self.b_copy.partition_S(token_of)[(0, None), None, None].load()
        self.v_first_token = v_first_token.reshape(v_first_token.numel)
        self.block_table_row = block_tables[seq, None]
        self.last_page = (context_len - 1) // block_size
        self.sm_atom = fx.make_copy_atom(fx.UniversalCopy128b(), fx.Float32)
        self.sm_copy = row_split_copy(self.sm_atom, MMA_ROWS, chunk).get_slice(tid)
        s_token_of = counting(fx.make_layout((MMA_ROWS, TILE_TOKENS), (0, 1)))
        self.s_token = self.sm_copy.partition_S(s_token_of).load()
        self.p_atom = fx.make_copy_atom(fx.UniversalCopy128b(), fp8)
        self.p_dst = row_split_copy(self.p_atom, MMA_ROWS, chunk).get_slice(tid).partition_D(sP)

        out_groups = fx.zipped_divide(out[seq, None, None], (group_size, HEAD_DIM))
        out_rows = fx.slice(out_groups, (None, (kv_head, 0)))
        out_layout = fx.make_layout((MMA_ROWS, HEAD_DIM), (HEAD_DIM, 1))
        self.out_tile = fx.make_view(fx.get_iter(out_rows), out_layout)
        o_row = thr_mma.partition_C(counting(fx.make_layout((MMA_ROWS, HEAD_DIM), (1, 0)))).load()
        self.o_row = o_row.reshape(o_row.numel)  # query row of each of this thread's output values
        self.sQ, self.sS, self.sP, self.block_size = sQ, sS, sP, block_size

    def offsets(self, virtual, tile, num_kv_heads, kv_head):
        return physical_offsets(virtual, tile, self.block_table_row, self.last_page, num_kv_heads,
                                kv_head, self.block_size)

# %% [markdown]
# The three phases of a tile. **Scores**: K is gathered page by page into the B fragments, each
# 8-byte piece's virtual offset translated through the block table. One `gemm` covers the tile,
# and the scores go to LDS.

# %% tags=["export"]
def tile_scores(t, tile, key_cache, num_kv_heads, kv_head):
    """S = Q·Kᵀ for one tile, K gathered page by page straight into the B fragments; S to LDS."""
    k_mma = t.thr_mma.make_fragment_B(fx.make_view(fx.get_iter(key_cache), t.k_layout))
    k_offsets = t.offsets(t.k_virtual, tile, num_kv_heads, kv_head)
    fx.gather(t.gather64, fx.get_iter(key_cache), k_offsets, t.b_copy.retile(k_mma))
    s_mma = t.thr_mma.make_fragment_C(t.sS)
    s_mma.fill(0.0)
    fx.gemm(t.tiled_mma, s_mma, t.q_mma, k_mma, s_mma)
    fx.copy(t.s32, t.c_copy.retile(s_mma), t.c_copy.partition_D(t.sS))
    fx.gpu.barrier()

# %% [markdown]
# **Softmax**: each thread reads 16 scores of its row and masks tokens past the context. It
# updates `(m, l)` with the row's max and sum (16-lane butterflies) and writes `P` to LDS as fp8.

# %% tags=["export"]
def tile_softmax(t, n_valid, row_factor, m_old, l_old, fp8, fp8_max_):
    """The online softmax, row-wise (16 threads per row, 16 scores each); P to LDS as fp8.
    Returns ``(m_new, l_new, correction)``."""
    s_src = t.sm_copy.partition_S(t.sS)
    s_frag = fx.make_fragment_like(s_src)
    fx.copy(t.sm_atom, s_src, s_frag)
    s = s_frag.load()
    x = (t.s_token < n_valid).select(s * row_factor, fx.Vector.filled_like(s, float("-inf")))
    m_new = fx.maxnumf(m_old, row_allreduce(x.reduce(ReductionOp.MAX), fx.maxnumf))
    p = fx.math.exp2(x - m_new)
    correction = fx.math.exp2(m_old - m_new)
    l_new = l_old * correction + row_allreduce(p.reduce(ReductionOp.ADD), lambda a, b: a + b)
    p_frag = fx.make_fragment_like(t.p_dst)
    p_frag.store(to_fp8(p * fx.Float32(fp8_max_), fp8))  # p in [0, 1] -> [0, FP8_MAX]
    fx.copy(t.p_atom, p_frag, t.p_dst)
    return m_new, l_new, correction

# %% [markdown]
# **P·V**: every wave reads all of `P` back, gathers its V pieces and zeroes those past the
# context. It accumulates `O · correction + P·V`, reading each output row's correction from LDS.

# %% tags=["export"]
def tile_pv(t, tile, value_cache, num_kv_heads, kv_head, n_valid, o_old, sRow):
    """O = O * correction + P·V, with every wave reading all of P back from LDS."""
    p_mma = t.thr_mma.make_fragment_A(t.sP)
    fx.copy(t.lds64, t.a_copy.partition_S(t.sP), t.a_copy.retile(p_mma))
    v_mma = t.thr_mma.make_fragment_B(fx.make_view(fx.get_iter(value_cache), t.v_layout))
    v_frag = t.b_copy.retile(v_mma)
    v_offsets = t.offsets(t.v_virtual, tile, num_kv_heads, kv_head)
    fx.gather(t.gather64, fx.get_iter(value_cache), v_offsets, v_frag)
    zero_tokens_past(v_frag, t.v_first_token, n_valid)
    pv = fx.make_fragment_like(t.thr_mma.partition_C(t.out_tile), fx.Float32)
    pv.fill(0.0)
    fx.gemm(t.tiled_mma, pv, p_mma, v_mma, pv)
    o_row = t.o_row
    row_correction = fx.Vector.from_elements(
        [fx.Float32(sRow[o_row[i]]) for i in range_constexpr(o_row.numel)], dtype=fx.Float32
    )
    return o_old * row_correction + pv.load().reshape(o_row.numel)


# %% [markdown]
# Part 4. After the loop each row's sum `l` goes through LDS to the threads that hold the row's
# outputs. They scale by `1/l`, fold `P`'s `FP8_MAX` and V's scale back in, round to f16 and
# store the group's real rows. `jit_launcher` (`pa_tile.kernel_lib`, taught in chapter 02) makes
# the `@flyc.jit` launcher every stage has. The branches on `part == 0` and on the rows stay in
# the kernel's own body, where chapter 00 showed a device branch may go.

# %% tags=["export"]
def normalized_output(t, final, sRow, v_scale, fp8_max_, tid):
    """O / l, with P's FP8_MAX and V's scale folded back in.

    Returns ``(copy atom, src, dst)`` of the f16 store."""
    o_row = t.o_row
    inv_l = fx.Vector.from_elements([rcp(sRow[o_row[i]]) for i in range_constexpr(o_row.numel)],
                                    dtype=fx.Float32)
    o = fx.Vector(final[2]) * inv_l * (v_scale * fx.Float32(1.0 / fp8_max_))
    o_out = fx.make_fragment_like(t.thr_mma.partition_C(t.out_tile))
    o_out.store(o.to(fx.Float16))
    store16 = fx.make_copy_atom(fx.rocdl.BufferCopy16b(), fx.Float16)
    o_copy = fx.make_tiled_copy_C(store16, t.tiled_mma).get_slice(tid)
    return store16, o_copy.retile(o_out), o_copy.partition_D(t.out_tile)


# %% [markdown]
# The workgroup's LDS: the quantized query, one tile's raw scores and its fp8 `P`, and one
# scalar per query row that the softmax hands to P·V (the correction; after the loop, the sum).
# The kernel views each array as a row-major tensor of query rows.

# %% tags=["export"]
def shared_storage(fp8):
    """The workgroup's LDS as a FlyDSL struct (``fp8``: the arch's fp8 element type)."""

    @fx.struct
    class SharedStorage:
        q: fx.Array[fp8, MMA_ROWS * HEAD_DIM, 16]  # quantized query rows
        s: fx.Array[fx.Float32, MMA_ROWS * TILE_TOKENS, 16]  # raw scores of one tile
        p: fx.Array[fp8, MMA_ROWS * TILE_TOKENS, 16]  # quantized probabilities of one tile
        row: fx.Array[fx.Float32, MMA_ROWS, 16]  # per-row scalar handed from softmax to P·V

    return SharedStorage


def lds_views(lds):
    """``(sQ, sS, sP, sRow)``: an allocated ``shared_storage``'s arrays, as row-major tensors."""
    sQ = lds.q.view(fx.make_layout((MMA_ROWS, HEAD_DIM), (HEAD_DIM, 1)))
    sS = lds.s.view(fx.make_layout((MMA_ROWS, TILE_TOKENS), (TILE_TOKENS, 1)))
    sP = lds.p.view(fx.make_layout((MMA_ROWS, TILE_TOKENS), (TILE_TOKENS, 1)))
    sRow = lds.row.view(fx.make_layout(MMA_ROWS, 1))
    return sQ, sS, sP, sRow

# %% [markdown]
# The kernel: buffer tensors, scale loads and LDS views, then parts 1 to 4. The tile loop is
# chapter 00's `range(..., init=)` with `yield`, carrying `(m, l, O)`.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(arch, block_size, group_size, softmax_scale):
    """The stage-1 ``@flyc.jit`` launcher for one configuration (all four are compile-time)."""
    fp8, fp8_max_ = FX_FP8[fp8_format(arch)], fp8_max(arch)
    SharedStorage = shared_storage(fp8)
    def paged_decode_kernel(query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                            block_tables: fx.Tensor, context_lengths: fx.Tensor,
                            key_scale: fx.Tensor, value_scale: fx.Tensor, out: fx.Tensor,
                            num_kv_heads: fx.Int32):
        tid, seq, kv_head = fx.thread_idx.x, fx.block_idx.x, fx.block_idx.y
        row, part = tid // ROW_THREADS, tid % ROW_THREADS  # row-wise phases: row, its sixteenth
        tensors = (query, key_cache, value_cache, block_tables, out)
        query, key_cache, value_cache, block_tables, out = map(fx.rocdl.make_buffer_tensor, tensors)
        context_len = fx.Int32(context_lengths[seq])
        k_scale, v_scale = fx.Float32(key_scale[0]), fx.Float32(value_scale[0])
        sQ, sS, sP, sRow = lds_views(fx.SharedAllocator().allocate(SharedStorage).peek())
        row_factor = quantize_query(query, seq, kv_head, tid, row, group_size, fp8, fp8_max_, sQ,
                                    softmax_scale * LOG2E, k_scale)
        t = Tiles(fp8, tid, block_size, group_size, sQ, sS, sP, block_tables, seq, kv_head,
                  context_len, out)
        num_tiles = (context_len + TILE_TOKENS - 1) // TILE_TOKENS
        o_zero = fx.Vector.filled(t.o_row.numel, 0.0, fx.Float32)
        init = [fx.Float32(float("-inf")), fx.Float32(0.0), o_zero]
        for tile, state in range(fx.Int32(0), num_tiles, fx.Int32(1), init=init):
            tile = fx.Int32(tile)
            n_valid = context_len - tile * TILE_TOKENS  # tokens of this tile inside the context
            tile_scores(t, tile, key_cache, num_kv_heads, kv_head)
            m_new, l_new, correction = tile_softmax(t, n_valid, row_factor, fx.Float32(state[0]),
                                                    fx.Float32(state[1]), fp8, fp8_max_)
            if part == 0:
                fx.memref_store(correction, sRow, row)
            fx.gpu.barrier()
            o_new = tile_pv(t, tile, value_cache, num_kv_heads, kv_head, n_valid,
                            fx.Vector(state[2]), sRow)
            fx.gpu.barrier()
            final = yield [m_new, l_new, o_new]
        if part == 0:
            fx.memref_store(fx.Float32(final[1]), sRow, row)
        fx.gpu.barrier()
        store16, o_src, o_dst = normalized_output(t, final, sRow, v_scale, fp8_max_, tid)
        if t.o_row[0] < group_size:  # a thread's 4 rows are all real or all padding
            fx.copy(store16, o_src, o_dst)

    # launch(out, query, ..., value_scale, num_seqs, num_kv_heads, stream); no fma contraction
    return jit_launcher(paged_decode_kernel, contract=False)

# %% [markdown]
# ## The launcher
#
# Every stage exposes the same `paged_decode`. It checks every argument before anything is
# compiled or launched, raising a `TypeError` or `ValueError` that names the argument. It picks
# the arch (the GPU's, the emulator's `ARCH`, or `arch=`) and launches on the backend
# `pa_tile.backend` chose.

# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *,
                softmax_scale=None, out=None, arch=None):
    """``(launcher, args, arch)`` after validation, with nothing compiled or launched:
    ``launcher(*args)`` (inside ``pa_tile.toolchain.target_arch(arch)``) runs the kernel and
    fills ``args[0]``, the output; ``pa_tile.toolchain.compile_isa(launcher, *args,
    arch=arch)`` shows its assembly. Same arguments as ``paged_decode``."""
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    ks, vs = problem.scale_tensors(p, key_scale, value_scale)
    fp8 = torch.float8_e4m3fnuz if fp8_format(p.arch) == "fnuz" else torch.float8_e4m3fn
    args = (problem.output(p, query, out), query.contiguous(),
            key_cache.view(torch.uint8).view(fp8),
            value_cache.view(torch.uint8).view(fp8), block_tables, context_lengths, ks, vs,
            p.num_seqs, p.num_kv_heads)
    return build_launcher(p.arch, p.block_size, p.group, p.softmax_scale), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *,
                 softmax_scale=None, out=None, arch=None):
    """fp8 paged decode attention (stage 1); returns ``out`` ``[num_seqs, num_q_heads, 128]`` f16.

    ``key_cache`` ``[num_blocks, num_kv_heads, block_size, 128]`` and ``value_cache``
    ``[num_blocks, num_kv_heads, 128, block_size]`` hold fp8 e4m3 codes of ``arch`` (FNUZ on
    gfx942, OCP on gfx950; uint8 accepted); values are ``code * key_scale`` / ``code *
    value_scale`` (float32 [1] or floats, > 0). ``block_tables`` ``[num_seqs, max_blocks]`` int32,
    ``context_lengths`` ``[num_seqs]`` int32 (>= 1). ``softmax_scale`` defaults to 1/sqrt(128);
    ``arch`` to the tensors' device (the emulator's for CPU tensors).
    Validation: ``pa_tile.problem``.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables,
                                       context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch)
    launching.launch(launcher, args, arch=arch)
    return args[0]


# %% [markdown]
# ## Does it work?
#
# The compiled kernel runs on cases with ragged contexts: 1 token, a partial first page, exactly
# one tile, three tokens past four tiles. Pages are shuffled, and unused block-table entries are
# `-1`, so a stray read faults. On a CPU both archs run in the emulator; on a ROCm GPU, the
# device's own arch (`backend.runnable_archs()`).
#
# The tolerance comes from fp8 arithmetic. Each probability is rounded once to e4m3 (3 mantissa
# bits: relative error ≤ 2⁻⁴), so `o = Σ w_t v_t` moves by at most `2⁻⁴ · max|v|`. The fp8 query
# moves the logits by a comparable amount. The bound is `2⁻³ · max|v|` over the values a
# sequence reads, plus f16 rounding of the output. Each row of the table is one (arch, block,
# group): the largest error of its four sequences, the worst `err / tolerance` and its context.

# %% tags=["nbval-ignore-output"]
from pa_tile import backend, cache, isa, show, toolchain  # noqa: E402
from pa_tile.arch import ARCHS, fp8_format  # noqa: E402
from pa_tile.emu.memory import format_table  # noqa: E402

print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"

# %% tags=["nbval-ignore-output"]
def check(arch, block_size, group, contexts=(1, 17, 256, 1027), num_kv_heads=2, seed=0):
    # the case lives where kernels run (the GPU on a ROCm machine); results compare on the CPU
    case = cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, HEAD_DIM, block_size,
                           list(contexts),
                           fp8_format=fp8_format(arch), seed=seed, pad_block_id=-1)
    got = paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables,
                       case.context_lengths,
                       case.k_scale, case.v_scale, arch=arch).float().cpu()
    want = case.reference().float().cpu()
    errs, tols = [], []
    for s, L in enumerate(contexts):
        pages = case.block_tables[s, : -(-L // block_size)].long()
        vmax = float(cache.dequantize(case.v_cache[pages], scale=case.v_scale).abs().max())
        errs.append(float((got[s] - want[s]).abs().max()))
        tols.append(2**-3 * vmax + 2**-10 * float(want[s].float().abs().max()))
    of_tol = [e / t for e, t in zip(errs, tols)]
    worst = of_tol.index(max(of_tol))
    return dict(arch=arch, block=block_size, group=group, max_err=round(max(errs), 4),
                of_tolerance=round(of_tol[worst], 2), at_context=contexts[worst],
                ok=all(e <= t for e, t in zip(errs, tols)))


# one row per (arch, block, group): the worst of its four sequences
table = [check(arch, bs, g) for arch in backend.runnable_archs()
         for bs in LIMITS.block_sizes for g in LIMITS.groups]
print(format_table(table))
worst = max(r["of_tolerance"] for r in table)
print(f"{len(table)} configurations x 4 contexts: "
      f"{'all' if all(r['ok'] for r in table) else 'NOT all'} "
      f"{4 * len(table)} sequences within tolerance, worst err / tolerance {worst:.2f}")
assert all(r["ok"] for r in table)

# %% [markdown]
# ## What it compiles to
#
# Static facts of the gfx942 and gfx950 code (block 16, group 8): the baseline later chapters
# improve on.

# %%
def stage1_isa(arch, block_size=16, group=8):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(
        1, group, 1, HEAD_DIM, block_size, 17, fp8_format=fp8_format(arch), device="cpu"
    )
    launcher, args, _ = launch_args(
        case.query,
        case.k_cache,
        case.v_plain(),
        case.block_tables,
        case.context_lengths,
        case.k_scale,
        case.v_scale,
        arch=arch,
    )
    return isa.IsaStats.from_asm(toolchain.compile_isa(launcher, *args, arch=arch))


stats = {arch: stage1_isa(arch) for arch in ARCHS}


def static_row(arch):
    st, occ = stats[arch], isa.occupancy(stats[arch], arch)
    fam = st.main_loop.families
    return dict(arch=arch, vgpr=st.vgpr_unified, lds=st.lds_bytes,
                waves_per_simd=occ.waves_per_simd, bound_by="+".join(occ.bound_by),
                loop_instr=st.main_loop_instructions, loop_ds=fam.get("ds", 0),
                loop_barriers=fam.get("barrier", 0), loop_mfma=fam.get("mfma", 0))


print(format_table([static_row(arch) for arch in ARCHS]))

# %% [markdown]
# ## Memory traffic of one tile
#
# The emulator records every memory instruction it executes. Below: one sequence of exactly one
# tile (256 tokens, block 16, group 8) on gfx942, grouped by instruction and access pattern.
# Global and buffer rows give the 128-byte lines one wave-wide execution touches against the
# fewest its bytes fit in. LDS rows give the worst bank-conflict degree of an execution (1 =
# conflict-free) and the extra cycles conflicts cost in total.

# %% tags=["nbval-ignore-output"]
from collections import defaultdict  # noqa: E402

from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402


def access_patterns(arch="gfx942"):
    """One tile's memory instructions, grouped by kind and access pattern."""
    case = cache.make_case(1, 8, 1, HEAD_DIM, 16, 256, fp8_format=fp8_format(arch), pad_block_id=-1)
    trace = Trace(arch)
    with emu_launch.launch_options(trace=trace):
        paged_decode(case.query, case.k_cache, case.v_plain(), case.block_tables,
                     case.context_lengths, case.k_scale, case.v_scale, arch=arch)
    groups = defaultdict(lambda: dict(executions=0, conflict_cycles=0))
    for a in trace.accesses():
        if a["space"] == "lds":
            pattern = "conflict x%d" % a["conflict_degree"]
        else:
            pattern = "%d of min %d lines" % (a["lines_128B"], a["min_lines_128B"])
        direction = "store" if a["write"] else "load"
        g = groups[(a["space"], a["mnemonic"], direction, a["bytes_per_lane"], pattern)]
        g["executions"] += 1
        g["conflict_cycles"] += a.get("conflict_cycles", 0)
    return [
        dict(space=k[0], instruction=k[1], dir=k[2], bytes_per_lane=k[3], per_execution=k[4], **v)
        for k, v in sorted(groups.items())
    ]


patterns = access_patterns() if backend.current_backend() == "emu" else []
print(format_table(patterns) if patterns else "memory traces are recorded only by the emulator")

# %% [markdown]
# Three patterns stand out (the cell below reads them from the table):
#
# * the page-table reads (`buffer_load_dword`) ask for one address per wave: every lane wants
#   the same page;
# * the K gathers read 32 of each token's 128 bytes per instruction, from 16 token rows 128
#   bytes apart: one 128-byte line per row. The V gathers read a channel's contiguous tokens;
# * the A-operand reads of Q and P from LDS (`ds_read2_b64`) conflict. The 16 lanes of an MFMA
#   column read 16 rows whose stride (128 B for Q, 256 B for P) is a multiple of 32 banks × 4 B =
#   128 B, so all 16 start in the same bank (gfx942; gfx950's 64 banks repeat every 256 B).
#
# The seed kernel's history quotes no time for a kernel like this one, so this chapter shows no
# measured effect; chapter 02 has the first.

# %% tags=["nbval-ignore-output"]
def pattern(instruction, *, lds=False):
    """The access pattern of the busiest row of one instruction in the table above."""
    rows = [r for r in patterns if r["instruction"] == instruction and (r["space"] == "lds") == lds]
    return max(rows, key=lambda r: r["executions"])["per_execution"] if rows else "not traced"


gathers = sorted({r["per_execution"] for r in patterns
                  if r["instruction"] == "buffer_load_dwordx2"})
show.md(f"""
Per execution, from the trace: the K and V gathers (`buffer_load_dwordx2`) touch
**{' and '.join(gathers) or 'not traced'}**; the Q and P reads (`ds_read2_b64`) run at
**{pattern('ds_read2_b64', lds=True)}**.
""")

# %% [markdown]
# ## What you built
#
# ```
# paged_decode_s1(q, K, V, block_tables, ctx):  # grid (seq, kv_head); 4 waves
#     Q8, row_factor = quantize(q rows of the group)     # fp8 per head -> LDS
#     m, l, O = -inf, 0, 0                                # per query row
#     for tile in range(ceil(ctx / 256)):                 # range(init=), yield
#         Kf = gather(K, block_table, tile)               # 8-byte pieces: B operand
#         S = gemm(Q8, Kf) -> LDS                         # waves split tokens
#         barrier
#         x = mask(S * row_factor)                        # every tile
#         m2 = max(m, rowmax(x)); c = exp2(m - m2)        # 16 lanes per row
#         p = exp2(x - m2); l = l*c + rowsum(p)
#         fp8(p * FP8_MAX) -> LDS; c -> LDS
#         barrier
#         Vf = gather(V, block_table, tile); zero past ctx
#         O = O*c + gemm(P8, Vf)                          # waves split head_dim
#         barrier
#         m = m2
#     out = f16(O / l * v_scale / FP8_MAX)
# ```
#
# Next: chapter 02 keeps the scores and `P` in registers, and the loop loses its LDS round trips
# and barriers.

# %% tags=["nbval-ignore-output"]
k_gather = [r for r in patterns if r["instruction"] == "buffer_load_dwordx2"]
show.measured({
    "VGPRs (gfx942 / gfx950)": f"{stats['gfx942'].vgpr_unified} / {stats['gfx950'].vgpr_unified}",
    "waves per SIMD (gfx942 / gfx950)":
        " / ".join(f"{isa.occupancy(stats[a], a).waves_per_simd:g}" for a in ("gfx942", "gfx950")),
    "LDS per workgroup": f"{stats['gfx942'].lds_bytes:,} B",
    "barriers in the loop": stats["gfx942"].main_loop.families.get("barrier", 0),
    "gathers, 128-byte lines per execution (gfx942)": ", ".join(gathers) or "emulator only",
})
