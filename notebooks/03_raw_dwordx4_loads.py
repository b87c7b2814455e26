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
# Chapter 02's kernel reads K, V and the query with raw `buffer_load_dwordx4` and calls the MFMA
# directly. This chapter shows why the tiled API cannot emit those loads, and what the kernel
# does with them. Then it pipelines the loop: the next tile's K is loaded while this tile computes.
#
# **You'll learn**
#
# * why a tiled copy of an MFMA operand stops at 64-bit loads;
# * why permuting the contracted dimension lets one 128-bit load feed two MFMAs;
# * why the query is read as raw dwords, not element by element;
# * how a software-pipelined loop carries the next tile's K, and what it costs in registers;
# * which cross-lane instructions the row max uses, and why DPP is not among them.
#
# **You need** chapter 01 (the MFMA operand layout), chapter 02 (the turned-around tile, the
# register softmax, the lane `(c, g)` naming).
#
# **Runs on** the CPU emulator (about 2 minutes) or a ROCm GPU (MI300 / MI355; seconds).
#
# Scope is chapter 02's: f16 query, head_dim 128, plain K and V layouts, per-tensor scales,
# block 16 or 64, 8 or 16 query heads per KV head.


# %%
import math
import re

import matplotlib.pyplot as plt
import numpy as np
import torch

from IPython.display import display

from pa_tile import backend, cache, figures, isa, seed_history, show, toolchain
from pa_tile.arch import ARCHS, INFO, fp8_format
from pa_tile.emu.memory import LINE_BYTES, format_table


# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"


# %% [markdown]
# ## Why the tiled copy stops at 64 bits
#
# Chapter 01 built K's MFMA operand with a tiled copy derived from the tiled MMA. Compile that
# kernel and count its loads by width:


# %%
from pa_tile.stages import s1_tile_qk  # noqa: E402


def compiled(module, arch="gfx942", block_size=16, group=8, **kw):
    # compiling needs no device: CPU tensors let a GPU machine compile for the other arch too
    case = cache.make_case(1, group, 1, 128, block_size, 17, fp8_format=fp8_format(arch),
                           device="cpu")
    launch, args, arch = module.launch_args(case.query, case.k_cache, case.v_plain(),
                                            case.block_tables, case.context_lengths, case.k_scale,
                                            case.v_scale, arch=arch, **kw)
    return toolchain.compile_isa(launch, *args, arch=arch)


asm1 = compiled(s1_tile_qk)
st1 = isa.IsaStats.from_asm(asm1)
print("stage 1 loads:", st1.load_widths)
print(*[ln.strip() for ln in asm1.splitlines() if "buffer_load_dwordx2" in ln][:4], sep="\n")


# %% [markdown]
# The K and V operand loads are `buffer_load_dwordx2`: 8 bytes per lane. The operand layout
# decides it. For `v_mfma_f32_16x16x32_fp8_fp8`, lane `(c, g)` (`c = lane % 16`,
# `g = lane // 16`) holds row `c` at contracted indices `k = 8g .. 8g+7`. That is 8 contiguous
# bytes. The next 8 bytes of the row belong to lane `(c, g+1)`. A tiled copy partitions the
# tensor exactly as the MMA atom does. So the widest vector it can prove contiguous per lane is
# 8 bytes, and that is the load it emits: half of what one load instruction can move.
#
# ## One 128-bit load feeds two k-steps
#
# The fix changes *which* contracted indices a k-step uses. For any permutation π of `k`,
# `Σ_k A[r, π(k)]·B[π(k), c] = Σ_k A[r, k]·B[k, c]`, as long as A and B are permuted alike. So
# lane `(c, g)` loads the 16 contiguous bytes `16g .. 16g+15` of its row with one `dwordx4`. It
# uses bytes 0-7 in k-step 0 and bytes 8-15 in k-step 1. The query's operand is loaded with the
# same mapping. Each MFMA sums a different set of 32 channels than the natural order, but the two
# k-steps together cover the same 64 and accumulate into the same `D`. Checked in integers:


