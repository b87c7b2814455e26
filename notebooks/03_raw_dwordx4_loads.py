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
# # 03 · Raw 128-bit loads and a pipelined loop
#
# Chapter 2 already reads K, V and the query with raw `buffer_load_dwordx4` and feeds raw
# MFMA calls; it did so without saying why the tiled API could not. This chapter shows it
# from the ISA, then spends the registers chapter 2 saved on a **software-pipelined loop**:
#
# 1. why a tiled copy of an MFMA operand stops at 64-bit loads, and why permuting the
#    contracted dimension lets one 128-bit load feed two MFMAs without changing the result;
# 2. why the query must be loaded as raw dwords (element access is scalarized into 16-bit loads);
# 3. the next tile's K and its block-table entries become loop-carried values, V is issued at
#    the top of the tile that uses it;
# 4. what it costs: registers and waves per SIMD, measured, and the choice made.
#
# Scope and numerics are chapter 2's (f16 query, head_dim 128, plain K/V layouts,
# per-tensor scales, block 16/64, group 8/16).

# %%
import math
import re

import torch

from pa_tile import cache, isa, toolchain
from pa_tile.arch import ARCHS, fp8_format
from pa_tile.emu.memory import format_table

# %% [markdown]
# ## Why the tiled copy stops at 64 bits
#
# Chapter 1 built K's MFMA operand with a tiled copy derived from the tiled MMA. Compile it and
# count the loads by width:

# %%
from pa_tile.stages import s1_tile_qk  # noqa: E402


def compiled(module, arch="gfx942", block_size=16, group=8, **kw):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, group, 1, 128, block_size, 17, fp8_format=fp8_format(arch), device="cpu")
    launch, args, arch = module.launch_args(case.query, case.k_cache, case.v_plain(), case.block_tables,
                                            case.context_lengths, case.k_scale, case.v_scale, arch=arch, **kw)
    return toolchain.compile_isa(launch, *args, arch=arch)


asm1 = compiled(s1_tile_qk)
st1 = isa.IsaStats.from_asm(asm1)
print("stage 1 loads:", st1.load_widths)
print(*[ln.strip() for ln in asm1.splitlines() if "buffer_load_dwordx2" in ln][:4], sep="\n")

# %% [markdown]
# The K and V operand loads are `buffer_load_dwordx2`: 8 bytes per lane. The reason is the
# operand layout. For `v_mfma_f32_16x16x32_fp8_fp8` lane `(c, g)` (`c = lane % 16`,
# `g = lane // 16`) holds row `c`, contracted indices `k = 8g .. 8g+7`: **8 contiguous
# bytes**. The next 8 bytes of the same K row (`k = 8g+8 ..`) belong to lane `(c, g+1)`, and
# the lane's next values (the next k-step, `k = 32 + 8g ..`) start 24 bytes further on. A
# tiled copy partitions the tensor exactly as the MMA atom does, so the widest vector it can
# prove contiguous per thread is 8 bytes, and that is the load it emits. Two loads per
# 128 bytes-per-lane-pair, twice the instructions, and each `dwordx2` moves half of what the
# memory pipeline could move per instruction.
#
# The fix is to change *which* contracted indices a k-step uses. For any permutation π of
# `k`, `Σ_k A[r, π(k)]·B[π(k), c] = Σ_k A[r, k]·B[k, c]`: a dot product does not care in which
# order its terms are paired, as long as A and B are permuted alike. So let lane `(c, g)` load
# 16 contiguous bytes `16g .. 16g+15` of its row with one `dwordx4`, use bytes 0-7 in k-step 0
# and bytes 8-15 in k-step 1, and load the query's B operand with the same mapping. Each
# MFMA then sums a different set of 32 channels than the "natural" order, but the two k-steps
# together cover the same 64, pair A and B alike, and accumulate into the same `D`.

