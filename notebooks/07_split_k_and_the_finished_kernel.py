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
# # 07 · Split-K, the reduce, and the finished kernel
#
# **You'll learn**
#
# * why one workgroup per (sequence, KV head) leaves most of the GPU idle at small batch, and how
#   split-K, flash-decoding's split and merge, fills it
# * the reduce: an exact merge of partial softmax results that no empty partition turns into NaN
# * how the partition count is chosen from shapes alone, and how a ragged batch is balanced
# * the finished kernel on one screen, and `pa_tile.paged_decode`, a call that allocates nothing
#
# **You need** chapters 05 and 06 (M-tiles, the phase split, the head_dim split of P·V: the kernel
# this chapter splits) and flash attention's online softmax (running max, rescaled sum).
#
# **Runs on** the CPU emulator (gfx942 and gfx950 code), about 2 minutes on a quiet 2-core CPU; on
# a ROCm GPU the kernels launch on the device and the emulator-only cells say so.

# %% [markdown]
# Chapter 06's kernel launches one workgroup per (sequence, KV head, M-group) and walks the whole
# context inside it. That fills the GPU at a big batch, and leaves it idle for the decode step of
# a few long conversations:

# %%
import math

import matplotlib.pyplot as plt
import torch

from pa_tile import backend, cache, figures, isa, seed_history, show, toolchain
from pa_tile.arch import fp8_format
from pa_tile.emu.memory import format_table
from pa_tile.progress import progress as tqdm

# %%
from pa_tile.arch import info as arch_info  # noqa: E402

CUS = {"MI300X": arch_info("gfx942").cu_count, "MI355X": arch_info("gfx950").cu_count}
busy = ["| batch × KV heads | workgroups | " + " | ".join(f"{g} ({n} CUs) busy" for g,
                                                          n in CUS.items()) + " |",
        "|---|---|---|---|"]
for b in (1, 4, 32):
    busy.append(f"| {b} × 8 | {8 * b} | " + " | ".join(f"{min(1, 8 * b / n):.1%}"
                                                       for n in CUS.values()) + " |")
show.md("\n".join(busy) + f"""

With 8 workgroups, {CUS["MI300X"] - 8} of MI300X's CUs idle while 8 stream a long context each.""")

# %% [markdown]
# Decode is bound by memory bandwidth, and one CU pulls only a small share of HBM's. **Split-K**
# cuts each context into `num_partitions` contiguous ranges, runs each range as a workgroup of its
# own, and merges the partial results in a second, small kernel: the **reduce**. This is
# **flash-decoding**'s split and merge, the parallel a Triton or FlashAttention reader knows:
# `flash_attn_with_kvcache(..., num_splits=)` in FlashAttention, and the two-stage Triton decode
# kernels (stage 1 per KV split, stage 2 the merge). Three sequences split four ways: each
# partition takes a contiguous run of a sequence's 256-token tiles, a short sequence leaves its
# last partitions empty, and the reduce combines what each row's partitions wrote.

# %%
figures.split_k(context_lengths=[300, 1027, 2600], num_partitions=4)
plt.show()

# %% [markdown]
# ## The module
#
# The chapter's code is `pa_tile.stages.s6_split_k`. The partial kernel is chapter 06's
# (`pa_tile.stages.s5_phase_split_mtp`) with `num_partitions` > 1 or a work list: workgroup z walks
# a contiguous range of tiles and writes that range's row max, row sum and normalized output.
# `build_reduce` merges them; `choose_num_partitions` picks the split; `work_list` balances a
# ragged batch; `workspace_size` and `carve` lay the partials out in one buffer. The public API
# built on them (`pa_tile.plan`, `pa_tile.paged_decode`, the `torch.ops.pa_tile.paged_decode` op)
# is `pa_tile.api`.

# %% tags=["export"]
"""Stage 6: split-K partitions, the flash-combine reduce, and the finished ``paged_decode``.

Chapter 06's kernel split into partitions (``num_partitions``, or a balanced ``work_list``), the
reduce that merges their partials (``build_reduce``), the choice of the split
(``choose_num_partitions``) and the workspace. The public API over them is ``pa_tile.api``.
"""

import dataclasses
import functools
import math
import types

import torch

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import const_expr, gpu, range_constexpr

from pa_tile import arch as _arch
from pa_tile.kernel_lib import (LOG2E, TILE, buffer_load, buffer_store, device_code, exp2, fmax,
                                imin,
                                rcp, rsrc, scalar_load, select, splat4)
from pa_tile.serving_math import log2, with_sink
from pa_tile.stages import s5_phase_split_mtp as s5

__all__ = ["paged_decode", "launch_args", "build_reduce", "combine_torch", "choose_num_partitions",
           "choose_num_partitions_budget", "partition_table", "DEFAULT_POLICY",
           "TRAFFIC_CAP", "split_extra_bytes", "within_traffic_cap", "workspace_size",
           "carve", "make_workspace", "LIMITS", "MAX_PARTITIONS",
           "PARTIAL_BYTES_BUDGET", "DEFAULT_SCHEDULE", "SCHEDULES", "chunk_floor",
           "choose_schedule", "work_entries", "work_list", "work_list_buffers",
           "reduce_geometry", "load_partition_group", "merge_partition_group",
           "combine_partitions", "write_combined", "uniform_reduce", "listed_reduce",
           "tabled_split", "build_ragged_reduce", "listed_ragged_reduce", "tiles_to_walk"]

# %% [markdown]
# Its constants, each explained in the section that uses it.

# %% tags=["export"]
#: the finished kernel supports what chapter 06's does; the split is what this chapter adds
LIMITS = dataclasses.replace(s5.LIMITS, stage="s6")
#: the largest split chapter 06's kernel accepts
MAX_PARTITIONS = LIMITS.max_partitions
#: workgroups the heuristic aims for, per CU (see ``choose_num_partitions``)
WORKGROUPS_PER_CU = 4
#: a partition gets at least this many 256-token tiles (see ``choose_num_partitions``)
MIN_TILES_PER_PARTITION = 2
#: the partials a split writes and the reduce reads back may cost at most this fraction of the
#: K and V bytes the call must read (see ``choose_num_partitions``)
PARTIAL_BYTES_BUDGET = 0.03
REDUCE_THREADS = 256
#: partitions the reduce loads together, waiting for memory once per group (its section)
REDUCE_GROUP = 4
#: the byte offset 2^31 (as a signed 32-bit value; the hardware reads offsets unsigned), past every
#: partial buffer (``s5.check_partial_offsets`` keeps them below 2^31): a buffer load there returns
#: 0 and fetches nothing
PAST_PARTIALS = -(2**31)

# %% [markdown]
# ## The partial results and the merge math
#
# Partition `z` of a (sequence, KV head) sees a token range `T_z`. For one query row with scores
# `s_t = softmax_scale · q·k_t` it keeps the three numbers flash attention keeps anyway (the running
# max, the running sum and the accumulator), and the kernel writes them out:
#
# * `m_z = max_{t∈T_z} s_t` (natural-log units),
# * `ℓ_z = Σ_{t∈T_z} exp(s_t − m_z)`,
# * `o_z = Σ_{t∈T_z} exp(s_t − m_z) · v_t / ℓ_z` (the partition's own softmax output, *normalized*).
#
# The full softmax over `T = ∪ T_z` follows exactly, because `exp(s − m_z) = exp(s − M)·exp(M − m_z)`:
#
# $$M = \max_z m_z,\qquad w_z = ℓ_z\,e^{m_z − M},\qquad o = \frac{\sum_z w_z\,o_z}{\sum_z w_z}.$$
#
# A normalized `o_z` stays in the range of V whatever `ℓ_z` is, and costs the reduce one
# multiply-add per partition.
#
# **Numerics of the combine.** A partition may see *no* token of a row: the context ends before
# the partition starts, or a sliding window or MTP's causal mask hides all of it. The kernel then
# writes `m_z = −6.9e29` (a finite −∞), `ℓ_z = 0`, `o_z = 0`. The reduce lets it add nothing and
# never produces NaN:
#
# * `M` is the max over partitions **with `ℓ_z > 0`** only; empty ones enter as `−∞`.
# * `w_z` is *selected* to 0 when `ℓ_z = 0`, never computed as `0 · exp(m_z − M)`: with `M = −∞`
#   (every partition empty) that exponent is `exp(+∞)` and `0 · ∞` is NaN.
# * The output is selected to 0 when `Σ w_z = 0` (a row no partition saw: impossible in a valid
#   decode, where each row sees its own token, but a corrupt input must not become NaN).
# * `M ≥ m_z` for every live partition, so every `exp(m_z − M) ≤ 1`: no overflow.
#
# In torch, the numerics model the tests hold the kernel to:

# %% tags=["export"]
def combine_torch(pmax, psum, pout, query_length, group):
    """The reduce in float32 torch, with the kernel's guards: partials ``[S, kvh, NP, rows(, d)]``
    -> ``[S·query_length, kvh·group, d]``."""
    live = psum > 0
    gmax = torch.where(live, pmax, torch.tensor(float("-inf"))).amax(2, keepdim=True)
    w = torch.where(live, psum * torch.exp(torch.where(live, pmax - gmax, torch.zeros(()))),
                    torch.zeros(()))
    den = w.sum(2)
    o = (w[..., None] * pout).sum(2) * torch.where(den > 0, 1.0 / den.clamp_min(1e-38),
                                                   torch.zeros(()))[..., None]
    S, kvh, rows, d = o.shape
    return o.reshape(S, kvh, query_length, group,
                     d).permute(0, 2, 1, 3, 4).reshape(S * query_length, kvh * group, d)

# %%
# four partitions of one row: two live, one empty, one live but far below the max
pmax = torch.tensor([[[[2.0], [-6.9e29], [0.5], [-40.0]]]])
psum = torch.tensor([[[[3.0], [0.0], [5.0], [1.0]]]])
pout = torch.tensor([[[[[1.0]], [[0.0]], [[-1.0]], [[7.0]]]]])
print("combined:", combine_torch(pmax, psum, pout, 1, 1).flatten().tolist())
print("all empty:", combine_torch(torch.full_like(pmax, -6.9e29), torch.zeros_like(psum),
                                  torch.zeros_like(pout), 1, 1).flatten().tolist())