# %%
# The argument, checked in integers (exact): permute k in both operands, same product.
g = torch.Generator().manual_seed(0)
A = torch.randint(-8, 8, (16, 64), generator=g)
B = torch.randint(-8, 8, (64, 16), generator=g)
lane_order = torch.tensor([16 * grp + 8 * step + i
                           for step in range(2) for grp in range(4) for i in range(8)])
# k-step `step`, lane group `grp` gets channels 16·grp + 8·step .. +8: a permutation of 0..63
assert sorted(lane_order.tolist()) == list(range(64))
assert torch.equal(A[:, lane_order] @ B[lane_order], A @ B)
print("k permuted in A and B alike: identical product")


# %% [markdown]
# Where those bytes are, for one K load of this chapter's kernel, traced by the emulator (one
# sequence of 256 tokens, block 16, gfx942). Each row is one 128-byte line, the unit the vector
# L1 and the L2 fetch on both targets (CDNA3 and CDNA4 white papers). Each box is one lane's 16
# bytes; the hatched half is what its second k-step uses.


# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import AddressTrace  # noqa: E402  (a Trace that keeps the lanes' addresses)
from pa_tile.stages import s2_register_softmax as s2  # noqa: E402
from pa_tile.stages import s3_raw_loads as s3  # noqa: E402

EMU = backend.current_backend() == "emu"  # traces are recorded only by the emulator
NO_TRACE = "ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)"
one_tile = cache.make_case(1, 8, 1, 128, 16, 256, fp8_format="fnuz", pad_block_id=-1)


def traced(module, **kw):
    trace = AddressTrace("gfx942")
    c = one_tile
    with emu_launch.launch_options(trace=trace):
        module.paged_decode(c.query, c.k_cache, c.v_plain(), c.block_tables, c.context_lengths,
                            c.k_scale, c.v_scale, arch="gfx942", **kw)
    return trace


def k_loads(trace):
    """Each whole-wave K load's lane offsets from the K cache's start (no lane repeated)."""
    lo = one_tile.k_cache.data_ptr()
    hi = lo + one_tile.k_cache.numel()
    return [a - lo for m, a in trace.addresses
            if a.size == 64 and np.unique(a).size == 64 and ((a >= lo) & (a < hi)).all()]

# %% tags=["nbval-ignore-output"]
if EMU:
    trace3 = traced(s3)
    first_k = k_loads(trace3)[0]
    note = "bytes 64-127 of each line:\nthe wave's next K load"
    figures.lane_lines({"stage 3: one K load": first_k}, ksteps=True,
                       notes={"stage 3: one K load": note})
    plt.show()
else:
    print(NO_TRACE)


# %% tags=["nbval-ignore-output"]
if EMU:
    rows_of = first_k // LINE_BYTES
    lanes_per_line = {int(r): int((rows_of == r).sum()) for r in np.unique(rows_of)}
    display(show.md(f"""
    One load touches {len(lanes_per_line)} lines, {set(lanes_per_line.values()).pop()} lanes in
    each: lanes `c, c+16, c+32, c+48` read bytes 0-63 of token `c`'s row. The wave's next K load
    reads bytes 64-127 of the same rows, so every line is read whole, over two loads."""))


# %% [markdown]
# ## The query: 16-bit elements, scalarized
#
# The query is f16. Reading a lane's 8 values element by element through a buffer tensor is the
# obvious code. The backend does not merge the eight 2-byte reads into one:


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
    asm = toolchain.compile_isa(query_probe(raw), o_demo, q_demo, arch="gfx942")
    st = isa.IsaStats.from_asm(asm)
    print("raw dwordx4 + bitcast" if raw else "element reads        ", st.load_widths)


# %% [markdown]
# Eight `buffer_load_ushort` per lane instead of one `buffer_load_dwordx4`: the loads are lowered
# one element at a time and nothing widens them. The fix asks for the width explicitly: a raw
# 4-dword load, then a bitcast of the `vector<4xi32>` to `vector<8xf16>`, which costs no
# instruction. `query_operands` (chapter 02) does exactly that.
#
# ## What 128-bit loads bought, measured
#
# The seed kernel (FlyDSL PR #825) made the same two changes, K first, then V, and its author
# timed each on a GPU:


# %%
show.md(seed_history.table("f44f95f5", "raw dwordx4 K load + raw QK MFMA") + "\n\n"
        + seed_history.table("e4fcfb4d", "raw dwordx4 V load + raw PV MFMA"))


# %% [markdown]
# pa_tile's own count, from the ISA (static, whole kernel) and the emulator (the one-tile case
# above): vector-memory loads by width, and the bytes each moves for the wave.


# %% tags=["nbval-ignore-output"]
def load_rows(label, asm, trace):
    st = isa.IsaStats.from_asm(asm)
    dyn = {}
    for r in trace.accesses():
        if r["space"] in ("buffer", "global") and not r["write"]:
            d = dyn.setdefault(r["mnemonic"], [0, 0])
            d[0] += 1
            d[1] += r["bytes"]
    return [dict(stage=label, load=m, executed=n, bytes_per_instr=b // n,
                 static=sum(v for w in st.load_widths.values() for k, v in w.items()
                            if m.endswith("_" + k)))
            for m, (n, b) in sorted(dyn.items())]


asm2, asm3 = compiled(s2), compiled(s3)
if EMU:
    widths = (load_rows("stage 1", asm1, traced(s1_tile_qk))
              + load_rows("stage 2", asm2, traced(s2))
              + load_rows("stage 3", asm3, trace3))
    print(format_table(widths))
else:
    print(NO_TRACE)


# %% tags=["nbval-ignore-output"]
if EMU:
    per = {(r["stage"], r["load"]): r["bytes_per_instr"] for r in widths}
    display(show.md(f"""
    Stage 1 moves K and V with `dwordx2`, {per["stage 1", "buffer_load_dwordx2"]} bytes a wave
    instruction. Stages 2 and 3 move every K, V and query byte with `dwordx4`,
    {per["stage 3", "buffer_load_dwordx4"]} bytes, the widest a vector-memory load has."""))


# %% [markdown]
# ## The kernel
#
# Everything outside the loop is chapter 02's and imported from its module: its `Workgroup` (the
# fixed state and the per-tile math) and the kernel library.