# %%
# The argument, checked in integers (exact): permute k in both operands, same product.
g = torch.Generator().manual_seed(0)
A = torch.randint(-8, 8, (16, 64), generator=g)
B = torch.randint(-8, 8, (64, 16), generator=g)
lane_order = torch.tensor([16 * grp + 8 * step + i for step in range(2) for grp in range(4) for i in range(8)])
# k-step `step`, lane group `grp` gets channels 16·grp + 8·step .. +8: a permutation of 0..63
assert sorted(lane_order.tolist()) == list(range(64))
assert torch.equal(A[:, lane_order] @ B[lane_order], A @ B)
print("k permuted in A and B alike: identical product")

# %% [markdown]
# ## The query: 16-bit elements, scalarized
#
# The query is f16. Reading a lane's 8 values element by element through a buffer tensor is
# the obvious code, and the backend does not merge the eight 2-byte reads into one:

# %%
import flydsl.compiler as flyc  # noqa: E402
import flydsl.expr as fx  # noqa: E402
from flydsl.expr import const_expr, gpu, range_constexpr  # noqa: E402

from pa_tile.kernel_lib import buffer_load, buffer_store, rsrc  # noqa: E402


def query_probe(raw):
    """A one-wave kernel summing 8 f16 per lane: element reads, or one raw 128-bit load."""

    @flyc.kernel(known_block_size=(64, 1, 1))
    def probe(out: fx.Tensor, q: fx.Tensor):
        tid = fx.Int32(gpu.thread_id("x"))
        if const_expr(raw):
            vals = buffer_load(rsrc(q), tid * 16, 4).bitcast(fx.Float16)  # 4 dwords = 8 f16
            xs = [fx.Float16(vals[i]) for i in range_constexpr(8)]
        else:
            qb = fx.rocdl.make_buffer_tensor(q)
            xs = [fx.Float16(qb[tid * 8 + i]) for i in range_constexpr(8)]
        acc = fx.Float32(0.0)
        for x in xs:
            acc = acc + x.to(fx.Float32)
        buffer_store(acc.bitcast(fx.Int32), rsrc(out), tid * 4)

    @flyc.jit
    def launch(out: fx.Tensor, q: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        probe(out, q).launch(grid=(1, 1, 1), block=(64, 1, 1), stream=stream)

    return launch


q_demo, o_demo = torch.zeros(512, dtype=torch.float16), torch.zeros(64)
for raw in (False, True):
    st = isa.IsaStats.from_asm(toolchain.compile_isa(query_probe(raw), o_demo, q_demo, arch="gfx942"))
    print("raw dwordx4 + bitcast" if raw else "element reads        ", st.load_widths)

# %% [markdown]
# Eight `buffer_load_ushort` per lane instead of one `buffer_load_dwordx4`. The loads are
# lowered one element at a time and nothing downstream widens them. The fix is to ask for
# the width explicitly: a raw 4-dword load, then a bitcast of the `vector<4xi32>` to
# `vector<8xf16>`, which costs no instruction. `query_operands` (chapter 2) does exactly
# that, four `dwordx4` per lane.
#
# ## The kernel
#
# Everything not about the loop is unchanged from chapter 2 and imported from its module:
# chapter 2's `Workgroup` (the fixed state and the per-tile math) and the kernel library.

# %% tags=["export"]
"""Stage 3: stage 2's kernel with a software-pipelined loop.

The next tile's K (8 ``buffer_load_dwordx4`` per lane) and its block-table entries are loop-carried
values, loaded one iteration ahead; V is issued at the top of the iteration it is used in, so
Q·Kᵀ and the softmax hide its latency. K and V go straight from 128-bit loads into the raw MFMA
operands, the query is read in 128-bit chunks, exp2/rcp are the hardware's ``v_exp_f32``/``v_rcp_f32``.

Layouts and numerics are stage 2's (``pa_tile.stages.s2_register_softmax``): query
``[num_seqs, num_q_heads, 128]`` f16; K ``[num_blocks, kv_heads, block_size, 128]``; V
``[num_blocks, kv_heads, 128, block_size]``; fp8 e4m3 of the arch's flavour; per-tensor scales.
``prefetch_k=False`` rebuilds stage 2's loop (no K prefetch) for comparison.
"""

import dataclasses
import functools

import flydsl.expr as fx
from flydsl.expr import const_expr, range_constexpr

from pa_tile import launching, problem
from pa_tile.arch import fp8_max
from pa_tile.kernel_lib import MASKED, jit_launcher, mask_tail
from pa_tile.stages import s2_register_softmax as s2
from pa_tile.stages.s2_register_softmax import numerics_model  # the same roundings as stage 2

__all__ = ["paged_decode", "build_launcher", "launch_args", "numerics_model", "LIMITS"]

#: the same inputs as stage 2
LIMITS = dataclasses.replace(s2.LIMITS, stage="s3")

# %% [markdown]
# ## Software pipelining
#
# In chapter 2 each iteration issued its tile's K and V loads and then waited for K before
# the first MFMA: one full memory latency per tile that only *other* waves could fill. Now
# the loop carries the next tile's K in registers:
#
# ```
#   before the loop: page ids of tile 0 -> K(0);  page id of tile 1 (K)
#   iteration t:     issue V(t)                       (page id carried from t-1)
#                    issue K(t+1)                     (page id carried from t-1)
#                    issue page ids: K of t+2, V of t+1
#                    Q·Kᵀ(t) on the carried K(t) -> softmax -> P·V(t)  (waits for V only)
#                    carry K(t+1) and the two page ids
# ```
#
# The block-table entries travel one step ahead of the loads that use them, so no load
# waits on a block-table read. Past the last tile the indices clamp to the sequence's last
# page: the final iteration loads that page's K once more and never uses it (8 KB per wave
# per workgroup, once), in exchange for a loop without a branch around its loads.
#
# Reloading a block-table entry could also be skipped while consecutive tiles stay on one
# page. In this kernel they never do: a tile is 256 tokens and a page at most 64, so every
# tile of a wave starts on a new page, and the only repeats are the clamped reads past the
# end. The kernel therefore keeps the loads unconditional (a branch per tile would cost more
# than the one `buffer_load_dword` it saves); for block 64 the K and V page of a lane are the
# same entry and the compiler already reads it once.

# %% tags=["export"]
def loop_entry_state(pages, prefetch):
    """``(values, base)``: what the tile loop carries in, and the index where its softmax state
    starts. With the K prefetch: tile 0's K (loaded here, before the loop), tile 1's K page and tile
    0's V page; without: tile 0's K and V pages. Then 8 zero output chunks, the running max
    (``MASKED``) and the running sum (0)."""
    zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
    softmax0 = [zero4] * 8 + [fx.Float32(MASKED), fx.Float32(0.0)]
    if prefetch:
        carried = [pages.k(pages.page_id(0, pages.k_j)), pages.page_id(1, pages.k_j), pages.page_id(0, pages.v_j)]
    else:
        carried = [pages.page_id(0, pages.k_j), pages.page_id(0, pages.v_j)]
    return carried + softmax0, len(carried)


# %% [markdown]
# The kernel: stage 2's `Workgroup` for everything outside the loop, and a loop whose carried
# values are the ones above. With the prefetch, each iteration issues this tile's V and the next
# tile's K before any math, so both land while the MFMAs of this tile run.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str, prefetch_k: bool = True):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch, prefetch_k) specialization."""
    PREFETCH = bool(prefetch_k)

    def pa_decode_s3(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32, scale_log2: fx.Float32):
        wg = s2.Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                          num_kv_heads, max_blocks, scale_log2, block_size=block_size, group=group,
                          fp8_max=fp8_max(arch))
        pages = wg.pages
        state, base = loop_entry_state(pages, PREFETCH)
        for t, st in range(0, wg.num_tiles, 1, init=state):
            t = fx.Int32(t)
            o = [st[base + j] for j in range_constexpr(8)]
            m_old, l_old = st[base + 8], st[base + 9]
            if const_expr(PREFETCH):
                k_words, k_page_next, v_page = st[0], st[1], st[2]
                v_words = pages.v(v_page)  # this tile's V: lands during Q·Kᵀ and the softmax
                k_words_next = pages.k(k_page_next)  # next tile's K: lands during this whole tile
                carry = [k_words_next, pages.page_id(t + 2, pages.k_j), pages.page_id(t + 1, pages.v_j)]
            else:
                k_page, v_page = st[0], st[1]
                k_words = pages.k(k_page)
                v_words = pages.v(v_page)
                carry = [pages.page_id(t + 1, pages.k_j), pages.page_id(t + 1, pages.v_j)]
            # keep every load of the iteration ahead of its math (the scheduler would otherwise
            # sink the V and next-K loads below the MFMAs that do not need them)
            fx.rocdl.sched_barrier(0)
            s, n_valid = wg.tile_scores(t, k_words)
            if t + 1 == wg.num_tiles:
                s, v_words = mask_tail(s, v_words, n_valid)
            o, m_new, l_new = wg.softmax_pv(s, v_words, o, m_old, l_old)
            res = yield carry + o + [m_new, l_new]

        mine, store = wg.merge([res[base + j] for j in range_constexpr(8)], res[base + 8], res[base + 9]), wg.store
        if wg.col < group:
            store(mine)

    return jit_launcher(pa_decode_s3)