# %% [markdown]
# ## The reduce kernel
#
# One thread per 4 output channels: a row of `head_dim` channels takes `head_dim/4` lanes (16, 32 or
# 64), so a 256-thread workgroup merges 16, 8 or 4 rows, and every partial-output load is one
# `buffer_load_dwordx4` of 16 contiguous bytes. Grid `(num_seqs, num_kv_heads, ceil(rows /
# rows_per_workgroup))`: sequence and KV head come from the block ids, so no index is divided at
# run time.
#
# One loop over the partitions (a run-time count, so one compiled reduce serves every split), in
# groups of `REDUCE_GROUP` = 4: a group's 12 loads (`m_z`, `ℓ_z` and 16 bytes of `o_z` for each of
# its partitions) are all issued before the first is used, so the loop waits for memory once per
# group. The merge is online, as in the kernel's own loop: the running max `M` rises to the group's
# live maxima, what came before is rescaled by `e^(M_old − M)`, and each partition adds
# `w_z = ℓ_z e^(m_z − M)` to `Σ w` and `w_z o_z` to the output. A slot past the last partition loads
# at byte offset 2^31, beyond every partial buffer: the buffer resource's bound makes that load
# return 0 (an empty partition) without fetching anything, so the tail costs no bytes and no
# branch. The output is converted to the query dtype and stored as 8 bytes per lane.