# %% tags=["export"]
"""Stage 3: stage 2's kernel with a software-pipelined loop.

The next tile's K (8 ``buffer_load_dwordx4`` per lane) and its block-table entries are loop-carried
values, loaded one iteration ahead; V is issued at the top of the iteration it is used in, so
Q·Kᵀ and the softmax hide its latency. K and V go straight from 128-bit loads into the raw MFMA
operands, the query is read in 128-bit chunks, exp2/rcp are the hardware's ``v_exp_f32``/
``v_rcp_f32``.

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
# The loop carries the next tile's K in registers. Each iteration issues this tile's V and the
# next tile's K before any math, so both are in flight while this tile's MFMAs run:
#
# ```
#   before the loop: page ids of tile 0 -> K(0);  page id of tile 1 (K)
#   iteration t:     issue V(t)                       (page id carried from t-1)
#                    issue K(t+1)                     (page id carried from t-1)
#                    issue page ids: K of t+2, V of t+1
#                    K·Qᵀ(t) on the carried K(t) -> softmax -> V·P(t)  (waits for V only)
#                    carry K(t+1) and the two page ids
# ```
#
# The block-table entries travel one step ahead of the loads that use them, so no load waits on
# a block-table read. Past the last tile the indices clamp to the sequence's last page. The
# final iteration loads that page's K once more and never uses it: one extra K tile per wave, in
# exchange for a loop without a branch around its loads.
#
# Every tile starts on a new page (a tile is 256 tokens, a page at most 64), so the block-table
# loads are unconditional. For block 64 a lane's K and V page are the same entry, and the
# compiler reads it once.


# %% tags=["export"]
def loop_entry_state(pages, prefetch):
    """``(values, base)``: what the tile loop carries in, and the index where its softmax state
    starts. With the K prefetch: tile 0's K (loaded here, before the loop), tile 1's K page and tile
    0's V page; without: tile 0's K and V pages. Then 8 zero output chunks, the running max
    (``MASKED``) and the running sum (0)."""
    zero4 = fx.Vector.filled(4, 0.0, fx.Float32)
    softmax0 = [zero4] * 8 + [fx.Float32(MASKED), fx.Float32(0.0)]
    if prefetch:
        carried = [pages.k(pages.page_id(0, pages.k_j)), pages.page_id(1, pages.k_j),
                   pages.page_id(0, pages.v_j)]
    else:
        carried = [pages.page_id(0, pages.k_j), pages.page_id(0, pages.v_j)]
    return carried + softmax0, len(carried)


# %% [markdown]
# The kernel: stage 2's `Workgroup` for everything outside the loop, and a loop whose carried
# values are the ones above. `prefetch_k=False` rebuilds chapter 02's loop, for the comparison
# below.


# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_launcher(block_size: int, group: int, arch: str, prefetch_k: bool = True):
    """The ``@flyc.jit`` launcher for one (block_size, group, arch, prefetch_k) specialization."""
    PREFETCH = bool(prefetch_k)

    def pa_decode_s3(out: fx.Tensor, query: fx.Tensor, key_cache: fx.Tensor, value_cache: fx.Tensor,
                     block_tables: fx.Tensor, context_lengths: fx.Tensor, key_scale: fx.Tensor,
                     value_scale: fx.Tensor, num_kv_heads: fx.Int32, max_blocks: fx.Int32,
                     scale_log2: fx.Float32):
        wg = s2.Workgroup(out, query, key_cache, value_cache, block_tables, context_lengths,
                          key_scale, value_scale, num_kv_heads, max_blocks, scale_log2,
                          block_size=block_size, group=group, fp8_max=fp8_max(arch))
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
                carry = [k_words_next, pages.page_id(t + 2, pages.k_j),
                         pages.page_id(t + 1, pages.v_j)]
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

        mine = wg.merge([res[base + j] for j in range_constexpr(8)], res[base + 8], res[base + 9])
        store = wg.store
        if wg.col < group:
            store(mine)

    return jit_launcher(pa_decode_s3)


# %% [markdown]
# ## The launcher
#
# Validation is chapter 02's (same inputs, same errors), then this stage's launcher.


# %% tags=["export"]
def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, *, softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """``(launcher, args, arch)`` after validation: stage 2's inputs, checks and arguments."""
    if not isinstance(prefetch_k, bool):
        raise TypeError(f"prefetch_k: expected a bool, got {type(prefetch_k).__name__}")
    p = problem.describe(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                         value_scale, limits=LIMITS, softmax_scale=softmax_scale, arch=arch)
    args = s2.kernel_args(p, query, key_cache, value_cache, block_tables, context_lengths,
                          key_scale, value_scale, out)
    return build_launcher(p.block_size, p.group, p.arch, prefetch_k), args, p.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, *, softmax_scale=None, out=None, arch=None, prefetch_k=True):
    """fp8 paged decode attention; returns ``out`` (shaped and typed like ``query``).

    Arguments as in stage 2 (``pa_tile.stages.s2_register_softmax.paged_decode``); ``prefetch_k``
    (default True) loads each tile's K one iteration ahead.
    """
    launcher, args, arch = launch_args(query, key_cache, value_cache, block_tables, context_lengths,
                                       key_scale, value_scale, softmax_scale=softmax_scale, out=out,
                                       arch=arch, prefetch_k=prefetch_k)
    launching.launch(launcher, args, arch=arch)
    return args[0]


# %% [markdown]
# ## What the prefetch costs, and what it buys
#
# Compile both loops (block 16, group 8). Read the registers, the waves per SIMD they allow, and
# how many of the iteration's loads its 16 K·Qᵀ MFMAs wait for. The count comes from the
# `s_waitcnt vmcnt(n)` the compiler placed: `vmcnt(n)` lets the newest `n` loads stay in flight,
# and loads complete in order.


# %%
from pa_tile.stages import s2_register_softmax as s2  # noqa: E402
from pa_tile.stages import s3_raw_loads as s3  # noqa: E402