# %% [markdown]
# ## The launcher
#
# Validation is chapter 2's (same inputs, same errors), then this stage's launcher.
# `prefetch_k=False` rebuilds chapter 2's loop so that the two can be compared below.

# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """``(launcher, args, arch)`` after validation: stage 2's inputs, checks and arguments."""
    if not isinstance(prefetch_k, bool):
        raise TypeError(f"prefetch_k: expected a bool, got {type(prefetch_k).__name__}")
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                         limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = s2.kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale,
                          out)
    return build_launcher(p.block_size, p.group, p.arch, prefetch_k), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale, value_scale, *,
                 softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """fp8 paged decode attention; returns ``out`` (shaped and typed like ``query``).

    Arguments as in stage 2 (``pa_tile.stages.s2_register_softmax.paged_decode``); ``prefetch_k``
    (default True) loads each tile's K one iteration ahead.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                                       value_scale, softmax_scale=softmax_scale, out=out, arch=arch,
                                       prefetch_k=prefetch_k)
    launching.launch(launcher, args, arch=arch)
    return args[0]


# %% [markdown]
# ## What the prefetch costs, and what it buys
#
# Compile both loops (block 16, group 8) and read the register count, the waves per SIMD it
# allows, and, from the `s_waitcnt vmcnt(n)` the compiler placed in the loop body, how many
# of the loads an iteration issues its 16 Q·Kᵀ MFMAs have to wait for (`vmcnt(n)` lets the
# newest `n` loads stay in flight; loads complete in order).

# %%
from pa_tile.stages import s2_register_softmax as s2  # noqa: E402
from pa_tile.stages import s3_raw_loads as s3  # noqa: E402


def loop_body(asm, st):
    lines = asm.splitlines()[st.main_loop.start_line - 1 : st.main_loop.end_line]
    return [ln.strip() for ln in lines
            if ln.strip() and not ln.strip().startswith((";", ".")) and not ln.rstrip().endswith(":")]


def qk_waits(body):
    """(vector loads one iteration issues, how many of them the 16 Q·Kᵀ MFMAs wait for)."""
    start = next(i for i, ln in enumerate(body) if ln.startswith("buffer_load_dwordx4"))
    body = body[start:] + body[:start]  # the compiler rotates loops; begin where the loads begin
    first = next(i for i, ln in enumerate(body) if ln.startswith("v_mfma"))
    issued = sum(ln.startswith("buffer_load") for ln in body[:first])
    allowed, mfmas = issued, 0
    for ln in body[first:]:
        m = re.search(r"vmcnt\((\d+)\)", ln) if ln.startswith("s_waitcnt") else None
        if m:
            allowed = min(allowed, int(m.group(1)))
        mfmas += ln.startswith("v_mfma")
        if mfmas == 16:
            break
    return issued, issued - allowed


# %%
rows = []
asms = {}
for arch in ARCHS:
    for label, mod, kw in (("stage 2", s2, {}), ("s3 prefetch_k=False", s3, dict(prefetch_k=False)),
                           ("s3 prefetch_k=True", s3, dict(prefetch_k=True))):
        asm = asms[label, arch] = compiled(mod, arch, **kw)
        st = isa.IsaStats.from_asm(asm)
        occ = isa.occupancy(st, arch)
        issued, waited = qk_waits(loop_body(asm, st))
        rows.append(dict(arch=arch, loop=label, vgpr=st.vgpr_unified, agpr=st.agpr, spills=st.vgpr_spill,
                         lds=st.lds_bytes, waves_per_simd=occ.waves_per_simd, loop_instr=st.main_loop_instructions,
                         loads_per_iter=issued, qk_waits_for=waited))
print(format_table(rows))

# %% [markdown]
# Reading the table:
#
# * **Registers.** The carried K is about 32 more VGPRs per lane (8 `dwordx4`): 124 → 158 on
#   gfx942. The unified file holds 512 registers per lane per SIMD in granules of 8, so 128
#   fits 4 waves and 158 fits 3. That is the wave chapter 2 kept by not prefetching.
# * **Latency.** An iteration issues 18 loads (8 `dwordx4` of K, 8 of V, 2 page ids). Without
#   prefetch Q·Kᵀ waits for the 8 K loads it just issued: one memory latency per tile, per
#   wave, hidden only if the other 3 waves of the SIMD happen to be computing. With prefetch
#   it waits for none: it runs on the carried K while V, the next K and the page ids are in
#   flight. The first wait is in the softmax, for V, issued one Q·Kᵀ earlier; the next K is
#   waited for at the top of the next iteration, a whole tile of work after it was issued.
#
# **Choice: prefetch on** (the default). Decode attention streams K and V once; what limits
# it is how many bytes a CU keeps in flight (bandwidth = bytes in flight / latency). Per
# wave, chapter 2's loop has 16 KB of K+V requested at the top of a tile and then nothing
# until the next tile; the pipelined loop has the next tile's 8 KB of K requested during the
# whole iteration as well. 3 waves × (8 KB V + 8 KB next K) in flight through most of the
# iteration beats 4 waves × 16 KB in flight only until each wave's K has landed, and the
# pipelined wave no longer depends on its neighbours being out of phase. This is an argument
# about timing that the emulator cannot measure (it has no clock); on a GPU,
# `python -m pa_tile bench` times both settings (`prefetch_k=False` stays available).

# %% [markdown]
# ## exp2, rcp and cross-lane reductions
#
# The softmax uses the hardware's transcendental unit directly: `v_exp_f32` (2^x) and
# `v_rcp_f32`, with the `log2(e)` and softmax scales folded into one multiplier per score, so
# no `exp` or division expansion appears. Cross-lane steps, per arch:

# %%
xlane = ("v_exp_f32", "v_rcp_f32", "v_mov_b32_dpp", "ds_swizzle_b32", "ds_bpermute_b32",
         "v_permlane32_swap_b32", "v_permlane16_swap_b32")
rows = []
for arch in ARCHS:
    st = isa.IsaStats.from_asm(asms["s3 prefetch_k=True", arch])
    body = [ln.split()[0] for ln in loop_body(asms["s3 prefetch_k=True", arch], st)]
    rows.append(dict(arch=arch, **{m: f"{sum(x.startswith(m) for x in body)} / {st.count_prefix(m)}" for m in xlane}))
print("loop / whole kernel")
print(format_table(rows))

# %% [markdown]
# The loop's cross-lane work is the per-tile max over the 4 lanes of a head, which the
# turned-around layout of chapter 2 puts **16 and 32 lanes apart** (lanes `c, c+16, c+32,
# c+48`). DPP moves data only inside a row of 16 lanes on these chips (`quad_perm`,
# `row_shl/shr/ror`; `row_bcast` is a one-way broadcast for scans, not a butterfly), so it
# cannot do an xor-16 or xor-32 step. The backend uses the cheapest tool each arch has:
# `ds_swizzle` (SWAP 16) and `ds_bpermute` on gfx942 (LDS crossbar, no LDS memory), and
# `v_permlane32_swap`/`v_permlane16_swap` on gfx950 (pure VALU). The other 15 of the 16
# comparisons per tile are in-lane `v_max_f32`. DPP reductions would pay off for a layout
# that spreads a reduction over neighbouring lanes (chapter 1's row softmax); this one was
# chosen so that it does not need them.

# %% [markdown]
# ## Does it work?
#
# Same matrix and checks as chapter 2 (the fp8 bound is explained there): both archs, block
# 16 and 64, group 8 and 16, contexts 1, 17, 256, 1027 with shuffled pages and `-1` in unused
# block-table entries. The prefetch changes no arithmetic, so the output must be
# **bit-identical** to chapter 2's kernel. One row per (arch, block, group), the worst of its
# four sequences, as in chapter 2.

# %% tags=["nbval-ignore-output"]
from pa_tile import backend  # noqa: E402

print("backend:", backend.ensure_backend())

# %% tags=["nbval-ignore-output"]
def check(arch, block_size, group, contexts=(1, 17, 256, 1027), num_kv_heads=1, seed=1):
    case = cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, 128, block_size, list(contexts),
                           fp8_format=fp8_format(arch), seed=seed, pad_block_id=-1)
    args = (case.query, case.k_cache, case.v_plain(), case.block_tables, case.context_lengths,
            case.k_scale, case.v_scale)
    got = s3.paged_decode(*args, arch=arch).cpu()
    before = s2.paged_decode(*args, arch=arch).cpu()
    ref, bound = case.error_bound(out_dtype=got.dtype)
    err = (got.float() - ref).abs()
    of_bound = (err / bound).flatten(1).amax(1)  # per sequence
    worst = int(of_bound.argmax())
    return dict(arch=arch, block=block_size, group=group, err_vs_ref=round(float(err.max()), 4),
                of_bound=round(float(of_bound[worst]), 2), at_context=contexts[worst],
                ok=bool((err <= bound).all()), same_as_stage2=bool(torch.equal(got, before)))


# one row per (arch, block, group): the worst of its four sequences
table = [check(arch, bs, g) for arch in backend.runnable_archs() for bs in (16, 64) for g in (8, 16)]
print(format_table(table))
same = all(r["same_as_stage2"] for r in table)
print(f"{len(table)} configurations x 4 contexts: {'all' if all(r['ok'] for r in table) else 'NOT all'} "
      f"{4 * len(table)} sequences within the bound, {'all' if same else 'NOT all'} bit-identical to stage 2")
assert all(r["ok"] and r["same_as_stage2"] for r in table)

# %% [markdown]
# ## What it compiles to, against chapter 2

# %%
# the rows that changed on either arch, and the headline facts
print(isa.diff_side_by_side({arch: (isa.IsaStats.from_asm(asms["stage 2", arch]),
                                    isa.IsaStats.from_asm(asms["s3 prefetch_k=True", arch])) for arch in ARCHS},
                            labels=("stage 2", "stage 3")))

# %% [markdown]
# ## Load instructions by width, stage 1 → 3
#
# From the ISA (static count, whole kernel) and from the emulator trace of one sequence of
# exactly one tile (256 tokens, block 16, group 8, gfx942): dynamic vector-memory load
# instructions by width, and the bytes each one moves for the wave.

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

EMU = backend.current_backend() == "emu"  # traces are recorded only by the emulator
NO_TRACE = "ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)"
one_tile = cache.make_case(1, 8, 1, 128, 16, 256, fp8_format="fnuz", pad_block_id=-1)


def traced(module, **kw):
    trace = Trace("gfx942")
    with emu_launch.launch_options(trace=trace):
        module.paged_decode(one_tile.query, one_tile.k_cache, one_tile.v_plain(), one_tile.block_tables,
                            one_tile.context_lengths, one_tile.k_scale, one_tile.v_scale, arch="gfx942", **kw)
    return trace


def load_rows(label, asm, trace):
    st = isa.IsaStats.from_asm(asm)
    dyn = {}
    for r in trace.accesses():
        if r["space"] in ("buffer", "global") and not r["write"]:
            d = dyn.setdefault(r["mnemonic"], [0, 0])
            d[0] += 1
            d[1] += r["bytes"]
    return [dict(stage=label, load=m, static=sum(v for w in st.load_widths.values() for k, v in w.items()
                                                  if m.endswith("_" + k)),
                 executed=n, bytes=b, bytes_per_instr=b // n) for m, (n, b) in sorted(dyn.items())]


if EMU:
    rows = (load_rows("stage 1", asm1, traced(s1_tile_qk)) + load_rows("stage 2", asms["stage 2", "gfx942"], traced(s2))
            + load_rows("stage 3", asms["s3 prefetch_k=True", "gfx942"], traced(s3)))
    print(format_table(rows))
else:
    print(NO_TRACE)

# %% [markdown]
# Stage 1 moves K and V with `dwordx2` (512 bytes per wave instruction) and the block table
# with one `dword` per element; stages 2 and 3 move every K, V and query byte with `dwordx4`
# (1 KB per wave instruction: the widest a VMEM load has). Stage 3 executes 8 more `dwordx4`
# per wave than stage 2 on this one-tile case: the prefetch of a tile that does not exist,
# clamped to the last page (see above); on a long context that is 1 extra K tile per wave.
#
# ## Memory traffic of one tile
#
# The full trace of stage 3 for that tile, before, in and after the loop: bytes, 64-byte
# segments touched (and the fewest possible), LDS bank conflicts (the merge only), per
# execution; the lines of one instruction that access memory alike share a row. The loop's
# second `dwordx4` row is that prefetch: clamped to the last page, a wave's 64 lanes read the
# same 256 bytes, 4 segments (below the "minimum", which assumes every lane's bytes distinct).

# %% tags=["nbval-ignore-output"]
if EMU:
    with emu_launch.record_launches() as launched:
        trace3 = traced(s3)
    print(trace3.grouped_table(phases=isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)))
else:
    print(NO_TRACE)

# %% [markdown]
# ## Predicted time against stage 2 (a model, not a measurement)
#
# No gain predicted at this shape, and the model says why. 16 sequences give 16 workgroups, one
# per CU, each walking its 64 tiles with one wave per SIMD, so every tile waits for memory.
# Prefetching the next tile's K hides only as much of that wait as one tile's work lasts, a
# fraction of the latency here, and stage 3's loop issues slightly more instructions per tile
# than stage 2's. The prefetch pays once a tile's work is comparable to the latency it hides (more
# waves per SIMD; chapter 6's split shortens the chains instead); the 128-bit loads pay in
# instructions per byte, and in the addresser once the loads are coalesced (chapter 4).

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

print(speedup.report("s3", "s2"))