# %% tags=["export"]
def reduce_geometry(head_dim, group, query_length, q_dtype="f16", sinks=False, lse=False):
    """The reduce's compile-time sizes for one (head_dim, group, query_length, query dtype),
    checked: ``HD``, ``G``, ``QL``; ``ROWS`` query rows per (sequence, KV head); ``LPR`` lanes
    per row (4 channels, one dwordx4, each); ``RPW`` rows per workgroup; ``GRID_Z`` workgroups
    per (sequence, KV head); ``QDT`` the output dtype; ``SINKS``, ``LSE``: chapter 08's sinks
    and log-sum-exp out."""
    if head_dim % 64 or not 64 <= head_dim <= 256:
        raise ValueError(f"unsupported head_dim={head_dim} (64, 128 or 256)")
    if not (1 <= query_length <= s5.LIMITS.max_query_length
            and s5.LIMITS.allows_group(group, query_length)):
        raise ValueError(f"unsupported group={group}, query_length={query_length} (group "
                         f"{s5.LIMITS.groups_text(query_length)} at this query_length)")
    rows = group * query_length
    lanes = head_dim // 4  # lanes per row: 4 channels (one dwordx4) each
    rows_per_wg = REDUCE_THREADS // lanes
    return types.SimpleNamespace(HD=head_dim, G=group, QL=query_length, ROWS=rows, LPR=lanes,
                                 RPW=rows_per_wg, SINKS=sinks, LSE=lse,
                                 QDT=fx.BFloat16 if q_dtype == "bf16" else fx.Float16,
                                 GRID_Z=(rows + rows_per_wg - 1) // rows_per_wg)

# %% [markdown]
# A group's loads, all issued before the first is used, so the loop waits for memory once per
# group. A slot past the last partition loads at `PAST_PARTIALS`: it reads an empty partition and
# fetches nothing, so the tail of the last group needs no branch.

# %% tags=["export"]
def load_partition_group(c, rsrcs, stat0, stride, zb, hi, d0):
    """The maxes, sums and 4 output channels of partitions ``zb .. zb + REDUCE_GROUP`` of the
    thread's row (stats at float ``stat0 + z·stride``, outputs ``HD`` floats apart), every load
    issued before any is used; a slot at or past ``hi`` reads 0 from ``PAST_PARTIALS``."""
    mx_rs, sm_rs, po_rs = rsrcs
    maxes, sums, outs = [], [], []
    for u in range_constexpr(REDUCE_GROUP):
        here = zb + u < hi
        i = stat0 + (zb + u) * stride
        at = fx.Int32(select(here, i * 4, PAST_PARTIALS))
        maxes.append(buffer_load(mx_rs, at, 1).bitcast(fx.Float32))
        sums.append(buffer_load(sm_rs, at, 1).bitcast(fx.Float32))
        outs.append(buffer_load(po_rs, fx.Int32(select(here, (i * c.HD + d0) * 4, PAST_PARTIALS)),
                                4)
                    .bitcast(fx.Float32))
    return maxes, sums, outs

# %% [markdown]
# The online merge of one group into the running state `(M, Σ w, Σ w·o)`, as in the kernel's own
# loop. Empty partitions are *selected* away, never multiplied by 0, so an all-empty prefix
# (`M = −∞`) never meets `0 · ∞`.

# %% tags=["export"]
def merge_partition_group(st, maxes, sums, outs, ninf, zero):
    """The state ``st`` = ``[M, Σw, Σw·o]`` after one group: ``M`` rises to the group's live maxima
    (an empty partition enters as ``ninf``), what came before is rescaled by ``e^(M_old - M)``, and
    each partition adds ``w = ℓ·e^(m - M)``, selected (not multiplied) to 0 where ``ℓ = 0``, so
    ``M = -inf`` (every partition so far empty) never meets ``0·inf``. Returns ``(M, Σw, Σw·o)``."""
    m_run = fx.Float32(st[0])
    m_new = m_run  # the running max over partitions that saw a token
    for u in range_constexpr(REDUCE_GROUP):
        m_new = fmax(m_new, fx.Float32(select(sums[u] > 0.0, maxes[u], ninf)))
    corr = fx.Float32(select(m_new > ninf, exp2((m_run - m_new) * LOG2E), zero))
    den, acc = fx.Float32(st[1]) * corr, fx.Vector(st[2]) * splat4(corr)
    for u in range_constexpr(REDUCE_GROUP):
        w = fx.Float32(select(sums[u] > 0.0, sums[u] * exp2((maxes[u] - m_new) * LOG2E), zero))
        den, acc = den + w, acc + outs[u] * splat4(w)
    return m_new, den, acc

# %% [markdown]
# One thread's whole job: find its row and channels from the thread and block ids, loop over the
# row's partitions a group at a time, then divide by `Σ w` (0 for a row no partition saw) and
# store the row's 4 channels in the query dtype. Where a sequence's partitions are is passed in
# (`z0`, `z1`, `first`, `stride`), so one body serves the uniform split and the work list.

# %% tags=["export"]
@device_code
def combine_partitions(c, out, pmax, psum, pout, num_kv_heads, z0, z1, first, stride, sinks,
                       lse, query_start_loc=None):
    """Merge partitions ``z0(seq) .. z1(seq)`` of this thread's row, whose stats sit at float
    ``first(seq, kvh) + z·stride``, and write its 4 channels (``c``: ``reduce_geometry``). With
    ``query_start_loc`` (ragged rows) sequence ``seq`` owns ``out`` rows ``loc[seq] ..
    loc[seq+1]``; a row past them (padding) loads no partial and writes nothing."""
    tid = fx.Int32(gpu.thread_id("x"))
    seq = fx.Int32(gpu.block_id("x"))
    kvh = fx.Int32(gpu.block_id("y"))
    r = fx.Int32(gpu.block_id("z")) * c.RPW + tid // c.LPR
    rc = imin(r, c.ROWS - 1)  # rows past the end compute a real row's result and do not store it
    d0 = (tid % c.LPR) * 4
    mx_rs, sm_rs, po_rs, o_rs = (rsrc(t) for t in (pmax, psum, pout, out))
    stat0 = first(seq, kvh) + rc  # partition z's stats at stat0 + z·stride, in floats
    ninf = fx.Float32(float("-inf"))
    zero = fx.Float32(0.0)
    lo, hi = z0(seq), z1(seq)
    ragged = None
    if const_expr(query_start_loc is not None):
        q0 = scalar_load(query_start_loc, seq)
        live_rows = (scalar_load(query_start_loc, seq + 1) - q0) * c.G
        hi = fx.Int32(select(r < live_rows, hi, lo))  # a padding row merges no partition
        ragged = (q0, live_rows)
    init = [ninf, zero, fx.Vector.filled(4, 0.0, fx.Float32)]
    for gi, st in range(0, (hi - lo + (REDUCE_GROUP - 1)) // REDUCE_GROUP, 1, init=init):
        zb = lo + fx.Int32(gi) * REDUCE_GROUP
        maxes, sums, outs = load_partition_group(c, (mx_rs, sm_rs, po_rs), stat0, stride, zb, hi,
                                                 d0)
        m_new, den, acc = merge_partition_group(st, maxes, sums, outs, ninf, zero)
        res = yield [m_new, den, acc]
    write_combined(c, res, o_rs, sinks, lse, seq, kvh, r, rc, d0, num_kv_heads, ragged)


# %% [markdown]
# Then `out = Σ w·o / Σ w`, 0 for a row no partition saw, stored as the query's dtype. Chapter
# 08's options join here when on: the sink's share of the denominator and the row's LSE.

# %% tags=["export"]
@device_code
def write_combined(c, res, o_rs, sinks, lse, seq, kvh, r, rc, d0, num_kv_heads, ragged=None):
    """The row's merged state ``res`` = ``[M, Σw, Σw·o]`` to its 4 channels of ``out`` (with the
    sink's share taken out if ``c.SINKS``) and, if ``c.LSE``, its log-sum-exp to ``lse``;
    ``ragged``: ``(first out row, live rows)`` of the sequence's ragged rows."""
    zero = fx.Float32(0.0)
    den = fx.Float32(res[1])
    inv = fx.Float32(select(den > 0.0, rcp(den), zero))
    qi = rc // c.G
    lse2 = None
    if const_expr(c.SINKS or c.LSE):
        # the keys' log-sum-exp in log2 units: -inf when no partition saw a key (M = -inf, den 0)
        lse2 = fx.Float32(res[0]) * LOG2E + log2(den)
        if const_expr(c.SINKS):
            sink2 = buffer_load(rsrc(sinks), (kvh * c.G + rc - qi * c.G) * 4, 1).bitcast(
                fx.Float32) * LOG2E
            g, lse2 = with_sink(lse2, sink2)
            inv = inv * g
    o = fx.Vector(res[2]) * splat4(inv)
    live, base = c.ROWS, seq * c.QL
    if const_expr(ragged is not None):
        base, live = ragged
    if r < live:
        orow = (base + qi) * (num_kv_heads * c.G) + kvh * c.G + (rc - qi * c.G)
        buffer_store(o.to(c.QDT).bitcast(fx.Int32), o_rs, (orow * c.HD + d0) * 2)
        if const_expr(c.LSE):
            if d0 == 0:
                buffer_store(fx.Float32(lse2 * (1.0 / LOG2E)).bitcast(fx.Int32), rsrc(lse),
                             orow * 4)


# %% [markdown]
# The launchers: one per (head_dim, group, query_length, dtype) and layout of the partials, the
# uniform split's `[S, kvh, NP, rows]` or the work list's `[entries, kvh, rows]`.

# %% tags=["export"]
@functools.lru_cache(maxsize=None)
def build_reduce(head_dim, group, query_length, q_dtype="f16", balanced=False, sinks=False,
                 lse=False, ragged=False):
    """The ``@flyc.jit`` flash-combine ``launch(out, pmax, psum, pout, num_seqs, num_kv_heads,
    num_partitions, sinks, lse)`` for one (head_dim, group, query_length, query dtype):
    partials ``pmax``/``psum`` [S, kvh, NP, rows], ``pout`` [S, kvh, NP, rows, head_dim]
    (float32) -> ``out`` [S·query_length, kvh·group, head_dim] (f16/bf16) = ``Σ w·o / Σ w``,
    ``w = ℓ·exp(m - max m)`` (live partitions; 0 where ℓ = 0, ``out`` 0 if Σ w = 0).
    ``balanced``: a work list's partials [entries, kvh, rows(, head_dim)], ``launch(out, pmax,
    psum, pout, offsets, num_seqs, num_kv_heads, sinks, lse)``: sequence s merges entries
    ``offsets[s] .. offsets[s+1]``. ``sinks``/``lse`` (chapter 08): read/written only when their
    flag is set (else any tensor). ``ragged``: the rows of ``query_start_loc``, a last argument
    (``build_ragged_reduce``)."""
    c = reduce_geometry(head_dim, group, query_length, q_dtype, sinks, lse)
    if ragged:
        return build_ragged_reduce(c, balanced)
    return listed_reduce(c) if balanced else uniform_reduce(c)


# %% tags=["export"]
def uniform_reduce(c):
    """``build_reduce``'s launcher for a uniform split's partials."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                     num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor,
                     lse: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: 0,
                           lambda seq: num_partitions,
                           lambda seq, kvh: (seq * num_kv_heads + kvh) * num_partitions * ROWS,
                           ROWS, sinks, lse)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32,
               num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor, lse: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6(out, pmax, psum, pout, num_kv_heads, num_partitions, sinks, lse).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch


# %% tags=["export"]
def listed_reduce(c):
    """``build_reduce``'s launcher for a work list's partials (sequence s: ``offsets[s] ..
    offsets[s+1]``)."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                            offsets: fx.Tensor, num_kv_heads: fx.Int32, sinks: fx.Tensor,
                            lse: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads,
                           lambda seq: scalar_load(offsets, seq),
                           lambda seq: scalar_load(offsets, seq + 1),
                           lambda seq, kvh: kvh * ROWS, num_kv_heads * ROWS, sinks, lse)

    @flyc.jit
    def launch_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                      offsets: fx.Tensor, num_seqs: fx.Int32, num_kv_heads: fx.Int32,
                      sinks: fx.Tensor, lse: fx.Tensor, stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_listed(out, pmax, psum, pout, offsets, num_kv_heads, sinks, lse).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch_listed


# %% [markdown]
# Ragged query rows (chapter 08) are a specialization of their own: the same launches with
# `query_start_loc` last, so the uniform reduce's code does not change.

# %% tags=["export"]
def build_ragged_reduce(c, balanced):
    """``build_reduce`` for ragged query rows: sequence s writes ``out`` rows ``loc[s] ..
    loc[s+1]`` (``c.QL`` is their bound); ``query_start_loc`` after the sinks and lse places."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z
    if balanced:
        return listed_ragged_reduce(c)

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_ragged(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                            num_kv_heads: fx.Int32, num_partitions: fx.Int32, sinks: fx.Tensor,
                            lse: fx.Tensor, query_start_loc: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads, lambda seq: 0,
                           lambda seq: num_partitions,
                           lambda seq, kvh: (seq * num_kv_heads + kvh) * num_partitions * ROWS,
                           ROWS, sinks, lse, query_start_loc)

    @flyc.jit
    def launch(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
               num_seqs: fx.Int32, num_kv_heads: fx.Int32, num_partitions: fx.Int32,
               sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor,
               stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_ragged(out, pmax, psum, pout, num_kv_heads, num_partitions, sinks, lse,
                            query_start_loc).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch


# %% tags=["export"]
def listed_ragged_reduce(c):
    """``build_ragged_reduce`` for a work list's partials."""
    ROWS, GRID_Z = c.ROWS, c.GRID_Z

    @flyc.kernel(known_block_size=(REDUCE_THREADS, 1, 1))
    def pa_reduce_s6_listed_ragged(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor,
                                   pout: fx.Tensor, offsets: fx.Tensor, num_kv_heads: fx.Int32,
                                   sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor):
        combine_partitions(c, out, pmax, psum, pout, num_kv_heads,
                           lambda seq: scalar_load(offsets, seq),
                           lambda seq: scalar_load(offsets, seq + 1),
                           lambda seq, kvh: kvh * ROWS, num_kv_heads * ROWS, sinks, lse,
                           query_start_loc)

    @flyc.jit
    def launch_listed(out: fx.Tensor, pmax: fx.Tensor, psum: fx.Tensor, pout: fx.Tensor,
                      offsets: fx.Tensor, num_seqs: fx.Int32, num_kv_heads: fx.Int32,
                      sinks: fx.Tensor, lse: fx.Tensor, query_start_loc: fx.Tensor,
                      stream: fx.Stream = fx.Stream(None)):
        pa_reduce_s6_listed_ragged(out, pmax, psum, pout, offsets, num_kv_heads, sinks, lse,
                                   query_start_loc).launch(
            grid=(num_seqs, num_kv_heads, GRID_Z), block=(REDUCE_THREADS, 1, 1), stream=stream)

    return launch_listed

# %% [markdown]
# The reduce on its own, on synthetic partials with the corner cases planted (gfx942 and gfx950,
# emulated): partition 1 of (seq 0, KV head 0) empty for every row, every partition empty for one
# row, and ordinary rows. It must agree with the torch model to the query dtype's rounding, with no NaN.

# %% tags=["nbval-ignore-output"]
print("backend:", backend.ensure_backend())  # "gpu" on a ROCm machine, else "emu"
DEV = backend.device_for_tensors()

# %% tags=["nbval-ignore-output"]
from pa_tile import launching  # noqa: E402


def synthetic_partials(S, kvh, NP, rows, hd, seed=0):
    g = torch.Generator().manual_seed(seed)
    pmax = torch.randn(S, kvh, NP, rows, generator=g) * 4
    psum = torch.rand(S, kvh, NP, rows, generator=g) * 50 + 1
    pout = torch.randn(S, kvh, NP, rows, hd, generator=g)
    # an empty partition; an all-empty row
    for sel in ((0, 0, NP - 1), (S - 1, kvh - 1, slice(None), rows - 1)):
        pmax[sel], psum[sel], pout[sel] = -6.9e29, 0.0, 0.0
    return pmax, psum, pout


def run_reduce(arch, pmax, psum, pout, ql, g, qdt):
    S, kvh, NP, rows, hd = pout.shape
    out = torch.full((S * ql, kvh * g, hd), float("nan"), dtype=qdt, device=DEV)
    launcher = build_reduce(hd, g, ql, "bf16" if qdt == torch.bfloat16 else "f16")
    pm = pmax.to(DEV)
    # the sinks' and log-sum-exp's places take any tensor: this reduce reads neither
    launching.launch(launcher, (out, pm, psum.to(DEV), pout.to(DEV), S, kvh, NP, pm, pm), arch=arch)
    return out.cpu()


rrows = []
for arch in backend.runnable_archs():
    for (S, kvh, NP, ql, g, hd, qdt) in ((2, 2, 3, 2, 5, 64, torch.float16), (1, 3, 7, 4, 8, 128,
                                                                              torch.bfloat16),
                                         (2, 1, 1, 1, 4, 256, torch.float16)):
        pm, ps, po = synthetic_partials(S, kvh, NP, ql * g, hd)
        out = run_reduce(arch, pm, ps, po, ql, g, qdt).float()
        want = combine_torch(pm, ps, po, ql, g)
        err = (out - want).abs().max().item()
        rrows.append(dict(arch=arch, seqs=S, kv_heads=kvh, partitions=NP, query_len=ql, group=g,
                          head_dim=hd,
                          dtype=str(qdt)[6:], max_err=f"{err:.1e}",
                          finite=bool(torch.isfinite(out).all()),
                          empty_row_0=bool((out[-1, -1] == 0).all())))
print(format_table(rrows, headers=dict(kv_heads="kvh", partitions="P", query_len="ql",
                                       head_dim="hd",
                                       empty_row_0="empty row 0")))
assert all(r["finite"] and r["empty_row_0"] and float(r["max_err"]) < 2**-7 * 8 for r in rrows)

# %% [markdown]
# ## How many partitions?
#
# More partitions fill more CUs, and each costs something: the kernel's prologue and merge across
# waves again, and `rows × (head_dim + 2)` floats of partials that the reduce reads back, bytes
# the unsplit kernel never moves.
#
# The **default** looks the shape up in a table of the timing model's choices
# (`pa_tile/data/partition_table.json`: per GPU part, configuration and (sequences × KV heads,
# tiles) point, the count `pa_tile.perf.model` predicts fastest), then lowers it to the largest
# even split within a **traffic cap**: at most `TRAFFIC_CAP` times the call's compulsory bytes,
# since decode is memory-bound. The count comes from **shapes**: the block table's width ×
# `block_size` is the most tokens any sequence can have. Reading `context_lengths` would
# synchronize with the GPU and break graph capture; a shorter sequence leaves its last partitions
# empty, which the reduce handles.
#
# How the table is made, what the model predicts against the partition count, where the model and
# the bytes disagree, and the rule of thumb below (`policy="budget"`): the appendix
# [Choosing the split](appendix_split_k_choices.ipynb). The rule aims for 4 workgroups per CU, gives a
# partition at least 2 tiles, keeps the partials under 3 % of the K and V bytes, and rounds so the longest
# sequence's tiles split evenly.

# %% tags=["export"]
def choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128,
                                 group=8,
                                 query_length=1, cu_count=None):
    """The rule of thumb (the default before the timing model chose): the split-K partition count.

    Aims for ``WORKGROUPS_PER_CU × cu_count`` workgroups of the partial kernel while giving every
    partition at least ``MIN_TILES_PER_PARTITION`` 256-token tiles and keeping the partials'
    bytes under ``PARTIAL_BYTES_BUDGET`` of the K/V bytes, then rounds so the longest
    sequence's tiles split evenly (no trailing empty partition). ``cu_count``: the device's
    (``pa_tile.backend.cu_count``); None takes the flagship part of ``arch`` (``pa_tile.arch``).
    """
    if cu_count is None:
        cu_count = _arch.info(arch).cu_count
    m_groups = s5.plan(head_dim, group, query_length)[3]
    base = max(1, num_seqs * num_kv_heads * m_groups)
    tiles = max(1, -(-max_context // TILE))
    want = -(-WORKGROUPS_PER_CU * cu_count // base)
    cap = max(1, tiles // MIN_TILES_PER_PARTITION)
    # each partition writes rows × (head_dim + 2) floats per KV head that the reduce reads back;
    # the KV head's K and V are 2 × 256 × head_dim fp8 bytes per tile
    rows = group * query_length
    budget = int(PARTIAL_BYTES_BUDGET * tiles * 2 * TILE * head_dim // (rows * (head_dim + 2) * 4))
    parts = max(1, min(want, cap, budget, MAX_PARTITIONS))
    per = -(-tiles // parts)
    return -(-tiles // per)


# %% [markdown]
# The policies: `"model"` (the default: the table within the traffic cap), `"fastest"` (the table
# uncapped) and `"budget"` (the rule above).

# %% tags=["export"]
#: how ``choose_num_partitions`` decides by default: "model" (the timing model's table, capped
#: at :data:`TRAFFIC_CAP`), "fastest" (the table uncapped) or "budget" (the rule of thumb above)
DEFAULT_POLICY = "model"
#: the "model" policy's split may load at most this many times the call's compulsory bytes
#: (``pa_tile.perf.tracing.compulsory_bytes``; issue #12: decode is memory-bound, bytes are the
#: metric)
TRAFFIC_CAP = 1.05
#: the first-principles extra bytes of a split (:func:`split_extra_bytes`) times this bound what
#: the emulator measures a split loading beyond the unsplit call (query and page-id re-reads at
#: partition edges): ``tests/test_traffic.py`` checks it
SPLIT_EXTRA_MARGIN = 1.25


@functools.lru_cache(maxsize=None)
def partition_table():
    """``pa_tile/data/partition_table.json``: the partition count the timing model
    (``pa_tile.perf.model``) predicts fastest, per configuration and (sequences × KV heads, tiles)
    grid point; written by ``scripts/partition_table.py``. MODEL PREDICTIONS, not measurements."""
    import importlib.resources
    import json

    return json.loads((importlib.resources.files(
        "pa_tile") / "data" / "partition_table.json").read_text())


def _nearest(values, x):
    """Index of the value nearest to ``x`` on a log scale."""
    lx = math.log(max(x, 1e-9))
    return min(range(len(values)), key=lambda i: abs(math.log(values[i]) - lx))

# %% [markdown]
# The traffic cap in bytes. What a split adds is known from first principles: each partition after
# the first re-reads its KV head's query rows, and the reduce reads every partition's partials
# back. The cap compares that (with `SPLIT_EXTRA_MARGIN` for what the emulator measures on top) with
# the unsplit call's compulsory bytes.

# %% tags=["export"]
def split_extra_bytes(num_seqs, num_kv_heads, head_dim, group, query_length, num_partitions,
                      query_bytes=2):
    """Bytes a split into ``num_partitions`` loads beyond the unsplit call, from first principles:
    every partition after the first re-reads its KV head's query rows, and the reduce reads each
    partition's float32 partials back (``rows × (head_dim + 2)``: output, max, sum)."""
    if num_partitions <= 1:
        return 0
    rows = group * query_length
    per_head = (num_partitions
                - 1) * rows * head_dim * query_bytes + num_partitions * rows * (head_dim + 2) * 4
    return num_seqs * num_kv_heads * per_head


@functools.lru_cache(maxsize=1024)  # one shape's bytes, asked once per candidate split
def _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group, query_length,
                              block_size,
                              per_token, query_bytes):
    """``pa_tile.perf.tracing.compulsory_bytes`` with every sequence at ``max_context``."""
    from pa_tile.perf.roofline import DecodeShape
    from pa_tile.perf.tracing import compulsory_bytes

    return compulsory_bytes(DecodeShape(
        batch=num_seqs, context=max(1, max_context), num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, query_length=query_length,
        scales="per-token" if per_token else "per-tensor", query_bytes=query_bytes))


def within_traffic_cap(num_seqs, num_kv_heads, max_context, num_partitions, *, head_dim=128,
                       group=8,
                       query_length=1, block_size=16, per_token=False, query_bytes=2):
    """Whether a split of ``num_partitions`` keeps the call at or under :data:`TRAFFIC_CAP` x its
    compulsory bytes: the unsplit call taken at its compulsory bytes (every sequence at
    ``max_context``), plus :data:`SPLIT_EXTRA_MARGIN` x :func:`split_extra_bytes`."""
    extra = SPLIT_EXTRA_MARGIN * split_extra_bytes(num_seqs, num_kv_heads, head_dim, group,
                                                   query_length,
                                                   num_partitions, query_bytes)
    need = _uniform_compulsory_bytes(num_seqs, num_kv_heads, max_context, head_dim, group,
                                     query_length,
                                     block_size, per_token, query_bytes)
    return extra <= (TRAFFIC_CAP - 1.0) * need

# %% [markdown]
# The table lookup: the tabled GPU part nearest in CU count (bandwidth per CU differs between
# parts, so an 80-CU part is not a 304-CU part with more sequences), the sampled configuration
# nearest in head_dim and query rows, and the grid point nearest in work; its tiles per partition,
# rounded so this context's tiles split evenly.

# %% tags=["export"]
def tabled_split(num_seqs, num_kv_heads, tiles, *, arch, head_dim, group, query_length, cu_count):
    """The timing model's split of ``tiles`` 256-token tiles, from :func:`partition_table`:
    ``(partitions, tiles per partition)``. The part tabled for ``arch`` whose CU count is nearest
    ``cu_count`` (MI300X 304 / MI308X 80 for gfx942, MI355X 256 for gfx950), the configuration
    sampled nearest to this one (nearest head_dim, then query rows ``group × query_length``, then
    query length), the grid point nearest on a log scale to ``num_seqs × num_kv_heads`` (scaled by
    the part's CU count over ``cu_count``, exact for a tabled part) and to ``tiles``; it keeps that
    point's tiles per partition, then rounds so the tiles split evenly."""
    table = partition_table()
    rows = group * query_length
    configs = [c for c in table["configs"] if c["arch"] == arch]
    part = min({c["cu_count"] for c in configs}, key=lambda n: abs(math.log2(n / max(1, cu_count))))
    configs = [c for c in configs if c["cu_count"] == part]
    c = min(configs, key=lambda c: (abs(math.log2(c["head_dim"] / head_dim)),
                                    abs(math.log2(c["group"] * c["query_length"] / rows)),
                                    abs(c["query_length"] - query_length)))
    i = _nearest(table["seq_heads"], num_seqs * num_kv_heads * c["cu_count"] / max(1, cu_count))
    j = _nearest(table["tiles"], tiles)
    per = -(-table["tiles"][j] // c["best"][i][j])  # the grid point's tiles per partition
    parts = max(1, min(-(-tiles // per), MAX_PARTITIONS))
    per = -(-tiles // parts)
    return -(-tiles // per), per

# %% [markdown]
# The chooser: the policy, the table's split, and (for the default policy) that split lowered to
# the largest even split whose bytes stay within the traffic cap.

# %% tags=["export"]
def choose_num_partitions(num_seqs, num_kv_heads, max_context, *, arch, head_dim=128, group=8,
                          query_length=1,
                          cu_count=None, policy=None, block_size=16, per_token=False,
                          query_bytes=2):
    """The split-K partition count for a problem shape (1 = no split, no reduce).

    ``policy`` (None: :data:`DEFAULT_POLICY`) ``"model"``: the timing model's choice, looked up in
    :func:`partition_table` (no emulator, no model at plan time; :func:`tabled_split` says how);
    then the largest even split not above it whose bytes stay within :data:`TRAFFIC_CAP`
    (:func:`within_traffic_cap`, which reads ``block_size``, ``per_token`` scales and
    ``query_bytes``). ``"fastest"``: the table's count uncapped (at small batches with many query
    rows the model predicts it up to ~1.5x faster, for up to ~1.6x the compulsory bytes: chapter
    07's appendix). ``"budget"``: :func:`choose_num_partitions_budget`, the earlier rule of thumb.
    ``cu_count``: the device's (``pa_tile.backend.cu_count``); None takes the flagship part of
    ``arch`` (``pa_tile.arch``).
    """
    policy = DEFAULT_POLICY if policy is None else policy
    if policy == "budget":
        return choose_num_partitions_budget(num_seqs, num_kv_heads, max_context, arch=arch,
                                            head_dim=head_dim,
                                            group=group, query_length=query_length,
                                            cu_count=cu_count)
    if policy not in ("model", "fastest"):
        raise ValueError(f"policy: expected 'model', 'fastest' or 'budget', got {policy!r}")
    if cu_count is None:
        cu_count = _arch.info(arch).cu_count
    _arch.check_arch(arch)
    tiles = max(1, -(-max_context // TILE))
    parts, per = tabled_split(num_seqs, num_kv_heads, tiles, arch=arch, head_dim=head_dim,
                              group=group,
                              query_length=query_length, cu_count=cu_count)
    if policy == "model":
        while parts > 1 and not within_traffic_cap(num_seqs, num_kv_heads, max_context, parts,
                                                   head_dim=head_dim,
                                                   group=group, query_length=query_length,
                                                   block_size=block_size,
                                                   per_token=per_token, query_bytes=query_bytes):
            per += 1
            parts = -(-tiles // per)  # the next smaller even split
    return parts

# %% [markdown]
# The default's choice for a few shapes (group 8, one query token, head_dim 128, pages of 16), and
# the workgroups per CU it launches:

# %%
SHAPES = ((1, 8, 32768), (4, 8, 32768), (16, 8, 32768), (64, 8, 4096), (256, 8, 32768), (3, 1,
                                                                                         1027))
choice = ["| sequences × KV heads | context | " + " | ".join(f"{g}: P (workgroups/CU)" for g in CUS)
          + " |",
          "|---|---|---|---|"]
picked = {}
for b, kvh, ctx in SHAPES:
    cells = []
    for gpu, arch in zip(CUS, ("gfx942", "gfx950")):
        picked[(b, kvh, ctx, gpu)] = P = choose_num_partitions(b, kvh, ctx, arch=arch)
        cells.append(f"{P} ({b * kvh * P / CUS[gpu]:.2f})")
    choice.append(f"| {b} × {kvh} | {ctx} | " + " | ".join(cells) + " |")
one = picked[(1, 8, 32768, "MI300X")]
show.md("\n".join(choice) + f"""

One 32k-token sequence over 8 KV heads splits {one} ways on MI300X: {8 * one} workgroups instead
of 8. At 256 sequences the batch fills the GPU and nothing splits.""")

# %% [markdown]
# ### What the split bought the seed kernel, measured
#
# Upstream's tile kernel, the seed these chapters retrace, made the same choice on hardware. Its
# commit messages quote what raising the partition count did (879c2e69), what production's
# split recommender did in its place (48b7b9c7), and a sweep of the count on one version of the
# kernel (2154f0cf, in a comment on its heuristic):

# %%
seed = seed_history.rows("879c2e69", "48b7b9c7", "2154f0cf")
fill = [r for r in seed if r["commit"] == "879c2e69"]
sweep = {r["shape"]: r for r in seed if r["commit"] == "2154f0cf"}
b1, b81 = sweep["b1 × 16k, d128, 8/1 heads"], sweep["b81 × 1027, d128, 8/1 heads"]
show.md(seed_history.markdown_table(seed, ("commit", "shape", "measured", "speedup")) + f"""

Filling idle CUs pays most at one sequence ({b1["measured"]}: {b1["speedup"]}), and raising the
count at high batch paid {min(r["speedup"] for r in fill)} to {max(r["speedup"] for r in fill)};
splitting a short context further than its tiles justify lost ({b81["measured"]} at 81 × 1027
tokens: {b81["speedup"]}). The traffic cap above keeps the default off that side.

{seed_history.attribution()}""")

# %% [markdown]
# ## Ragged batches: a balanced split
#
# The split above gives every sequence `P` partitions of its own tiles. A real decode batch is
# ragged: one 32k-token conversation beside seven 1k-token ones. The long sequence's workgroups walk
# many tiles each, the short ones' one or none, and the launch lasts as long as its busiest
# workgroup. Upstream's persistent kernel hands out 256-token work units evenly; here the same idea
# needs no new loop, only a **work list**. The batch's tiles are laid end to end and cut into chunks
# of `per = max(floor, ceil(total / (S·P)))` tiles, never across a sequence. Grid x is the list's
# entries, entry x says (sequence, first tile, end tile), and each entry writes one partial; the
# reduce merges sequence s's entries `offsets[s] .. offsets[s+1]`. `floor` keeps a chunk's extra
# bytes (its query re-read and its partials' round trip) within the traffic cap.
#
# Torch ops (cumsum, searchsorted) build the list on the device without reading a value on the
# host, and `S·(P + 1)` entries always suffice; entries past the last chunk are empty and read
# nothing but their entry.

# %% tags=["export"]
#: how a split lays its work out: "balanced" (a work list, "Ragged batches") or "uniform" (each
#: sequence in ``num_partitions`` equal ranges of its own tiles)
DEFAULT_SCHEDULE = "balanced"
SCHEDULES = ("balanced", "uniform")


def choose_schedule(num_partitions, schedule=None):
    """The layout of a call's work: ``schedule`` if given (``"balanced"`` also balances an
    unsplit call: a work list aiming at one chunk per sequence), else :data:`DEFAULT_SCHEDULE`
    for a split and ``"uniform"`` (chapter 06's kernel, no reduce) for an unsplit call, whose
    lengths the plan cannot read without a host sync: balancing a batch of short sequences
    would add a partial per sequence, past the traffic cap."""
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES} or None, got {schedule!r}")
    return schedule or (DEFAULT_SCHEDULE if num_partitions > 1 else "uniform")


def chunk_floor(head_dim, group, query_length, *, block_size=16, per_token=False, query_bytes=2):
    """The fewest 256-token tiles a balanced split's chunk gets: its extra bytes (one more query
    read and one more partial's round trip, :data:`SPLIT_EXTRA_MARGIN` x) at most
    ``TRAFFIC_CAP - 1`` of its tiles' compulsory bytes (and at least
    ``MIN_TILES_PER_PARTITION``)."""
    def compulsory(ctx):
        return _uniform_compulsory_bytes(1, 1, ctx, head_dim, group, query_length, block_size,
                                         per_token, query_bytes)

    per_tile = compulsory(2 * TILE) - compulsory(TILE)
    extra = SPLIT_EXTRA_MARGIN * (split_extra_bytes(1, 1, head_dim, group, query_length, 3,
                                                    query_bytes)
                                  - split_extra_bytes(1, 1, head_dim, group, query_length, 2,
                                                      query_bytes))
    return max(MIN_TILES_PER_PARTITION, math.ceil(extra / ((TRAFFIC_CAP - 1.0) * per_tile)))

# %% [markdown]
# The list's size is fixed by the shapes alone, so a plan allocates its buffers once and a run
# (or a captured graph's replay) allocates nothing.

# %% tags=["export"]
def work_entries(num_seqs, num_partitions):
    """Entries of a balanced work list aiming at ``num_seqs × num_partitions`` chunks: every
    sequence may add one short chunk, so ``num_seqs × (num_partitions + 1)`` always suffice."""
    return num_seqs * (num_partitions + 1)


def work_list_buffers(num_seqs, num_partitions, device):
    """The tensors :func:`work_list` computes in (a plan allocates them once, so a run allocates
    nothing and a captured graph replays the list's ops on its lengths)."""
    n = work_entries(num_seqs, num_partitions)
    per_seq = ("tiles", "first", "units", "chunks", "ends", "qlens", "has_rows")
    b = {k: torch.empty(num_seqs, dtype=torch.int64, device=device) for k in per_seq}
    b.update({k: torch.empty(n, dtype=torch.int64, device=device) for k in ("seq", "t0", "t1",
                                                                            "gathered")})
    b.update(per=torch.empty(1, dtype=torch.int64, device=device), x=torch.arange(n, device=device),
             live=torch.empty(n, dtype=torch.bool, device=device),
             work=torch.zeros(n, 4, dtype=torch.int32, device=device),
             offsets=torch.zeros(num_seqs + 1, dtype=torch.int32, device=device))
    return b

# %% tags=["export"]
def tiles_to_walk(b, context_lengths, query_length, sliding_window, query_start_loc=None):
    """Per sequence, into the work list's buffers ``b``: its 256-token ``tiles``, the ``first``
    one a sliding window lets any row see, and the ``units`` between (0 for a ragged sequence
    without queries: the kernel would load nothing)."""
    S = context_lengths.shape[0]
    tiles, first, units = b["tiles"], b["first"], b["units"]
    torch.add(context_lengths, TILE - 1, out=tiles).floor_divide_(TILE)
    if query_start_loc is not None:
        qn = torch.sub(query_start_loc.narrow(0, 1, S), query_start_loc.narrow(0, 0, S),
                       out=b["qlens"])
    if sliding_window > 0 and query_start_loc is not None:  # the sequence's own rows' windows
        torch.sub(context_lengths, qn, out=first).add_(1 - sliding_window).clamp_min_(
            0).floor_divide_(TILE)
    elif sliding_window > 0:  # as the kernel's tile_range: tiles wholly before every row's window
        torch.sub(context_lengths, query_length - 1 + sliding_window,
                  out=first).clamp_min_(0).floor_divide_(TILE)
    else:
        first.zero_()
    torch.sub(tiles, first, out=units).clamp_min_(0)
    if query_start_loc is not None:
        units.mul_(torch.clamp(qn, 0, 1, out=b["has_rows"]))


# %% [markdown]
# The list itself, in torch ops that write into those buffers: tiles per sequence (less those a
# sliding window skips), the chunk size, chunks per sequence and their running sum (the
# offsets), then each entry's sequence (a sorted search) and its first and end tile.

# %% tags=["export"]
def work_list(context_lengths, num_partitions, min_tiles, *, query_length=1, sliding_window=0,
              buffers=None, fixed_chunks=False, query_start_loc=None):
    """The balanced split of a batch, on ``context_lengths``' device without reading a value on
    the host: ``(work, offsets)``, ``work`` [``work_entries``, 4] int32 rows (sequence, first tile,
    end tile, 0), ``offsets`` [S + 1] int32 (sequence s owns entries
    ``offsets[s] .. offsets[s+1]``). Chunks of ``per = max(min_tiles, ceil(total /
    (S·num_partitions)))`` tiles, the tiles a sliding window skips left out. Every op writes
    into ``buffers`` (:func:`work_list_buffers`; None: allocated here), so with them given
    nothing is allocated. ``fixed_chunks``: ``per = min_tiles`` whatever the batch (batch
    invariance, chapter 08; ``num_partitions`` must then cover the longest sequence's chunks).
    ``query_start_loc`` (ragged rows): each sequence's own query count ``loc[s+1] - loc[s]``
    bounds its window's first tile, and a sequence without queries gets no chunk."""
    S = context_lengths.shape[0]
    b = buffers if buffers is not None else work_list_buffers(S, num_partitions,
                                                              context_lengths.device)
    tiles, first, units, chunks, ends, per = (b[k] for k in ("tiles", "first", "units", "chunks",
                                                             "ends", "per"))
    seq, t0, t1, g, x = (b[k] for k in ("seq", "t0", "t1", "gathered", "x"))
    tiles_to_walk(b, context_lengths, query_length, sliding_window, query_start_loc)
    target = S * num_partitions
    if fixed_chunks:
        per.fill_(min_tiles)
    else:
        torch.sum(units, 0, keepdim=True, out=per).add_(target - 1).floor_divide_(
            target).clamp_min_(min_tiles)
    torch.add(units, per, out=chunks).sub_(1).floor_divide_(per)
    torch.cumsum(chunks, 0, out=ends)
    torch.searchsorted(ends, x, right=True, out=seq).clamp_max_(S - 1)
    # gathers (index_select), not indexing: fake cuda tensors (pa_tile's CPU proofs) take them
    # t0 = first[seq] + (x - (ends[seq] - chunks[seq])) * per: the entry's place in its sequence
    torch.index_select(ends, 0, seq, out=t0).sub_(torch.index_select(chunks, 0, seq, out=g))
    torch.sub(x, t0, out=t0).mul_(per).add_(torch.index_select(first, 0, seq, out=g))
    torch.minimum(torch.add(t0, per, out=t1), torch.index_select(tiles, 0, seq, out=g), out=t1)
    # past the last chunk: empty
    torch.where(torch.lt(x, ends.narrow(0, S - 1, 1), out=b["live"]), t1, t0, out=t1)
    work, offsets = b["work"], b["offsets"]
    # add, not copy_: fake cuda tensors take an out= op, not copy_
    for col, v in enumerate((seq, t0, t1)):
        torch.add(v, 0, out=work.select(1, col))
    torch.add(ends, 0, out=offsets.narrow(0, 1, S))
    return work, offsets

# %% [markdown]
# One 32k-token conversation beside seven 1k-token ones, 8 KV heads: the split the chooser picks
# for the block table's width, laid out both ways. Each bar is one workgroup's tiles (per KV head).

# %%
RAGGED = [32768] + [1024] * 7
P_RAGGED = choose_num_partitions(len(RAGGED), 8, max(RAGGED), arch="gfx942")
work, offsets = work_list(torch.tensor(RAGGED, dtype=torch.int32), P_RAGGED, chunk_floor(128, 8, 1))
tiles = [-(-L // TILE) for L in RAGGED]
uniform = [[(z * -(-n // P_RAGGED), min((z + 1) * -(-n // P_RAGGED), n)) for z in range(P_RAGGED)]
           for n in tiles]
balanced = [[tuple(work[x, 1:3].tolist()) for x in range(offsets[s], offsets[s + 1])]
            for s in range(len(RAGGED))]
figures.work_layouts(tiles, {f"uniform, P = {P_RAGGED}": uniform,
                             f"balanced, chunks of {work[0, 2] - work[0, 1]} tiles": balanced})
plt.show()
busiest = {k: max(t1 - t0 for seq in lay for t0, t1 in seq) for k, lay in (("u", uniform),
                                                                           ("b", balanced))}
show.md(f"""The uniform split's busiest workgroup walks {busiest["u"]} tiles, the work list's
{busiest["b"]}: with the same partition count, the launch no longer waits on the long sequence.""")

# %% [markdown]
# A split call is balanced by default; an unsplit call stays the plain kernel, since whether a
# batch is ragged is in `context_lengths`, which the plan never reads on a GPU. A caller who knows
# its batches are ragged asks for `schedule="balanced"`. The plan builds the list into buffers it
# owns, once per decode step; `plan.refresh()` redoes it after the lengths change in place (a
# captured graph's next step).
#
# The other grid choice is the M-tiles per workgroup. The default keeps all of a KV head's M-tiles
# in one workgroup, so K and V are read once; `m_tiles=` caps them, and each extra M-group reads K
# and V again, past the traffic cap. The model's predictions for ragged batches and for `m_tiles`
# are in the appendix [Choosing the split](appendix_split_k_choices.ipynb).

# %% [markdown]
# ## The workspace
#
# The partials of `P > 1` partitions live in one float32 buffer: `pmax`, `psum` (`S·kvh·P·rows`
# each) and `pout` (`S·kvh·P·rows·head_dim`), carved out as views. When the caller passes it (and
# `out`), `paged_decode` allocates nothing: every launch argument is a view of a caller tensor, so
# the call can be captured in a CUDA/HIP graph and replayed. `make_workspace` sizes it from the same
# shapes the call will see, with the same heuristic, so the two agree.

# %% tags=["export"]
def workspace_size(num_seqs, num_kv_heads, group, query_length, head_dim, num_partitions,
                   schedule="uniform"):
    """float32 elements of the workspace for one problem shape, partition count and schedule
    (1 when ``num_partitions`` is 1: a placeholder the unsplit kernel never touches; a balanced
    split's partials are per work-list entry, ``work_entries`` of them)."""
    if num_partitions <= 1 and schedule != "balanced":
        return 1
    slots = work_entries(num_seqs,
                         num_partitions) if schedule == "balanced" else num_seqs * num_partitions
    return slots * num_kv_heads * group * query_length * (head_dim + 2)


def carve(workspace, num_seqs, num_kv_heads, rows, head_dim, num_partitions):
    """``(pmax, psum, pout)`` as views of a float32 ``workspace`` (see ``workspace_size``)."""
    shape = (num_seqs, num_kv_heads, num_partitions, rows)
    n = num_seqs * num_kv_heads * num_partitions * rows
    # narrow, not slicing: the same views, and fake cuda tensors (pa_tile's CPU proofs) support it
    return (workspace.narrow(0, 0, n).view(shape), workspace.narrow(0, n, n).view(shape),
            workspace.narrow(0, 2 * n, n * head_dim).view(shape + (head_dim,)))

# %% [markdown]
# ## The entry point
#
# `paged_decode` checks every argument before anything is compiled or launched (a `TypeError` for a
# wrong type, a `ValueError` for a wrong shape or value, each naming the argument), resolves the
# layout options from the tensors (plain or trans-blocked V from the rank, per-tensor or per-token
# scales from the shape, query length from the rows, f16/bf16 from the query), picks the partition
# count, and runs chapter 06's kernel once (writing `out` directly) or twice-over (partials, then the
# reduce). On a GPU both launches go to torch's current stream, which is what graph capture records.
# Values are checked only on the CPU (emulator), where it is free; on a GPU, reading
# `context_lengths` would synchronize.

# %% tags=["export"]
def make_workspace(query, key_cache, block_tables, *, query_length=None, num_partitions=None,
                   arch=None,
                   schedule=None):
    """A float32 workspace for ``paged_decode`` calls with these shapes (same validation,
    partition choice and schedule as the call: ``pa_tile.api.make_workspace``)."""
    from pa_tile import api

    return api.make_workspace(query, key_cache, block_tables, query_length=query_length,
                              num_partitions=num_partitions, arch=arch, schedule=schedule)


def launch_args(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                value_scale, **options):
    """``(launcher, (), arch)`` after validation: ``launcher()`` runs the partial kernel and, when
    split, the reduce; ``pa_tile.toolchain.compile_isa(launcher, arch=arch)`` returns both kernels'
    assembly (partial kernel first). Options as ``paged_decode``."""
    from pa_tile import api

    out = options.pop("out", None)
    pl = api.plan(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                  value_scale, **options)
    return pl.pipeline(query, key_cache, value_cache, out=out), (), pl.problem.arch


def paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                 value_scale, **options):
    """The finished kernel, ``pa_tile.paged_decode`` (``pa_tile.api``)."""
    from pa_tile import api

    return api.paged_decode(query, key_cache, value_cache, block_tables, context_lengths, key_scale,
                            value_scale,
                            **options)


# %% [markdown]
# ## Using it
#
# The finished kernel is `pa_tile.paged_decode` (this module's function, re-exported). Five lines,
# with the caches built by `pa_tile.cache` from a test case (in a real server they come from the
# KV-cache manager, already in these layouts):

# %% tags=["nbval-ignore-output"]
import pa_tile  # noqa: E402

arch = backend.default_arch()  # the GPU's, or the emulator's
case = cache.make_case(2, 16, 2, 128, 16, [300, 1027], fp8_format=fp8_format(arch), seed=5)
kv = dict(key_cache=case.k_blocked(), value_cache=case.v_trans_blocked())
out = pa_tile.paged_decode(case.query, **kv, block_tables=case.block_tables,
                           context_lengths=case.context_lengths,
                           key_scale=case.k_scale, value_scale=case.v_scale)
err = float((out.float().cpu() - case.reference().float().cpu()).abs().max())
print(tuple(out.shape), out.dtype, f"max |err| vs reference: {err:.4f}")

# %% [markdown]
# For graph capture, allocate `out` and the workspace once and pass them every step:
#
# ```python
# ws = pa_tile.make_workspace(query, key_cache, block_tables)
# out = torch.empty_like(query)
# g = torch.cuda.CUDAGraph()
# with torch.cuda.graph(g):
#     pa_tile.paged_decode(query, key_cache, value_cache, block_tables, context_lengths,
#                          key_scale, value_scale, out=out, workspace=ws)
# g.replay()  # after updating query / block_tables / context_lengths in place
# ```
#
# A wrong argument is named before anything is compiled:

# %%
import textwrap  # noqa: E402

for bad, fix in ((dict(block_tables=case.block_tables.long()), "int64 block table"),
                 (dict(workspace=torch.empty(10, device=case.query.device)),
                  "workspace too small for the split"),
                 (dict(num_partitions=0), "no partitions")):
    kw = dict(key_cache=case.k_blocked(), value_cache=case.v_trans_blocked(),
              block_tables=case.block_tables,
              context_lengths=case.context_lengths, key_scale=case.k_scale,
              value_scale=case.v_scale)
    kw.update(bad)
    P = kw.pop("num_partitions", 2)
    try:
        pa_tile.paged_decode(case.query, **kw, num_partitions=P)
    except (TypeError, ValueError) as e:
        print(textwrap.fill(f"{fix} -> {type(e).__name__}: {e}", 100, subsequent_indent="    "))

# %% [markdown]
# ## Does it work? The full feature matrix
#
# Every option of the finished kernel, on the emulated gfx942 and gfx950 code, against the float32
# reference: block 16/32/64/128, head_dim 64/128 (256: see below), query_length 1–8, groups 1–128
# (at most 128 rows), per-tensor and per-token scales, f16/bf16, trans-blocked and plain V, a
# sliding window, a strided query, and
# the split chosen by default (`P`: the timing model's table) or forced. The contexts are the ragged set (1, 17, 256, 1027;
# raised to `query_length`) with shuffled pages and `-1` in unused block-table entries; with
# 1027 tokens (5 tiles) a split of 3 leaves the 17-token sequence two empty partitions and the
# 1-token one two as well. Checked as in chapters 02 and 05: every element within the fp8 bound
# (`case.error_bound()`, which a split keeps: float32 partials, one float32 combine).

# %%
def make(arch, bs, hd, g, ql, scales="per-tensor", qdt=torch.float16,
         contexts=cache.RAGGED_CONTEXTS, kvh=1, seed=1,
         device=None):
    """A case on ``device`` (default: where kernels run here; "cpu" for compile-only cells)."""
    ctx = [max(c, ql) for c in contexts]
    return cache.make_case(len(ctx), g * kvh, kvh, hd, bs, ctx, query_length=ql,
                           fp8_format=fp8_format(arch),
                           scales=scales, query_dtype=qdt, seed=seed, pad_block_id=-1,
                           device=device)


def inputs(case, trans_v=True, strided=False):
    q = case.query
    if strided:  # rows and heads strided: a view into a wider buffer
        wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 32, dtype=q.dtype, device=q.device)
        wide[:, :, : q.shape[2]] = q
        q = wide[:, :, : q.shape[2]]
    v = case.v_trans_blocked() if trans_v else case.v_plain()
    return (q, case.k_blocked(), v, case.block_tables, case.context_lengths, case.k_scale,
            case.v_scale)

# %% tags=["nbval-ignore-output"]
# block, head_dim, group, query_length, scales, query dtype, trans V, window, strided, partitions
MATRIX = [
    (16, 128, 8, 1, "per-tensor", torch.float16, True, 0, False, None),
    (64, 128, 16, 1, "per-token", torch.bfloat16, True, 0, True, 3),
    (16, 64, 32, 3, "per-token", torch.float16, False, 0, False, None),
    (64, 64, 4, 4, "per-tensor", torch.bfloat16, True, 300, False, 5),
    (16, 128, 5, 2, "per-tensor", torch.float16, False, 100, True, 2),
    (64, 64, 1, 1, "per-tensor", torch.float16, True, 0, False, 1),
    (32, 128, 48, 1, "per-token", torch.bfloat16, True, 0, False, None),
    (128, 64, 8, 8, "per-tensor", torch.float16, False, 200, False, 2),
]
rows = []
for arch in backend.runnable_archs():
    for bs, hd, g, ql, sc, qdt, tv, w, strided, P in tqdm(MATRIX, desc=f"run {arch}"):
        case = make(arch, bs, hd, g, ql, sc, qdt)
        args = inputs(case, tv, strided)
        used = P or choose_num_partitions(len(cache.RAGGED_CONTEXTS), 1, args[3].shape[1] * bs,
                                          arch=arch,
                                          head_dim=hd, group=g, query_length=ql, block_size=bs,
                                          per_token=sc == "per-token")
        out = pa_tile.paged_decode(*args, sliding_window=w, num_partitions=P, arch=arch).cpu()
        ok, of_bound, mean_err = case.check(out, sliding_window=w)
        rows.append(dict(arch=arch, bs=bs, hd=hd, g=g, ql=ql, scales=sc[4:],
                         q=str(qdt)[6:].replace("float", "f"),
                         v="trans" if tv else "plain", window=w, strided="yes" if strided else "",
                         P=f"{used}{'' if P else ' (auto)'}", of_bound=round(of_bound, 2),
                         mean_err=f"{mean_err:.4f}", ok=ok))
print(format_table(rows, headers=dict(of_bound="of bound", mean_err="mean err")))
assert all(r["ok"] for r in rows)

# %% [markdown]
# Splitting must not change the answer beyond rounding: the same problem with 1, 2 and 5 partitions
# (5 = one tile each for the 1027-token sequence). The partial outputs are rounded to float32, not
# to the query dtype, so the split results differ from the unsplit one by at most a few f16 ulps.

# %% tags=["nbval-ignore-output"]
arch = backend.runnable_archs()[-1]  # gfx950 on the emulator, the device's own on a GPU
case = make(arch, 16, 128, 8, 2, "per-token")
outs = {P: pa_tile.paged_decode(*inputs(case), num_partitions=P, arch=arch).float().cpu()
        for P in (1, 2, 5)}
for P in (2, 5):
    print(f"P={P}: max |out - out(P=1)| = {float((outs[P] - outs[1]).abs().max()):.2e}")
    assert torch.allclose(outs[P], outs[1], atol=2e-2, rtol=2**-8)

# %% [markdown]
# ## head_dim 256
#
# Chapter 06's kernel takes any multiple of 64 channels (`head_dim/64` K chunks per lane,
# `head_dim/16` output chunks, a quarter of them per wave), and the reduce above handles 256 (64
# lanes per row). What 256 costs, measured on the compiled code (gfx942, block 16, bf16, one
# M-tile):

# %%
def stats_for(arch, bs, hd, g, ql, scales="per-tensor", P=1, which=0):
    # compile only
    case = make(arch, bs, hd, g, ql, scales, torch.bfloat16, contexts=[20], device="cpu")
    pipe, a, arch = launch_args(*inputs(case), num_partitions=P, arch=arch)
    text = toolchain.compile_isa(pipe, *a, arch=arch)
    return isa.IsaStats.from_asm(text, kernel=which)


supports_256 = 256 in s5.LIMITS.head_dims
print("chapter 06's kernel accepts head_dim 256:", supports_256)
r256 = []
if supports_256:
    for hd in (128, 256):
        for sc in ("per-tensor", "per-token"):
            st = stats_for("gfx942", 16, hd, 8, 1, sc)
            r256.append(dict(head_dim=hd, scales=sc, vgpr=st.vgpr_unified, agpr=st.agpr,
                             spills=st.vgpr_spill,
                             scratch=st.scratch_bytes, lds=st.lds_bytes,
                             waves_per_simd=isa.occupancy(st, "gfx942").waves_per_simd))
    print(format_table(r256))

# %%
by = {(r["head_dim"], r["scales"]): r for r in r256}
a, b = by[(128, "per-tensor")], by[(256, "per-tensor")]
at, bt = by[(128, "per-token")], by[(256, "per-token")]
staged = {hd: s5.Spec("gfx942", 16, hd, 8, 1, "bf16", False, True, 0, 1, None).SHARED_BYTES
          for hd in (128, 256)}
assert b["lds"] - a["lds"] == staged[256] - staged[128]  # what grows in LDS is the staged query
show.md(f"""head_dim 256 costs {b["vgpr"] - a["vgpr"]} more VGPRs than 128 ({a["vgpr"]} →
{b["vgpr"]}; per-token scales {at["vgpr"]} → {bt["vgpr"]}): each wave's quarter of the output
and the K and V words a lane holds per tile grow with head_dim. Occupancy goes from
{a["waves_per_simd"]:g} to {b["waves_per_simd"]:g} waves per SIMD with per-tensor scales
(per-token: {at["waves_per_simd"]:g} → {bt["waves_per_simd"]:g}). LDS grows by
{b["lds"] - a["lds"]:,} B, exactly the staged query's 16 rows of 128 more channels; nothing
spills ({max(r["spills"] + r["scratch"] for r in r256)} B of scratch), and the emulator matches
the reference at 256 (`tests/test_stage5.py`; the reduce: `tests/test_stage6.py`).""")

# %% [markdown]
# ## Registers and occupancy against the upstream kernel
#
# The finished kernel is chapter 06's partial kernel (specialized per split) plus the reduce. The
# recorded figures of FlyDSL's `pa_decode_tile` (`pa_tile/data/upstream_pa_decode_tile_isa.md`,
# read by `pa_tile.upstream`; the 64 head_dim 64/128 configurations, both archs, one partition)
# next to this kernel's **split** specialization (`P = 4`, what a small batch runs;
# `tests/test_stage5.py` checks `P = 1` against the same figures): each configuration's margin.

# %%
from pa_tile import upstream  # noqa: E402

UPSTREAM = {  # (arch, block, head_dim, query_length, group, per_token) -> (VGPR+AGPR, waves/SIMD)
    (r["arch"], r["block"], r["head_dim"], r["query_len"], r["group"], r["per_token"]): (r["vgpr"],
                                                                                         r["occ"])
    for r in upstream.tile_isa_figures() if r["head_dim"] <= 128
}

up_rows = []
for (arch, bs, hd, ql, g, tok), (uv, uo) in tqdm(sorted(UPSTREAM.items()), desc="compile"):
    st = stats_for(arch, bs, hd, g, ql, "per-token" if tok else "per-tensor", P=4)
    occ = isa.occupancy(st, arch).waves_per_simd
    up_rows.append(dict(arch=arch, block=bs, head_dim=hd, query_len=ql, group=g, scales="token"
                        if tok else "tensor",
                        vgpr=st.vgpr_unified, upstream=uv, waves=occ, upstream_waves=uo,
                        spill=st.vgpr_spill + st.scratch_bytes,
                        meets="yes" if st.vgpr_unified <= uv and occ >= uo else "NO"))
figures.upstream_margins(up_rows, [("VGPR+AGPR", "vgpr", "upstream", False),
                                   ("waves/SIMD", "waves", "upstream_waves", True)],
                         color="arch", marker="scales",
                         title="The split kernel (P = 4) against upstream's pa_decode_tile: "
                               "each configuration's margin")
plt.show()
print(sum(r["meets"] == "yes" for r in up_rows), "of", len(up_rows), "meet or beat upstream;",
      "spills/scratch anywhere:", any(r["spill"] for r in up_rows))
print(f"upstream: ROCm/FlyDSL {upstream.UPSTREAM_COMMIT[:8]}, "
      f"compiled here with flydsl {upstream.FLYDSL_VERSION}")

# %% [markdown]
# The split adds only the partial stores after the loop, so these figures follow chapter 06's
# (`tests/test_stage5.py` pins the unsplit ones). The reduce is small enough never to limit
# occupancy:

# %%
st_red = stats_for("gfx942", 16, 128, 8, 1, P=4, which=1)
red_loop = max(st_red.loops, key=lambda lp: lp.n_instructions).n_instructions
print(f"{st_red.kernel} (gfx942): {st_red.vgpr_unified} VGPRs, {st_red.sgpr} SGPRs, "
      f"LDS {st_red.lds_bytes} B, scratch {st_red.scratch_bytes} B")
red_waves = isa.occupancy(st_red, "gfx942").waves_per_simd
print(f"{red_waves:g} waves per SIMD; {st_red.n_instructions} instructions, main loop {red_loop}")

# %% [markdown]
# ## What the split adds to the compiled code
#
# Same problem (gfx942, block 16, head_dim 128, group 8, one query token, bf16, per-tensor): the
# unsplit kernel against the `P = 4` specialization, the rows that changed.

# %%
st_p1, st_p4 = stats_for("gfx942", 16, 128, 8, 1, P=1), stats_for("gfx942", 16, 128, 8, 1, P=4)
print(isa.diff(st_p1, st_p4, labels=("unsplit (P=1)", "split (P=4)"), mnemonics=False,
               compact=True))

# %%
loop1, loop4 = (max(s.loops, key=lambda lp: lp.n_instructions).n_instructions for s in (st_p1,
                                                                                        st_p4))
fam = {f: st_p4.families.get(f, 0) - st_p1.families.get(f, 0) for f in ("salu", "valu")}
show.md(f"""The main loop is the same {loop1} instructions either way ({loop4} split). Outside
it the split computes its tile range (scalar work: {fam["salu"]:+d} SALU) and writes float32
partials: a `buffer_store_dwordx4` of 4 float channels where the unsplit kernel stores 4 halves
with a `dwordx2`, with no conversion to the query dtype ({fam["valu"]:+d} VALU), and the two
stats (`buffer_store_dword`).""")

# %% [markdown]
# ## Memory traffic of a split
#
# One sequence of 512 tokens (two tiles), block 16, head_dim 128, group 8, one query token,
# per-tensor scales, `P = 2`: each partition walks one tile and writes its partials, then the
# reduce reads them. The emulator traces the two launches separately (gfx942): before, in and after
# each kernel's loop, one row per kind of access, its figures per execution.

# %% tags=["nbval-ignore-output"]
from pa_tile.emu import launch as emu_launch  # noqa: E402
from pa_tile.emu.memory import Trace  # noqa: E402

case = make("gfx942", 16, 128, 8, 1, contexts=[512], device="cpu")
pipe, _, arch = launch_args(*inputs(case), num_partitions=2, arch="gfx942")
steps = pipe.steps if backend.current_backend() == "emu" else ()
COLS = {"phase": "phase", "mnemonic": "mnemonic", "executions": "execs", "bytes_per_exec": "B/exec",
        "lines_128B_per_exec": "128B lines/exec", "max_degree": "LDS way",
        "conflict_cycles": "LDS cycles"}
traced = []
for launcher, largs in steps:
    trace = Trace("gfx942")
    with (emu_launch.record_launches() as launched, emu_launch.launch_options(trace=trace),
          toolchain.target_arch(arch)):
        launcher(*largs)
    phases = isa.loop_phases(launched[0].asm, kernel=launched[0].kernel)
    traced.append(trace.grouped_summary(phases=phases, merge_scalar=True))
print("partial kernel (2 workgroups, one tile each)" if steps else
      "ran on the GPU: memory traces are recorded only by the emulator (PA_TILE_BACKEND=emu)")
if traced:
    print(format_table(traced[0], list(COLS), headers=COLS))

# %% tags=["nbval-ignore-output"]
print("reduce" if traced else "ran on the GPU: no trace")
if traced:
    print(format_table(traced[1], list(COLS), headers=COLS))

# %%
ROWS8, HD = 8, 128
show.md(f"""The partial kernel reads each K and V byte of its tile once, in
`buffer_load_dwordx4`s of 1,024 bytes a wave. The split costs, per partition, `rows × head_dim`
floats of partial output ({ROWS8 * HD * 4:,} B for these {ROWS8} rows) and 8 bytes of stats per
row, written once and read back once by the reduce, against {2 * TILE * HD:,} B of K and V in
the tile.""")

# %% [markdown]
# ## The finished kernel on one screen
#
# Every piece of chapters 01 to 07, as the default call runs it (head_dim 128, group 8, one query
# token: one 16-row M-tile; the LDS regions drawn to scale from the kernel's own layout, the total
# from the compiled code):

# %%
spec = s5.Spec("gfx942", 16, 128, 8, 1, "bf16", False, True, 0, 4, None)
# per-tensor: no scales
NAMES = {"stats": "row max / sum", "shared": "staged query", "pslab": "P slab"}
regions = {NAMES[f.name]: f.type_spec.__dsl_size_of__()
           for f in s5.lds_layout(spec).__dsl_field_defs__
           if f.name in NAMES}
st_map = stats_for("gfx942", 16, 128, 8, 1, "per-tensor", P=4)
assert sum(regions.values()) == st_map.lds_bytes
figures.kernel_map(head_dim=128, group=8, waves=s5.WAVES, wave_lanes=s5.WAVE, tile_tokens=TILE,
                   lds_regions=regions, lds_bytes=st_map.lds_bytes, reduce_group=REDUCE_GROUP,
                   reduce_threads=REDUCE_THREADS)
plt.show()

# %% [markdown]
# ## What you built
#
# ```text
# paged_decode(q, k_blocked, v_trans_blocked, block_tables, lengths, k_scale, v_scale):
#   plan, from shapes only: P = table[GPU, shape], lowered to fit 1.05x the compulsory bytes
#        work = work_list(lengths, P)            # (seq, t0, t1): chunks of the batch's tiles
#   partial kernel, grid (entries, kv_heads x m_groups), 4 waves x 64 lanes each:
#     seq, t0, t1 = work[x]; stage the group's query rows (fp8) in LDS
#     m, l, O = -inf, 0, 0                       # per row; O: this wave's head_dim / 4 channels
#     for t in t0 .. t1-1:                       # 256-token tiles; page ids a tile ahead
#       K: dwordx4 loads of this wave's 64 tokens (blocked K); V issued beside K
#       S = mfma(K, Q^T) * scale * log2(e)       # turned around: tokens x query rows
#       mask only a boundary tile (context end, sliding window, MTP causal)
#       m_new = max(m, row max of S over all 4 waves)        # max table in LDS
#       P = fp8(exp2(S - m_new)); P -> LDS slab
#       O = O * exp2(m - m_new) + mfma(V[my channels], P of all 4 waves)
#       l = l * exp2(m - m_new) + row sum of P; m = m_new
#     l summed over the waves (LDS); write partials (m, l, O / l), or out = O / l unsplit
#   reduce kernel, grid (seqs, kv_heads, row groups), 256 threads, 4 channels a lane:
#     M, W, acc = -inf, 0, 0
#     for each group of 4 partitions of my row:    # 12 loads issued, one wait
#       M2 = max(M, live m_z); W, acc *= exp(M - M2); M = M2
#       W += l_z exp(m_z - M); acc += l_z exp(m_z - M) o_z   # l_z = 0: adds nothing
#     out = acc / W  (0 if W == 0)
# ```

# %%
occ = {k: isa.occupancy(s, "gfx942").waves_per_simd for k, s in (("map", st_map), ("red", st_red))}
show.measured({"split kernel (gfx942, head_dim 128, group 8): VGPRs, waves/SIMD":
               f"{st_map.vgpr_unified}, {occ['map']:g}",
               "split kernel: LDS per workgroup": f"{st_map.lds_bytes:,} B",
               "reduce: VGPRs, waves/SIMD": f"{st_red.vgpr_unified}, {occ['red']:g}"})

# %% tags=["nbval-ignore-output"]
from pa_tile.perf import speedup  # noqa: E402

if backend.current_backend() == "emu":  # the model samples its kernels in the emulator
    steps = speedup.predicted_steps("s6", "s5")
    pred = "\n".join(f"* {s.gpu}: {s.us:.0f} µs, against {s.previous_us:.0f} µs unsplit (stage 5)"
                     for s in steps)
    display(show.md(f"""PREDICTED by `pa_tile.perf.model` (a model, not a measurement),
{speedup.HEADLINE.label}:

{pred}

Chapter 09 sets every stage, upstream's measured time and the model's error side by side."""))
else:
    print(
        "skipped on a GPU: the timing model samples its kernels in the emulator (run this chapter")
    print("with PA_TILE_BACKEND=emu for its prediction); chapter 09 times the stages on this GPU")