def loop_body(asm, st):
    lines = asm.splitlines()[st.main_loop.start_line - 1 : st.main_loop.end_line]
    return [ln.strip() for ln in lines
            if ln.strip() and not ln.strip().startswith((";", "."))
            and not ln.rstrip().endswith(":")]


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
        rows.append(dict(arch=arch, loop=label, vgpr=st.vgpr_unified, spills=st.vgpr_spill,
                         waves_per_simd=occ.waves_per_simd, loop_instr=st.main_loop_instructions,
                         loads_per_iter=issued, qk_waits_for=waited))
print(format_table(rows))


# %%
r = {(x["arch"], x["loop"]): x for x in rows}
off, on = r["gfx942", "s3 prefetch_k=False"], r["gfx942", "s3 prefetch_k=True"]
a = INFO["gfx942"]
show.md(f"""
* **Registers.** The carried K costs {on["vgpr"] - off["vgpr"]} VGPRs per lane on gfx942
  ({off["vgpr"]} -> {on["vgpr"]}). A SIMD holds {a.vgprs_per_lane} registers per lane, allocated
  in granules of {a.vgpr_granule}, so {off["waves_per_simd"]:g} waves fit without the prefetch
  and {on["waves_per_simd"]:g} with it.
* **Latency.** An iteration issues {on["loads_per_iter"]} loads. Without the prefetch, K·Qᵀ
  waits for {off["qk_waits_for"]} of them, this tile's K: one memory latency per tile, hidden
  only while the SIMD's other waves compute. With it, K·Qᵀ waits for {on["qk_waits_for"]}: it
  runs on the carried K while V, the next K and the page ids are in flight.""")


# %% [markdown]
# **Choice: prefetch on** (the default). Per wave, chapter 02's loop requests 16 KiB of K and V at
# the top of a tile and then nothing. The pipelined loop also keeps the next tile's 8 KiB of K in
# flight through the whole iteration. The emulator has no clock, so it cannot time this;
# `python -m pa_tile bench` does, on a GPU. The seed kernel measured the same trade:


# %%
pf = {s["shape"]["batch"]: s for s in seed_history.steps("28a3bb1e")}
show.md(seed_history.table("28a3bb1e", "K prefetch added") + f"""

The prefetch bought {100 * (1 - pf[16]["after_us"] / pf[16]["before_us"]):.0f} % at batch 16, where
a CU has few waves to hide latency with, and cost
{100 * (pf[128]["after_us"] / pf[128]["before_us"] - 1):.0f} % at batch 128, where other waves
hide it anyway.""")


# %% [markdown]
# **A later chapter drops it.** [Chapter 05](05_phase_split_mtp.ipynb) issues K and V together at
# the top of each tile instead. A tile then waits for memory once, as here, without holding a
# second tile's K (8 `dwordx4`, 32 registers per lane) through the loop. Chapter 05 spends those
# registers on more query rows.
#
# ## exp2, rcp and cross-lane reductions
#
# The softmax uses the transcendental unit directly: `v_exp_f32` (2^x) and `v_rcp_f32`. The
# `log2 e` and softmax scales are folded into one multiplier per score, as Triton's and
# FlashAttention's kernels do with `exp2`, so no `exp` or division expansion appears. Cross-lane
# steps, per arch:


# %%
xlane = ("v_exp_f32", "v_rcp_f32", "_dpp", "ds_swizzle", "ds_bpermute",
         "v_permlane32_swap", "v_permlane16_swap")
counts = {}
for arch in ARCHS:
    st = isa.IsaStats.from_asm(asms["s3 prefetch_k=True", arch])
    body = [ln.split()[0] for ln in loop_body(asms["s3 prefetch_k=True", arch], st)]
    whole = [ln.split()[0] for ln in asms["s3 prefetch_k=True", arch].splitlines()
             if ln.strip() and not ln.strip().startswith((";", "."))]
    counts[arch] = {m: (sum(m in x for x in body), sum(m in x for x in whole)) for m in xlane}
print("in the loop / in the whole kernel (\"_dpp\": any instruction with a DPP modifier)")
print(format_table([dict(arch=a, **{m.removeprefix("v_"): "%d / %d" % c[m] for m in xlane})
                    for a, c in counts.items()]))


# %%
used = {a: [m for m in xlane[2:] if c[m][1]] for a, c in counts.items()}
show.md(f"""
The loop's cross-lane work is the per-tile row max over the 4 lanes of a query head, lanes
`c, c+16, c+32, c+48`: exchanges 16 and 32 lanes apart. gfx942 uses
{" and ".join(f"`{m}`" for m in used["gfx942"])}; gfx950 uses
{" and ".join(f"`{m}`" for m in used["gfx950"])}. Instructions with a DPP modifier:
{counts["gfx942"]["_dpp"][1]} on gfx942, {counts["gfx950"]["_dpp"][1]} on gfx950.""")


# %% [markdown]
# Why no DPP. GFX9's DPP (gfx942 and gfx950 are GFX9; the CDNA3 ISA guide's DPP section, and
# LLVM's `dpp_ctrl` syntax) offers `quad_perm` and `row_shl/shr/ror/mirror` inside a
# row of 16 lanes, `wave_shl/shr/rol/ror` by one lane across the wave, `row_bcast:15` and
# `row_bcast:31` (one lane copied into the next row or rows, for scans), and on gfx90a and later
# `row_newbcast` (one lane of a row to its whole row). None swaps every lane with the lane 16 or
# 32 away, which is what a butterfly step needs. So the compiler takes `ds_swizzle` (`SWAP,16`)
# and `ds_bpermute` on gfx942: the LDS crossbar, with no LDS memory used. gfx950 adds
# `v_permlane16_swap` and `v_permlane32_swap`, plain VALU. The rest of the row max is in-lane
# `v_max_f32` over the lane's own scores.
#
# ## Does it work?
#
# Chapter 02's matrix and checks (the fp8 bound is explained there): both archs, block 16 and
# 64, group 8 and 16, contexts 1, 17, 256 and 1027, shuffled pages and `-1` in unused
# block-table entries. The prefetch changes no arithmetic, so the output must be
# **bit-identical** to chapter 02's kernel. One row per (arch, block, group), the worst of its
# four sequences.


# %% tags=["nbval-ignore-output"]
def check(arch, block_size, group, contexts=(1, 17, 256, 1027), num_kv_heads=1, seed=1):
    case = cache.make_case(len(contexts), group * num_kv_heads, num_kv_heads, 128, block_size,
                           list(contexts), fp8_format=fp8_format(arch), seed=seed, pad_block_id=-1)
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
table = [check(arch, bs, g)
         for arch in backend.runnable_archs() for bs in (16, 64) for g in (8, 16)]
print(format_table(table))
same = all(r["same_as_stage2"] for r in table)
ok = all(x["ok"] for x in table)
print(f"{len(table)} configurations x 4 contexts: {'all' if ok else 'NOT all'} "
      f"{4 * len(table)} sequences within the bound, "
      f"{'all' if same else 'NOT all'} bit-identical to stage 2")
assert all(x["ok"] and x["same_as_stage2"] for x in table)


# %% [markdown]
# ## What it compiles to, against chapter 02


# %%
# the rows that changed on either arch, and the headline facts
print(isa.diff_side_by_side({arch: (isa.IsaStats.from_asm(asms["stage 2", arch]),
                                    isa.IsaStats.from_asm(asms["s3 prefetch_k=True", arch]))
                             for arch in ARCHS}, labels=("stage 2", "stage 3")))


# %% [markdown]
# ## Memory traffic of one tile
#
# The full trace of stage 3 for the one-tile case, before, in and after the loop. Per execution:
# bytes, 128-byte lines touched (and the fewest the bytes fit in), LDS bank conflicts (the merge
# only). The lines of one instruction that access memory alike share a row.


# %% tags=["nbval-ignore-output"]
if EMU:
    with emu_launch.record_launches() as launched:
        trace3 = traced(s3)
    phases = isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)
    print(trace3.grouped_table(phases=phases))
else:
    print(NO_TRACE)


# %% tags=["nbval-ignore-output"]
if EMU:
    x4 = [g for g in trace3.grouped_summary(phases=phases)
          if g["mnemonic"] == "buffer_load_dwordx4"]
    k0 = next(g for g in x4 if g["lines_128B_per_exec"] > g["min_lines_128B_per_exec"])
    v = next(g for g in x4 if g["phase"] == "loop"
             and g["lines_128B_per_exec"] == g["min_lines_128B_per_exec"])
    clamped = next(g for g in x4 if g["lines_128B_per_exec"] < g["min_lines_128B_per_exec"])
    display(show.md(f"""
    The {k0["phase"]}'s {k0["lines_128B_per_exec"]}-line row is tile 0's K: {k0["bytes_per_exec"]}
    bytes in {k0["lines_128B_per_exec"]} lines, half of each (the figure above). V's loads in the
    loop fill whole lines: {v["lines_128B_per_exec"]} for {v["bytes_per_exec"]} bytes. The loop's
    {clamped["lines_128B_per_exec"]}-line row is the prefetch of a tile that does not exist,
    clamped to the last page: its 64 lanes read only
    {clamped["distinct_bytes"] // clamped["executions"]} distinct bytes."""))


# %% [markdown]
# ## What you built
#
# ```
# paged_decode_s3(q, K, V, block_tables, ctx):      # grid (seq, kv_head); 4 waves
#     lane (c, g) = (lane % 16, lane // 16)          # c: the lane's query head
#     Qops, c_qk = quantize(q[head c])               # raw dwordx4 reads, 8 registers
#     m, l, O[8 d-chunks] = MASKED, 0, 0
#     Kw = 8 x dwordx4 of tile 0's K                 # 16 B a lane: two k-steps' bytes
#     for tile in range(ceil(ctx / 256)):            # wave w: tokens 64w .. 64w+63
#         Vw = 8 x dwordx4 of V(tile)                # in flight during K·Qᵀ
#         Kn = 8 x dwordx4 of K(tile + 1)            # clamped to the last page
#         page ids of K(tile + 2), V(tile + 1)       # one step ahead of their loads
#         S = K·Qᵀ on the carried Kw: 16 MFMAs       # waits for no load
#         if last tile: mask S, zero V's tail
#         m2 = max(m, row_max(S * c_qk))             # ds_swizzle/bpermute or permlane swaps
#         corr = exp2(m - m2); P = exp2(S*c_qk - m2 + log2 FP8_MAX)
#         l = l*corr + tree_sum(P)
#         O = O*corr + V·fp8(P): 16 MFMAs            # waits for V
#         m, Kw = m2, Kn
#     merge the 4 waves' (m, l, O) through LDS       # once
#     store f16 O / l
# ```
#
# Next, [chapter 04](04_blocked_layouts.ipynb): the production cache layouts, and the scope the
# finished kernel serves.


# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

# the model samples its kernels in the emulator: no prediction where this runs on a GPU
pred = {s.gpu: s for s in speedup.predicted_steps("s3", "s2")} if EMU else {}
show.measured({
    "VGPRs, stage 2 -> 3 (gfx942)": f'{r["gfx942", "stage 2"]["vgpr"]} -> {on["vgpr"]}',
    "waves per SIMD, stage 2 -> 3 (gfx942)": f'{r["gfx942", "stage 2"]["waves_per_simd"]:g} -> '
                                             f'{on["waves_per_simd"]:g}',
    "loads an iteration's K·Qᵀ waits for": f'{off["qk_waits_for"]} -> {on["qk_waits_for"]} '
                                           f'of {on["loads_per_iter"]}',
    "PREDICTED (timing model), b16 x 16k, MI300X / MI355X":
        f'{pred["MI300X"].us:.0f} / {pred["MI355X"].us:.0f} µs (stage 2: '
        f'{pred["MI300X"].previous_us:.0f} / {pred["MI355X"].previous_us:.0f})' if pred
        else "emulator only",
})
